"""How many aten ops one training forward+backward of a hybrid issues, by the chunk size of the
PyTorch GDN kernel (tcal.kernels.chunked_gated_delta_rule_torch, what training uses when fla's
backward is unavailable).

At 135M parameters a training step on an H200 is bound by launching ops, not by FLOPs (issue 5:
halving the per-GPU batch did not shorten the step), so the op count is the figure to lower.
Counted with torch.profiler on any device; nested ops (a matmul's reshapes and bmm) are included.

    python bench/op_count.py --model smollm2-135m-instruct --length 1024 --chunks 64,128,256
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

import tcal.kernels as kernels
from surgery import PassManager, capture


def step(graph, ids) -> None:
    graph(ids).float().mean().backward()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--keep-ratio", type=float, default=0.5)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--chunks", default="64,128,256")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    graph = capture(args.model, max_length=max(args.length, 64), device=device)
    PassManager(["select", "replace"], {"select": {"keep_ratio": args.keep_ratio}, "replace": {"backend": "torch"}})(graph)
    for p in graph.gm.parameters():
        p.requires_grad_(True)
    ids = torch.randint(0, graph.config.vocab_size, (1, args.length), generator=torch.Generator().manual_seed(0)).to(device)
    original = kernels.chunked_gated_delta_rule_torch
    rows = []
    try:
        for chunk in [int(c) for c in args.chunks.split(",")]:
            def chunked(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, chunk_size=64, _c=chunk):
                return original(q, k, v, g, beta, scale, initial_state, output_final_state, _c)

            kernels.chunked_gated_delta_rule_torch = chunked
            step(graph, ids)  # warm-up
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                t = time.perf_counter()
                step(graph, ids)
                seconds = time.perf_counter() - t
            events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
            rows.append((chunk, sum(e.count for e in events), sum(e.count for e in events if e.key == "aten::bmm"), seconds))
    finally:
        kernels.chunked_gated_delta_rule_torch = original
    print(f"\n{args.model}, {100 - 100 * args.keep_ratio:.0f}% GDN, 1 x {args.length} tokens, {device}")
    print("| GDN chunk | aten ops per forward+backward | of which bmm | seconds (profiled) |\n|---|---|---|---|")
    for chunk, ops, bmm, seconds in rows:
        print(f"| {chunk} | {ops:,} | {bmm:,} | {seconds:.2f} |")


if __name__ == "__main__":
    main()
