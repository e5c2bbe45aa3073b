"""What every `surgery` command shares: the consoles, the error guard (a SurgeryError becomes one
paragraph and exit 2), device and dtype parsing, and opening a model."""
from __future__ import annotations

import sys
from typing import Optional

import typer
from rich.console import Console

from surgery.errors import SurgeryError

out = Console(width=None if sys.stdout.isatty() else 160)  # pipes and logs get the whole table
err = Console(stderr=True)


def fail(exc: SurgeryError) -> None:
    err.print(f"[bold red]Error:[/] {exc.problem}")
    if exc.fix:
        err.print(f"[bold]Fix:[/] {exc.fix}")
    raise typer.Exit(2)


class guard:
    """Context: SurgeryError -> one paragraph and exit 2 (tracebacks only with --debug)."""

    def __init__(self, debug: bool):
        self.debug = debug

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        if value is None or self.debug or isinstance(value, (typer.Exit, KeyboardInterrupt)):
            return False
        if isinstance(value, SurgeryError):
            fail(value)
        return False


def parse_dtype(name: str):
    """'bfloat16' -> torch.bfloat16, or the error every command gives for a dtype it does not know."""
    import torch

    if not isinstance(getattr(torch, name, None), torch.dtype):
        raise SurgeryError(f"Unknown dtype '{name}'.", "Use float32, bfloat16 or float16.")
    return getattr(torch, name)


def placement(device: Optional[str], dtype: Optional[str]):
    """(device, dtype) from the options: CUDA and bf16 when there is a GPU, else CPU and float32."""
    import torch

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dt = parse_dtype(dtype) if dtype is not None else (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    return dev, dt
