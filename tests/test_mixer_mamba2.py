"""replace.mixer=mamba2: Mamba2's SSD (one decay per head, q = C, k = B, v = dt * x, skip D).

References: a float64 sum over past tokens written from Mamba2's definition (the kernels and the
layer), fla's own naive simple-GLA recurrence when fla's sources are importable, full recomputation
(decoding), the teacher's attention block output on held-out text (Phase 1, Phase 2), the saved
weights (save/load)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import surgery
from surgery import PassManager
from surgery.errors import ExportError, PassConfigError
from tcal.kernels import fla_available, fla_backward_supported
from tcal.mixers import MIXERS, get_mixer
from tcal.mixers.mamba2 import Mamba2
from tcal.mixers.mamba2_kernels import chunked_ssd_torch, recurrent_ssd_torch, ssd

from test_mixer_gla import fla_naive
from test_mixer_swa import block_error, convert, held_out, matches_full  # noqa: F401  (held_out: a fixture)


def naive_ssd(q, k, v, g, scale, s0):
    """float64: o_t = scale sum_{s<=t} (q_t . k_s) e^(G_t - G_s) v_s + scale e^(G_t) q_t S_0, G the running sum of g."""
    q, k, v, g, s0 = (x.double() for x in (q, k, v, g, s0))
    cum = g.cumsum(1)  # [B, T, H]
    o = torch.zeros(*q.shape[:3], v.shape[-1], dtype=torch.float64)
    for t in range(q.shape[1]):
        o[:, t] = scale * cum[:, t, :, None].exp() * torch.einsum("bhk,bhkv->bhv", q[:, t], s0)
        for s in range(t + 1):
            w = scale * (q[:, t] * k[:, s]).sum(-1) * (cum[:, t] - cum[:, s]).exp()  # [B, H]
            o[:, t] += w[..., None] * v[:, s]
    weights = (cum[:, -1:] - cum).exp()[..., None]
    final = s0 * cum[:, -1, :, None, None].exp() + torch.einsum("bthk,bthv->bhkv", k * weights, v)
    return o, final


def inputs(b=2, t=45, h=3, dk=8, dv=5, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(b, t, h, dk, generator=gen, dtype=dtype), torch.randn(b, t, h, dk, generator=gen, dtype=dtype)
    v = torch.randn(b, t, h, dv, generator=gen, dtype=dtype)
    g = -torch.rand(b, t, h, generator=gen, dtype=dtype) * 2
    return q, k, v, g, torch.randn(b, h, dk, dv, generator=gen, dtype=dtype)


@pytest.mark.parametrize("kernel", [recurrent_ssd_torch, chunked_ssd_torch])
def test_kernels_match_the_float64_definition(kernel):
    q, k, v, g, s0 = inputs()  # 45 tokens: one full chunk of 32 and a padded one
    want_o, want_s = naive_ssd(q, k, v, g, 0.35, s0)
    o, s = kernel(q, k, v, g, 0.35, s0, True)
    torch.testing.assert_close(o, want_o, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(s, want_s, atol=1e-10, rtol=1e-10)


def test_kernels_match_fla_naive_reference():
    naive = fla_naive("simple_gla")
    q, k, v, g, s0 = inputs(dtype=torch.float32)
    want_o, want_s = naive.naive_recurrent_simple_gla(q, k, v, g, initial_state=s0, output_final_state=True)
    o, s = ssd(q, k, v, g, initial_state=s0, output_final_state=True, backend="torch")
    torch.testing.assert_close(o, want_o, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s, want_s, atol=1e-4, rtol=1e-4)


def test_calls_continue_from_the_state_and_strong_decay_stays_finite():
    q, k, v, g, s0 = inputs(t=70)
    g[:, 5:9] = -80.0  # e^-80 per step underflows; no overflow anywhere
    want_o, want_s = naive_ssd(q, k, v, g, 0.35, s0)
    outs, state = [], s0
    for lo, hi in ((0, 37), (37, 38), (38, 70)):  # chunked (a padded chunk), one token, chunked
        o, state = ssd(*(x[:, lo:hi] for x in (q, k, v, g)), scale=0.35, initial_state=state, output_final_state=True, backend="torch")
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 1), want_o, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(state, want_s, atol=1e-10, rtol=1e-10)
    assert torch.isfinite(ssd(*(x.float() for x in (q, k, v, g)), backend="torch")[0]).all()
    with pytest.raises(ValueError, match="unknown Mamba2 backend 'triton'; use auto, torch or fla"):
        ssd(q, k, v, g, backend="triton")


@pytest.mark.skipif(not torch.cuda.is_available() or not fla_available(), reason="fla's Triton kernels need CUDA")
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 2e-3), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("t", [1, 40, 300])
def test_fla_kernels_match_the_reference_on_cuda(t, dtype, tolerance):
    """fla's fused recurrent (short, no gradient) and chunked simple GLA against the float64 token loop:
    outputs, final state, and (where fla's backward is trusted on this Triton) the gradients."""
    q, k, v, g, s0 = (x.cuda() for x in inputs(b=2, t=t, h=9, dk=64, dv=64, seed=1, dtype=torch.float32))
    k, g, s0 = torch.nn.functional.normalize(k, dim=-1), g * 0.25, s0 * 0.1
    rel = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm())  # noqa: E731
    want_o, want_s = recurrent_ssd_torch(*(x.double() for x in (q, k, v, g)), 0.125, s0.double(), True)
    with torch.no_grad():
        o, s = ssd(q.to(dtype), k.to(dtype), v.to(dtype), g, 0.125, s0, True, backend="fla")
    assert rel(o, want_o) < tolerance and rel(s, want_s) < tolerance, (rel(o, want_o), rel(s, want_s))
    if not fla_backward_supported():
        return
    grads = {}
    for backend in ("fla", "torch"):
        leaves = [x.detach().to(dtype if i < 3 else torch.float32).requires_grad_() for i, x in enumerate((q, k, v, g))]
        o, s = ssd(*leaves, 0.125, s0, True, backend=backend)
        (o.float().pow(2).mean() + s.float().pow(2).mean()).backward()
        grads[backend] = [x.grad for x in leaves]
    assert max(rel(a, b) for a, b in zip(grads["fla"], grads["torch"])) < tolerance


