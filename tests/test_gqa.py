"""surgery/decode/gqa.py: a GQA layer's unmasked SDPA on its own key/value heads (enable_gqa), repeat_kv's copies gone.

Across tiny GQA architectures after the causal-flag rewrite: every layer's call rewritten and the logits equal the
graph's; nothing rewritten where a mask remains or the heads are not grouped; through the fast route unless
SURGERY_SDPA_GQA=off."""
from __future__ import annotations

import pytest
import torch

import surgery.core.compiled as compiled_module
import surgery.decode.gqa as gqa
from surgery.core.compiled import Route
from surgery.core.run import graph_logits
from surgery.decode.causal_flags import CausalFlags
from surgery.decode.fast import bucket, fast_graph, fast_logits


def sdpa_calls(gm) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is gqa.SDPA]


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "phi3", "olmo2", "granite", "smollm3"])
def test_grouped_layers_read_their_own_heads(tiny, name):
    entry = tiny(name)
    graph = entry.graph
    flagged = CausalFlags(bucket(40, graph.max_length))(graph.gm)
    calls = sdpa_calls(flagged)
    assert calls and all(gqa.gqa_call(n) is not None for n in calls), name
    rewritten, count = gqa.sdpa_on_grouped_heads(flagged)
    assert count == len(calls) and rewritten is not flagged
    assert all(n.kwargs.get("enable_gqa") for n in sdpa_calls(rewritten))
    assert not any(n.target is torch.ops.aten.expand.default for n in rewritten.graph.nodes
                   if any(u.target is gqa.SDPA for u in n.users))
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(graph_logits(rewritten, ids), graph_logits(flagged, ids), rtol=1e-5, atol=1e-5)


def test_masked_or_ungrouped_calls_stay(tiny):
    llama = tiny("llama").graph
    masked, count = gqa.sdpa_on_grouped_heads(llama.gm)  # the captured graph: SDPA still takes its mask
    assert count == 0 and masked is llama.gm
    mistral = tiny("mistral").graph  # every layer sliding: the flags keep each window's mask
    windowed = CausalFlags(bucket(40, mistral.max_length))(mistral.gm)
    assert sdpa_calls(windowed) and gqa.sdpa_on_grouped_heads(windowed) == (windowed, 0)
    gpt2 = tiny("gpt2").graph  # one key/value head per query head: nothing repeated
    flagged = CausalFlags(bucket(40, gpt2.max_length))(gpt2.gm)
    assert gqa.sdpa_on_grouped_heads(flagged) == (flagged, 0)


def test_fast_route_takes_it_unless_switched_off(tiny, monkeypatch):
    monkeypatch.setattr(compiled_module, "ROUTES", {("cpu", "eval"): Route(causal_flags=True, fused=True)})
    graph = tiny("llama").graph
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    key = bucket(40, graph.max_length)
    with torch.no_grad():
        want = graph.logits(ids)
        for setting in ("off", "on", None):  # None: the default, on
            if setting is None:
                monkeypatch.delenv(gqa.SWITCH, raising=False)
            else:
                monkeypatch.setenv(gqa.SWITCH, setting)
            graph.cache.clear()
            torch.testing.assert_close(fast_logits(graph, ids), want, rtol=1e-5, atol=1e-5)
            grouped = [n.kwargs.get("enable_gqa", False) for n in sdpa_calls(fast_graph(graph).graphs[key])]
            assert grouped and all(grouped) == (setting != "off"), (setting, grouped)
