"""surgery.decode.step_tables: a static step's length-only tables (RoPE's cos/sin, a learned position
table's rows) computed once per capacity and kept, against full recomputation."""
from __future__ import annotations

import torch
from test_generate import full_greedy, hybrid, incremental_greedy

from surgery.decode import Decoder
from surgery.decode.step_tables import TARGET, StepTables


def static_decoder(arch: str):
    from conftest import get_tiny

    graph = hybrid(get_tiny(arch).graph.branch())
    return graph, Decoder(graph, step_mode="static")


def test_rope_tables_leave_the_step_and_are_computed_once():
    graph, decoder = static_decoder("llama")
    ops = {getattr(n.target, "__name__", "") for n in decoder.step_gm.graph.nodes if n.op == "call_function"}
    assert not ops & {"arange.default", "cos.default", "sin.default"}, ops
    tables = decoder.step_gm.get_submodule(TARGET)
    assert isinstance(tables, StepTables)
    runs = []
    original = tables.sub.forward
    tables.sub.forward = lambda *a: runs.append(a) or original(*a)
    prompt = torch.randint(3, graph.config.vocab_size, (6,), generator=torch.Generator().manual_seed(3)).tolist()
    for capacity_steps in (5, 9):  # a second capacity: computed again, at its length
        tokens, logits = incremental_greedy(decoder, prompt, capacity_steps)
        want_tokens, want_logits = full_greedy(graph, prompt, capacity_steps)
        assert tokens == want_tokens
        torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
        assert tables.values[0].shape[-2] == len(prompt) + capacity_steps
    assert len(runs) == 2


def test_a_changed_position_table_is_read_again():
    """GPT-2's learned position table: changed in place between two generations, the kept rows follow."""
    graph, decoder = static_decoder("gpt2")
    tables = decoder.step_gm.get_submodule(TARGET)
    prompt = torch.randint(3, graph.config.vocab_size, (6,), generator=torch.Generator().manual_seed(4)).tolist()
    assert incremental_greedy(decoder, prompt, 4)[0] == full_greedy(graph, prompt, 4)[0]
    kept = tables.values[0].clone()
    wpe = next(p for name, p in graph.gm.named_parameters() if "wpe" in name)
    with torch.no_grad():
        wpe.mul_(-3.0)
    tokens, logits = incremental_greedy(decoder, prompt, 4)
    want_tokens, want_logits = full_greedy(graph, prompt, 4)
    assert not torch.equal(tables.values[0], kept)
    assert tokens == want_tokens
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)


def test_not_static_means_computed_every_call():
    _, decoder = static_decoder("llama")
    tables = decoder.step_gm.get_submodule(TARGET)
    state = tables._state[0]
    assert not state.static
    kept = tables.values
    first, second = tables(1), tables(1)  # the length of a one-token call
    assert tables.values is kept and first[0] is not second[0]
    torch.testing.assert_close(first, second, rtol=0, atol=0)


def test_a_step_selects_each_table_once_and_caches_kv_heads():
    """Every layer slices its own unsqueeze of the shared cos/sin: one row of each per step, not one per
    layer; and K/V reach the cache from before repeat_kv (no expand copy, no head pick back), with
    decoding still equal to full recomputation (teacher: every layer attention, grouped query heads)."""
    from conftest import get_tiny

    graph = get_tiny("llama").graph.branch()
    assert graph.config.num_key_value_heads < graph.config.num_attention_heads and len(graph.sites) >= 2
    decoder = Decoder(graph, step_mode="static")
    nodes = list(decoder.step_gm.graph.nodes)
    slices = [n for n in nodes if n.op == "call_module" and n.target == "_decode" and "dim" in n.kwargs]
    assert len(slices) == 2, [n.format_node() for n in slices]  # cos and sin
    assert not [n for n in nodes if getattr(n.target, "__name__", "") == "expand.default"]
    assert all(m.k_prep.select is None and m.v_prep.select is None for m in decoder.attention.values())
    prompt = torch.randint(3, graph.config.vocab_size, (6,), generator=torch.Generator().manual_seed(5)).tolist()
    tokens, logits = incremental_greedy(decoder, prompt, 5)
    want_tokens, want_logits = full_greedy(graph, prompt, 5)
    assert tokens == want_tokens
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
