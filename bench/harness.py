"""What every bench entry point shares (not run directly): timing (device-synchronised medians after
warm-up), the one row format (a markdown table row, and a JSON line per row when --json names a
file), the models a bench loads, and the `surgery` command run as a user runs it.

The entry points (each answers --help; bench/RESULTS.md records each figure with its command):
  bench/speed.py         prefill, generate, decode, export, distill, apply, fsdp, offload: each against its anchor in one run;
                         step_attention, floors, state_splits and gdn_forward (CUDA only): one kernel (decode shapes,
                         the GDN forward with its state pass cut along the sequence, or fla's GDN forward stage by stage
                         per launch config), replayed as a CUDA graph
  bench/quality.py       perplexity tables (phases, policies, --mixers: per mixer with block error and state bytes),
                         in memory and through save / `surgery apply`; --kernel-check: fla's gla/kda kernels on CUDA
  bench/recovery.py      recovery curves: distillation of the copy-only and Taylor-Calibrate inits (one per stay: --init),
                         passkey and RULER-style rows, the recipe study (--recipes); modules recovery_*.py
  bench/apply_phases.py  `surgery apply` as the CLI runs it, wall and CPU seconds per phase (the cold start)
  bench/sweep.py         conversion across the registry of architectures (the checks tests/test_sweep.py runs)
  bench/lm_eval_task.py  the shipped choice task (surgery_next_sentence), own scoring and lm-eval's
  bench/parity.sh        the CLI's perplexities on stories260K bit for bit: a refactor must reproduce them
  bench/gpu.sh           the GPU machine: pack and carry wheels, models and texts; start/wait background runs
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
STORIES = ROOT / "tests/assets/stories260k/stories260K.gguf"
SAMPLE = ROOT / "surgery/data/calibration_sample.txt"
COLUMNS = ("name", "config", "metric", "value", "unit", "anchor", "ratio")
LOWER_IS_BETTER = {"ms", "us", "s", "ppl", "GiB", "MiB", "rel sq err", "rel err"}

SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5, rope_theta=100000.0,
                     tie_word_embeddings=True, max_position_embeddings=8192)


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed_s(fn, device) -> tuple[object, float]:
    """fn()'s result and its wall seconds, the device synchronised before and after."""
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - start


# Untimed calls go on for at least this long before the timed ones. In the thirty-seventh session one 2k
# prefill graph read 3.97 ms and the same graph of another hybrid 3.45 in the same run, each the median of
# five calls after three warm-up calls of ~4 ms; a GPU's clocks ramp over longer than that (this warm-up was
# not yet run on a GPU: no machine was lent after it was written).
WARM_SECONDS = 0.5


def median_ms(fn, device, repeats: int = 5, warmup: int = 2, warm_calls: int | None = None) -> float:
    """Median wall ms of fn() over `repeats` synchronised calls after `warmup` untimed ones (the
    first calls compile, autotune or record CUDA graphs) and, on CUDA, more untimed calls up to
    WARM_SECONDS of them, at most `warm_calls` (a call that uses something up, as a decode step uses a
    position of its cache, reserves that many)."""
    for _ in range(warmup):
        fn()
    if torch.device(device).type == "cuda":
        start, calls = time.perf_counter(), 0
        while time.perf_counter() - start < WARM_SECONDS and (warm_calls is None or calls < warm_calls):
            timed_s(fn, device)
            calls += 1
    return 1000 * statistics.median(timed_s(fn, device)[1] for _ in range(repeats))


