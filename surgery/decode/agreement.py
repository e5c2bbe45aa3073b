"""When the decoder's numbers count as the graph's: the checks that compare a KV-cache attention with
the graph's own attention output, and incremental logits with full recomputation."""
from __future__ import annotations

import torch

from ..errors import DecodeError
from .lengths import FIX_FULL

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


def worst_relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest relative logit error over positions (|got - want| / |want| per position's vector)."""
    g, w = got.float(), want.float()
    return ((g - w).norm(dim=-1) / w.norm(dim=-1).clamp_min(1e-6)).max().item()


def agrees(got: torch.Tensor, full: torch.Tensor) -> tuple[bool, str]:
    """The self-check's criterion: float32/64 as tight as `close`; bf16/fp16 by the worst position's
    relative error, since 30 layers of rounding move single logits by O(1) while a structural
    mistake moves a position's whole distribution."""
    if full.dtype in (torch.float32, torch.float64):
        ok, diff = close(got, full)
        return ok, f"max logit difference {diff:.3g}"
    rel = worst_relative(got, full)
    return rel <= LOW_PRECISION_REL_ERROR, f"relative logit error {rel:.3g} at the worst position, in {str(full.dtype).removeprefix('torch.')}"


SELF_CHECK = 12      # tokens of the construction-time comparison with full recomputation
SWITCH_CHECK = 1024  # the longest probe across a switch of the position tables (LongRoPE's) it also runs


def probes(max_length: int, switches: list[int]) -> list[tuple[int, int]]:
    """(tokens, prefilled) of each self-check probe: a short one, and one whose steps cross the
    first switch of the position tables when that is within SWITCH_CHECK tokens."""
    n = min(max_length, SELF_CHECK)
    out = [(n, max(1, n - 4))]
    if switches and switches[0] + 2 <= min(max_length, SWITCH_CHECK):
        out.append((switches[0] + 2, max(1, switches[0] - 2)))
    return out


def references(graph, ids: torch.Tensor, first: int) -> torch.Tensor:
    """What full recomputation gives for a prefill of `first` tokens and then one step per token:
    each call's logits from the sequence as long as it then was (positions whose tables change with
    the length make the last call's full pass differ from the first's)."""
    with torch.no_grad():
        calls = [graph.logits(ids[:, :first])] + [graph.logits(ids[:, :t + 1])[:, -1:] for t in range(first, ids.shape[1])]
    return torch.cat(calls, dim=1)


class ProbeDisagreement(DecodeError):
    """The self-check's refusal; `measured` says by how much (surgery.decode.self_check reads it)."""

    def __init__(self, tokens: int, measured: str):
        self.measured = measured
        super().__init__(
            f"Incremental decoding disagrees with full recomputation on a {tokens}-token probe ({measured}): "
            "the graph computes something from the sequence that the decoder does not carry over (positions in an unusual form?).",
            FIX_FULL,
        )


def check_probe(got: torch.Tensor, full: torch.Tensor) -> None:
    """A self-check probe's incremental logits against full recomputation's: ProbeDisagreement if they disagree."""
    ok, diff = agrees(got, full)
    if not ok:
        raise ProbeDisagreement(full.shape[1], diff)



# A compiled graph's logits against the eager graph's on the same ids (the runtime guard of
# surgery.decode.fast): the mean over positions of the total variation distance between their next-
# token distributions (0: the same, 1: disjoint). Rounding moves probability a little (bf16 against
# float32, the real SmolLM2 teacher kept the same top token at 90% of positions); a broken compile
# predicts other tokens (near 1 where the model is confident) or NaN. A logit-space measure would
# not do: a common offset across the vocabulary shrinks relative errors, and the random-weight hybrid's
# flat logits differed by 0.35 relative from rounding alone (issue 29). Whether compiled is as near
# float32 as eager is the slower question surgery.decode.precision answers.
COMPILED_TOTAL_VARIATION = 0.5
POSITIONS_AT_ONCE = 1024  # softmax in float32 over this many positions at a time (a 32k x 49k one is 6.4 GB)


def compiled_agrees(got: torch.Tensor, eager: torch.Tensor) -> tuple[bool, str]:
    """(ok, what was measured) for compiled logits `got` [B, T, V] against eager logits of the same ids."""
    g, e = got.flatten(0, -2), eager.flatten(0, -2)
    if not bool(torch.isfinite(g).all()) and bool(torch.isfinite(e).all()):
        return False, "non-finite logits"
    total = 0.0
    for start in range(0, g.shape[0], POSITIONS_AT_ONCE):
        p, q = (x[start:start + POSITIONS_AT_ONCE].float().softmax(-1) for x in (g, e))
        total += (p - q).abs().sum(-1).mul(0.5).sum().item()
    tv = total / max(1, g.shape[0])
    return tv <= COMPILED_TOTAL_VARIATION, f"mean total variation {tv:.3g} between the next-token distributions"
