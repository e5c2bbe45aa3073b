"""The recipe: everything needed to rebuild a hybrid from the teacher's config alone — the source,
the config, the passes with their configs, the decisions they took, and a per-layer map."""
from __future__ import annotations

import importlib.metadata
import math
import platform

import torch

from tcal.gdn import constructor_options
from tcal.head_split import HeadSplitLayer
from tcal.mixers import MIXERS

from ..core.graph import Graph
from ..errors import CheckpointError

FORMAT = "surgery-hybrid"
VERSION = 1


def library_versions() -> dict:
    """The versions a run used; torch's with its build (torch.__version__: "2.14.1+cu130", where PyPI's
    CUDA wheels' metadata says only "2.14.1"), since the build decides which kernels ran."""
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("surgery", "transformers", "safetensors", "flash-linear-attention", "gguf"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def layer_map(graph: Graph) -> list[dict]:
    targets = graph.gdn_targets()
    rows = []
    for site, kind in zip(graph.sites, graph.layer_kinds):
        rows.append({"layer": site.layer, "kind": kind, "attention_path": site.module_path,
                     "module": targets.get(site.layer, site.module_path)})
    return rows


def build(graph: Graph, weights: dict) -> dict:
    from ..core.pipeline import REGISTRY

    structural = [h["pass"] for h in graph.history if getattr(REGISTRY.get(h["pass"]), "structural", False)]
    config = graph.config.to_dict()
    return {
        "format": FORMAT,
        "version": VERSION,
        "source": graph.source,
        "model_type": graph.config.model_type,
        "config": config,
        "capture": capture_record(graph),
        "passes": graph.history,
        "decisions": {name: _jsonable(graph.meta[name]) for name in dict.fromkeys(structural) if name in graph.meta},
        "results": {k: _jsonable(v) for k, v in graph.meta.items() if k not in ("capture", "offload") and k not in structural},
        "layers": layer_map(graph),
        "sites": [s.to_dict() for s in graph.sites],
        "weights": weights,
        "versions": library_versions(),
    }


def capture_record(graph: Graph) -> dict:
    """How the teacher was captured: length, dtype and the attention implementation its model ran
    (load must build the same one: Gemma2 has no SDPA, and another choice changes the graph)."""
    capture = dict(graph.meta.get("capture", {}))
    impl = getattr(graph.config, "_attn_implementation", None)
    if isinstance(impl, str) and impl:
        capture.setdefault(ATTN_FIELD, impl)
    return capture


ATTN_FIELD = "attn_implementation"
RECIPE_FIX = "The recipe was edited or damaged; write the checkpoint again with `surgery apply`."
FIELD_TYPES = {"config": dict, "passes": list, "decisions": dict, "weights": dict, "sites": list, "capture": dict}
GDN_INTS, GDN_BOOLS = constructor_options("int"), constructor_options("bool")
DTYPES = ("float32", "float16", "bfloat16", "float64")
TYPE_NAMES = {dict: "an object", list: "a list", int: "an integer", str: "a string", bool: "true or false"}


def check(recipe: dict, where: str) -> None:
    """Every field a load reads, checked before anything is built: CheckpointError naming the field."""
    if not isinstance(recipe, dict) or recipe.get("format") != FORMAT:
        found = recipe.get("format") if isinstance(recipe, dict) else type(recipe).__name__
        raise CheckpointError(f"'{where}' is not a surgery hybrid (format {found!r}).", "Point at a directory written by `surgery apply --out`.")
    if not isinstance(recipe.get("version", 0), int) or recipe.get("version", 0) > VERSION:
        raise CheckpointError(f"'{where}' was written by a newer surgery (recipe version {recipe['version']}).", "Upgrade surgery.")
    for key, kind in FIELD_TYPES.items():
        if key not in recipe:
            raise CheckpointError(f"The recipe in '{where}' lacks '{key}'.", "The checkpoint is incomplete; write it again with `surgery apply`.")
        expect(recipe[key], kind, key, where)
    check_capture(recipe["capture"], where)
    check_weights(recipe["weights"], where)
    for i, entry in enumerate(recipe["passes"]):
        expect(entry, dict, f"passes[{i}]", where)
        expect(entry.get("pass"), str, f"passes[{i}].pass", where)
        expect(entry.get("config", {}), dict, f"passes[{i}].config", where)
    for i, site in enumerate(recipe["sites"]):
        expect(site, dict, f"sites[{i}]", where)
        layer_index(site.get("layer"), f"sites[{i}].layer", len(recipe["sites"]), where)
    check_decisions(recipe["decisions"], len(recipe["sites"]), where)
    check_teacher(recipe, where)


def check_teacher(recipe: dict, where: str) -> None:
    """The teacher config's numbers, and that the model they size fits in memory (config_check)."""
    import torch

    from .config_check import check_config

    dtype = getattr(torch, recipe["capture"].get("dtype", "float32"))
    check_config(recipe["config"], recipe["config"].get("model_type", recipe.get("model_type")), dtype, CheckpointError, f"{where}/recipe.json", RECIPE_FIX)


def bad_field(where: str, field: str, value, problem: str) -> CheckpointError:
    return CheckpointError(f"{where}/recipe.json: {field} = {value!r} {problem}.", RECIPE_FIX)


def expect(value, kind, field: str, where: str) -> None:
    """value is a `kind` (bool is no int here: JSON true is not a layer)."""
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise bad_field(where, field, value, f"is not {TYPE_NAMES[kind]}")


def layer_index(value, field: str, layers: int, where: str) -> int:
    expect(value, int, field, where)
    if not 0 <= value < layers:
        raise bad_field(where, field, value, f"is out of range 0..{layers - 1}")
    return value


def layer_list(value, field: str, layers: int, where: str) -> list[int]:
    expect(value, list, field, where)
    return [layer_index(v, f"{field}[{i}]", layers, where) for i, v in enumerate(value)]


def check_capture(capture: dict, where: str) -> None:
    if capture.get("max_length") is not None:
        expect(capture["max_length"], int, "capture.max_length", where)
        if capture["max_length"] < 1:
            raise bad_field(where, "capture.max_length", capture["max_length"], "is not a positive length")
    if capture.get("dtype", "float32") not in DTYPES:
        raise bad_field(where, "capture.dtype", capture.get("dtype"), f"is not one of {', '.join(DTYPES)}")
    if ATTN_FIELD in capture:  # absent in recipes written before it was recorded: load lets transformers choose
        expect(capture[ATTN_FIELD], str, f"capture.{ATTN_FIELD}", where)
        if not capture[ATTN_FIELD].strip():
            raise bad_field(where, f"capture.{ATTN_FIELD}", capture[ATTN_FIELD], "names no attention implementation")


def check_weights(weights: dict, where: str) -> None:
    """File names are plain names inside the checkpoint (no path escapes it); aliases name tensors."""
    expect(weights.get("files"), dict, "weights.files", where)
    for name, digest in weights["files"].items():
        if "/" in name or "\\" in name or name.startswith(".") or not name.endswith(".safetensors"):
            raise bad_field(where, "weights.files", name, "is not a .safetensors file name inside the checkpoint")
        expect(digest, str, f"weights.files[{name!r}]", where)
    expect(weights.get("aliases", {}), dict, "weights.aliases", where)
    for alias, name in weights.get("aliases", {}).items():
        expect(name, str, f"weights.aliases[{alias!r}]", where)


def check_decisions(decisions: dict, layers: int, where: str) -> None:
    """select's convert/keep and replace's layers and modules: layer numbers of this model, and
    every replaced layer with its module's target and GDN config."""
    select = decisions.get("select")
    if select is not None:
        expect(select, dict, "decisions.select", where)
        for key in ("convert", "keep"):
            if key in select:
                layer_list(select[key], f"decisions.select.{key}", layers, where)
    replace = decisions.get("replace")
    if replace is None:
        return
    expect(replace, dict, "decisions.replace", where)
    replaced = layer_list(replace.get("layers"), "decisions.replace.layers", layers, where)
    if len(set(replaced)) != len(replaced):
        raise bad_field(where, "decisions.replace.layers", replaced, "names a layer twice")
    modules = replace.get("modules")
    expect(modules, dict, "decisions.replace.modules", where)
    for key in modules:
        if not key.isdigit():
            raise bad_field(where, "decisions.replace.modules", key, "is not a layer number")
        layer_index(int(key), f"decisions.replace.modules[{key!r}]", layers, where)
    for layer in replaced:
        field = f"decisions.replace.modules[{str(layer)!r}]"
        if str(layer) not in modules:
            raise bad_field(where, "decisions.replace.layers", layer, "has no entry in decisions.replace.modules")
        expect(modules[str(layer)], dict, field, where)
        expect(modules[str(layer)].get("target"), str, f"{field}.target", where)
        mixer = modules[str(layer)].get("mixer", "gdn")  # recipes before the mixer choice hold GDNs
        if mixer not in MIXERS:
            raise bad_field(where, f"{field}.mixer", mixer, f"is not one of {', '.join(MIXERS)}")
        if "kept_kv_heads" in modules[str(layer)]:  # a layer split by heads (select.granularity=head)
            check_split_config(modules[str(layer)].get("gdn_config"), f"{field}.gdn_config", where)
            continue
        check_gdn_config(modules[str(layer)].get("gdn_config"), f"{field}.gdn_config", where, MIXERS[mixer].module)


def check_split_config(config, field: str, where: str) -> None:
    """A HeadSplitLayer's constructor arguments: its sizes, its head lists, and the GDN's within."""
    check_gdn_config(config, field, where, HeadSplitLayer)
    for key in ("kept_heads", "kv_index", "kept_kv"):
        value = config.get(key)
        if not isinstance(value, list) or not value or not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in value):
            raise bad_field(where, f"{field}.{key}", value, "is not a non-empty list of head numbers")
    if not set(config["kept_heads"]) < set(range(config.get("num_heads", 0))) or len(config["kept_heads"]) % len(config["kv_index"]):
        raise bad_field(where, f"{field}.kept_heads", config["kept_heads"], "is not some but not all of the layer's heads, in whole KV groups")
    check_gdn_config(config.get("gdn"), f"{field}.gdn", where)
    expect(config.get("attention"), dict, f"{field}.attention", where)


def check_gdn_config(config, field: str, where: str, module=None) -> None:
    """The module's constructor arguments: its ints positive, its bools bools (GDN's by default)."""
    expect(config, dict, field, where)
    ints, bools = (GDN_INTS, GDN_BOOLS) if module is None else (constructor_options("int", module), constructor_options("bool", module))
    for key in ints:
        if key in config:
            expect(config[key], int, f"{field}.{key}", where)
            if config[key] < 1:
                raise bad_field(where, f"{field}.{key}", config[key], "is not a positive size")
    for key in bools:
        if key in config:
            expect(config[key], bool, f"{field}.{key}", where)


def _jsonable(value):
    """Decisions and results hold tensors and tuples at times; the recipe stores plain JSON."""
    import torch

    if hasattr(value, "to_dict"):  # a typed decision (select's LayerSelection): its plain form
        return _jsonable(value.to_dict())
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return _jsonable(value.detach().cpu().tolist())
    if isinstance(value, float) and not math.isfinite(value):  # JSON has no NaN or Infinity
        return None
    return value
