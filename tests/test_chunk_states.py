"""tcal/chunk_states.py: the GDN state pass with one product a chunk (D_c S), its transitions and output kernels.

Which inputs it takes (only when SURGERY_CHUNK_STATES=on), on any machine; the float64 reference against the
token recurrence; the kernels under Triton's CPU interpreter (float32, float16) against the reference, and
through tcal.split_state's one-piece path beside fla's state pass and output (skipped where Triton is not
installed); on CUDA, bf16 no farther from float64 than fla's kernels, and in a CUDA graph."""
from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

import tcal.chunk_states as cs
from interpreted import run_interpreted
from tcal.chunk_intra import chunk_intra_torch
from tcal.kernels import gated_delta_rule
from test_split_state import cuda_fla, errors_by_setting, gdn_inputs, replays_as_eager

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed (a CUDA-side extra)")
needs_fla = pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="fla is not installed (a CUDA-side extra)")


def rule_inputs(batch=1, length=100, heads=2, k_dim=64, v_dim=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(batch, length, heads, k_dim, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(batch, length, heads, v_dim, generator=gen)
    g, beta = -0.3 * torch.rand(batch, length, heads, generator=gen), torch.rand(batch, length, heads, generator=gen)
    return q, k, v, g, beta, 0.1 * torch.randn(batch, heads, k_dim, v_dim, generator=gen)


@needs_triton
def test_takes_only_when_switched_on(monkeypatch):
    q, k, v, g, beta, _ = rule_inputs()
    g_cum, w, u = (x.float() for x in chunk_intra_torch(k, v, g, beta))
    monkeypatch.delenv(cs.SWITCH, raising=False)
    assert not cs.chunk_states_takes(q, k, w, u, g_cum)  # not timed on a GPU yet: off by default
    monkeypatch.setenv(cs.SWITCH, "on")
    assert cs.chunk_states_takes(q, k, w, u, g_cum)
    assert not cs.chunk_states_takes(q, k, w, u[:, :, :1].contiguous(), g_cum)  # grouped v heads: fla's kernels
    assert not cs.chunk_states_takes(q, k, w, u, g_cum.bfloat16())
    assert not cs.chunk_states_takes(q.transpose(1, 2).contiguous().transpose(1, 2), k, w, u, g_cum)
    assert not cs.chunk_states_takes(q.double(), k.double(), w.double(), u.double(), g_cum)
    wide = rule_inputs(k_dim=128)
    wide_intra = [x.float() for x in chunk_intra_torch(*wide[1:3], *wide[3:5])]
    assert not cs.chunk_states_takes(wide[0], wide[1], wide_intra[1], wide_intra[2], wide_intra[0])


@pytest.mark.parametrize("length,with_state", [(130, True), (64, False), (200, True)])
def test_reference_is_the_recurrence(length, with_state):
    """chunk_states_torch from chunk_intra_torch's w and u equals the float64 token recurrence: the chunk
    algebra (D_c, N_c, v' from the stored states) holds, partial last chunks included."""
    q, k, v, g, beta, state = (x.double() for x in rule_inputs(2, length, 3, 32, 48))
    state = state if with_state else None
    g_cum, w, u = chunk_intra_torch(k, v, g, beta)
    o, states, final = cs.chunk_states_torch(q, k, w, u, g_cum, 32 ** -0.5, state)
    want, want_state = gated_delta_rule(q, k, v, g, beta, None, state, True, backend="torch")
    assert torch.allclose(o, want, atol=1e-10) and torch.allclose(final, want_state, atol=1e-10)
    assert states.shape == (2, -(-length // 64), 3, 32, 48) and torch.equal(states[:, 0], state if with_state else states[:, 0] * 0)


@needs_triton
@needs_fla
def test_kernels_in_the_interpreter():
    script = textwrap.dedent("""
        import os, torch
        from tests.fla_interpreter import install
        install("fla.ops.gated_delta_rule", "fla.ops.common", "fla.ops.utils")
        from tcal.chunk_intra import chunk_intra_torch
        from tcal.chunk_states import SWITCH, chunk_states_torch, chunk_states_triton
        from tcal.gated_norm import OutputNorm, gated_rms_norm_torch
        from tcal.split_state import split_state_gated_delta_rule
        from tcal.kernels import gated_delta_rule

        rel = lambda a, b: ((a.double() - b.double()).norm() / b.double().norm()).item()
        def inputs(batch, length, heads, k_dim, v_dim):
            gen = torch.Generator().manual_seed(0)
            q, k = (torch.nn.functional.normalize(torch.randn(batch, length, heads, k_dim, generator=gen), dim=-1) for _ in range(2))
            v = torch.randn(batch, length, heads, v_dim, generator=gen)
            g, beta = -0.3 * torch.rand(batch, length, heads, generator=gen), torch.rand(batch, length, heads, generator=gen)
            return q, k, v, g, beta, 0.1 * torch.randn(batch, heads, k_dim, v_dim, generator=gen)

        for shape in ((1, 300, 2, 64, 64), (2, 130, 3, 32, 48), (1, 64, 1, 16, 64)):
            q, k, v, g, beta, h0 = inputs(*shape)
            g_cum, w, u = chunk_intra_torch(k, v, g, beta)
            scale = shape[3] ** -0.5
            for start in (h0, None):
                want_o, _, want_s = chunk_states_torch(q, k, w, u, g_cum, scale, start)
                for block in (None, 16):
                    o, s = chunk_states_triton(q, k, w.float(), u.float(), g_cum.float(), scale, start, True, block)
                    assert max(rel(o, want_o), rel(s, want_s)) < 1e-5, (shape, block, rel(o, want_o), rel(s, want_s))
                o2, none = chunk_states_triton(q, k, w.float(), u.float(), g_cum.float(), scale, start, False)
                assert none is None and torch.equal(o2, o), shape
                # float16: the products' operands rounded as on a GPU (the interpreter's bf16 dot is wrong)
                o16, s16 = chunk_states_triton(q.half(), k.half(), w.half(), u.half(), g_cum.float(), scale, start, True)
                assert o16.dtype == torch.float16 and max(rel(o16, want_o), rel(s16, want_s)) < 2e-2, (shape, rel(o16, want_o))
        # the gated output norm in the output kernel (a strided gate, both activations) against tcal.gated_norm's
        # reference on the reference output rounded as the kernel rounds it; a gate it cannot take: the norm's apply
        q, k, v, g, beta, h0 = inputs(1, 200, 3, 64, 64)
        g_cum, w, u = chunk_intra_torch(k, v, g, beta)
        gate = torch.randn(1, 200, 3, 2 * 64)[..., 64:]  # a slice of a wider projection, as a layer's g_proj
        weight = torch.rand(64) + 0.5
        want_o = chunk_states_torch(q, k, w, u, g_cum, 0.125, h0)[0]
        for dtype in (torch.float32, torch.float16):
            for activation in ("silu", "sigmoid"):
                norm = OutputNorm(gate.to(dtype), weight, 1e-5, activation, lambda o: None)
                got, _ = chunk_states_triton(*(x.to(dtype) for x in (q, k, w, u)), g_cum.float(), 0.125, h0, True, output_norm=norm)
                want = gated_rms_norm_torch(want_o.to(dtype), gate.to(dtype), weight, 1e-5, activation)
                assert got.dtype == dtype and rel(got, want) < (1e-5 if dtype == torch.float32 else 2e-2), (dtype, activation, rel(got, want))
        applied = OutputNorm(gate[:, :, :2], weight, 1e-5, "silu", lambda o: o * 2)  # shape it cannot take: apply(o)
        got, _ = chunk_states_triton(q, k, w.float(), u.float(), g_cum.float(), 0.125, h0, True, output_norm=applied)
        assert torch.equal(got, 2 * chunk_states_triton(q, k, w.float(), u.float(), g_cum.float(), 0.125, h0, True)[0])

        q, k, v = (x[:, :0] for x in inputs(1, 8, 2, 64, 64)[:3])
        empty = chunk_states_triton(q, k, k, v, torch.zeros(1, 0, 2), 0.1, None, True)
        assert empty[0].shape == (1, 0, 2, 64) and torch.equal(empty[1], torch.zeros(1, 2, 64, 64))

        # through split_state's one-piece path, beside fla's state pass and output on the same inputs
        q, k, v, g, beta, h0 = inputs(1, 260, 2, 64, 64)
        want, want_state = gated_delta_rule(*[x.double() for x in (q, k, v, g, beta)], None, h0.double(), True, backend="torch")
        results = {}
        for setting in ("off", "on"):
            os.environ[SWITCH] = setting
            with torch.no_grad():
                results[setting] = split_state_gated_delta_rule(q, k, v, g, beta, 64 ** -0.5, h0, True, 1, (16, 4, 3))
        for setting, (o, s) in results.items():
            assert max(rel(o, want), rel(s, want_state)) < 1e-5, (setting, rel(o, want), rel(s, want_state))
        print("ok")
    """)
    done = run_interpreted(script)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


@cuda_fla
@pytest.mark.parametrize("batch,seq_len,heads,dim", [(1, 2048, 9, 64), (2, 1000, 9, 64), (1, 777, 3, 64)])
def test_bf16_as_close_to_float64_as_fla(monkeypatch, batch, seq_len, heads, dim):
    """bf16 through gated_delta_rule's one-piece path (SURGERY_STATE_SPLITS=off keeps it whole): the walk with
    one product a chunk no farther from float64 than fla's state pass and output."""
    monkeypatch.setenv("SURGERY_STATE_SPLITS", "off")
    errors = errors_by_setting(monkeypatch, cs.SWITCH, ("off", "on"), gdn_inputs(batch, seq_len, heads, dim))
    assert errors["on"][0] <= 1.5 * errors["off"][0] + 1e-4, errors
    assert errors["on"][1] <= 1.5 * errors["off"][1] + 1e-4, errors


@cuda_fla
@pytest.mark.parametrize("dim", [32, 64])
def test_kernels_bf16_beside_fla(dim):
    """The three kernels alone on one intra pass's w and u (head sizes 32 and 64, bf16), against fla's state
    pass and output on the same inputs: each no farther from the float64 reference than fla's."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_fwd_o

    from tcal.chunk_intra import chunk_intra_triton

    q, k, v, g, beta, state = gdn_inputs(1, 1500, 4, dim)
    with torch.no_grad():
        g_cum, w, u = chunk_intra_triton(k, v, g, beta)
        want_o, _, want_s = cs.chunk_states_torch(q, k, w, u, g_cum, dim ** -0.5, state)
        o, s = cs.chunk_states_triton(q, k, w, u, g_cum, dim ** -0.5, state, True)
        h, v_new, fla_s = chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, g=g_cum, initial_state=state.contiguous(),
                                                       output_final_state=True, chunk_size=64)
        fla_o = chunk_fwd_o(q=q, k=k, v=v_new, h=h, g=g_cum, scale=dim ** -0.5, chunk_size=64)
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(o, want_o) <= 1.5 * rel(fla_o, want_o) + 1e-4 and rel(s, want_s) <= 1.5 * rel(fla_s, want_s) + 1e-4


@cuda_fla
def test_replays_from_a_cuda_graph(monkeypatch):
    monkeypatch.setenv(cs.SWITCH, "on")
    monkeypatch.setenv("SURGERY_STATE_SPLITS", "off")
    q, k, v, g, beta, state = gdn_inputs(1, 2048)
    assert replays_as_eager(lambda: gated_delta_rule(q, k, v, g, beta, None, state, True, backend="fla"))


@cuda_fla
@pytest.mark.parametrize("use_cache", [False, True])
def test_layer_folds_its_output_norm(monkeypatch, use_cache):
    """A bf16 GatedDeltaNet of SmolLM2's GDN shapes at 2k x 1 (with a cache: a Decoder's prefill, the final state
    written): the output with the walk and the gated norm in its output kernel against fla's kernels and the
    layer's own norm, each against the same layer in float32 with the torch kernels; the state too."""
    from tcal.gdn import GDNCache, GatedDeltaNet

    torch.manual_seed(0)
    layer = GatedDeltaNet(576, 9, 64, backend="fla").cuda()
    with torch.no_grad():
        layer.o_norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(1, 2048, 576, device="cuda")
    reference = GatedDeltaNet(576, 9, 64, backend="torch").cuda()
    reference.load_state_dict(layer.state_dict())
    with torch.no_grad():
        want_cache = GDNCache() if use_cache else None
        want = reference(x, want_cache)
    layer = layer.bfloat16()
    rel = lambda a, b: ((a.float() - b).norm() / b.norm()).item()  # noqa: E731
    errors = {}
    monkeypatch.setenv("SURGERY_STATE_SPLITS", "off")
    for setting in ("off", "on"):
        monkeypatch.setenv(cs.SWITCH, setting)
        cache = GDNCache() if use_cache else None
        with torch.no_grad():
            out = layer(x.bfloat16(), cache)
        errors[setting] = (rel(out, want), rel(cache.recurrent, want_cache.recurrent) if use_cache else 0.0)
    assert errors["on"][0] <= 1.5 * errors["off"][0] + 1e-3 and errors["on"][1] <= 1.5 * errors["off"][1] + 1e-4, errors
