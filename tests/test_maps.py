"""Phase 1 closed-form maps against hand-computed cases."""

import math

import pytest
import torch
import torch.nn.functional as F

from tcal import maps


def alpha(a_log, dt_bias):
    """GDN decay with a_proj contributing nothing: exp(-exp(A_log) * softplus(dt_bias))."""
    return torch.exp(-torch.exp(a_log) * F.softplus(dt_bias))


def test_softplus_inverse_inverts_softplus_over_a_wide_range():
    y = torch.logspace(-8, 2, 200, dtype=torch.float64)
    x = maps.softplus_inverse(y, dtype=torch.float64)
    softplus = torch.logaddexp(x, torch.zeros_like(x))  # F.softplus returns x itself above 20
    torch.testing.assert_close(softplus, y, rtol=1e-14, atol=0)
    assert maps.softplus_inverse(math.log(2.0)).item() == pytest.approx(0.0, abs=1e-7)
    assert maps.softplus_inverse(1.0).dtype == torch.float32


def test_decay_halves_memory_after_d_tokens():
    a_log, dt_bias = maps.decay_from_distance(torch.tensor([1.0, 10.0]), dtype=torch.float64)
    assert torch.equal(a_log, torch.zeros(2, dtype=torch.float64))
    got = alpha(a_log, dt_bias)
    assert got[0].item() == pytest.approx(0.5, abs=1e-15)
    assert got[1].item() == pytest.approx(2**-0.1, abs=1e-15)
    a_log32, dt32 = maps.decay_from_distance(torch.tensor([1.0, 10.0]))
    assert a_log32.dtype == dt32.dtype == torch.float32


def test_decay_rate_is_clamped_at_both_ends():
    _, dt_bias = maps.decay_from_distance(torch.tensor([0.01, 1e6]), dtype=torch.float64)
    rates = F.softplus(dt_bias)
    torch.testing.assert_close(rates, torch.tensor([5.0, 1e-3], dtype=torch.float64), rtol=1e-12, atol=0)
    _, dt_bias = maps.decay_from_distance(torch.tensor([100.0]), min_rate=0.1, dtype=torch.float64)
    assert F.softplus(dt_bias).item() == pytest.approx(0.1, rel=1e-12)


def test_concentration_minmax_and_normalized():
    stats = {"entropy": torch.tensor([0.0, 2.0, 1.0, 4.0]), "norm_entropy": torch.tensor([0.0, 0.25, 1.0, 1.2])}
    assert maps.concentration(stats).tolist() == [1.0, 0.5, 0.75, 0.0]
    assert maps.concentration(stats, "normalized").tolist() == [1.0, 0.75, 0.0, 0.0]
    flat = {"entropy": torch.tensor([2.0, 2.0005], dtype=torch.float64)}
    torch.testing.assert_close(maps.concentration(flat, dtype=torch.float64), torch.tensor([1.0, 0.5], dtype=torch.float64))
    with pytest.raises(ValueError, match="unknown concentration mode"):
        maps.concentration(stats, "softmax")


def test_write_gate_target_and_logit():
    beta = maps.write_gate_target(torch.tensor([0.0, 0.5, 1.0]), dtype=torch.float64)
    torch.testing.assert_close(beta, torch.tensor([0.3, 0.5, 0.7], dtype=torch.float64))
    lg = maps.logit(beta, dtype=torch.float64)
    torch.testing.assert_close(torch.sigmoid(lg), beta, rtol=1e-14, atol=0)
    assert lg[1].item() == 0.0
    with pytest.raises(ValueError, match="0 < p < 1"):
        maps.logit(torch.tensor([0.2, 1.0]))


