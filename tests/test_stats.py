"""AttentionStats: hand-computable heads, and chunked streaming == a brute-force full matrix."""

import math

import pytest
import torch

from tcal.maps import concentration
from tcal.stats import AttentionStats, StatsError


def previous_token_probs(t: int) -> torch.Tensor:
    """[T, T] rows: row t attends only to t-1, row 0 to itself."""
    p = torch.zeros(t, t, dtype=torch.float64)
    p[0, 0] = 1.0
    p[torch.arange(1, t), torch.arange(0, t - 1)] = 1.0
    return p


def uniform_causal_probs(t: int) -> torch.Tensor:
    causal = torch.ones(t, t, dtype=torch.float64).tril()
    return causal / causal.sum(-1, keepdim=True)


def uniform_causal_distance(t: int) -> float:
    """Row t averages 0.5 (self) and 1..t over t+1 keys: t/2 + 0.5/(t+1); mean over t=0..T-1."""
    return sum(r / 2 + 0.5 / (r + 1) for r in range(t)) / t


def brute_force(q, k, *, scale, mask=None, window=None, softcap=None):
    """Float64 full [B, H, Tq, Tk] attention and its statistics, written from the definitions."""
    q, k = q.double(), k.double()
    b, h, tq, _ = q.shape
    tk = k.shape[2]
    k = k.repeat_interleave(h // k.shape[1], dim=1)
    logits = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    pos = torch.arange(tk - tq, tk)[:, None]
    keys = torch.arange(tk)[None, :]
    if mask is None:
        allowed = (keys <= pos) & ((keys > pos - window) if window else True)
    elif mask.dtype == torch.bool:
        allowed = mask
    else:
        allowed = torch.isfinite(mask) & (mask != torch.finfo(mask.dtype).min)
        logits = logits + torch.where(allowed, mask, 0).double()
    allowed = allowed.expand(b, h, tq, tk)
    p = torch.softmax(logits.masked_fill(~allowed, -math.inf), -1)
    dist = (pos - keys).double().clamp_min(0.5)
    row_d = (p * dist).sum(-1)
    row_h = -(p * torch.log(torch.where(p > 0, p, 1.0))).sum(-1)
    n = allowed.sum(-1).double()
    valid, multi = n > 0, n > 1
    rows = valid.sum((0, 2))
    norm = torch.where(multi, row_h / torch.log(n.clamp_min(2)), 0.0)
    p_valid = torch.where(valid[..., None], p, 0.0)
    mass = torch.stack([(p_valid * ((pos - keys).clamp_min(0) == d)).sum((0, 2, 3)) for d in range(tk)], -1)  # [H, distance]
    return {
        "distance_mass": mass / rows[:, None],
        "distance": (torch.where(valid, row_d, 0.0).sum((0, 2)) / rows).clamp_min(0.5),
        "entropy": torch.where(valid, row_h, 0.0).sum((0, 2)) / rows,
        "norm_entropy": norm.sum((0, 2)) / multi.sum((0, 2)),
        "rows": rows,
    }


def assert_stats_close(got, want, rtol=1e-5, atol=1e-6):
    assert set(got) == set(want)
    for name in ("distance", "entropy", "norm_entropy"):
        assert got[name].dtype == torch.float64 and got[name].device.type == "cpu"
        torch.testing.assert_close(got[name], want[name].double(), rtol=rtol, atol=atol, msg=name)
    assert torch.equal(got["rows"], want["rows"])
    size = max(got["distance_mass"].shape[1], want["distance_mass"].shape[1])
    pad = [torch.nn.functional.pad(m.double(), (0, size - m.shape[1])) for m in (got["distance_mass"], want["distance_mass"])]
    torch.testing.assert_close(*pad, rtol=rtol, atol=atol, msg="distance_mass")


def stats_from_qk(q, k, **kwargs):
    stats = AttentionStats(q.shape[1])
    stats.update_from_qk(q, k, **kwargs)
    return stats.result()


def test_previous_token_head_from_probs_is_distance_one_and_most_concentrated():
    t = 64
    p = torch.stack([previous_token_probs(t), uniform_causal_probs(t)])[None]
    stats = AttentionStats(2)
    stats.update_from_probs(p)
    out = stats.result()
    assert out["distance"][0].item() == pytest.approx((0.5 + (t - 1)) / t, abs=1e-12)
    assert out["entropy"][0].item() == 0.0
    assert out["norm_entropy"][0].item() == 0.0
    assert concentration(out, "minmax").tolist() == [1.0, 0.0]
    assert concentration(out, "normalized")[0].item() == 1.0


def test_previous_token_head_rows_after_the_first_have_distance_exactly_one():
    t = 32
    p = previous_token_probs(t)[None, None, 1:]  # queries 1..T-1 over all T keys
    stats = AttentionStats(1)
    stats.update_from_probs(p)
    assert stats.result()["distance"].item() == 1.0


def test_previous_token_head_from_qk():
    """One-hot positions: q_t = big * e_{t-1} (q_0 = big * e_0), k_j = big * e_j."""
    t, big = 48, 12.0
    k = torch.eye(t, dtype=torch.float64) * big
    q = k[(torch.arange(t) - 1).clamp_min(0)]
    out = stats_from_qk(q[None, None], k[None, None], scale=1.0)
    assert out["distance"].item() == pytest.approx((0.5 + (t - 1)) / t, abs=1e-9)
    assert out["entropy"].item() == pytest.approx(0.0, abs=1e-9)


def test_uniform_causal_head_distance_is_about_a_quarter_of_the_length():
    t = 1024
    q = torch.zeros(1, 1, t, 8)
    k = torch.randn(1, 1, t, 8)
    out = stats_from_qk(q, k, scale=1.0, query_chunk=100)
    exact = (t - 1) / 4 + sum(1 / n for n in range(1, t + 1)) / (2 * t)
    assert uniform_causal_distance(t) == pytest.approx(exact, rel=1e-12)
    assert out["distance"].item() == pytest.approx(exact, rel=1e-5)
    assert out["distance"].item() == pytest.approx(t / 4, rel=0.02)
    assert out["norm_entropy"].item() == pytest.approx(1.0, abs=1e-5)
    mean_log = sum(math.log(r + 1) for r in range(t)) / t
    assert out["entropy"].item() == pytest.approx(mean_log, rel=1e-5)


def qk(b=2, h=4, hk=2, tq=40, tk=40, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, tq, d, generator=g), torch.randn(b, hk, tk, d, generator=g)


CASES = {
    "causal_gqa": dict(),
    "window": dict(window=7),
    "softcap": dict(softcap=2.0),
    "short_queries": dict(tq=13, tk=40),
    "short_queries_window": dict(tq=13, tk=40, window=9),
}


@pytest.mark.parametrize("case", CASES)
def test_chunked_equals_unchunked_equals_brute_force(case):
    kwargs = dict(CASES[case])
    shape = {key: kwargs.pop(key) for key in ("tq", "tk") if key in kwargs}
    q, k = qk(**shape)
    want = brute_force(q, k, scale=0.25, **kwargs)
    for chunk in (5, 1000):
        assert_stats_close(stats_from_qk(q, k, scale=0.25, query_chunk=chunk, **kwargs), want)


def padded_causal_mask(b, tq, tk):
    """[B, 1, Tq, Tk] causal mask with the first key of batch 1 padded out."""
    pos = torch.arange(tk - tq, tk)[:, None]
    allowed = (torch.arange(tk)[None, :] <= pos).expand(b, 1, tq, tk).clone()
    allowed[1, :, :, 0] = False
    return allowed


def test_boolean_mask_replaces_causal_rule():
    q, k = qk(tq=20, tk=30)
    mask = padded_causal_mask(2, 20, 30)
    want = brute_force(q, k, scale=0.3, mask=mask)
    for chunk in (3, 64):
        assert_stats_close(stats_from_qk(q, k, scale=0.3, mask=mask, query_chunk=chunk), want)


def test_additive_mask_with_bias_inf_and_dtype_min():
    q, k = qk(tq=20, tk=30)
    allowed = padded_causal_mask(2, 20, 30)
    bias = 0.1 * torch.randn(2, 1, 20, 30)
    mask = torch.where(allowed, bias, -math.inf)
    mask[0][~allowed[0]] = torch.finfo(torch.float32).min
    want = brute_force(q, k, scale=0.3, mask=mask)
    for chunk in (4, 64):
        assert_stats_close(stats_from_qk(q, k, scale=0.3, mask=mask, query_chunk=chunk), want)


def test_broadcast_row_mask_is_not_sliced_per_chunk():
    """A [B, 1, 1, Tk] padding-only mask (no causality) keeps every row's keys in every chunk."""
    q, k = qk(tq=12, tk=12)
    mask = torch.ones(2, 1, 1, 12, dtype=torch.bool)
    mask[0, ..., :3] = False
    want = brute_force(q, k, scale=0.3, mask=mask)
    assert_stats_close(stats_from_qk(q, k, scale=0.3, mask=mask, query_chunk=5), want)


@pytest.mark.parametrize("case", ["causal", "mask", "short_queries"])
def test_probs_path_equals_qk_path(case):
    q, k = qk(tq=15 if case == "short_queries" else 30, tk=30)
    mask = padded_causal_mask(2, 30, 30) if case == "mask" else None
    from_qk = stats_from_qk(q, k, scale=0.3, mask=mask, query_chunk=7)
    h, tq = q.shape[1:3]
    assert_stats_close(from_qk, brute_force(q, k, scale=0.3, mask=mask))
    logits = q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2) * 0.3
    pos = torch.arange(30 - tq, 30)[:, None]
    allowed = mask if mask is not None else torch.arange(30)[None, :] <= pos
    p = torch.softmax(logits.masked_fill(~allowed, -math.inf), -1)
    stats = AttentionStats(h)
    stats.update_from_probs(p.float(), query_chunk=4)
    assert_stats_close(stats.result(), from_qk)


