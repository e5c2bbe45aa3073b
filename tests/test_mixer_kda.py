"""replace.mixer=kda: Gated DeltaNet with a decay per key channel (Kimi Delta Attention's recurrence).

References: the GDN kernels (already checked against fla's naive gated delta rule) when every channel
of a head decays alike, the token loop in float64 for per-channel decays, fla's naive KDA when fla's
sources import, full recomputation (decoding), the teacher's attention block output on held-out text
(Phase 1, Phase 2), the saved weights (save/load)."""
from __future__ import annotations

import math

import pytest
import torch

import surgery
from surgery import PassManager
from surgery.errors import ExportError
from surgery.passes.teacher_data import collect
from surgery.data.windows import calibration_ids
from tcal.kernels import recurrent_gated_delta_rule_torch
from tcal.mixers import MIXERS
from tcal.mixers.kda import KimiDeltaAttention
from tcal.mixers.kda_kernels import chunked_kda_torch, kda, recurrent_kda_torch

from test_mixer_gla import fla_naive
from test_mixer_swa import block_error, convert, held_out  # noqa: F401  (held_out: a fixture)


def inputs(b=2, t=37, h=3, dk=8, dv=5, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, dk, generator=gen, dtype=dtype)
    k = torch.nn.functional.normalize(torch.randn(b, t, h, dk, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(b, t, h, dv, generator=gen, dtype=dtype)
    g = -torch.rand(b, t, h, dk, generator=gen, dtype=dtype) * 2
    beta = torch.rand(b, t, h, generator=gen, dtype=dtype)
    return q, k, v, g, beta, torch.randn(b, h, dk, dv, generator=gen, dtype=dtype)


@pytest.mark.parametrize("kernel", [recurrent_kda_torch, chunked_kda_torch])
def test_one_decay_per_head_is_the_gated_delta_rule(kernel):
    q, k, v, g, beta, s0 = inputs()
    head = g[..., :1].expand_as(g).contiguous()
    want_o, want_s = recurrent_gated_delta_rule_torch(q, k, v, g[..., 0], beta, 0.35, s0, True)
    o, s = kernel(q, k, v, head, beta, 0.35, s0, True)
    torch.testing.assert_close(o, want_o, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(s, want_s, atol=1e-12, rtol=1e-12)


def test_chunked_matches_the_float64_loop_with_per_channel_decay_and_across_calls():
    q, k, v, g, beta, s0 = inputs(t=45)
    g[:, 10:13] = -90.0  # strong decay underflows, never overflows
    want_o, want_s = recurrent_kda_torch(q, k, v, g, beta, 0.35, s0, True)
    o, s = chunked_kda_torch(q, k, v, g, beta, 0.35, s0, True)
    torch.testing.assert_close(o, want_o, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(s, want_s, atol=1e-12, rtol=1e-12)
    first, mid = kda(*(x[:, :29] for x in (q, k, v, g, beta)), scale=0.35, initial_state=s0, output_final_state=True, backend="torch")
    rest, end = kda(*(x[:, 29:] for x in (q, k, v, g, beta)), scale=0.35, initial_state=mid, output_final_state=True, backend="torch")
    torch.testing.assert_close(torch.cat([first, rest], 1), want_o, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(end, want_s, atol=1e-12, rtol=1e-12)


def test_matches_fla_naive_reference():
    naive = fla_naive("kda")
    q, k, v, g, beta, s0 = inputs(dtype=torch.float32)
    want_o, want_s = naive.naive_recurrent_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    o, s = kda(q, k, v, g, beta, initial_state=s0, output_final_state=True, backend="torch")
    torch.testing.assert_close(o, want_o, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s, want_s, atol=1e-4, rtol=1e-4)


def test_layer_declares_its_roles_and_decodes_with_its_cache():
    layer = KimiDeltaAttention(32, 2, 8, use_short_conv=True)
    assert MIXERS["kda"].module is KimiDeltaAttention
    assert [n for n, _ in layer.param_groups()["gates"]] == ["A_log", "dt_bias", "f_proj.0.weight", "f_proj.1.weight", "b_proj.weight", "g_proj.weight"]
    assert layer.dt_bias.shape == (16,) and layer.A_log.shape == (2,)
    cache, x = layer.new_cache(), torch.randn(1, 20, 32)
    with torch.no_grad():
        full = layer(x)
        steps = torch.cat([layer(x[:, :17], cache=cache)] + [layer(x[:, t:t + 1], cache=cache) for t in (17, 18, 19)], 1)
    torch.testing.assert_close(steps, full, atol=1e-5, rtol=1e-5)


def test_phase1_sets_each_channel_from_its_head_and_beats_the_copy_only_baseline(stories, stories_teacher, held_out, record, tmp_path):
    """Phase 1: every channel of head h decays by 2^(-1/d_h) at a_proj's contribution 0, each head's
    mean write-gate logit is logit(0.3 + 0.4 c_h); on held-out stories the block outputs come closer
    to the teacher's than copy-only, Phase 2 closer still. Save/load exact; export refuses kda."""
    small = {"samples": 4, "length": 128}
    baseline = convert(stories(), mixer="kda", layers=[1, 3])
    phase1 = convert(stories(), mixer="kda", layers=[1, 3])
    PassManager(["calibrate"], {"calibrate": small})(phase1)
    report = phase1.meta["calibrate"]["layers"][1]
    layer = phase1.gdn_modules()[1]
    alpha = torch.exp(-torch.nn.functional.softplus(layer.dt_bias.double()))
    want = torch.tensor([2 ** (-1 / d) if 1e-3 <= math.log(2) / d <= 5 else math.nan for d in report["distance"]], dtype=torch.float64)
    torch.testing.assert_close(alpha, want.repeat_interleave(layer.head_dim), atol=1e-6, rtol=1e-6)
    assert torch.equal(layer.A_log, torch.zeros_like(layer.A_log))
    ids = calibration_ids(phase1, None, 4, 128, 0)
    x = collect(phase1, [1], ids, with_stats=False)[1].x
    logits = layer.b_proj(x).double().mean((0, 1))
    beta = torch.tensor(report["beta_target"], dtype=torch.float64)
    torch.testing.assert_close(logits, torch.log(beta / (1 - beta)), atol=1e-4, rtol=1e-4)

    both = convert(stories(), mixer="kda", layers=[1, 3])
    PassManager(["calibrate", "align"], {"calibrate": small, "align": {**small, "progress": False}})(both)
    errors = [block_error(g, stories_teacher, held_out, [1, 3], record) for g in (baseline, phase1, both)]
    assert errors[1] < 0.7 * errors[0] and errors[2] < 0.95 * errors[1], errors  # measured: 2.01, 0.79, 0.66
    surgery.save(both, tmp_path / "h")
    loaded = surgery.load(tmp_path / "h")
    assert torch.equal(loaded.logits(held_out[:1]), both.logits(held_out[:1]))
    with pytest.raises(ExportError, match=r"--format qwen3_5 exports GDN layers only, and this hybrid converted layer 1 \(kda\), layer 3 \(kda\)"):
        surgery.export(loaded, tmp_path / "q", format="qwen3_5")  # --format hf: tests/test_export.py::test_layer_mixers_export_exactly
