"""The RoPE keys transformers 4.x reads (rope_theta, rope_scaling, rope_local_base_freq, ...), for an
export's config.json: 5.x keeps them all in `rope_parameters`, which 4.x ignores (it would silently
use its default theta).

Which legacy key holds which value is asked of the installed 5.x config class itself: its
backward-compatibility code maps each legacy key into `rope_parameters`, so each candidate key is
passed with a marker value and found where the marker lands. No table of architectures."""
from __future__ import annotations

import copy
import warnings

CANDIDATES = ("rope_theta", "rope_local_base_freq", "rotary_emb_base", "partial_rotary_factor", "rotary_pct")
MARK = 4242.125  # no real RoPE parameter has this value
SCALING_MARK = {"rope_type": "linear", "factor": MARK}


def paths_of(tree, value, path=()) -> list[tuple]:
    """The key paths under which `value` sits in the nested dict `tree`."""
    if isinstance(tree, dict):
        return [p for k, v in tree.items() for p in paths_of(v, value, path + (k,))]
    return [path] if tree == value else []


def at(tree: dict, path: tuple):
    for key in path:
        tree = tree[key]
    return tree


def probe(config, extra: dict) -> dict | None:
    """rope_parameters of the teacher's config class built from its own fields without rope_parameters, plus `extra`."""
    from transformers.utils import logging

    fields = {k: v for k, v in config.to_dict().items() if k not in ("rope_parameters", "rope_scaling", *CANDIDATES)}
    level = logging.get_verbosity()
    logging.set_verbosity_error()  # the marker values draw the config class's validation warnings
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return copy.deepcopy(type(config)(**fields, **extra).rope_parameters)
    except Exception:  # noqa: BLE001 -- a class that refuses the key simply does not read it
        return None
    finally:
        logging.set_verbosity(level)


def legacy_rope_keys(config) -> dict:
    """{legacy key: value} equal to `config.rope_parameters`, for the keys its class reads."""
    rope = getattr(config, "rope_parameters", None)
    if not isinstance(rope, dict) or not rope:
        return {}
    keys = {}
    for key in CANDIDATES:
        found = paths_of(probe(config, {key: MARK}), MARK)
        if len(found) == 1:
            try:
                keys[key] = at(rope, found[0])
            except (KeyError, TypeError):
                continue
    scaled = probe(config, {"rope_scaling": dict(SCALING_MARK)})
    found = paths_of(scaled, MARK)
    if len(found) == 1:
        try:
            entry = at(rope, found[0][:-1])
        except (KeyError, TypeError):
            entry = None
        if isinstance(entry, dict) and entry.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in entry.items() if k not in ("rope_theta", "partial_rotary_factor")}
            keys["rope_scaling"] = {**scaling, "type": scaling["rope_type"]}
    return keys


def keeps_rope(config_class, config: dict, legacy: dict, rope: dict | None) -> bool:
    """Whether the installed transformers, reading `config` with `legacy` added, still builds the
    teacher's rope_parameters (for some classes a legacy rope_scaling would override them: YaRN's
    own max_position_embeddings, say). Where it does not, the export leaves the legacy keys out."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            read = config_class.from_dict(copy.deepcopy({**config, **legacy}))
        except Exception:  # noqa: BLE001 - a class that refuses the mixed keys: leave them out
            return False
    return read.to_dict().get("rope_parameters") == rope
