"""What one kernel costs inside a CUDA graph on this GPU, at a decode step's shapes (bf16): an empty Triton
kernel, a small elementwise op, and the matmul of 1 or 16 rows over each of SmolLM2-135M's weight shapes
(q/k/v fused 960 x 576, o_proj 576 x 576, gate/up fused 3,072 x 576, down 576 x 1,536, a GDN layer's fused
input projection 2,368 x 576, the head 49,152 x 576): CALLS calls of one captured in one graph, the graph
replayed, the time per call (a graph of one call would add the graph's own launch to each). A decode step is
a chain of such kernels, so these floors bound it from below (bench/RESULTS.md, thirtieth session).

    python bench/speed.py --sections floors
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from bench.step_attention_bench import graph_ms
from surgery.decode.residual_norm import add_rms_norm_triton

CALLS = 50

# (rows of the weight, its width): SmolLM2-135M's decode-step matmuls, then one larger and the head
WEIGHTS = ((576, 576), (960, 576), (1536, 576), (2368, 576), (3072, 576), (576, 1536), (8192, 576), (49152, 576))


def per_call_us(fn) -> float:
    """us per call of fn, CALLS of them captured in one CUDA graph."""
    return graph_ms(lambda: [fn() for _ in range(CALLS)], replays=40) * 1000 / CALLS


def empty_kernel_us() -> float:
    import triton

    @triton.jit
    def _empty(x):
        pass

    x = torch.zeros(1, device="cuda")
    return per_call_us(lambda: _empty[(1,)](x))


def run(rows) -> None:
    """Rows: us per kernel, and for the matmuls the weight's bytes over that time (GB/s)."""
    rows.add("empty Triton kernel", "CUDA graph", "kernel", empty_kernel_us(), "us")
    y = torch.randn(576, device="cuda", dtype=torch.bfloat16)
    z = torch.empty_like(y)
    rows.add("torch.add, 576 bf16", "CUDA graph", "kernel", per_call_us(lambda: torch.add(y, y, out=z)), "us")
    for m in (1, 16):  # the residual add with its RMSNorm, the only kernel between two of a layer's matmuls
        a, b = torch.randn(2, m, 576, device="cuda", dtype=torch.bfloat16)
        rows.add("add_rms_norm (surgery.decode.residual_norm)", f"{m} x 576", "kernel",
                 per_call_us(lambda: add_rms_norm_triton(a, b, y, 1e-5)), "us")
    for m in (1, 16):
        for n, k in WEIGHTS:
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            us = per_call_us(lambda: F.linear(a, w))
            config = f"{m} x {k} @ {k} x {n} ({n * k * 2 / 1e6:.2f} MB)"
            rows.add("F.linear (cuBLAS)", config, "kernel", us, "us")
            rows.add("F.linear (cuBLAS)", config, "weight read", n * k * 2 / us / 1e3, "GB/s")