def naive_mamba2(layer: Mamba2, x: torch.Tensor) -> torch.Tensor:
    """float64 from the parameters: y_t = sum_s (C_t . B_s) e^(G_t - G_s) dt_s x_s / sqrt(D) + D x_t,
    then RMSNorm(y) * w * silu(z), o_proj (no convolutions, v identity)."""
    p = {n: t.detach().double() for n, t in layer.named_parameters()}
    x = x.double()
    heads = lambda y: y.unflatten(-1, (layer.num_heads, layer.head_dim))  # noqa: E731
    c, b, xv, z = (heads(x @ p[f"{n}.weight"].T) for n in ("q_proj", "k_proj", "v_proj", "g_proj"))
    dt = F.softplus(x @ p["dt_proj.weight"].T + p["dt_bias"])  # [B, T, H]
    cum = (-dt * p["A_log"].exp()).cumsum(1)
    t = x.shape[1]
    scores = torch.einsum("bthd,bshd->bhts", c, b) * layer.head_dim ** -0.5
    decays = (cum.transpose(1, 2)[..., :, None] - cum.transpose(1, 2)[..., None, :]).tril().exp().tril()
    y = torch.einsum("bhts,bshd->bthd", scores * decays, xv * dt[..., None]) + p["D"][:, None] * xv
    normed = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + layer.o_norm.eps) * p["o_norm.weight"] * F.silu(z)
    assert t == normed.shape[1]
    return normed.flatten(-2) @ p["o_proj.weight"].T


