"""A residual add with the RMSNorm that reads it as one call (surgery.decode.residual_norm), on the
CPU: each pre-norm block's add -> norm pair is found after the norms are fused, the logits stay the
eager ones (the CPU path is the two calls themselves), a decoded hybrid keeps full recomputation's
tokens, and the Triton kernels (this one and SwiGLU's) match their references in Triton's interpreter."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from test_generate import full_greedy, hybrid, incremental_greedy

from surgery.decode import Decoder
from surgery.decode.gdn_blocks import GDNBlock
from surgery.decode.fused_norms import fuse_rms_norms
from surgery.decode.residual_norm import add_rms_norm, fuse_residual_norms


def calls(gm) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is add_rms_norm)


def logits(gm, ids):
    with torch.no_grad():
        return gm(input_ids=ids, **gm.meta.get("extra_inputs", {})).logits


@pytest.mark.parametrize("arch", ["llama", "qwen3", "olmo2", "gemma3"])
def test_each_residual_norm_pair(tiny, arch):
    """Llama / Qwen3: two pairs per layer (the last one's with the final norm); OLMo2 (norms after the
    sublayers, not of the sum) and Gemma-3 (its own norm form) have none; logits unchanged."""
    graph = tiny(arch).graph
    normed, _ = fuse_rms_norms(graph.gm)
    fused, count = fuse_residual_norms(normed)
    assert count == calls(fused) == (2 * graph.config.num_hidden_layers if arch in ("llama", "qwen3") else 0)
    if count:
        ids = torch.randint(3, graph.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(logits(fused, ids), logits(normed, ids), rtol=0, atol=0)
        assert fuse_residual_norms(fused)[1] == 0
    else:
        assert fused is normed


def test_static_steps_of_a_hybrid():
    """A GDN hybrid decoded with static steps (where the fusions run by default): full recomputation's tokens."""
    from conftest import get_tiny

    graph = hybrid(get_tiny("llama").graph.branch())
    prompt = torch.randint(3, graph.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1))[0].tolist()
    decoder = Decoder(graph, step_mode="static")
    blocks = sum(isinstance(m, GDNBlock) for m in decoder.step_gm.modules())  # a GDN layer's two are inside its block
    assert blocks == graph.layer_kinds.count("gdn") > 0
    assert calls(decoder.step_gm) + 2 * blocks == 2 * graph.config.num_hidden_layers
    assert incremental_greedy(decoder, prompt, 5)[0] == full_greedy(graph, prompt, 5)[0]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed (a CUDA-side extra)")
def test_kernels_in_the_interpreter():
    """add_rms_norm's and silu_mul's Triton kernels, run by Triton's CPU interpreter: a row width that is
    not a power of two, strided inputs, with and without a weight."""
    script = textwrap.dedent("""
        import torch, torch.nn.functional as F
        from surgery.decode.residual_norm import add_rms_norm_torch, add_rms_norm_triton
        from surgery.decode.swiglu import silu_mul_triton
        g = torch.Generator().manual_seed(0)
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
            both = torch.randn(6, 2 * 40, generator=g).to(dtype)
            a, b = both.split(40, -1)
            w = (torch.rand(40, generator=g) + 0.5).to(dtype)
            for weight in (w, None):
                h, n = add_rms_norm_triton(a, b, weight, 1e-6)
                h0, n0 = add_rms_norm_torch(a, b, weight, 1e-6)
                # (the interpreter's float32 -> bf16 cast is not the GPU's round-to-nearest: bf16 gets a tolerance here,
                # and bench/quality.py --kernel-check compares the sum bit for bit on CUDA)
                torch.testing.assert_close(h.float(), h0.float(), rtol=tol, atol=tol)
                torch.testing.assert_close(n.float(), n0.float(), rtol=tol, atol=tol)
            exact = F.silu(a.float()) * b.float()
            torch.testing.assert_close(silu_mul_triton(a, b).float(), exact, rtol=tol, atol=tol)
        print("ok")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]
