"""Streaming per-head attention statistics of a teacher layer (METHOD.md, Phase 1).

Phase 1 needs, per query head, the mean attention distance and the attention entropy over a
calibration set. The full T x T attention of a whole batch does not fit in memory at long context,
so rows are produced a chunk of queries at a time and reduced to per-head sums at once.
"""

from __future__ import annotations

from typing import Iterator, NamedTuple

import torch

# Additive-mask entries at or below this are treated as "may not attend" (HF uses the dtype's
# minimum, older code -1e4 or -1e9); exp() of them is 0 in float32 anyway.
BLOCKED_BELOW = -1e4


class StatsError(ValueError):
    """Statistics cannot be computed or are unusable; the message names the problem and the fix."""


class RowChunk(NamedTuple):
    """Attention rows for a run of consecutive queries."""

    probs: torch.Tensor  # [B, H, c, Tk] softmaxed rows
    positions: torch.Tensor  # [c] absolute query positions, in key index units
    n_keys: torch.Tensor  # [B, H, c] number of keys each row may attend to


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _mask_rows(mask: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Rows start:stop of a mask broadcastable to [..., Tq, Tk] (a broadcast row dim is kept)."""
    if mask.dim() < 2 or mask.shape[-2] == 1:
        return mask
    return mask[..., start:stop, :]


def _allowed_and_bias(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Split a boolean or additive mask into (may-attend, finite additive bias or None)."""
    if mask.dtype == torch.bool:
        return mask, None
    allowed = mask > BLOCKED_BELOW
    return allowed, torch.where(allowed, mask, torch.zeros((), dtype=mask.dtype, device=mask.device))


def _structural_allowed(positions: torch.Tensor, tk: int, window: int | None) -> torch.Tensor:
    """Causal (and optionally sliding-window) rule for queries at `positions`: [c, Tk] bool."""
    keys = torch.arange(tk, device=positions.device)
    rel = positions[:, None] - keys[None, :]
    allowed = rel >= 0
    if window is not None:
        allowed &= rel < window
    return allowed


def _check_qk(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, window: int | None) -> None:
    if q.dim() != 4 or k.dim() != 4:
        raise StatsError(
            f"q and k must be [B, H, T, D]; got q {tuple(q.shape)}, k {tuple(k.shape)}. "
            "Pass the per-head tensors as fed to attention (after RoPE), heads on dim 1."
        )
    (b, h, tq, d), (bk, hk, tk, dk) = q.shape, k.shape
    if b != bk or d != dk or h % hk != 0:
        raise StatsError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} do not match: batch and head_dim must agree "
            "and the query heads must be a multiple of the kv heads (GQA)."
        )
    if tq > tk:
        raise StatsError(
            f"{tq} queries but only {tk} keys: queries are aligned to the end of the keys, so Tq <= Tk. "
            "Pass the full key cache (past + current)."
        )
    if window is not None and window < 1:
        raise StatsError(f"window={window} must be >= 1 (or None for full causal attention).")
    if mask is not None:
        try:
            torch.broadcast_shapes(mask.shape, (b, h, tq, tk))
        except RuntimeError as exc:
            raise StatsError(
                f"mask {tuple(mask.shape)} does not broadcast to [B, H, Tq, Tk] = {(b, h, tq, tk)}. "
                "Pass the attention mask exactly as the layer applies it."
            ) from exc