@pytest.mark.parametrize("row_scale", [1.0, 0.5, torch.tensor([0.5, 2.0, 1.0])])
def test_shift_rows_sets_mean_logit_over_tokens_to_target(row_scale):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 32, generator=g)
    tokens = torch.randn(500, 32, dtype=torch.float64, generator=g) + 0.3
    target = maps.logit(maps.write_gate_target(torch.tensor([0.0, 0.4, 1.0])), dtype=torch.float64)
    shifted = maps.shift_rows_to_mean_logit(w, tokens.mean(0), target, row_scale, dtype=torch.float64)
    mean_logit = (tokens @ shifted.T).mean(0)
    torch.testing.assert_close(mean_logit, target, rtol=0, atol=1e-10)
    # Directions orthogonal to x_mean keep the scaled row's response.
    x_mean = tokens.mean(0)
    ortho = torch.randn(32, dtype=torch.float64, generator=g)
    ortho -= ortho.dot(x_mean) / x_mean.dot(x_mean) * x_mean
    scaled = torch.as_tensor(row_scale, dtype=torch.float64).reshape(-1, 1) * w.double()
    torch.testing.assert_close(shifted @ ortho, scaled @ ortho)


def test_shift_rows_rejects_zero_mean_input():
    with pytest.raises(ValueError, match="norm ~0"):
        maps.shift_rows_to_mean_logit(torch.randn(2, 4), torch.zeros(4), torch.zeros(2))


def test_ols_scale_recovers_planted_factor_and_clamps():
    g = torch.Generator().manual_seed(1)
    pred = torch.randn(2, 50, 4, 8, generator=g)  # [B, T, H, D]
    factor = torch.tensor([0.5, 3.0, 20.0, 0.01])
    target = pred * factor[None, None, :, None]
    got = maps.ols_scale(target, pred, dim=2, dtype=torch.float64)
    torch.testing.assert_close(got, torch.tensor([0.5, 3.0, 10.0, 0.1], dtype=torch.float64))
    noisy = target + 0.01 * torch.randn(target.shape, generator=g)
    assert maps.ols_scale(noisy, pred, dim=2)[:2].tolist() == pytest.approx([0.5, 3.0], rel=1e-2)
    with pytest.raises(ValueError, match="zero for heads \\[1\\]"):
        maps.ols_scale(target, pred * torch.tensor([1.0, 0, 1, 1])[None, None, :, None], dim=2)


def test_rms_and_reference_gate_scale():
    x = torch.tensor([[3.0, 4.0], [0.0, 0.0]])
    assert maps.rms(x).item() == pytest.approx(math.sqrt(25 / 4))
    assert maps.rms(x, dim=1).tolist() == pytest.approx([math.sqrt(12.5), 0.0])
    teacher_ctx = torch.full((4, 8), 2.0)
    v_act = torch.full((4, 16), -0.5)
    assert maps.reference_gate_scale(teacher_ctx, v_act).item() == pytest.approx(0.01 * 2.0 / 0.5)
    with pytest.raises(ValueError, match="identically zero"):
        maps.reference_gate_scale(teacher_ctx, torch.zeros(3))


@pytest.mark.parametrize(
    "call",
    [
        lambda: maps.softplus_inverse(torch.tensor([1.0, math.nan])),
        lambda: maps.decay_from_distance(torch.tensor([math.inf])),
        lambda: maps.concentration({"entropy": torch.tensor([0.0, math.nan])}),
        lambda: maps.shift_rows_to_mean_logit(torch.randn(2, 3), torch.tensor([1.0, math.nan, 0]), torch.zeros(2)),
        lambda: maps.ols_scale(torch.full((2, 3), math.nan), torch.ones(2, 3), dim=0),
        lambda: maps.rms(torch.tensor([math.inf])),
    ],
)
def test_non_finite_inputs_raise(call):
    with pytest.raises(ValueError, match="NaN or inf"):
        call()


def test_non_positive_inputs_raise():
    with pytest.raises(ValueError, match="y > 0"):
        maps.softplus_inverse(torch.tensor([0.0]))
    with pytest.raises(ValueError, match="d must be > 0"):
        maps.decay_from_distance(torch.tensor([-1.0]))
