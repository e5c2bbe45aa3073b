"""Options every `surgery` command spells the same way (shared by cli/app.py and the commands in
their own modules, which app.py imports, so they cannot import these from app.py)."""
from __future__ import annotations

import typer

from surgery.core.load import DEFAULT_MODEL, SHORT_NAMES

ModelOpt = typer.Option(DEFAULT_MODEL, "--model", "-m",
                        help=f"Model directory, .gguf file, saved hybrid, distillation run, or short name: {', '.join(SHORT_NAMES)}.")
JsonOpt = typer.Option(False, "--json", help="Print the result as JSON on stdout, alone (progress and messages stay on stderr).")
DebugOpt = typer.Option(False, "--debug", help="Show full tracebacks.")
DeviceOpt = typer.Option(None, "--device", help="cpu, cuda, cuda:1 ... (default: cuda when available).")
DtypeOpt = typer.Option(None, "--dtype", help="float32, bfloat16, float16 (default: float32 on CPU, bfloat16 on CUDA).")
CompileOpt = typer.Option(None, "--compile/--no-compile", help="Run the graph through torch.compile (default: where it pays, surgery.core.compiled: on CUDA for distillation of >= 30M tokens, and for evaluation and prefill once eager calls have cost a compile; never on CPU).")
