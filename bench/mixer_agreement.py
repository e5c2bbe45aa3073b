"""Why a mixer's Decoder self-check refuses on random weights (issue 31): for each replace.mixer, a random
SmolLM2-shaped 75% hybrid (bench/speed.py --random's) in float32 and in bf16 on one device, and per
hybrid these numbers:

  self-check   the Decoder self-check's own measure (surgery.decode.agreement: a 12-token probe, prefill
               then one-token steps, against full recomputation), taken as the Decoder takes it on that
               device (on CUDA: the captured static steps), without refusing
  bf16 drift   (bf16 rows) the worst position's relative logit error of the bf16 hybrid's full
               recomputation against the float32 hybrid's on the same ids: how far rounding alone
               moves this model's logits
  rounded      (--rounding-seeds, bf16) the self-check's measure when every bf16 matmul of the
               incremental pass rounds stochastically (its float32 result up or down to a neighbouring
               bf16 value) and the full recomputation's to nearest: a device-free stand-in for the GPU,
               whose GEMMs round differently at one token than at twelve

A convention mistake in a kernel wrapper (the decay on the wrong tensor, a state layout) shows in
float32, whose check is tight; rounding shows only in bf16, and there about as large as the drift.

Run by bench/quality.py (not an entry point of its own):

    python3 bench/quality.py --decode-agreement gla,kda,mamba2              # CUDA when present
    python3 bench/quality.py --decode-agreement gla,kda,mamba2 --device cpu --rounding-seeds 0,1,2
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.harness import Rows, random_smollm2
from surgery import Decoder, PassManager, capture
from surgery.decode.agreement import SELF_CHECK, agrees, references, worst_relative

MAX_LENGTH = 2048  # the probe is 12 tokens; the position tables need no more
aten = torch.ops.aten
MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}


class StochasticMatmuls(TorchDispatchMode):
    """Every bf16 matmul computed in float32, then rounded up or down to a neighbouring bf16 value with
    probability by distance (random low 16 bits added before truncation)."""

    def __init__(self, seed: int):
        super().__init__()
        self.gen = torch.Generator().manual_seed(seed)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in MATMULS or args[-1].dtype != torch.bfloat16:
            return func(*args, **kwargs)
        exact = func(*[a.float() if isinstance(a, torch.Tensor) else a for a in args], **kwargs)
        noise = torch.randint(0, 1 << 16, exact.shape, generator=self.gen, dtype=torch.int32).to(exact.device)
        return ((exact.view(torch.int32) + noise) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)


def hybrid(mixer: str, device, dtype, keep_ratio: float):
    """select + replace on a fresh random teacher (the same seed, so float32 and bf16 share weights)."""
    graph = capture(random_smollm2(MAX_LENGTH), device=device, dtype=dtype, max_length=MAX_LENGTH).branch()
    PassManager(["select", "replace"], {"select": {"keep_ratio": keep_ratio}, "replace": {"mixer": mixer}})(graph)
    return graph


def self_check(graph, ids: torch.Tensor, first: int, seed: int | None = None) -> tuple[bool, str, float]:
    """(passed, the self-check's measure, the worst position's relative logit error) of the Decoder self-check's (surgery.decode.self_check)
    probe on these ids, returned instead of raised; with `seed`, the incremental pass under StochasticMatmuls."""
    decoder = Decoder(graph, verify=False)
    decoder.reset(1, ids.shape[1])
    with torch.no_grad(), (StochasticMatmuls(seed) if seed is not None else contextlib.nullcontext()):
        got = [decoder.prefill(ids[:, :first])] + [decoder.step(ids[:, t:t + 1]) for t in range(first, ids.shape[1])]
    decoder.reset()
    got, full = torch.cat(got, dim=1), references(graph, ids, first)
    return (*agrees(got, full), worst_relative(got, full))


def decode_agreement(rows: Rows, mixers: list[str], device: torch.device, rounding_seeds: list[int],
                     keep_ratio: float = 0.25) -> Rows:
    """The rows above for each mixer: the self-check in float32 and bf16 (and, per rounding seed, bf16
    under StochasticMatmuls), then the bf16 drift."""
    ids = torch.randint(0, 49152, (1, SELF_CHECK), generator=torch.Generator().manual_seed(0)).to(device)
    first = SELF_CHECK - 4
    for mixer in mixers:
        logits = {}
        for dtype in (torch.float32, torch.bfloat16):
            graph = hybrid(mixer, device, dtype, keep_ratio)
            ok, measure, error = self_check(graph, ids, first)
            config = f"{str(dtype).removeprefix('torch.')}, {device.type}, {SELF_CHECK}-token probe"
            rows.add(f"{mixer}: Decoder self-check", config, f"worst position's relative logit error ({'passed' if ok else 'REFUSED'}: {measure})",
                     error, "rel err")
            for seed in rounding_seeds if dtype == torch.bfloat16 else []:
                error = self_check(graph, ids, first, seed)[2]
                rows.add(f"{mixer}: Decoder self-check, matmuls rounded stochastically", f"{config}, seed {seed}",
                         "worst position's relative logit error", error, "rel err")
            with torch.no_grad():
                logits[dtype] = graph.logits(ids)
            del graph
        drift = worst_relative(logits[torch.bfloat16], logits[torch.float32])
        rows.add(f"{mixer}: bf16 drift", f"bf16 against float32, {device.type}, {SELF_CHECK} tokens", "worst position's relative logit error",
                 drift, "rel err")
    return rows
