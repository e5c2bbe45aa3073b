"""Peak memory and time of distillation's KL loss (forward + backward): the plain float32 formula
against surgery.train.losses.kl_divergence (row chunks, closed-form gradient). Each variant runs in its own
process so peaks do not mix: on CUDA torch.cuda.max_memory_allocated, on the CPU the process's
peak resident set (the logits themselves included in both).

    python bench/kl_memory.py --tokens 4096 --vocab 49152                        # CPU, float32 logits
    python bench/kl_memory.py --tokens 32768 --vocab 49152 --dtype bfloat16      # one H200 (micro-batch 32 x 1024)
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def plain(student, teacher):
    import torch.nn.functional as F

    t = F.log_softmax(teacher.float(), dim=-1)
    s = F.log_softmax(student.float(), dim=-1)
    return (t.exp() * (t - s)).sum(-1).mean()


def measure(variant: str, tokens: int, vocab: int, dtype: str, repeats: int) -> dict:
    import torch

    from surgery.train.losses import kl_divergence

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    g = torch.Generator(device=device).manual_seed(0)
    teacher = torch.randn(tokens, vocab, generator=g, device=device).to(getattr(torch, dtype))
    student = torch.randn(tokens, vocab, generator=g, device=device).to(getattr(torch, dtype)).requires_grad_(True)
    fn = plain if variant == "plain" else kl_divergence
    times = []
    for i in range(repeats + 1):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        loss = fn(student, teacher)
        loss.backward()
        student.grad = None
        if cuda:
            torch.cuda.synchronize()
        if i:  # the first run warms up
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"variant": variant, "loss": float(loss), "seconds": sorted(times)[len(times) // 2], "peak_bytes": peak,
            "logits_bytes": teacher.numel() * teacher.element_size(), "device": torch.cuda.get_device_name() if cuda else "cpu"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variant", default=None, help=argparse.SUPPRESS)  # one measurement, in a child process
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(measure(args.variant, args.tokens, args.vocab, args.dtype, args.repeats)))
        return
    rows = []
    for variant in ("plain", "chunked"):
        cmd = [sys.executable, __file__, "--variant", variant, "--tokens", str(args.tokens), "--vocab", str(args.vocab),
               "--dtype", args.dtype, "--repeats", str(args.repeats)]
        rows.append(json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]))
    gib = 2**30
    print(f"\n{rows[0]['device']}, {args.tokens} tokens x {args.vocab} vocabulary, {args.dtype} logits "
          f"({rows[0]['logits_bytes'] / gib:.2f} GiB each), forward + backward")
    print("| KL | loss | peak memory GiB | time s (median) |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['loss']:.6f} | {r['peak_bytes'] / gib:.2f} | {r['seconds']:.3f} |")


if __name__ == "__main__":
    main()
