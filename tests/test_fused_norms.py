"""The fused-RMSNorm rewrite of the fast route (surgery.decode.fused_norms) on the CPU: every traced
RMSNorm core of the RMSNorm families becomes one fused call with the eager logits unchanged, LayerNorm
families are left as they are, and the fast route with the rewrite gives the eager numbers, also
through a Decoder's prefill and the hybrid."""
from __future__ import annotations

import pytest
import torch
from test_generate import full_greedy, hybrid, incremental_greedy

import surgery.core.compiled as compiled_module
import surgery.decode.fused_norms as fused_norms_module
from surgery.core.compiled import Route
from surgery.decode import Decoder
from surgery.decode.fast import fast_logits
from surgery.decode.fused_norms import fuse_rms_norms, fused_op

def logits(gm, ids):
    with torch.no_grad():
        return gm(input_ids=ids, **gm.meta.get("extra_inputs", {})).logits


def fused_calls(gm) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is fused_op().default)


def test_stories_norms_fused_and_logits_unchanged(stories):
    """stories260K: two norms per layer and the final one; the eager logits to float32 rounding."""
    graph = stories()
    fused, count = fuse_rms_norms(graph.gm)
    assert count == fused_calls(fused) == 2 * graph.config.num_hidden_layers + 1
    assert fused is not graph.gm and fused_calls(graph.gm) == 0  # a fork: the teacher's graph is untouched
    ids = torch.randint(3, graph.config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(logits(fused, ids), logits(graph.gm, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "olmo2", "phi3", "gpt2", "stablelm"])
def test_families(tiny, arch):
    """RMSNorm families get fused calls (Qwen3's per-head q/k norms and Gemma's (1 + w) included), with
    the eager logits; LayerNorm families (GPT-2, StableLM) come back as the same graph."""
    graph = tiny(arch).graph
    fused, count = fuse_rms_norms(graph.gm)
    if arch in ("gpt2", "stablelm"):
        assert (fused, count) == (graph.gm, 0)
        return
    assert count >= 2 * graph.config.num_hidden_layers + 1 and fused_calls(fused) == count
    ids = torch.randint(3, graph.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(logits(fused, ids), logits(graph.gm, ids), rtol=1e-5, atol=1e-5)


class Scaled(torch.nn.Module):
    """x * rsqrt(mean(s^2) + eps) with s = x (an RMSNorm) or s = y (not one)."""

    def __init__(self, own: bool):
        super().__init__()
        self.own = own

    def forward(self, x, y):
        xf = x.float()
        s = xf if self.own else y.float()
        return xf * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5)


@pytest.mark.parametrize("own", [True, False])
def test_only_the_exact_pattern(own):
    """Only x * rsqrt(mean(x^2) + eps) is fused; the square of another tensor is left alone; a fused
    graph has nothing left to fuse."""
    x, y = torch.randn(3, 8), torch.randn(3, 8)
    gm = torch.export.export(Scaled(own), (x, y)).module()
    fused, count = fuse_rms_norms(gm)
    assert count == int(own)
    torch.testing.assert_close(fused(x, y), gm(x, y))
    assert fuse_rms_norms(fused)[1] == 0


def test_fast_route_with_fused_norms(tiny, monkeypatch):
    """The route CUDA takes (flags and fused norms; no replay on the CPU): the runner's logits and a
    Decoder's prefill and steps equal the plain graph's, on a GDN hybrid."""
    route = Route(causal_flags=True, fused=True)
    graph = hybrid(tiny("llama").graph.branch())
    prompt = torch.randint(3, graph.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(2))[0].tolist()
    reference, _ = full_greedy(graph, prompt, 4)
    ids = torch.tensor([prompt])
    plain = graph.logits(ids)
    monkeypatch.setattr(compiled_module, "ROUTES", {("cpu", "eval"): route, ("cpu", "prefill"): route})
    torch.testing.assert_close(fast_logits(graph, ids), plain, rtol=1e-5, atol=1e-5)
    tokens, _ = incremental_greedy(Decoder(graph), prompt, 4)
    assert tokens == reference


def test_static_decode_steps_fuse_their_norms(tiny):
    """A Decoder's static step graph (what a CUDA graph replays) runs fused norms, the decode graph for
    prefills keeps the traced ones, and the steps still give full recomputation's tokens."""
    graph = hybrid(tiny("qwen3").graph.branch())
    prompt = torch.randint(3, graph.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(3))[0].tolist()
    reference, _ = full_greedy(graph, prompt, 5)
    assert fused_calls(Decoder(graph, step_mode="static", fuse_elementwise=False).step_gm) == 0
    decoder = Decoder(graph, step_mode="static")  # on by default (compiled.FUSED_BY_DEFAULT)
    from surgery.decode.residual_norm import add_rms_norm
    with_residual = sum(1 for n in decoder.step_gm.graph.nodes if n.op == "call_function" and n.target is add_rms_norm)
    assert fused_calls(decoder.step_gm) + with_residual >= 2 * graph.config.num_hidden_layers + 1 and fused_calls(decoder.gm) == 0
    assert incremental_greedy(decoder, prompt, 5)[0] == reference


def test_a_torch_without_the_op_keeps_the_graph(stories, monkeypatch):
    """Every torch of the declared range (2.11 to 2.15) has aten._fused_rms_norm; one without it would
    get the graph back unchanged, never an error."""
    graph = stories()
    monkeypatch.setattr(fused_norms_module, "fused_op", lambda: None)
    assert fuse_rms_norms(graph.gm) == (graph.gm, 0)


def weighted_calls(gm) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is fused_op().default and n.args[2] is not None)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_whole_norm_in_bf16(tiny, arch):
    """bf16: Llama's whole norm (casts and weight) is one call, nearer the float32 norm than the traced
    two roundings; Gemma's x * (1 + w) keeps its weight as traced (the core alone is fused)."""
    import copy

    from surgery import capture
    model = copy.deepcopy(tiny(arch).model).to(torch.bfloat16)  # the shared tiny model stays float32
    gm = capture(model).gm
    fused, count = fuse_rms_norms(gm)
    assert weighted_calls(fused) == (count if arch == "llama" else 0)
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))
    reference = logits(capture(model.float()).gm, ids)
    got, traced = logits(fused, ids).float(), logits(gm, ids).float()
    assert (got - reference).abs().max() <= 1.5 * (traced - reference).abs().max() + 1e-3
