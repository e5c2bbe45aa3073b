"""The fused one-token GDN step (tcal.token_step): its reference against the layer's own composition
and full recomputation, in-place state semantics, the custom op's schema, and the Triton kernel
against the reference under Triton's CPU interpreter (where Triton is installed)."""

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import tcal.gdn
from tcal.gdn import GatedDeltaNet
from tcal.token_step import MAX_TRITON_HEAD_DIM, gdn_token_step_op, token_step_fits, token_step_torch


def layer(v_activation="silu", dtype=torch.float64, **kw):
    """A layer with every new parameter away from its init, so each term of the step matters."""
    torch.manual_seed(0)
    m = GatedDeltaNet(24, 3, 8, q_bias=True, v_activation=v_activation, **kw).to(dtype).eval()
    with torch.no_grad():
        m.A_log.uniform_(-2, 1)
        m.dt_bias.normal_()
        m.o_norm.weight.uniform_(0.5, 1.5)
    return m


def prefilled(m, x, in_place: bool):
    cache = m.new_cache()
    with torch.no_grad():
        m(x, cache=cache)
    cache.in_place = in_place
    return cache


@pytest.mark.parametrize("v_activation", ["silu", "identity"])
def test_token_step_matches_the_composed_layer_and_full_recomputation(v_activation):
    m = layer(v_activation)
    x = torch.randn(2, 9, 24, dtype=torch.float64)
    fused, composed = prefilled(m, x[:, :6], True), prefilled(m, x[:, :6], False)
    memory = fused.recurrent.data_ptr()
    with torch.no_grad():
        got = [m(x[:, t:t + 1], cache=fused) for t in range(6, 9)]
        want = [m(x[:, t:t + 1], cache=composed) for t in range(6, 9)]
        full = m(x)[:, 6:]
    assert fused.recurrent.data_ptr() == memory, "the in-place cache kept its tensor"
    # the layer's l2norm and output norm round through float32 even for a float64 layer; the token
    # step does not, so they agree to float32's precision, not float64's
    torch.testing.assert_close(torch.cat(got, 1), torch.cat(want, 1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.cat(got, 1), full, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused.recurrent, composed.recurrent, rtol=1e-5, atol=1e-6)


def test_token_step_is_taken_only_where_it_applies(monkeypatch):
    """In-place cache, one token, no gradient, no short convolution: anything else composes."""
    calls = []
    real = tcal.gdn.gdn_token_step
    monkeypatch.setattr(tcal.gdn, "gdn_token_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randn(1, 5, 24, dtype=torch.float64)
    m, conv = layer(), layer(use_short_conv=True)
    with torch.no_grad():
        m(x[:, 4:], cache=prefilled(m, x[:, :4], True))
        assert len(calls) == 1
        m(x[:, 4:], cache=prefilled(m, x[:, :4], False))
        m(x[:, 3:], cache=prefilled(m, x[:, :3], True))
        conv(x[:, 4:], cache=prefilled(conv, x[:, :4], True))
    m(x[:, 4:], cache=prefilled(m, x[:, :4], True))  # gradients on
    assert len(calls) == 1


def test_a_token_step_runs_its_fused_projection_and_o_proj_through_the_given_linear():
    """`linear` (a decoder's few-row kernel) takes the fused input projection and o_proj, with the same output."""
    import torch.nn.functional as F

    m = layer()
    x = torch.randn(2, 5, 24, dtype=torch.float64)
    parts = [m.get_submodule(n) for n in m.INPUT_PROJECTIONS]
    projection = tcal.gdn.concatenated([p.weight for p in parts], [p.bias for p in parts])
    seen = []
    counted = lambda x, w, b=None: seen.append(tuple(w.shape)) or F.linear(x, w, b)  # noqa: E731
    a, b = prefilled(m, x[:, :4], True), prefilled(m, x[:, :4], True)
    with torch.no_grad():
        want = m(x[:, 4:], cache=a, projection=projection)
        got = m(x[:, 4:], cache=b, projection=projection, linear=counted)
    assert seen == [tuple(projection[0].shape), tuple(m.o_proj.weight.shape)]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(b.recurrent, a.recurrent, rtol=0, atol=0)


def test_kda_takes_the_token_step_with_a_decay_per_channel(monkeypatch):
    """A KDA layer (GDN's recurrence with a decay per key channel) decodes a token through the same
    fused step: equal to its own composition and to full recomputation, its state in place; the per-channel
    reference against a float64 loop of the definition; Kimi Linear's form (a sigmoid gate) composes."""
    from tcal.mixers.kda import KimiDeltaAttention

    calls = []
    real = tcal.gdn.gdn_token_step
    monkeypatch.setattr(tcal.gdn, "gdn_token_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(0)
    m = KimiDeltaAttention(24, 3, 8, q_bias=True).to(torch.float64).eval()
    with torch.no_grad():
        m.A_log.uniform_(-2, 1)
        m.dt_bias.normal_()
        m.o_norm.weight.uniform_(0.5, 1.5)
        m.f_proj[1].weight.normal_()  # each channel's decay its own
    x = torch.randn(2, 9, 24, dtype=torch.float64)
    fused, composed = prefilled(m, x[:, :6], True), prefilled(m, x[:, :6], False)
    memory = fused.recurrent.data_ptr()
    with torch.no_grad():
        got = torch.cat([m(x[:, t:t + 1], cache=fused) for t in range(6, 9)], 1)
        want = torch.cat([m(x[:, t:t + 1], cache=composed) for t in range(6, 9)], 1)
        full = m(x)[:, 6:]
    assert len(calls) == 3 and fused.recurrent.data_ptr() == memory
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused.recurrent, composed.recurrent, rtol=1e-5, atol=1e-6)

    q, k, v, a, b, gate, A_log, dt_bias, weight, state = [t.double() for t in step_inputs(channel_decay=True)]
    before = state.clone()
    token_step_torch(q, k, v, a, b, gate, A_log, dt_bias, weight, state, 8**-0.5, 1e-5, True)
    qn, kn = (torch.nn.functional.normalize(torch.nn.functional.silu(t.reshape(2, 3, 8)), dim=-1, eps=0) for t in (q, k))
    decay = torch.exp(-A_log.exp()[:, None] * torch.nn.functional.softplus(a.reshape(2, 3, 8) + dt_bias.reshape(3, 8)))
    expected = before.clone()
    for n in range(2):
        for h in range(3):
            s = before[n, h] * decay[n, h][:, None]
            error = torch.nn.functional.silu(v.reshape(2, 3, 8)[n, h]) - s.T @ kn[n, h]
            expected[n, h] = s + torch.outer(kn[n, h], torch.sigmoid(b.reshape(2, 3)[n, h]) * error)
    torch.testing.assert_close(state, expected, rtol=1e-6, atol=1e-6)

    calls.clear()
    kimi = KimiDeltaAttention(24, 3, 8, kimi_form=True).to(torch.float64).eval()
    with torch.no_grad():
        kimi(x[:, 4:5], cache=prefilled(kimi, x[:, :4], True))
    assert calls == []


def step_inputs(dtype=torch.float32, batch=2, heads=3, dim=8, seed=0, channel_decay=False):
    """Slices of one projection output; channel_decay: a decay input per key channel (KDA) instead of per head."""
    g = torch.Generator().manual_seed(seed)
    width = heads * dim
    decay = width if channel_decay else heads
    proj = torch.randn(batch, 1, 4 * width + heads + decay, generator=g).to(dtype)
    q, k, v, a, b, gate = proj.split([width, width, width, decay, heads, width], dim=-1)
    params = [torch.randn(heads, generator=g), torch.randn(decay, generator=g), torch.rand(dim, generator=g) + 0.5]
    state = torch.randn(batch, heads, dim, dim, generator=g)
    return [q, k, v, a, b, gate, *params, state]


def test_token_step_op_passes_opcheck():
    """Schema (the state is declared mutated), fake shapes and strides, on slices of one projection."""
    args = step_inputs()
    torch.library.opcheck(gdn_token_step_op, (*args, 8**-0.5, 1e-5, True, False))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed (a CUDA-side extra)")
def test_triton_kernel_matches_the_reference_in_the_interpreter(tmp_path):
    """The kernel itself, run by Triton's CPU interpreter: non-power-of-two head size, both dtypes,
    both v activations, a decay per head and per key channel, the state written in place."""
    script = textwrap.dedent("""
        import torch
        from tcal.token_step import token_step_torch, token_step_triton
        import tests.test_token_step as t
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
            for v_silu, channel_decay in ((True, False), (False, False), (True, True)):
                args = t.step_inputs(dtype, batch=2, heads=3, dim=24, seed=1, channel_decay=channel_decay)
                mine = [x.clone() for x in args]
                want = token_step_torch(*args, 24**-0.5, 1e-5, v_silu)
                memory = mine[-1].data_ptr()
                got = token_step_triton(*mine, 24**-0.5, 1e-5, v_silu)
                assert mine[-1].data_ptr() == memory
                torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
                torch.testing.assert_close(mine[-1], args[-1], rtol=1e-5, atol=1e-5)
        print("ok")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


def test_reference_writes_the_state_it_is_given():
    args = step_inputs(torch.float64)
    args[6:9] = [p.double() for p in args[6:9]]
    state = args[-1] = args[-1].double()
    before = state.clone()
    token_step_torch(*args, 8**-0.5, 1e-5, True)
    assert not torch.equal(state, before)


def test_wide_heads_on_cuda_compose_instead():
    """The Triton kernel keeps a head's whole state in one program: heads wider than it can hold
    (Gemma's 256) keep the composed step on CUDA; the CPU reference takes any width."""
    assert token_step_fits(256, "cpu", "auto") and token_step_fits(256, "cuda", "torch")
    assert not token_step_fits(MAX_TRITON_HEAD_DIM * 2, "cuda", "auto")
    assert token_step_fits(64, "cuda", "auto") == (importlib.util.find_spec("triton") is not None)


def test_a_freed_copy_of_the_files_leaves_the_package_ops_working(tmp_path):
    """An exported model imports copies of tcal's files (surgery.io.hf_export). Each copy registers
    its ops under a namespace of its own: when one registered "tcal::..." again and was then freed,
    the package's ops lost their schema (opcheck failed after the export tests)."""
    import gc
    import importlib
    import shutil

    import tcal.kernels
    from surgery.io.hf_export import GDN_SOURCES

    package = tmp_path / "exported_copy"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name, source in GDN_SOURCES.items():  # the files an export copies, as it copies them
        shutil.copy(source, package / name)
    sys.path.insert(0, str(tmp_path))
    try:
        copy = importlib.import_module("exported_copy.token_step")
        assert copy.OP_NAMESPACE != "tcal" and tcal.kernels.OP_NAMESPACE == "tcal"
        del copy
        for name in [m for m in sys.modules if m.startswith("exported_copy")]:
            del sys.modules[name]
        gc.collect()
    finally:
        sys.path.remove(str(tmp_path))
    torch.library.opcheck(gdn_token_step_op, (*step_inputs(), 8**-0.5, 1e-5, True, False))
