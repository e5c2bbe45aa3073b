"""tcal.delta_inputs: the recurrence's inputs from a GatedDeltaNet's projections as one kernel.
The reference against the layer's composition, the Triton kernel (Triton's CPU interpreter) against
float64, and the layer on the kernel against the layer composed."""
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from tcal.delta_inputs import delta_inputs_torch, kernel_takes
from tcal.gdn import GatedDeltaNet, l2norm, needs_gradient, takes_fused_inputs


def projections(dtype=torch.float32, batch=2, length=37, heads=3, dim=24, seed=0):
    """q, k, v [B, T, H, D] and a, b [B, T, H]: strided slices of one projection output, as the layer has them."""
    g = torch.Generator().manual_seed(seed)
    proj = (torch.randn(batch, length, 3 * heads * dim + 2 * heads, generator=g) * 3).to(dtype)
    q, k, v, a, b = proj.split([heads * dim] * 3 + [heads] * 2, dim=-1)
    return [x.unflatten(-1, (heads, dim)) for x in (q, k, v)] + [a, b]


def composed(q, k, v, a, b, A_log, dt_bias, v_silu):
    """The layer's composition (delta_rule_inputs, GatedDeltaNet._decay) written out independently."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return l2norm(F.silu(q)), l2norm(F.silu(k)), (F.silu(v) if v_silu else v), g, b.float().sigmoid()


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-6), (torch.float32, 1e-6)])
def test_reference_is_the_composition_in_full_precision(dtype, tol):
    """Where the composition does not round between steps (float32, float64), the two agree (the
    composition's decay and beta are float32 even for float64 inputs: hence 1e-6)."""
    inputs = projections(dtype)
    A_log, dt_bias = torch.randn(3, dtype=dtype), torch.randn(3, dtype=dtype) * 4
    for v_silu in (True, False):
        got = delta_inputs_torch(*inputs, A_log, dt_bias, v_silu)
        want = composed(*inputs, A_log, dt_bias, v_silu)
        for x, y in zip(got, want):
            assert x.is_contiguous()
            torch.testing.assert_close(x, y.to(x.dtype), rtol=tol, atol=tol)


def test_reference_rounds_once_in_bf16():
    """In bf16 the reference is nearer float64 than the composition (which rounds SiLU's output too)."""
    inputs = projections(torch.bfloat16)
    A_log, dt_bias = torch.randn(3), torch.randn(3) * 4
    exact = delta_inputs_torch(*(x.double() for x in inputs), A_log.double(), dt_bias.double(), True)
    mine = delta_inputs_torch(*inputs, A_log, dt_bias, True)
    theirs = composed(*inputs, A_log, dt_bias, True)
    err = lambda got, want: float((got.double() - want).norm() / want.norm())  # noqa: E731
    for i in (0, 1):
        assert err(mine[i], exact[i]) < err(theirs[i], exact[i])


def test_cpu_and_training_keep_the_composition():
    """The kernel is CUDA-only and forward-only: a CPU layer, or one whose inputs need a gradient, never takes it."""
    m = GatedDeltaNet(48, 3, 16, backend="auto")
    x = torch.randn(1, 5, 48)
    p = m._input_projections(x)
    assert not takes_fused_inputs(m, p)
    with torch.no_grad():
        p = m._input_projections(x)
        assert not takes_fused_inputs(m, p)  # CPU
        fla = GatedDeltaNet(48, 3, 16, backend="fla")
        assert not takes_fused_inputs(fla, fla._input_projections(x))  # backend fla, still CPU tensors


def test_the_kernel_waits_for_no_gradient():
    """The kernel has no backward: any gradient the layer's inputs or parameters ask for (A_log alone too)
    keeps the composition; frozen layers and no_grad take the kernel."""
    m = GatedDeltaNet(48, 3, 16)
    x = torch.randn(1, 5, 48)
    assert needs_gradient(m, m._input_projections(x))
    with torch.no_grad():
        assert not needs_gradient(m, m._input_projections(x))
    m.requires_grad_(False)
    assert not needs_gradient(m, m._input_projections(x))
    m.A_log.requires_grad_(True)
    assert needs_gradient(m, m._input_projections(x))
    m.A_log.requires_grad_(False)
    assert needs_gradient(m, m._input_projections(x.requires_grad_()))


def test_kernel_takes_only_what_it_computes():
    q, k, v, a, b = projections()
    assert kernel_takes(q, k, v, a, b) == (importlib.util.find_spec("triton") is not None)  # CPU installs have none
    assert not kernel_takes(q.double(), k.double(), v.double(), a, b)  # float64 is the reference's
    assert not kernel_takes(q, k[:, :-1], v, a, b)
    assert not kernel_takes(q, k, v, a[..., :-1], b)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed (a CUDA-side extra)")
def test_kernel_in_the_interpreter():
    """The Triton kernel in Triton's CPU interpreter against the float64 reference: slices of one
    projection and transposed views (a short convolution's output), a head size that is not a power
    of two, both dtypes and v activations; then GatedDeltaNet on this kernel and tcal.gated_norm's (with
    and without short convolutions, prefill and a cached continuation) against the same layer composed."""
    script = textwrap.dedent("""
        import torch
        import tcal.gdn as gdn
        import tests.test_delta_inputs as t
        from tcal.delta_inputs import delta_inputs_torch, delta_inputs_triton, kernel_takes
        A_log, dt_bias = torch.randn(3), torch.randn(3) * 4
        rel = lambda x, y: float((x.double() - y).norm() / y.norm().clamp_min(1e-30))
        for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 8e-3)):
            sliced = t.projections(dtype, seed=1)
            transposed = [x.transpose(1, 0).contiguous().transpose(1, 0) for x in sliced]
            for inputs in (sliced, transposed):
                for v_silu in (True, False):
                    got = delta_inputs_triton(*inputs, A_log, dt_bias, v_silu)
                    exact = delta_inputs_torch(*(x.double() for x in inputs), A_log.double(), dt_bias.double(), v_silu)
                    for name, x, y in zip("qkvgb", got, exact):
                        assert x.is_contiguous() and x.dtype == (dtype if name in "qkv" else torch.float32)
                        assert rel(x, y) < (tol if name in "qkv" else 1e-6), (dtype, name, rel(x, y))
        from tcal.gated_norm import kernel_takes as norm_takes
        real = (gdn.takes_fused_inputs, gdn._fused_norms, gdn.GatedRMSNorm.takes_strided_kernel)
        on_cpu = (lambda layer, p: kernel_takes(*(layer._split_heads(p[n + "_proj"]) for n in "qkv"), p["a_proj"], p["b_proj"]),
                  lambda x, backend: True, lambda norm, x, gate: norm_takes(x, gate, norm.weight, norm.activation))
        x = torch.randn(2, 40, 48)
        for conv in (False, True):
            m = gdn.GatedDeltaNet(48, 3, 16, use_short_conv=conv, conv_identity_init=False, v_activation="silu", backend="torch")
            with torch.no_grad():
                want = m.forward_parts(x)
                gdn.takes_fused_inputs, gdn._fused_norms, gdn.GatedRMSNorm.takes_strided_kernel = on_cpu
                got, cache = m.forward_parts(x), gdn.GDNCache()
                called = m(x)  # forward_out: the projections handed to the rule (tcal.kernels.gated_delta_rule_from_projections)
                m.forward_parts(x[:, :30], cache)
                tail = m.forward_parts(x[:, 30:], cache)["out"]
                cache = gdn.GDNCache()
                m(x[:, :30], cache)
                called_tail = m(x[:, 30:], cache)
                gdn.takes_fused_inputs, gdn._fused_norms, gdn.GatedRMSNorm.takes_strided_kernel = real
            for name in ("q", "k", "v", "g", "beta", "normed", "out"):
                torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(tail, want["out"][:, 30:], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(called, want["out"], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(called_tail, want["out"][:, 30:], rtol=1e-5, atol=1e-5)
        print("ok")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]
