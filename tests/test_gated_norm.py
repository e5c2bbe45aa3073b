"""tcal.gated_norm: the recurrent layers' gated output norm as one kernel that reads the gate through
its strides. The reference against GatedRMSNorm's composition, the Triton kernel (Triton's CPU
interpreter) against float64."""
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tcal.gated_norm import gated_rms_norm_torch, kernel_takes
from tcal.gdn import GatedRMSNorm


def norm_inputs(dtype=torch.float32, batch=2, length=9, heads=3, dim=24, seed=0):
    """x [B, T, H, D] contiguous, gate a strided slice of a wider projection, weight [D]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, length, heads, dim, generator=g).to(dtype)
    proj = (torch.randn(batch, length, 2 * heads * dim + 5, generator=g) * 2).to(dtype)
    gate = proj[..., heads * dim:2 * heads * dim].unflatten(-1, (heads, dim))
    return x, gate, torch.rand(dim, generator=g) + 0.5


@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reference_is_the_layers_norm(dtype, activation):
    x, gate, weight = norm_inputs(dtype)
    norm = GatedRMSNorm(24, eps=1e-5, activation=activation).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        want = norm(x, gate)
    got = gated_rms_norm_torch(x, gate, weight.to(dtype), 1e-5, activation)
    assert got.is_contiguous() and got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_cpu_and_gradients_keep_the_other_paths():
    x, gate, _ = norm_inputs()
    norm = GatedRMSNorm(24)
    assert kernel_takes(x, gate, norm.weight, "silu") == (importlib.util.find_spec("triton") is not None)
    assert not norm.takes_strided_kernel(x, gate)  # CPU tensors
    assert not kernel_takes(x, gate[:, :-1], norm.weight, "silu") and not kernel_takes(x, gate, norm.weight, "relu")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed (a CUDA-side extra)")
def test_kernel_in_the_interpreter():
    """A strided gate and a transposed x, a width that is not a power of two, both gate activations, both
    dtypes, against the float64 reference (bf16: the interpreter truncates where CUDA rounds)."""
    script = textwrap.dedent('''
        import torch
        import tests.test_gated_norm as t
        from tcal.gated_norm import gated_rms_norm_torch, gated_rms_norm_triton
        rel = lambda x, y: float((x.double() - y).norm() / y.norm())
        for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 8e-3)):
            x, gate, weight = t.norm_inputs(dtype, seed=1)
            for xs in (x, x.transpose(1, 2).contiguous().transpose(1, 2)):
                for activation in ("silu", "sigmoid"):
                    got = gated_rms_norm_triton(xs, gate, weight, 1e-5, activation)
                    exact = gated_rms_norm_torch(xs.double(), gate.double(), weight.double(), 1e-5, activation)
                    assert got.is_contiguous() and got.dtype == dtype
                    assert rel(got, exact) < tol, (dtype, activation, rel(got, exact))
        print("ok")
    ''')
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]
