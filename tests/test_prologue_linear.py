"""A decode step's residual norm (or SwiGLU product) and the linear reading it as one call
(surgery.decode.prologue_linear): found in static step graphs of teachers and hybrids (a GDN layer's fused
input projection included), the CPU path keeps full recomputation's tokens, the kernel matches its
reference in Triton's interpreter, and on CUDA in bf16 against the two kernels it replaces."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import get_tiny
from test_generate import full_greedy, hybrid, incremental_greedy

from surgery.decode import Decoder
from surgery.decode.prologue_linear import (
    kernel_takes,
    norm_linear,
    norm_linear_reference,
    swiglu_linear,
    swiglu_linear_reference,
)
from surgery.decode.residual_norm import add_rms_norm


def calls(gm, target) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is target)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_static_steps_of_teacher_and_hybrid(arch):
    """Every residual norm pair feeds a linear (the next layer's q/k/v or GDN projection, the MLP's gate/up,
    the head), every SwiGLU product the down projection: all fused, none left; tokens are the full
    recomputation's and the logits within float32 rounding."""
    teacher = get_tiny(arch).graph
    layers = teacher.config.num_hidden_layers
    for graph in (teacher, hybrid(teacher.branch())):
        prompt = torch.randint(3, graph.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1))[0].tolist()
        decoder = Decoder(graph, step_mode="static")
        gm = decoder.step_gm
        assert (calls(gm, norm_linear), calls(gm, swiglu_linear), calls(gm, add_rms_norm)) == (2 * layers, layers, 0)
        tokens, logits = incremental_greedy(decoder, prompt, 5)
        full_tokens, full_logits = full_greedy(graph, prompt, 5)
        assert tokens == full_tokens
        torch.testing.assert_close(logits, full_logits, rtol=1e-4, atol=1e-4)


def test_unfused_steps_keep_the_plain_calls():
    graph = hybrid(get_tiny("llama").graph.branch())
    gm = Decoder(graph, step_mode="static", fuse_elementwise=False).step_gm
    assert calls(gm, norm_linear) == calls(gm, swiglu_linear) == 0


def test_the_kernel_takes_only_what_it_can():
    """CPU tensors, float32, more than ROWS rows, a head-sized weight: the references run."""
    a = torch.randn(1, 64, dtype=torch.bfloat16)
    w = torch.randn(32, 64, dtype=torch.bfloat16)
    assert not kernel_takes(a, a, w, None)  # the CPU
    if torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
        c, wc = a.cuda(), w.cuda()
        assert kernel_takes(c, c, wc, None)
        assert not kernel_takes(c.float(), c.float(), wc.float(), None)
        assert not kernel_takes(torch.randn(17, 64, device="cuda", dtype=torch.bfloat16), torch.randn(17, 64, device="cuda", dtype=torch.bfloat16), wc, None)
        assert not kernel_takes(c, c, torch.randn(200_000, 64, device="cuda", dtype=torch.bfloat16), None)


KERNEL_CHECK = """
    import torch, torch.nn.functional as F
    from surgery.decode.prologue_linear import prologue_linear_triton
    from surgery.decode.residual_norm import add_rms_norm_torch
    g = torch.Generator().manual_seed(0)
    dtype, device, tol = DTYPE, DEVICE, TOL
    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)
    for rows in (1, 5, 16):
        both = rand(rows, 2 * 72)
        a, b = both.split(72, -1)  # strided rows, as a fused projection's slices are
        nw = (torch.rand(72, generator=g) + 0.5).to(dtype).to(device)
        for n in (40, 2100, 9000):  # the three column blocks
            w = rand(n, 72, scale=0.1)
            for bias in (None, rand(n)):
                fb = None if bias is None else bias.float()
                for norm_w in (nw, None):
                    h, y = prologue_linear_triton(a, b, norm_w, 1e-6, w, bias, swiglu=False)
                    h0, n0 = add_rms_norm_torch(a, b, norm_w, 1e-6)
                    torch.testing.assert_close(h.float(), h0.float(), rtol=tol, atol=tol)
                    torch.testing.assert_close(y.float(), F.linear(n0.float(), w.float(), fb), rtol=tol, atol=tol)
                _, y = prologue_linear_triton(a, b, None, 0.0, w, bias, swiglu=True)
                x = (F.silu(a.float()) * b.float()).to(dtype).float()
                torch.testing.assert_close(y.float(), F.linear(x, w.float(), fb), rtol=tol, atol=tol)
    print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed (a CUDA-side extra)")
def test_kernel_in_the_interpreter():
    """float16 (the interpreter's bf16 tl.dot is not the GPU's: the CUDA test below covers bf16): 1, 5 and
    16 rows, strided inputs, a width that is not a power of two, with and without bias and norm weight."""
    script = textwrap.dedent(KERNEL_CHECK).replace("DTYPE", "torch.float16").replace("DEVICE", "'cpu'").replace("TOL", "1e-2")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None, reason="needs CUDA and Triton")
def test_kernel_on_cuda_in_bf16():
    """The kernel against float32 math on the same bf16 inputs (the two kernels it replaces round where it does)."""
    exec(textwrap.dedent(KERNEL_CHECK).replace("DTYPE", "torch.bfloat16").replace("DEVICE", "'cuda'").replace("TOL", "2e-2"), {})
    a, b = torch.randn(2, 2, 1, 576, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1536, 576, device="cuda", dtype=torch.bfloat16) * 0.05
    nw = torch.rand(576, device="cuda", dtype=torch.bfloat16) + 0.5
    for fused, reference in ((norm_linear(a, b, nw, 1e-5, w, None), norm_linear_reference(a, b, nw, 1e-5, w, None)),
                             ((swiglu_linear(a, b, w[:, :576], None),), (swiglu_linear_reference(a, b, w[:, :576], None),))):
        for x, y in zip(fused, reference):
            torch.testing.assert_close(x.float(), y.float(), rtol=2e-2, atol=2e-2)