def test_layer_matches_mamba2_definition_declares_its_roles_and_decodes():
    torch.manual_seed(0)
    layer = Mamba2(32, 2, 8, v_activation="identity", backend="torch")
    assert MIXERS["mamba2"].module is Mamba2 and get_mixer("mamba2").replaces == "layer"
    assert [n for n, _ in layer.param_groups()["gates"]] == ["A_log", "dt_bias", "D", "dt_proj.weight", "g_proj.weight"]
    assert [n for n, _ in layer.copied_parameters()] == ["q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"]
    assert torch.equal(layer.D, torch.ones(2)) and ((layer.A_log.exp() >= 1) & (layer.A_log.exp() <= 16)).all()  # fla's init
    with torch.no_grad():
        layer.D.copy_(torch.tensor([0.7, -0.4]))
    x = torch.randn(2, 40, 32)
    with torch.no_grad():
        full = layer(x)
    torch.testing.assert_close(full.double(), naive_mamba2(layer, x), atol=1e-5, rtol=1e-5)

    conv = Mamba2(32, 2, 8, use_short_conv=True, q_bias=True)
    assert [n for n, _ in conv.param_groups()["conv"]] == ["q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"]
    cache, x = conv.new_cache(), torch.randn(1, 20, 32)
    with torch.no_grad():
        full = conv(x)
        steps = torch.cat([conv(x[:, :17], cache=cache)] + [conv(x[:, t:t + 1], cache=cache) for t in (17, 18, 19)], 1)
    torch.testing.assert_close(steps, full, atol=1e-5, rtol=1e-5)
    assert cache.recurrent.shape == (1, 2, 8, 8) and set(cache.conv) == {"q", "k", "v"}


def test_short_convolutions_and_a_prefill_of_several_chunks_decode_exactly(stories):
    """(Six tiny architectures: tests/test_mixer_gla.py, parametrized over gla, kda and mamba2.)"""
    graph = convert(stories(), mixer="mamba2", layers=[1, 3], use_short_conv=True)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in graph.gdn_modules().values():
            for conv in (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d):
                conv.weight.normal_(0.0, 0.5, generator=gen)
    matches_full(graph, torch.randint(3, 512, (1, 72), generator=torch.Generator().manual_seed(2)), 67)  # 67 = 2 x 32 + 3


def test_unknown_mixer_and_bad_options_are_refused_before_any_work(stories):
    for replace, message in [({"mixer": "mamba"}, "mixer 'mamba' is not one of gdn, swa, gla, kda, mamba2"),
                             ({"mixer": "mamba2", "v_activation": "gelu"}, "v_activation 'gelu' is not one of"),
                             ({"mixer": "mamba2", "backend": "triton"}, "backend 'triton' is not one of"),
                             ({"mixer": "mamba2", "conv_size": 0}, "conv_size must be >= 1")] + \
                            ([] if torch.cuda.is_available() else [({"mixer": "mamba2", "backend": "fla"}, "backend 'fla' runs fla's Triton kernels on a CUDA device only")]):
        graph = stories()
        with pytest.raises(PassConfigError, match=message):
            convert(graph, layers=[1], **replace)
        assert graph.history == [] and "replace" not in graph.meta


