"""SwiGLU's product as one call (surgery.decode.swiglu) and the fast route's fusions together
(surgery.decode.fusions), on the CPU: the rewrite finds each MLP's silu(gate) * up and nothing else,
the logits stay the eager ones, and silu_mul's CPU path is the traced arithmetic bit for bit."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from surgery.decode.fusions import fuse_elementwise
from surgery.decode.swiglu import fuse_swiglu, silu_mul, silu_mul_torch


def calls(gm) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is silu_mul)


def logits(gm, ids):
    with torch.no_grad():
        return gm(input_ids=ids, **gm.meta.get("extra_inputs", {})).logits


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral", "gpt2"])
def test_each_mlp_fused_logits_unchanged(tiny, arch):
    """One call per SwiGLU MLP (none for GPT-2's GELU MLP, whose graph comes back as it was); the
    logits are the eager ones exactly on the CPU (silu_mul is the traced arithmetic there)."""
    graph = tiny(arch).graph
    fused, count = fuse_swiglu(graph.gm)
    if arch == "gpt2":
        assert (fused, count) == (graph.gm, 0)
        return
    assert count == calls(fused) == graph.config.num_hidden_layers and calls(graph.gm) == 0
    ids = torch.randint(3, graph.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(logits(fused, ids), logits(graph.gm, ids), rtol=0, atol=0)
    assert fuse_swiglu(fused)[1] == 0


class Gated(torch.nn.Module):
    """silu(a) * b, with the SiLU also returned (shared) or not; silu(a) * c with c broadcast."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def forward(self, a, b):
        s = F.silu(a)
        if self.kind == "shared":
            return s * b, s
        if self.kind == "broadcast":
            return s * b[..., :1]
        return s * b


@pytest.mark.parametrize("kind, fused", [("plain", 1), ("shared", 0), ("broadcast", 0)])
def test_only_the_exact_pattern(kind, fused):
    """A SiLU another op also reads, or a product that broadcasts, is left as it is."""
    a, b = torch.randn(3, 8), torch.randn(3, 8)
    gm = torch.export.export(Gated(kind), (a, b)).module()
    out, count = fuse_swiglu(gm)
    assert count == fused
    torch.testing.assert_close(out(a, b), gm(a, b), rtol=0, atol=0)


def test_cpu_path_is_the_traced_arithmetic():
    """bf16 on the CPU: silu_mul rounds as F.silu(a) * b does (the Triton kernel, CUDA only, rounds once)."""
    a, b = (torch.randn(5, 7, 48, generator=torch.Generator().manual_seed(i)).bfloat16() for i in (1, 2))
    assert torch.equal(silu_mul(a, b), F.silu(a) * b) and torch.equal(silu_mul_torch(a, b), F.silu(a) * b)


def test_fusions_together(tiny):
    """fuse_elementwise: the norms, the residual adds into them, the SwiGLU products and the RoPEs of one
    graph, in one fork, the logits kept."""
    graph = tiny("llama").graph
    fused, counts = fuse_elementwise(graph.gm)
    layers = graph.config.num_hidden_layers
    assert counts == {"norms": 2 * layers + 1, "residual norms": 2 * layers, "swiglu": layers, "rope": 2 * layers} and calls(graph.gm) == 0
    ids = torch.randint(3, graph.config.vocab_size, (1, 13), generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(logits(fused, ids), logits(graph.gm, ids), rtol=1e-5, atol=1e-5)
