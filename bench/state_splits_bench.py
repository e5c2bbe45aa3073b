"""The gated delta rule's chunk forward with its state pass cut into S pieces along the sequence
(tcal/split_state.py), timed inside a CUDA graph against the unsplit kernel at batch-1 and small-batch
prefill shapes (SmolLM2-135M's GDN: 9 heads of 64, bf16), with each output's error against the float64
PyTorch recurrence. The rows for S = 1 (off), fixed counts, and the count `state_splits` picks (auto)
are what its cost model's constants were set from (bench/RESULTS.md, thirty-first session).

    python bench/speed.py --sections state_splits [--split-shapes 2048x1,32768x1]
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from bench.harness import env_setting
from bench.step_attention_bench import graph_ms
from tcal.kernels import gated_delta_rule
from tcal.split_state import SWITCH, requested_splits

HEADS, DIM = 9, 64
COUNTS = ("off", "2", "4", "8", "16", "32", "auto")


def inputs(batch: int, seq_len: int, seed: int = 0):
    """GDN-like inputs: unit-norm q and k, a decay in (-0.3, 0], a write strength in (0, 1), a small initial state."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")
    q, k = (F.normalize(r(batch, seq_len, HEADS, DIM), dim=-1) for _ in range(2))
    v = r(batch, seq_len, HEADS, DIM)
    g = -0.3 * torch.rand(batch, seq_len, HEADS, generator=gen, device="cuda")
    beta = torch.rand(batch, seq_len, HEADS, generator=gen, device="cuda")
    state = 0.1 * r(batch, HEADS, DIM, DIM)
    return [x.to(torch.bfloat16) for x in (q, k, v)] + [g, beta, state]


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def run(rows, shapes: str) -> None:
    """Rows: ms per forward (with the final state) in a CUDA graph for each piece count, the relative
    error of its output and final state against float64 (bf16 rounding dominates it), and its output's
    relative difference from the unsplit kernel's."""
    for shape in shapes.split(","):
        seq_len, batch = (int(x) for x in shape.split("x"))
        q, k, v, g, beta, state = inputs(batch, seq_len)
        want, want_state = gated_delta_rule(*(x.double() for x in (q, k, v, g, beta)), DIM**-0.5, state.double(),
                                            True, backend="torch")
        unsplit, unsplit_o = None, None
        for count in COUNTS:
            call = lambda: gated_delta_rule(q, k, v, g, beta, DIM**-0.5, state, True, backend="fla")
            with env_setting(SWITCH, count), torch.no_grad():
                pieces = requested_splits(batch, HEADS, seq_len, q.device)
                o, s = call()
                ms = graph_ms(call, replays=50)
            if count == "off":
                unsplit, unsplit_o = ms, o.double()
            config = f"{seq_len} x {batch}, {HEADS} heads of {DIM}, {count} -> {pieces} piece(s)"
            rows.add("gated_delta_rule forward (fla, split state)", config, "forward", ms, "ms",
                     anchor=("unsplit", unsplit), pieces=pieces)
            rows.add("gated_delta_rule forward (fla, split state)", config, "output error vs float64", relative(o, want), "")
            rows.add("gated_delta_rule forward (fla, split state)", config, "state error vs float64", relative(s, want_state), "")
            rows.add("gated_delta_rule forward (fla, split state)", config, "output difference from unsplit", relative(o, unsplit_o), "")
