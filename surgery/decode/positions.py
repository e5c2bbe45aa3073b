"""Positions continued from the cache: whatever the graph computes from the input's length alone
(the arange behind RoPE or a learned position table, OPT's cumsum of ones, the masks) is evaluated
at cache+new length and sliced to the new tokens, so a call with T tokens after N cached ones sees
positions N..N+T-1. For an arange this is exactly "shift by the offset"; the general form also
covers positions that are not an arange."""
from __future__ import annotations

import torch

from ..core.rewrite import SHAPE_QUERIES, ancestors, token_dependent
from ..errors import DecodeError
from .lengths import FIX_FULL, Lengths, symbolic
from .regimes import Regimes, TableRun, find_regimes


def length_derived(gm, seq, value: set) -> tuple[set, set, set]:
    """(sources, derived, mixed): the shape queries that are the input's length, every node computed
    from the length and not from the tokens, and those among them computed from a compound size."""
    sources, mixed_sources = set(), set()
    for n in gm.graph.nodes:
        expr = symbolic(n)
        if n.op == "call_function" and n.target in SHAPE_QUERIES and expr is not None and seq in expr.free_symbols:
            (sources if expr == seq else mixed_sources).add(n)
    derived, mixed = set(sources | mixed_sources), set(mixed_sources)
    for n in gm.graph.nodes:
        if n in value or n in derived:
            continue
        if any(a in derived for a in n.all_input_nodes):
            derived.add(n)
            if any(a in mixed for a in n.all_input_nodes):
                mixed.add(n)
    return sources, derived, mixed


def sliced_tensors(gm, seq, value: set, derived: set) -> list:
    """(node, dim) for each length-derived tensor that feeds the token computation, with the one
    sequence-long dimension to slice; refuses those that cannot be continued that way."""
    rewrite = []
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if n not in derived or n in value or not any(u in value for u in n.users) or not isinstance(val, torch.Tensor):
            continue
        shape = list(val.shape)
        clean = [i for i, d in enumerate(shape) if isinstance(d, torch.SymInt) and d.node.expr == seq]
        other = [i for i, d in enumerate(shape) if isinstance(d, torch.SymInt) and seq in d.node.expr.free_symbols and d.node.expr != seq]
        if len(clean) == 1 and not other:
            rewrite.append((n, clean[0]))
        elif len(clean) > 1:
            raise DecodeError(
                f"Node '{n.name}' of shape {tuple(shape)} (a mask of an attention the site finder did not see?) still feeds the tokens.",
                FIX_FULL,
            )
        elif clean or not other:
            raise DecodeError(f"Node '{n.name}' is computed from the sequence length in a way the decoder cannot continue.", FIX_FULL)
    return rewrite


def rewrite_positions(gm, lengths: Lengths, state_target: str, max_length: int, device) -> Regimes:
    """Evaluate what the graph computes from the input's length alone at cache+new length and keep
    the new tokens' part: every such tensor with one sequence-long dimension that feeds the token
    computation is recomputed from length + offset and sliced (for positions = arange(T), that is
    arange(T) + offset). Tensors of the call's tokens only (MoE dispatch over B*T) are left alone.
    Returns the lengths at which those tensors are not continued exactly (surgery.decode.regimes)."""
    value = token_dependent(gm, lengths.ids)
    sources, derived, mixed = length_derived(gm, lengths.seq, value)
    rewrite = sliced_tensors(gm, lengths.seq, value, derived)
    if not rewrite:
        return Regimes()
    regimes = find_regimes(TableRun(gm, [f for f, _ in rewrite], [d for _, d in rewrite], device), max_length)
    copy = set()
    for f, _ in rewrite:
        copy |= (ancestors(f) | {f}) & derived
    if copy & mixed:
        bad = sorted(n.name for n in copy & mixed)[:3]
        raise DecodeError(f"Positions are computed from a compound size ({bad}).", FIX_FULL)
    mapping = {}
    for n in list(gm.graph.nodes):
        if n not in copy:
            continue
        with gm.graph.inserting_after(n):
            if n in sources:
                mapping[n] = gm.graph.call_module(state_target, (n,))
            else:
                mapping[n] = gm.graph.node_copy(n, lambda a: mapping.get(a, a))
    for f, dim in rewrite:
        with gm.graph.inserting_after(mapping[f]):
            sliced = gm.graph.call_module(state_target, (mapping[f],), {"dim": dim})
        f.replace_all_uses_with(sliced, delete_user_cb=lambda u: u in value)
    return regimes