def test_accumulates_across_updates_like_one_batch():
    q, k = qk(b=2)
    whole = stats_from_qk(q, k, scale=0.2)
    stats = AttentionStats(q.shape[1])
    for i in range(2):
        stats.update_from_qk(q[i : i + 1], k[i : i + 1], scale=0.2, query_chunk=9)
    assert_stats_close(stats.result(), whole)


def test_float64_inputs_compute_in_float64():
    q, k = qk()
    out = stats_from_qk(q.double(), k.double(), scale=0.25, query_chunk=6)
    assert_stats_close(out, brute_force(q, k, scale=0.25), rtol=1e-12, atol=1e-12)


def test_empty_stats_raise():
    with pytest.raises(StatsError, match="no attention rows"):
        AttentionStats(4).result()


def test_fully_masked_rows_are_skipped():
    q, k = qk(tq=6, tk=6)
    mask = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    mask[1, :, :3] = False  # three padding queries that see no key
    out = stats_from_qk(q, k, scale=0.3, mask=mask)
    assert out["rows"].tolist() == [9] * 4
    assert_stats_close(out, brute_force(q, k, scale=0.3, mask=mask))


def test_nan_input_raises():
    q, k = qk()
    q[0, 1, 3, 0] = math.nan
    stats = AttentionStats(4)
    stats.update_from_qk(q, k, scale=0.25)
    with pytest.raises(StatsError, match=r"NaN/inf for heads \[1\]"):
        stats.result()


@pytest.mark.parametrize(
    "q_shape, k_shape, kwargs, match",
    [
        ((1, 4, 8, 16), (1, 3, 8, 16), {}, "multiple of the kv heads"),
        ((1, 4, 9, 16), (1, 2, 8, 16), {}, "Tq <= Tk"),
        ((1, 4, 8, 16), (1, 2, 8, 16), {"mask": torch.ones(3, 8, 8, dtype=torch.bool)}, "does not broadcast"),
        ((1, 2, 8, 16), (1, 2, 8, 16), {}, "built for 4"),
    ],
)
def test_bad_shapes_raise(q_shape, k_shape, kwargs, match):
    with pytest.raises(StatsError, match=match):
        AttentionStats(4).update_from_qk(torch.randn(q_shape), torch.randn(k_shape), scale=1.0, **kwargs)
