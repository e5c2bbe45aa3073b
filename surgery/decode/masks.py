"""Reading a layer's attention mask at any length: the graph's own mask tensor (or SDPA's is_causal
flag, or the eager score path with zero scores pushed through it) evaluated from the input's length
alone, checked to be causal, and read as full causal attention or a sliding window."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Node

from ..core.rewrite import SHAPE_QUERIES
from ..core.run import interpret
from ..errors import DecodeError
from .lengths import FIX_FULL, Lengths, symbolic

MASK_CHECK = 64        # length at which the meaning of each mask is checked (cheap)
MASK_PROBE = 8192      # longest length at which a mask is read to find a sliding window
UNLIMITED = 1 << 62
MASKED = -1e4


def square(m: torch.Tensor, length: int, what: str) -> torch.Tensor:
    """[..., L, L] with equal leading slices -> [L, L]."""
    if m.dim() < 2 or m.shape[-1] != length or m.shape[-2] not in (1, length):
        raise DecodeError(
            f"{what} has shape {tuple(m.shape)} at {length} tokens, not [.., {length}, {length}] (extra columns such as attention sinks?).",
            FIX_FULL,
        )
    m = m.expand(*m.shape[:-2], length, length)
    keep = tuple(0 if m.stride(i) == 0 else slice(None) for i in range(m.dim() - 2))
    flat = m[keep].reshape(-1, length, length)
    if any(not torch.equal(flat[0], flat[i]) for i in range(1, flat.shape[0])):
        raise DecodeError(f"{what} differs between batch rows or heads (a per-head position bias such as ALiBi?).", FIX_FULL)
    return flat[0]


def band(allowed: torch.Tensor, layer: int) -> int | None:
    """The sliding window of a causal mask (None: full causal at this length)."""
    n = allowed.shape[0]
    i = torch.arange(n, device=allowed.device)
    causal = i[None, :] <= i[:, None]
    if (allowed & ~causal).any():
        raise DecodeError(f"Attention {layer} lets tokens see later tokens.", "Only causal attention can be decoded incrementally.")
    width = int(allowed[-1].sum())
    if width < 1 or not torch.equal(allowed, causal & (i[:, None] - i[None, :] < width)):
        raise DecodeError(f"The mask of attention {layer} is neither causal nor a causal sliding window.", FIX_FULL)
    return None if width == n else width


def threshold(dtype) -> float:
    """Additive mask entries at or below this are "masked": exp(-1e4) is 0 in every float dtype, so
    they weigh exactly what -inf does (GPT-1 masks with -1e4, most models with the dtype's min)."""
    return MASKED if dtype.is_floating_point else 0


def no_bias(scores: torch.Tensor, layer: int) -> torch.Tensor:
    """The keep-mask of additive entries, refusing any that are neither 0 nor masked (a bias)."""
    keep = scores > threshold(scores.dtype)
    if (scores.masked_fill(~keep, 0) != 0).any():
        raise DecodeError(f"Attention {layer} adds a position bias to its scores (ALiBi or relative positions).", FIX_FULL)
    return keep


@dataclass
class MaskRule:
    """How to read a layer's allowed-keys pattern at any length: from a tensor of the graph
    (`node`) read as a boolean keep-mask ("keep"), its negation ("drop") or an additive 0/-inf mask
    ("additive"); node None with mode "causal" is SDPA's is_causal flag."""

    node: Node | None
    mode: str

    def allowed(self, reader: "MaskReader", length: int, layer: int) -> torch.Tensor | None:
        if self.mode == "causal":
            i = torch.arange(length)
            return i[None, :] <= i[:, None]
        got = reader.value(self.node, length)
        if got is None:
            return None
        m = square(got[0], length, f"The mask of attention {layer}")
        if self.mode == "additive":
            return no_bias(m, layer)
        return m.bool() if self.mode == "keep" else ~m.bool()


class MaskReader:
    """Evaluates what a graph computes from its input's length alone, remembering each mask read:
    layers share one mask node, so each (node, length) is evaluated once while a graph is planned."""

    def __init__(self, gm, lengths: Lengths):
        self.gm, self.lengths = gm, lengths
        self.values: dict = {}
        self.windows: dict = {}

    def value(self, node: Node, length: int):
        key = (node, length)
        if key not in self.values:
            self.values[key] = self.evaluate([node], length)
        return self.values[key]

    def window(self, rule: MaskRule, length: int, layer: int) -> int | None:
        """The sliding window of a rule read at `length` (one read of a long mask serves every layer that shares it)."""
        key = (rule.node, rule.mode, length)
        if key not in self.windows:
            self.windows[key] = band(rule.allowed(self, length, layer), layer)
        return self.windows[key]

    def evaluate(self, targets: list, length: int, given: dict | None = None):
        """Values of `targets` for a batch-1 input of `length` tokens, computing only their ancestors;
        None when one of those depends on the token values (only shape-derived tensors qualify).
        Shape queries are answered from their symbolic size, so a mask sliced to K's length does not
        pull K (and the whole model before it) into the evaluation."""
        given = given or {}
        ids, subs = self.lengths.ids, self.lengths.at(length)
        sizes = {}
        needed, todo = set(), list(targets)
        while todo:
            n = todo.pop()
            if n in needed or n in given:
                continue
            if n.op == "call_function" and n.target in SHAPE_QUERIES and symbolic(n) is not None:
                size = symbolic(n).subs(subs)
                if size.free_symbols:  # a size that is not a function of batch and length
                    return None
                sizes[n] = int(size)
                continue
            if n is ids:  # reached through something other than a shape query: depends on the tokens
                return None
            needed.add(n)
            todo.extend(n.all_input_nodes)
        wanted = set(targets)
        got = interpret(self.gm, given={**given, **sizes}, only=needed, keep=lambda n: n in wanted)
        return [got[t] for t in targets]


def eager_rule(reader: MaskReader, scores: Node, logits: Node, path: set, length: int, layer: int, device):
    """The eager mask: push zero scores through the score path (scale, softcap, mask) at `length`;
    what is left is the mask itself (0 where allowed, very negative elsewhere) or a bias. Returns
    the rule that reads the same pattern from the one mask tensor on the path (None if there is no
    such tensor) and the pattern at `length`."""
    zeros = torch.zeros(reader.lengths.shape_at(scores, length), dtype=scores.meta["val"].dtype, device=device)
    got = reader.evaluate([logits], length, given={scores: zeros})
    if got is None:
        raise DecodeError(f"The mask of attention {layer} depends on the tokens or hidden states.", FIX_FULL)
    x = got[0]
    if x.shape[-1] != length:
        raise DecodeError(f"Attention {layer}'s softmax runs over {x.shape[-1]} columns for {length} keys (attention sinks?).", FIX_FULL)
    keep = no_bias(x.reshape(-1, length, length), layer)
    allowed = square(keep, length, f"The mask of attention {layer}")
    # the same pattern from the one mask tensor on the path, so it can be read at long lengths
    operands = [a for n in path for a in n.all_input_nodes if a not in path and a is not scores
                and isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].dim() >= 2]
    if len(set(operands)) != 1:
        return None, allowed
    node = operands[0]
    for mode in (("keep", "drop") if node.meta["val"].dtype == torch.bool else ("additive",)):
        candidate = MaskRule(node, mode)
        try:
            got = candidate.allowed(reader, length, layer)
        except DecodeError:
            continue
        if got is not None and torch.equal(got, allowed):
            return candidate, allowed
    return None, allowed
