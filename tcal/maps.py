"""Closed-form maps from teacher statistics to GDN parameters (METHOD.md, Phase 1).

Pure functions on tensors. Each computes in float64, so that the exact identities the method relies
on (alpha = 2^(-1/d), mean logit == target) hold to rounding, and returns `dtype` (float32 unless
the caller asks otherwise). Non-finite inputs raise ValueError naming the argument: a NaN here
would silently become a NaN parameter in the student.
"""

from __future__ import annotations

import math

import torch

Number = float | int | torch.Tensor


def _f64(x: Number, name: str) -> torch.Tensor:
    """`x` as a float64 tensor on its own device, rejecting NaN/inf."""
    t = torch.as_tensor(x).to(torch.float64)
    if not torch.isfinite(t).all():
        raise ValueError(
            f"{name} contains NaN or inf; check the calibration activations/statistics it came from "
            "(fp16 overflow is the usual cause: calibrate in float32 or bfloat16)."
        )
    return t


def softplus_inverse(y: Number, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x with softplus(x) = y, as y + log(-expm1(-y)) (stable for small and large y; METHOD.md Decay)."""
    y = _f64(y, "y")
    if (y <= 0).any():
        raise ValueError("softplus_inverse needs y > 0: softplus never reaches 0 or below.")
    return (y + torch.log(-torch.expm1(-y))).to(dtype)


def decay_from_distance(
    d: Number, min_rate: float = 1e-3, max_rate: float = 5.0, *, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """(A_log, dt_bias) so the GDN memory halves after about d tokens (METHOD.md Phase 1, Decay).

    With A_log = 0 and a_proj contributing nothing, alpha = exp(-softplus(dt_bias)) = exp(-rate),
    and rate = ln 2 / d gives alpha = 2^(-1/d); the rate is clamped to [min_rate, max_rate].
    """
    d = _f64(d, "d (mean attention distance)")
    if (d <= 0).any():
        raise ValueError("mean attention distance d must be > 0 (AttentionStats clamps it to >= 0.5).")
    rate = (math.log(2.0) / d).clamp(min_rate, max_rate)
    return torch.zeros_like(d).to(dtype), softplus_inverse(rate, dtype=dtype)


def concentration(
    stats: dict[str, torch.Tensor], mode: str = "minmax", *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Per-head concentration c in [0, 1] from a layer's AttentionStats result (METHOD.md Concentration).

    "minmax" (the reference): 1 - (H - min H) / max(max H - min H, 1e-3) over the layer's heads, so
    the sharpest head gets 1 and the most diffuse 0. "normalized": 1 - entropy / log(n_keys), which
    compares each head with a uniform row instead of with the other heads.
    """
    if mode == "minmax":
        h = _f64(stats["entropy"], "stats['entropy']")
        spread = (h.max() - h.min()).clamp_min(1e-3)
        return (1 - (h - h.min()) / spread).to(dtype)
    if mode == "normalized":
        h = _f64(stats["norm_entropy"], "stats['norm_entropy']")
        return (1 - h).clamp(0, 1).to(dtype)
    raise ValueError(f"unknown concentration mode {mode!r}; use 'minmax' or 'normalized'.")


def write_gate_target(c: Number, low: float = 0.3, span: float = 0.4, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Target write gate beta* = low + span * c (METHOD.md: 0.3 + 0.4 c): sharp heads write more."""
    return (low + span * _f64(c, "c (concentration)")).to(dtype)


def logit(p: Number, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse sigmoid, log(p) - log(1 - p), for p strictly inside (0, 1)."""
    p = _f64(p, "p")
    if ((p <= 0) | (p >= 1)).any():
        raise ValueError("logit needs 0 < p < 1; a gate target of exactly 0 or 1 has no finite logit.")
    return (torch.log(p) - torch.log1p(-p)).to(dtype)


def shift_rows_to_mean_logit(
    w: torch.Tensor,
    x_mean: torch.Tensor,
    target_logit: Number,
    row_scale: Number = 1.0,
    *,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Rows of b_proj [H, in] whose mean pre-sigmoid logit over calibration tokens is the target.

    METHOD.md (write gate) follows the paper's text: since the projection is linear and has no bias,
    the mean logit is W' @ x_mean. Scale the rows, then add the rank-one shift along x_mean that
    moves W' @ x_mean exactly to the target while leaving directions orthogonal to x_mean unchanged.
    """
    w = _f64(w, "w (b_proj weight)")
    x_mean = _f64(x_mean, "x_mean (mean calibration input)")
    target = _f64(target_logit, "target_logit")
    scale = _f64(row_scale, "row_scale").reshape(-1, 1)
    norm_sq = x_mean.dot(x_mean)
    if norm_sq.sqrt() < 1e-6:
        raise ValueError(
            "x_mean (mean calibration input) has norm ~0, so no shift along it can set the mean logit "
            "(it would need to be ~1/||x_mean||); use the input to b_proj (the normed hidden state)."
        )
    scaled = scale * w
    gap = target - scaled @ x_mean
    return (scaled + gap[:, None] * x_mean[None, :] / norm_sq).to(dtype)


def ols_scale(
    target: torch.Tensor,
    pred: torch.Tensor,
    dim: int,
    clamp: tuple[float, float] = (0.1, 10.0),
    *,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Per-head least-squares factor <target, pred> / ||pred||^2 (METHOD.md Value scale), clamped.

    `dim` is the head dimension; every other dim is reduced. Returns [H].
    """
    if target.shape != pred.shape:
        raise ValueError(f"target {tuple(target.shape)} and pred {tuple(pred.shape)} must have the same shape.")
    t = _f64(target, "target").movedim(dim, 0).flatten(1)
    p = _f64(pred, "pred").movedim(dim, 0).flatten(1)
    energy = (p * p).sum(1)
    if (energy == 0).any():
        heads = torch.nonzero(energy == 0).flatten().tolist()
        raise ValueError(f"pred is identically zero for heads {heads}: no scale factor can match the target.")
    return ((t * p).sum(1) / energy).clamp(*clamp).to(dtype)


def rms(x: torch.Tensor, dim: int | tuple[int, ...] | None = None, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Root mean square of x over `dim` (all elements when None)."""
    x = _f64(x, "x")
    sq = x * x
    return (sq.mean() if dim is None else sq.mean(dim)).sqrt().to(dtype)


def reference_gate_scale(
    teacher_ctx: torch.Tensor, v_act: torch.Tensor, factor: float = 0.01, *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """alpha_l = factor * RMS(teacher_ctx) / RMS(v_act): the reference's g_proj = alpha_l * v_proj damping.

    METHOD.md (output gate): with factor 0.01 the gate starts tiny; kept to reproduce the reference.
    """
    denominator = rms(v_act, dtype=torch.float64)
    if denominator == 0:
        raise ValueError("v_act (silu(v_proj x)) is identically zero: its RMS cannot set the gate scale.")
    return (factor * rms(teacher_ctx, dtype=torch.float64) / denominator).to(dtype)


def window_from_mass(distance_mass: torch.Tensor, quantile: float) -> torch.Tensor:
    """Per head, the smallest window w whose last w positions (distances 0 .. w-1) hold at least
    `quantile` of the head's mean attention mass: distance_mass [H, D] as AttentionStats gives it
    (each row sums to 1 over distances). Returns int64 [H]; a head whose mass never reaches the
    quantile (rounding) gets the longest distance seen + 1."""
    mass = _f64(distance_mass, "distance_mass")
    if not 0 < quantile <= 1:
        raise ValueError(f"quantile must lie in (0, 1], got {quantile}.")
    kept = mass.cumsum(-1) / mass.sum(-1, keepdim=True).clamp_min(1e-30)
    reached = kept >= quantile - 1e-12
    first = torch.where(reached.any(-1), reached.to(torch.int64).argmax(-1), torch.full_like(reached[:, 0], mass.shape[-1] - 1, dtype=torch.int64))
    return first + 1


def gate_bias_from_distance(d: Number, normalizer: float, min_rate: float = 1e-3, max_rate: float = 5.0, *,
                            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The bias b of a GLA forget gate log(alpha) = logsigmoid(b) / normalizer (fla's
    gate_logit_normalizer) that halves the memory after about d tokens, as decay_from_distance does
    for GDN: logsigmoid(b) = -normalizer * rate with rate = ln 2 / d (clamped), so
    b = -softplus^-1(normalizer * rate)."""
    d = _f64(d, "d (mean attention distance)")
    if (d <= 0).any():
        raise ValueError("mean attention distance d must be > 0 (AttentionStats clamps it to >= 0.5).")
    rate = (math.log(2.0) / d).clamp(min_rate, max_rate)
    return (-softplus_inverse(normalizer * rate, dtype=torch.float64)).to(dtype)