def test_phase1_and_phase2_beat_the_copy_only_baseline(stories, stories_teacher, held_out, record, tmp_path):
    """Phase 1: A_log = 0, each head's decay 2^(-1/d_h) (and step ln 2 / d_h) at dt_proj's contribution 0,
    D = 0, B/C still the teacher's K/Q; on held-out stories the block outputs come closer to the teacher's
    than copy-only (fla's init), Phase 2 closer still. Save/load exact; diff names the new parameters;
    both exports refuse the mixer by name."""
    small = {"samples": 4, "length": 128}
    baseline = convert(stories(), mixer="mamba2", layers=[1, 3])
    phase1 = convert(stories(), mixer="mamba2", layers=[1, 3])
    PassManager(["calibrate"], {"calibrate": small})(phase1)
    report, layer = phase1.meta["calibrate"]["layers"][1], phase1.gdn_modules()[1]
    rate = torch.tensor([min(max(math.log(2) / d, 1e-3), 5.0) for d in report["distance"]], dtype=torch.float64)
    torch.testing.assert_close(F.softplus(layer.dt_bias.double()), rate, atol=1e-6, rtol=1e-6)
    assert torch.equal(layer.A_log, torch.zeros(layer.num_heads)) and torch.equal(layer.D, torch.zeros(layer.num_heads))
    assert torch.equal(layer.k_proj.weight, baseline.gdn_modules()[1].k_proj.weight)  # B = the teacher's K, untouched

    both = convert(stories(), mixer="mamba2", layers=[1, 3])
    PassManager(["calibrate", "align"], {"calibrate": small, "align": {**small, "progress": False}})(both)
    errors = [block_error(g, stories_teacher, held_out, [1, 3], record) for g in (baseline, phase1, both)]
    assert errors[1] < 0.7 * errors[0] and errors[2] < 0.95 * errors[1], errors  # measured: 2.08, 0.87, 0.70 (GDN: 1.90, 0.79, 0.70)

    surgery.save(both, tmp_path / "h")
    loaded = surgery.load(tmp_path / "h")
    assert torch.equal(loaded.logits(held_out[:1]), both.logits(held_out[:1]))
    matches_full(loaded, held_out[:1, :24], 19)
    rows = surgery.diff(stories_teacher, loaded)["layers"]
    added = [p["name"] for e in rows if e["after"] == "mamba2" for p in e["params_added"]]
    assert [e["layer"] for e in rows if e["after"] == "mamba2"] == [1, 3]
    assert all(sum(n.endswith(f".{part}") for n in added) == 2 for part in ("dt_proj.weight", "D", "A_log", "dt_bias")), added
    with pytest.raises(ExportError, match="--format qwen3_5 exports GDN layers only, and this hybrid converted layer 1 \\(mamba2\\), layer 3 \\(mamba2\\)"):
        surgery.export(loaded, tmp_path / "qwen3_5", format="qwen3_5")
    assert not (tmp_path / "qwen3_5").exists()


def test_cli_apply_inspect_diff_and_export_refusal(stories_path, tmp_path):
    """Through the CLI: apply with --set replace.mixer=mamba2, inspect counts the layers as mamba2
    with a fixed state and no KV cache, diff names the kinds, the qwen3_5 export refuses by name and writes nothing, the hf export writes
    the layers as mamba2."""
    import json

    from typer.testing import CliRunner

    from cli_checks import assert_clean_failure, invoke

    runner, out = CliRunner(), tmp_path / "hybrid"
    applied = invoke(runner, "apply", "--model", stories_path, "--passes", "select,replace", "--layers", "1,3,4",
                     "--set", "replace.mixer=mamba2", "--out", out)
    assert applied.exit_code == 0, applied.output
    data = json.loads(invoke(runner, "inspect", "--model", out, "--json").stdout)
    assert [r["kind"] for r in data["sites"]] == ["sdpa", "mamba2", "sdpa", "mamba2", "mamba2"]
    assert (data["softmax_layers"], data["gdn_layers"], data["kv_bytes_per_token"]) == (2, 3, 2 * 256)
    assert [r["state_bytes"] for r in data["sites"]] == [0, 8 * 8 * 8 * 4, 0, 8 * 8 * 8 * 4, 8 * 8 * 8 * 4]  # 8 heads of 8 x 8, float32
    assert "5 layers: 2 softmax attention + 3 mamba2 (llama)" in invoke(runner, "inspect", "--model", out).stdout
    groups = json.loads(invoke(runner, "diff", stories_path, out, "--json").stdout)["groups"]
    assert [(g["label"], g["before"], g["after"]) for g in groups if g["after"] == "mamba2"] == [("1,3,4", "attention", "mamba2")]
    refused = invoke(runner, "export", "--model", out, "--out", tmp_path / "q", "--format", "qwen3_5")
    assert_clean_failure(refused, "exports GDN layers only", "layer 1 (mamba2), layer 3 (mamba2), layer 4 (mamba2)")
    assert not (tmp_path / "q").exists()
    exported = invoke(runner, "export", "--model", out, "--out", tmp_path / "hf", "--format", "hf")
    assert exported.exit_code == 0, exported.output
    config = json.loads((tmp_path / "hf" / "config.json").read_text())["surgery_hybrid"]["gdn_layers"]
    assert sorted((e["layer"], e["mixer"]) for e in config.values()) == [(1, "mamba2"), (3, "mamba2"), (4, "mamba2")]