class Rows:
    """The one row format: name | config | metric | value | unit | anchor | ratio. The anchor is the
    reference measured in the same run (label and value, same unit); ratio says how many times better
    than the anchor the row is (anchor / value where lower is better: ms, s, ppl; else value / anchor).
    With `path`, each row is also appended to it as a JSON line as it comes (a run cut short keeps
    what it measured)."""

    def __init__(self, path: str | None = None):
        self.path, self.rows, self.header = path, [], False

    def add(self, name: str, config: str, metric: str, value: float | None, unit: str,
            anchor: tuple[str, float | None] | None = None, **extra) -> dict:
        ratio = None
        if anchor is not None and value and anchor[1]:
            ratio = anchor[1] / value if unit in LOWER_IS_BETTER else value / anchor[1]
        row = {"name": name, "config": config, "metric": metric, "value": value, "unit": unit,
               "anchor": anchor[0] if anchor else None, "anchor_value": anchor[1] if anchor else None, "ratio": ratio, **extra}
        self.rows.append(row)
        self.print(row)
        if self.path:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
        return row

    def note(self, text: str) -> None:
        print(f"# {text}", flush=True)

    def print(self, row: dict) -> None:
        if not self.header:
            print("\n| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS), flush=True)
            self.header = True
        anchor = "-" if row["anchor"] is None else f"{row['anchor']} {number(row['anchor_value'])}"
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}x"
        cells = (row["name"], row["config"], row["metric"], number(row["value"]), row["unit"], anchor, ratio)
        print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)


@contextmanager
def env_setting(name: str, value: str):
    """os.environ[name] = value inside the block (a library switch read at call time), as before after it."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def number(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"
    return str(v)


def common_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=None, help="teacher: a GGUF, a directory or a short name")
    ap.add_argument("--device", default=None, help="default: cuda when available (cpu with --smoke)")
    ap.add_argument("--json", default=None, help="append each row to this file as a JSON line")
    ap.add_argument("--smoke", action="store_true", help="the CPU, stories260K, tiny sizes: checks the bench runs")


def parse(ap: argparse.ArgumentParser, argv, smoke: dict) -> argparse.Namespace:
    """The arguments, with `smoke`'s tiny settings as defaults under --smoke (options given still apply)."""
    if ap.parse_known_args(argv)[0].smoke:
        ap.set_defaults(**smoke)
    return ap.parse_args(argv)


def check_names(ap: argparse.ArgumentParser, text: str, known, what: str) -> None:
    """A usage error naming every unknown item of the comma-separated `text`, and the known ones."""
    unknown = set(text.split(",")) - set(known)
    if unknown:
        ap.error(f"unknown {what} {', '.join(sorted(unknown))}; known: {', '.join(known)}")


def placement(args) -> tuple[torch.device, torch.dtype]:
    """The device and the dtype the benches use there (bf16 on CUDA, float32 on the CPU)."""
    name = args.device or ("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    device = torch.device(name)
    return device, torch.bfloat16 if device.type == "cuda" else torch.float32


def random_smollm2(max_length: int):
    """SmolLM2-135M's shapes with random weights (speed does not depend on them, and no 98 MB
    teacher has to travel to the machine)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(**(SMOLLM2_SHAPE | {"max_position_embeddings": max(max_length, 8192)}))
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def transformers_teacher(source, device, dtype):
    """The teacher as transformers runs it (a loaded model passes through), on `device` in `dtype`."""
    from surgery.core.load import load_model

    model = source if isinstance(source, torch.nn.Module) else load_model(str(source), dtype=dtype)[0]
    model.generation_config.max_length = None
    return model.to(device=device, dtype=dtype).eval()


def surgery_cli(*args: str, env: dict | None = None) -> dict:
    """One `surgery ...` command in a subprocess, as a user runs it: its last --json line (if any)
    and its wall seconds. A failure ends the bench with the command's stderr."""
    exe = shutil.which("surgery")
    command = [exe] if exe else [sys.executable, "-m", "surgery.cli.app"]
    start = time.perf_counter()
    done = subprocess.run([*command, *args], capture_output=True, text=True, env={**os.environ, **(env or {})})
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"`surgery {' '.join(args)}` failed ({done.returncode}):\n{done.stderr[-3000:]}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return (json.loads(lines[-1]) if lines else {}) | {"seconds": seconds}
