"""Wall and CPU seconds of each phase of one `surgery apply`, run as the CLI runs it (cli.app.main in
this process), with timers wrapped around the functions the command calls: import, reading the GGUF's
header, transformers' config, weights and tokenizer, model.to, torch.export, site discovery, each
pass, the diff table, the save. What the table misses (typer, rich, checks) shows as "other".

    python bench/apply_phases.py -- --model FILE.gguf --passes select,replace --out /tmp/x --force

Prints one `phase wall_s cpu_s calls` table on stderr after the command's own output."""
from __future__ import annotations

import atexit
import importlib
import sys
import time
from collections import defaultdict
from functools import wraps

START = time.perf_counter(), time.process_time()
TOTALS: dict = defaultdict(lambda: [0.0, 0.0, 0])
ACTIVE: list = []


# What `surgery` imports first, each timed alone (on the H200 the whole took 11 s against 1.8 s on the CPU
# machine, twenty-first session). fla is otherwise imported by the first pass that runs its kernels.
IMPORTS = (("import torch", "torch"), ("import transformers", "transformers"), ("import triton", "triton"),
           ("import fla (GDN kernels)", "fla.ops.gated_delta_rule"), ("import the CLI (the rest)", "surgery.cli.app"))


def timed(owner, name: str, phase: str) -> None:
    """Replace owner.name by a wrapper adding its time to `phase` (nested phases are not double counted)."""
    original = getattr(owner, name)

    @wraps(original)
    def wrapper(*args, **kwargs):
        if ACTIVE:  # counted by the phase already open
            return original(*args, **kwargs)
        ACTIVE.append(phase)
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return original(*args, **kwargs)
        finally:
            row = TOTALS[phase]
            row[0] += time.perf_counter() - wall
            row[1] += time.process_time() - cpu
            row[2] += 1
            ACTIVE.pop()

    setattr(owner, name, wrapper)


def report() -> None:
    wall, cpu = time.perf_counter() - START[0], time.process_time() - START[1]
    print(f"{'phase':<28}{'wall_s':>9}{'cpu_s':>9}{'calls':>7}", file=sys.stderr)
    for phase, (w, c, n) in TOTALS.items():
        print(f"{phase:<28}{w:9.2f}{c:9.2f}{n:7d}", file=sys.stderr)
    print(f"{'other':<28}{wall - sum(r[0] for r in TOTALS.values()):9.2f}{cpu - sum(r[1] for r in TOTALS.values()):9.2f}", file=sys.stderr)
    print(f"{'total':<28}{wall:9.2f}{cpu:9.2f}", file=sys.stderr)


def instrument() -> None:
    import transformers

    from surgery.core import capture, load
    from surgery.io import checkpoint, open as opening
    import surgery
    import surgery.core.pipeline as pipeline

    timed(load, "check_gguf", "gguf header (check_gguf)")
    timed(transformers.AutoConfig, "from_pretrained", "transformers config")
    timed(transformers.AutoModelForCausalLM, "from_pretrained", "transformers weights")
    timed(transformers.AutoTokenizer, "from_pretrained", "transformers tokenizer")
    timed(capture, "export_model", "torch.export")
    timed(opening, "find_sites", "find_sites")
    timed(pipeline.PassManager, "validate", "pass checks")
    for name in ("diff", "save"):
        timed(surgery, name, name)
    timed(checkpoint, "save", "save")
    import torch
    timed(torch.nn.Module, "to", "model.to")
    for cls in set(pipeline.REGISTRY.values()):
        timed(cls, "run", f"pass {cls.name}")


def main() -> None:
    args = sys.argv[1:]
    args = args[args.index("--") + 1:] if "--" in args else args
    for label, module in IMPORTS:  # the import of the CLI, split: torch, transformers, Triton, fla, the rest
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            importlib.import_module(module)
        except Exception:  # Triton and fla are CUDA-side extras (a broken install raises more than ImportError)
            continue
        TOTALS[label] = [time.perf_counter() - wall, time.process_time() - cpu, 1]
    import surgery.cli.app as app
    instrument()
    atexit.register(report)
    sys.argv = ["surgery", "apply", *args]
    app.main()


if __name__ == "__main__":
    main()
