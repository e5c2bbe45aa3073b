"""When the decoder's numbers count as the graph's: the checks that compare a KV-cache attention with
the graph's own attention output, and incremental logits with full recomputation."""
from __future__ import annotations

import torch

# The worst position's relative logit error (||incremental - full|| / ||full|| over the vocabulary)
# that bf16/fp16 rounding stays under on the self-check's short probe, while a structural mistake
# goes well over it; the measurements behind it are in bench/RESULTS.md ("Numbers formerly in decode
# comments"). float32 gets the tight check.
LOW_PRECISION_REL_ERROR = 0.1


def tolerance(dtype) -> float:
    return 1e-3 if dtype in (torch.float32, torch.float64) else 3e-2


def close(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, float]:
    """Max absolute difference within the dtype's tolerance, relative to b's largest entry (at least 1)."""
    diff = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
    scale = max(1.0, b.float().abs().max().item() if b.numel() else 1.0)
    return diff <= tolerance(b.dtype) * scale, diff


def agrees(got: torch.Tensor, full: torch.Tensor) -> tuple[bool, str]:
    """The self-check's criterion: float32/64 as tight as `close`; bf16/fp16 by the worst position's
    relative error, since 30 layers of rounding move single logits by O(1) while a structural
    mistake moves a position's whole distribution."""
    if full.dtype in (torch.float32, torch.float64):
        ok, diff = close(got, full)
        return ok, f"max logit difference {diff:.3g}"
    g, f = got.float(), full.float()
    rel = ((g - f).norm(dim=-1) / f.norm(dim=-1).clamp_min(1e-6)).max().item()
    return rel <= LOW_PRECISION_REL_ERROR, f"relative logit error {rel:.3g} at the worst position, in {str(full.dtype).removeprefix('torch.')}"
