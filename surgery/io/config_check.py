"""A teacher config's numbers (recipe.json's `config`, a model directory's config.json), checked
before any model is built: sizes are whole numbers in range, eps/dropout/theta in theirs, and the
parameters the sizes make, times the dtype's bytes, fit in memory. A hand-edited vocab_size of 1e30
or intermediate_size of 2^40 otherwise ends in a torch overflow or an allocation of 281 TB.

Knowledge comes from the config class's own defaults (an int default makes the field an integer)
and transformers' field-name conventions (`*_size`, `num_*`, `n_*`, `*_eps`), never a model type."""
from __future__ import annotations

import re

import torch

from ..core.pipeline import INT_LIMIT
from ..errors import SurgeryError
from .json_safe import non_finite
from .memory import available_bytes, describe_bytes

MEMORY_FIX = ("Load it where more memory is free or in a smaller --dtype (bfloat16 halves it), or convert it layer by layer "
              "(`surgery apply --offload-layers`); if a size was edited by hand, restore it.")
SIZE = re.compile(r"(^|_)(size|dim|embd|embeddings|positions|inner|layers?|heads?|experts?|window)$|^(num|n)_")
RATE = re.compile(r"(^|_)(dropout|pdrop)$")
EPS = re.compile(r"(^|_)(eps|epsilon)$")
THETA = re.compile(r"(^|_)theta$")


def check_numbers(config: dict, defaults: dict, error: type[SurgeryError], where: str, fix: str, path: str = "config") -> None:
    """Every number in `config` (nested objects too) of the right kind and range, or `error` naming it."""
    found = non_finite(config, path)
    if found is not None:
        raise error(f"{where}: {found[0]} = {found[1]} is not a finite number.", fix)
    for key, value in config.items():
        field, default = f"{path}.{key}", defaults.get(key) if isinstance(defaults, dict) else None
        if isinstance(value, dict):
            check_numbers(value, default if isinstance(default, dict) else {}, error, where, fix, field)
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        top = path == "config"  # nested objects (rope_parameters, ...) mix kinds: 1.0 may stand for a float there
        wants_int = top and ((isinstance(default, int) and not isinstance(default, bool)) or SIZE.search(key))
        if wants_int and not isinstance(value, int):
            raise error(f"{where}: {field} = {value!r} is not an integer (a size or count).", fix)
        problem = None
        if isinstance(value, int) and not -INT_LIMIT < value < INT_LIMIT:
            problem = f"is out of range (at most {INT_LIMIT - 1:,})"
        elif SIZE.search(key) and value < 0:
            problem = "is not a size (negative)"
        elif RATE.search(key) and not 0 <= value <= 1:
            problem = "is not a probability in [0, 1]"
        elif EPS.search(key) and not 0 <= value < 1:
            problem = "is not an epsilon in [0, 1)"
        elif THETA.search(key) and value <= 0:
            problem = "is not a positive base"
        if problem:
            raise error(f"{where}: {field} = {value!r} {problem}.", fix)


def parameter_bytes(config, dtype: torch.dtype) -> int:
    """Bytes of the model's parameters and buffers in `dtype`, from the model built on the meta device
    (no memory taken); a size too large for torch to count raises OverflowError."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except (RuntimeError, OverflowError, ValueError, MemoryError) as exc:
        raise OverflowError(str(exc)) from exc
    size = torch.empty((), dtype=dtype).element_size()
    return sum(t.numel() * (size if t.is_floating_point() else t.element_size()) for t in [*model.parameters(), *model.buffers()])


def largest_size(config: dict, defaults: dict) -> str:
    """The size field furthest above its class default: the likely culprit of a model too large."""
    sizes = [(value / max(defaults.get(key) or 1, 1), key, value) for key, value in config.items()
             if SIZE.search(key) and isinstance(value, int) and not isinstance(value, bool)]
    return f"{max(sizes)[1]} = {max(sizes)[2]:,}" if sizes else "its sizes"


def check_fits(config, config_dict: dict, defaults: dict, dtype: torch.dtype, error: type[SurgeryError], where: str, fix: str,
               device: torch.device | str = "cpu") -> int:
    """The model's parameters in `dtype` fit the memory `device` has free, else `error` naming the
    size field that makes them large. Returns the bytes."""
    name = str(dtype).removeprefix("torch.")
    try:
        need = parameter_bytes(config, dtype)
    except OverflowError:
        raise error(f"{where}: the model's sizes overflow when its tensors are counted ({largest_size(config_dict, defaults)}).", fix) from None
    free = available_bytes(device)
    if free is not None and need > free:
        raise error(f"{where}: the model's parameters take {describe_bytes(need)} in {name}, more than the {describe_bytes(free)} "
                    f"of memory free on {device} ({largest_size(config_dict, defaults)}).", MEMORY_FIX)
    return need


def check_config(config_dict: dict, model_type, dtype: torch.dtype, error: type[SurgeryError], where: str, fix: str,
                 device: torch.device | str = "cpu", memory: bool = True) -> None:
    """check_numbers, then check_fits (memory=False: not) on the config transformers builds from it
    (a model type or field transformers does not know is left to the loader, which names it)."""
    from transformers import AutoConfig

    try:
        defaults = AutoConfig.for_model(model_type).to_dict()
    except Exception:  # an unknown model_type: the loader says so by name
        defaults = {}
    check_numbers(config_dict, defaults, error, where, fix)
    try:
        config = AutoConfig.for_model(model_type, **{k: v for k, v in config_dict.items() if k != "model_type"})
    except Exception:
        return
    if memory:
        check_fits(config, config_dict, defaults, dtype, error, where, fix, device)


def check_model_dir(path, memory: bool = True) -> None:
    """A teacher directory's config.json (not a hybrid's or a run's: their recipes are checked at
    load), read with the safe reader and checked in the dtype it names (float32 when it names none);
    memory=False: not against the memory free (a teacher converted layer by layer is never whole)."""
    from pathlib import Path

    from ..errors import ModelLoadError
    from .json_safe import read_json

    path = Path(path)
    file = path / "config.json"
    if not path.is_dir() or not file.is_file() or (path / "recipe.json").exists():
        return
    fix = f"Fix or restore '{file}' (the model's own config)."
    config = read_json(file, ModelLoadError, fix)
    if not isinstance(config, dict):
        raise ModelLoadError(f"'{file}' holds {type(config).__name__}, not a config object.", fix)
    named = config.get("dtype") or config.get("torch_dtype")
    dtype = getattr(torch, named, None) if isinstance(named, str) else None
    check_config(config, config.get("model_type"), dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32,
                 ModelLoadError, str(file), fix, memory=memory)


def check_fits_on(path, device, dtype: torch.dtype) -> None:
    """The parameters of the model directory or saved hybrid at `path` fit the memory free on
    `device` in `dtype` (the CPU is checked when the files are read; this is for an accelerator,
    whose dtype and device are known only once the options are parsed)."""
    from pathlib import Path

    from ..errors import CheckpointError, ModelLoadError
    from .json_safe import read_json

    path = Path(path)
    if (path / "recipe.json").is_file():
        file, error = path / "recipe.json", CheckpointError
        config = read_json(file, error, MEMORY_FIX).get("config")
    elif (path / "config.json").is_file():
        file, error = path / "config.json", ModelLoadError
        config = read_json(file, error, MEMORY_FIX)
    else:
        return
    if isinstance(config, dict):
        check_config(config, config.get("model_type"), dtype, error, str(file), MEMORY_FIX, device)