def attention_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float,
    mask: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    query_chunk: int = 256,
) -> Iterator[RowChunk]:
    """Yield the softmax attention of q over k, `query_chunk` query rows at a time.

    Causal with queries aligned to the end of the keys, unless `mask` is given, which then replaces
    the causal/window rule. GQA is handled by grouping query heads instead of repeating k.
    """
    _check_qk(q, k, mask, window)
    b, h, tq, d = q.shape
    hk, tk = k.shape[1], k.shape[2]
    dtype = _compute_dtype(q)
    kk = k.to(dtype)[:, :, None]  # [B, Hk, 1, Tk, D]
    offset = tk - tq
    for start in range(0, tq, query_chunk):
        stop = min(start + query_chunk, tq)
        positions = torch.arange(start + offset, stop + offset, device=q.device)
        qc = q[:, :, start:stop].to(dtype).reshape(b, hk, h // hk, stop - start, d)
        logits = (qc @ kk.transpose(-1, -2)).reshape(b, h, stop - start, tk) * scale
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        if mask is None:
            allowed = _structural_allowed(positions, tk, window)
        else:
            allowed, bias = _allowed_and_bias(_mask_rows(mask, start, stop))
            if bias is not None:
                logits = logits + bias.to(dtype)
        logits = logits.masked_fill(~allowed, float("-inf"))
        n_keys = allowed.sum(-1).expand(b, h, stop - start)
        yield RowChunk(torch.softmax(logits, dim=-1), positions, n_keys)


def prob_rows(p: torch.Tensor, query_offset: int | None = None, query_chunk: int = 256) -> Iterator[RowChunk]:
    """Yield already-softmaxed rows p [B, H, Tq, Tk] in chunks; a row's keys are its nonzero entries."""
    if p.dim() != 4:
        raise StatsError(f"p must be [B, H, Tq, Tk]; got {tuple(p.shape)}. Pass the layer's attention weights.")
    tq, tk = p.shape[-2:]
    offset = tk - tq if query_offset is None else query_offset
    if offset < 0:
        raise StatsError(
            f"query offset {offset} < 0 ({tq} queries, {tk} keys): pass query_offset, the absolute "
            "position of the first query, when rows are not aligned to the end of the keys."
        )
    dtype = _compute_dtype(p)
    for start in range(0, tq, query_chunk):
        stop = min(start + query_chunk, tq)
        rows = p[:, :, start:stop].to(dtype)
        positions = torch.arange(start + offset, stop + offset, device=p.device)
        yield RowChunk(rows, positions, (rows > 0).sum(-1))


class AttentionStats:
    """Per-head sums over (batch, query row) of attention distance and entropy, for one layer.

    Rows with no attendable key (fully masked padding) are skipped; normalised entropy skips rows
    with a single key, whose entropy is 0 by construction (and is 0 for a head with no other rows).
    """

    def __init__(self, num_heads: int):
        self.num_heads = num_heads
        names = ("rows", "distance", "entropy", "norm_rows", "norm_entropy")
        self._sums = {name: torch.zeros(num_heads, dtype=torch.float64) for name in names}
        self._mass = torch.zeros(num_heads, 1, dtype=torch.float64)  # [H, distances seen]: attention mass by distance

    def update_from_qk(self, q: torch.Tensor, k: torch.Tensor, **options) -> None:
        """Accumulate from post-RoPE q [B,H,Tq,D] and k [B,Hk,Tk,D]; options (scale, mask, window,
        softcap, query_chunk) are those of `attention_rows`."""
        for chunk in attention_rows(q, k, **options):
            self._accumulate(chunk)

    def update_from_probs(self, p: torch.Tensor, *, query_offset: int | None = None, query_chunk: int = 256) -> None:
        """Accumulate from softmaxed rows p [B,H,Tq,Tk], as an eager attention layer returns them."""
        for chunk in prob_rows(p, query_offset, query_chunk):
            self._accumulate(chunk)

    def result(self) -> dict[str, torch.Tensor]:
        """Per-head means as float64 CPU tensors [H]; raises StatsError if empty or non-finite."""
        sums = {name: total.cpu() for name, total in self._sums.items()}
        rows, norm_rows = sums["rows"], sums["norm_rows"]
        if (rows == 0).any():
            raise StatsError(
                f"no attention rows seen for heads {_heads(rows == 0)}: call update_from_qk or "
                "update_from_probs on calibration batches (and check the mask allows some keys) first."
            )
        out = {
            "distance": (sums["distance"] / rows).clamp_min(0.5),
            "entropy": sums["entropy"] / rows,
            # A head whose rows each had one key is fully concentrated: its entropy is 0.
            "norm_entropy": sums["norm_entropy"] / norm_rows.clamp_min(1),
        }
        for name, value in out.items():
            if not torch.isfinite(value).all():
                raise StatsError(
                    f"attention statistic '{name}' is NaN/inf for heads {_heads(~torch.isfinite(value))}: "
                    "the teacher's q/k or attention weights hold NaN/inf (often fp16 overflow); "
                    "run calibration in float32 or bfloat16."
                )
        out["rows"] = rows.to(torch.int64)
        # mean attention mass per row at each distance 0, 1, 2, ... (what a window of w keeps: the first w)
        out["distance_mass"] = self._mass.cpu() / rows[:, None]
        return out

    def _check_heads(self, h: int) -> None:
        if h != self.num_heads:
            raise StatsError(
                f"input has {h} query heads on dim 1 but these stats were built for {self.num_heads}; "
                "use one AttentionStats per layer, created with that layer's query-head count."
            )

    def _accumulate(self, chunk: RowChunk) -> None:
        """Reduce one chunk of rows to per-head sums (float64, on the input's device)."""
        probs, positions, n_keys = chunk
        self._check_heads(probs.shape[1])
        keys = torch.arange(probs.shape[-1], device=probs.device)
        dist = (positions[:, None] - keys[None, :]).to(probs.dtype).clamp_min(0.5)
        valid = n_keys > 0
        multi = n_keys > 1
        row_distance = torch.where(valid, (probs * dist).sum(-1), 0.0)
        entropy = -torch.special.xlogy(probs, probs).sum(-1)
        row_entropy = torch.where(valid, entropy, 0.0)
        log_n = torch.log(n_keys.clamp_min(2).to(probs.dtype))
        row_norm = torch.where(multi, entropy / log_n, 0.0)
        parts = {
            "rows": valid,
            "distance": row_distance,
            "entropy": row_entropy,
            "norm_rows": multi,
            "norm_entropy": row_norm,
        }
        for name, part in parts.items():
            total = self._sums[name].to(probs.device)
            self._sums[name] = total + part.to(torch.float64).sum(dim=(0, 2))
        self._add_mass(torch.where(valid[..., None], probs, 0.0), positions, keys)

    def _add_mass(self, probs: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor) -> None:
        """Attention mass by query-key distance, summed over rows: [H, max distance + 1] (what Phase 1
        of a sliding-window mixer reads its window from: tcal.maps.window_from_mass)."""
        heads, rows, tk = probs.shape[1], probs.shape[2], probs.shape[3]
        where = (positions[:, None] - keys[None, :]).clamp_min(0)  # later keys (non-causal masks) count at 0, as in "distance"
        size = max(int(where.max()) + 1, self._mass.shape[1])
        mass = probs.to(torch.float64).sum(0).reshape(heads, -1)
        index = where.reshape(1, -1).expand(heads, rows * tk)
        added = torch.zeros(heads, size, dtype=torch.float64, device=probs.device).scatter_add_(1, index, mass)
        added[:, : self._mass.shape[1]] += self._mass.to(probs.device)
        self._mass = added


def _heads(flags: torch.Tensor) -> list[int]:
    return torch.nonzero(flags).flatten().tolist()

