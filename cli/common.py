"""What every `surgery` command shares: the consoles, the error guard (a SurgeryError becomes one
paragraph and exit 2), device and dtype parsing, and opening a model."""
from __future__ import annotations

import sys
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from surgery.errors import OUT_OF_MEMORY_FIX, SurgeryError, first_line, ran_out_of_memory

out = Console(width=None if sys.stdout.isatty() else 160)  # pipes and logs get the whole table
err = Console(stderr=True, soft_wrap=True)  # messages are never cut mid-word or mid-value; a terminal wraps them


def emit_json(result) -> None:
    """A command's result on stdout, alone: one JSON document (NaN and infinities become null, which
    JSON has; anything else JSON lacks becomes its text)."""
    import json
    import math

    def finite(value):
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {str(k): finite(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [finite(v) for v in value]
        return value

    print(json.dumps(finite(result), default=str), flush=True)


def fail(exc: SurgeryError) -> None:
    err.print(f"[bold red]Error:[/] {escape(exc.problem)}")  # escaped: a message's [brackets] are text, not markup
    if exc.fix:
        err.print(f"[bold]Fix:[/] {escape(exc.fix)}")
    raise typer.Exit(2)


class guard:
    """Context: SurgeryError -> one paragraph and exit 2 (tracebacks only with --debug); so is running
    out of device memory anywhere in a command (torch's allocator or a Triton launch), with what makes
    the work fit."""

    def __init__(self, debug: bool):
        self.debug = debug

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        if value is None or self.debug or isinstance(value, (typer.Exit, KeyboardInterrupt)):
            return False
        if isinstance(value, SurgeryError):
            fail(value)
        if ran_out_of_memory(value):
            fail(SurgeryError(f"Out of memory ({first_line(value)}).", OUT_OF_MEMORY_FIX))
        return False


DTYPES = ("float32", "bfloat16", "float16")


def parse_dtype(name: str):
    """'bfloat16' -> torch.bfloat16, or the error every command gives for a dtype it does not know
    or cannot compute in (float8, integer types: torch knows them, a model cannot run in them)."""
    import torch

    if name not in DTYPES:
        known = isinstance(getattr(torch, name, None), torch.dtype)
        problem = f"Unsupported dtype '{name}': models load and run in {', '.join(DTYPES)} only." if known else f"Unknown dtype '{name}'."
        raise SurgeryError(problem, "Use float32, bfloat16 or float16.")
    return getattr(torch, name)


def parse_device(name: str):
    """'cuda:1' -> torch.device, checked to exist on this machine before any model loads."""
    import torch

    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise SurgeryError(f"Unknown device '{name}'.", "Use cpu, cuda or cuda:N.") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise SurgeryError(f"--device {name}: CUDA is not available on this machine (torch {torch.__version__}, {build}).",
                               "Use --device cpu, or run where a GPU is visible.")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise SurgeryError(f"--device {name}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}.", "Pick one of them.")
    elif dev.type != "cpu":
        backend = getattr(torch.backends, dev.type, None) or getattr(torch, dev.type, None)
        if not callable(getattr(backend, "is_available", None)) or not backend.is_available():
            raise SurgeryError(f"--device {name}: no {dev.type} device is available here.", "Use --device cpu or cuda.")
    return dev


def placement(device: Optional[str], dtype: Optional[str]):
    """(device, dtype) from the options: CUDA and bf16 when there is a GPU, else CPU and float32."""
    import torch

    dev = parse_device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dt = parse_dtype(dtype) if dtype is not None else (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    return dev, dt


def model_inputs(source: str, memory: bool = True) -> list:
    """The path a --model names (a short name resolved), checked to exist before anything loads; a
    model directory's config.json is checked too (its numbers, and that the model fits in memory), and
    an export directory is verified (surgery verify-export) before anything could run its code."""
    from surgery.core.load import resolve
    from surgery.io.config_check import check_model_dir
    from surgery.io.export_manifest import is_export, verify_export

    path = resolve(source)
    check_model_dir(path, memory=memory)  # memory=False: apply --offload-layers never holds the teacher whole
    if is_export(path):
        verify_export(path)
    return [path]


def more_files(given, more, option: str) -> list | None:
    """An option that takes several values after one flag (`--calibration a.txt b.txt`): click gives
    the values after the first as extra arguments; they join the option's list."""
    if more and not given:
        raise SurgeryError(f"Unexpected argument(s): {', '.join(map(str, more))}.", f"Give them after {option} (e.g. {option} a.txt b.txt).")
    return [*(given or []), *(more or [])] or None


def choose_offload(path, dev, dt, asked: bool | None) -> bool:
    """Whether apply converts layer by layer (surgery.core.meta_capture): as --offload-layers says,
    else when the teacher directory's safetensors exceed the memory free on `dev` (said in one line).
    A teacher loaded whole is checked to fit the device (check_device_fits)."""
    offload = wants_offload(path, dev, dt, asked)
    if not offload:
        check_device_fits(path, dev, dt)
    return offload


def wants_offload(path, dev, dt, asked: bool | None) -> bool:
    """choose_offload's decision."""
    from pathlib import Path

    from surgery.core.weight_files import INDEX, SINGLE, WeightFiles
    from surgery.io.memory import available_bytes, describe_bytes

    path = Path(path)
    if asked is not None:
        return asked
    if not (path.is_dir() and (path / "config.json").is_file() and ((path / SINGLE).is_file() or (path / INDEX).is_file())):
        return False
    need, free = WeightFiles(path).nbytes(dt), available_bytes(dev)
    if free is None or need <= free:
        return False
    err.print(f"the teacher's weights take {describe_bytes(need)} in {str(dt).removeprefix('torch.')}, more than the "
              f"{describe_bytes(free)} free on {dev}: converting layer by layer (--offload-layers; --no-offload-layers refuses instead)")
    return True


def check_device_fits(path, dev, dt) -> None:
    """On an accelerator: the model at `path` fits its free memory in `dt`, before it loads."""
    if dev.type == "cuda":
        from surgery.io.config_check import check_fits_on

        check_fits_on(path, dev, dt)
