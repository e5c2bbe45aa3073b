"""Rotate-half RoPE as one call (surgery.decode.rope), on the CPU: the rewrite finds q's and k's RoPE in
every kept attention layer of the rotate-half families (partial rotary included) and nothing else, the
logits stay the eager ones (the CPU path is the traced arithmetic), a hybrid's static decode steps keep
full recomputation's tokens, and the Triton kernel matches the reference in Triton's interpreter."""
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
from surgery.decode.rope import fuse_rope, rope, rope_torch


def calls(gm) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is rope)


def logits(gm, ids):
    with torch.no_grad():
        return gm(input_ids=ids, **gm.meta.get("extra_inputs", {})).logits


@pytest.mark.parametrize("arch, per_layer", [("llama", 2), ("qwen3", 2), ("gemma3", 2), ("phi", 2), ("gpt2", 0)])
def test_each_rope_fused_logits_unchanged(tiny, arch, per_layer):
    """q's and k's RoPE in every layer (Phi's partial rotary: the rotated slice); none in GPT-2 (learned
    positions), whose graph comes back as it was; the logits exactly the eager ones on the CPU."""
    graph = tiny(arch).graph
    fused, count = fuse_rope(graph.gm)
    assert count == calls(fused) == per_layer * graph.config.num_hidden_layers
    if not count:
        assert fused is graph.gm
        return
    ids = torch.randint(3, graph.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(logits(fused, ids), logits(graph.gm, ids), rtol=0, atol=0)
    assert fuse_rope(fused)[1] == 0 and calls(graph.gm) == 0


class Rotated(torch.nn.Module):
    """x * c + cat(-x2, x1) * s (a RoPE), or with the halves in the wrong order, or the rotation of another tensor."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def forward(self, x, y, c, s):
        src = y if self.kind == "other" else x
        h = x.shape[-1] // 2
        halves = [src[..., :h], -src[..., h:]] if self.kind == "swapped" else [-src[..., h:], src[..., :h]]
        return x * c + torch.cat(halves, dim=-1) * s


@pytest.mark.parametrize("kind, fused", [("rope", 1), ("swapped", 0), ("other", 0)])
def test_only_the_exact_pattern(kind, fused):
    x, y = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8)
    c, s = torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8)
    gm = torch.export.export(Rotated(kind), (x, y, c, s)).module()
    out, count = fuse_rope(gm)
    assert count == fused
    torch.testing.assert_close(out(x, y, c, s), gm(x, y, c, s), rtol=0, atol=0)


def test_static_steps_of_a_hybrid():
    """A GDN hybrid's static decode steps (the fusions on by default there): full recomputation's tokens."""
    from conftest import get_tiny

    graph = hybrid(get_tiny("llama").graph.branch())
    prompt = torch.randint(3, graph.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1))[0].tolist()
    decoder = Decoder(graph, step_mode="static")
    kept = sum(1 for kind in graph.layer_kinds if kind == "attention")
    assert calls(decoder.step_gm) == 2 * kept
    assert incremental_greedy(decoder, prompt, 5)[0] == full_greedy(graph, prompt, 5)[0]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed (a CUDA-side extra)")
def test_kernel_in_the_interpreter():
    """The Triton kernel in Triton's CPU interpreter: x a transposed view (as q and k are), cos and sin
    shared by the batch or per row, against the reference."""
    script = textwrap.dedent("""
        import torch
        from surgery.decode.rope import kernel_takes, rope_torch, rope_triton
        g = torch.Generator().manual_seed(0)
        for length in (1, 7, 70):  # a decoded token; a prompt in one block of positions and in three, the last partial
            x = torch.randn(2, length, 3, 12, generator=g).transpose(1, 2)  # [B, H, T, D] with T and H swapped in memory
            for batch in (1, 2):
                cos, sin = (torch.randn(batch, 1, length, 12, generator=g) for _ in range(2))
                assert kernel_takes(x, cos, sin)
                got, want = rope_triton(x, cos, sin), rope_torch(x, cos, sin)
                assert [s for s, n in zip(got.stride(), got.shape) if n > 1] == [s for s, n in zip(want.stride(), want.shape) if n > 1]
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        print("ok")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


def test_reference_is_the_traced_form():
    x, c, s = torch.randn(1, 2, 3, 6), torch.randn(1, 1, 3, 6), torch.randn(1, 1, 3, 6)
    expected = x * c + torch.cat([-x[..., 3:], x[..., :3]], dim=-1) * s
    assert torch.equal(rope_torch(x, c, s), expected) and torch.equal(rope(x, c, s), expected)
