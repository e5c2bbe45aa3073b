"""Where one Phase 2 (align) step's time goes on the CPU, for one SmolLM2-shaped GDN layer (random
weights: the cost does not depend on them) at the default 16 x 256 calibration tokens (issue 17,
part 4: the README's main job on a 2-core CPU). Prints the step time and the top ops by self time.

    python bench/align_step_profile.py [--samples 16 --length 256 --rows 12]
    python bench/align_step_profile.py --compare-compiled   # eager vs torch.compile (what apply --compile does)
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from bench._models import smollm2_shaped  # noqa: E402
from surgery import PassManager, capture  # noqa: E402
from surgery.core.compiled import CompiledGraph  # noqa: E402


def compare_compiled(layer, x, target, rounds: int = 3, repeats: int = 5) -> None:
    """Min and median seconds of eager and compiled forward+backward steps, alternating rounds."""
    compiled = CompiledGraph(layer, label="GDN layer")
    for name, module in (("eager", layer), ("compiled", compiled)):
        start = time.perf_counter()
        F.mse_loss(module(x), target).backward()
        print(f"{name} first step: {time.perf_counter() - start:.1f} s", flush=True)
    for r in range(rounds):
        for name, module in (("eager", layer), ("compiled", compiled)):
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                F.mse_loss(module(x), target).backward()
                times.append(time.perf_counter() - start)
            print(f"round {r} {name}: min {min(times):.3f} s, median {statistics.median(times):.3f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--rows", type=int, default=12)
    ap.add_argument("--compare-compiled", action="store_true", help="time eager and compiled steps alternately instead")
    args = ap.parse_args()
    graph = capture(smollm2_shaped(), max_length=args.length)
    PassManager(["select", "replace"], {"select": {"keep_ratio": 0.5}})(graph)
    layer = next(iter(graph.gdn_modules().values())).float()
    hidden = graph.config.hidden_size
    x, target = torch.randn(args.samples, args.length, hidden), torch.randn(args.samples, args.length, hidden)

    def step():
        F.mse_loss(layer(x), target).backward()

    if args.compare_compiled:
        return compare_compiled(layer, x, target)
    step()
    start = time.perf_counter()
    for _ in range(3):
        step()
    seconds = (time.perf_counter() - start) / 3
    print(f"one layer, {args.samples} x {args.length} tokens: {seconds:.3f} s per forward+backward "
          f"({torch.get_num_threads()} threads)")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
