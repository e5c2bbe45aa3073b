"""SDPA masks proven plain causal become SDPA's is_causal flag (surgery.decode.causal_flags), for the
compiled paths: the rewritten graph computes the same logits as the captured one, sliding-window
layers wider than the checked length keep their mask, and longer inputs are refused."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import surgery.core.compiled as compiled_module
from surgery.core.run import graph_logits
import surgery.decode.fast as fast_module
from surgery.decode.causal_flags import causal_flags
from surgery.decode.fast import fast_graph, fast_runner
from surgery.sites.ops import SDPA_OPS, sdpa_arguments
from surgery.errors import CaptureError

LENGTH = 40


def masked_calls(gm) -> tuple[int, int]:
    """(SDPA calls with a mask, SDPA calls with is_causal and no mask)."""
    calls = [sdpa_arguments(n) for n in gm.graph.nodes if n.op == "call_function" and n.target in SDPA_OPS]
    return sum(a.get("attn_mask") is not None for a in calls), sum(bool(a.get("is_causal")) and a.get("attn_mask") is None for a in calls)


def full_layers(graph) -> int:
    types = getattr(graph.config, "layer_types", None)
    if getattr(graph.config, "sliding_window", None) is None:
        return graph.config.num_hidden_layers
    return sum(t == "full_attention" for t in types) if types else 0


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "gemma3", "phi3", "cohere2"])
def test_rewritten_graph_agrees_and_keeps_windows(tiny, name):
    """mistral: every layer slides (window 8 < 40 tokens): nothing is rewritten; gemma3 and cohere2
    alternate sliding and full layers: only the full ones are."""
    graph = tiny(name).graph
    before, _ = masked_calls(graph.gm)
    assert before == graph.config.num_hidden_layers  # SDPA with a traced mask in every layer
    gm, count = causal_flags(graph.gm, LENGTH)
    assert count == full_layers(graph), (count, before)
    assert masked_calls(gm) == (before - count, count)
    ids = torch.randint(3, graph.config.vocab_size, (2, LENGTH), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        eager, flagged = graph_logits(graph.gm, ids), graph_logits(gm, ids)
    assert (eager - flagged).abs().max() <= 1e-5 * eager.abs().max()
    assert masked_calls(graph.gm) == (before, 0)  # the captured graph itself is untouched


def test_a_window_wider_than_the_checked_length_is_causal_up_to_it(tiny):
    """At 6 tokens mistral's window of 8 is plain causal: rewritten, and 9+ tokens are refused."""
    graph = tiny("mistral").graph
    gm, count = causal_flags(graph.gm, 6)
    assert count == graph.config.num_hidden_layers
    ids = torch.randint(3, graph.config.vocab_size, (1, 6))
    with torch.no_grad():
        assert torch.allclose(graph_logits(gm, ids), graph_logits(graph.gm, ids), atol=1e-5)
        with pytest.raises(CaptureError, match="longer than the 6"):
            graph_logits(gm, torch.randint(3, graph.config.vocab_size, (1, 9)))


def test_compiled_runner_uses_the_flags(stories, monkeypatch):
    """The fast runner compiled: the compiled module has no mask left, one compiled graph per length
    bucket (surgery.decode.fast)."""
    monkeypatch.setattr(compiled_module, "BACKEND", "aot_eager")
    monkeypatch.setattr(fast_module, "MIN_BUCKET", 64)
    graph = dataclasses.replace(stories(), cache={})  # its own cache: other tests compile the same teacher
    run = fast_runner(graph, True, report=None)
    ids = torch.randint(3, graph.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        eager, compiled = graph.logits(ids), run(ids)
        assert (eager - compiled).abs().max() <= 1e-5 * eager.abs().max()
        fast = fast_graph(graph, True)
        assert list(fast.compiled) == [64]
        assert masked_calls(fast.compiled[64].module) == (0, graph.config.num_hidden_layers)
        run(ids[:, :50])
        assert list(fast.compiled) == [64]
        run(torch.cat([ids, ids], dim=1))
    assert list(fast.compiled) == [64, 128]


def test_a_graph_without_a_length_to_prove_with_is_returned_unchanged(tiny):
    """No symbolic length to read masks with (symbolic_trace keeps no shapes): unchanged; a length under 1 is refused."""
    graph = tiny("llama").graph
    fixed = torch.fx.symbolic_trace(torch.nn.Linear(4, 4))
    assert causal_flags(fixed, 16) == (fixed, 0)
    with pytest.raises(CaptureError, match="at least 1 token"):
        causal_flags(graph.gm, 0)
