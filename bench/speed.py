"""Forward throughput and peak memory: teacher vs hybrids (select + replace) at long contexts.

Models: a teacher file (e.g. SmolLM2-135M's GGUF) and a random-weight model shaped like
Qwen2.5-1.5B (28 layers, hidden 1536, 12 heads, 2 KV heads, head_dim 128). Weights do not matter
for speed. Each point: median of --repeats timed forwards (batch 1) after a warm-up, bf16, CUDA.

    python bench/speed.py --model /root/m/smol.gguf --lengths 2048,8192,32768 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench._models import qwen15b_shaped  # noqa: E402
from surgery import PassManager, capture  # noqa: E402


def timed(graph, length: int, repeats: int, vocab: int) -> tuple[float, float]:
    ids = torch.randint(0, vocab, (1, length), device="cuda")
    with torch.no_grad():
        graph(ids)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            t = time.perf_counter()
            graph(ids)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / 2**30


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="teacher file; omitted: only the Qwen-shaped model")
    ap.add_argument("--lengths", default="2048,8192,32768")
    ap.add_argument("--keep-ratios", default="0.5,0.25")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-qwen", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    longest = max(lengths)
    sources = []
    if args.model:
        sources.append(("SmolLM2-135M", args.model))
    if not args.skip_qwen:
        sources.append(("Qwen2.5-1.5B-shaped (random)", qwen15b_shaped("cuda", torch.bfloat16, longest)))
    rows = []
    for name, source in sources:
        teacher = capture(source, device="cuda", dtype=torch.bfloat16, max_length=longest)
        vocab = teacher.config.vocab_size
        variants = [("teacher", teacher)]
        for ratio in [float(r) for r in args.keep_ratios.split(",")]:
            hybrid = teacher.branch()
            PassManager(["select", "replace"], {"select": {"keep_ratio": ratio}})(hybrid)
            variants.append((f"hybrid {100 - ratio * 100:.0f}% GDN", hybrid))
        for length in lengths:
            base = None
            for label, graph in variants:
                seconds, peak = timed(graph, length, args.repeats, vocab)
                base = base or seconds
                row = {"model": name, "variant": label, "length": length, "ms": seconds * 1e3,
                       "tokens_per_s": length / seconds, "peak_gib": peak, "speedup_vs_teacher": base / seconds}
                rows.append(row)
                print(json.dumps(row), flush=True)
        del variants, teacher
        torch.cuda.empty_cache()
    print()
    print("| model | variant | length | forward ms | tokens/s | peak GiB | speed-up vs teacher |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['variant']} | {r['length']} | {r['ms']:.1f} | {r['tokens_per_s']:,.0f} | {r['peak_gib']:.2f} | {r['speedup_vs_teacher']:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
