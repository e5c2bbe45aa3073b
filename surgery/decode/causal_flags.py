"""SDPA calls whose mask is provably plain causal, rewritten to SDPA's own is_causal flag.

torch.export traces the mask transformers builds (arange, compares, packed-sequence checks) into the
graph, and each SDPA call gets that [L, L] tensor as attn_mask. With a mask, SDPA cannot take its
flash kernel: on the H200 the compiled teacher graph ran 336 ms at 32k tokens against 130 ms for
transformers' own forward, which passes is_causal=True itself. Where the mask is a function of the
length alone and equals the causal pattern, the flag computes the same attention without
materialising it.

"Provably" here: the mask is evaluated from the input's length alone (one that depends on the
tokens, such as a padding mask, is left alone) at a short length and at the longest length the
caller will run, and must be exactly causal at both. Masks built from positions are prefix-
consistent (the first l rows and columns at length L are the mask at length l), so a sliding window
or chunked attention narrower than the longest length shows there; the rewritten graph refuses
longer inputs. Used by the compiled paths only: the eager graph keeps the traced mask, so its
numbers stay those of the captured teacher."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from ..core.rewrite import ancestors, fork
from ..errors import CaptureError, DecodeError
from ..sites.ops import SDPA_OPS, mask_mode, sdpa_arguments
from .lengths import Lengths
from .masks import MASK_CHECK, MaskReader, MaskRule, band


def check_length(input_ids: torch.Tensor, longest: int) -> None:
    """The rewritten graph's guard: its masks were proven causal up to `longest` tokens only."""
    if input_ids.shape[-1] > longest:
        raise CaptureError(
            f"A sequence of {input_ids.shape[-1]} tokens is longer than the {longest} this graph's causal-flag rewrite was checked for.",
            "Build it again with CausalFlags(longest) covering the longest input.",
        )


def is_plain_causal(rule: MaskRule, reader: MaskReader, lengths: list[int]) -> bool:
    """Whether the mask reads as full causal attention (no window, no bias, no token dependence) at every length."""
    for length in lengths:
        try:
            allowed = rule.allowed(reader, length, -1)
            if allowed is None or band(allowed, -1) is not None:
                return False
        except (DecodeError, RuntimeError):  # not read as a causal pattern: left as it is
            return False
    return True


def square_attention(node: Node, lengths: Lengths, length: int) -> bool:
    """Queries and keys both as long as the input (is_causal aligns the mask to the top left)."""
    a = sdpa_arguments(node)
    try:
        q, k = (lengths.shape_at(a[name], length) for name in ("query", "key"))
    except (TypeError, KeyError):  # a size that is not a function of batch and length: left as it is
        return False
    return q[-2] == k[-2] == length


def causal_flags(gm: GraphModule, longest: int) -> tuple[GraphModule, int]:
    """A fork of `gm` in which every SDPA call with a provably causal mask (checked up to `longest`
    tokens) passes is_causal=True and no mask, and how many calls were rewritten. The mask's own
    nodes are dropped when nothing else reads them."""
    if longest < 1:
        raise CaptureError(f"The causal-flag rewrite needs a longest length of at least 1 token, got {longest}.",
                           "Pass the longest input length the graph will run.")
    forked = fork(gm)
    try:
        lengths = Lengths(forked)
    except (DecodeError, KeyError):  # no input, one fixed length, no shape metadata: nothing to prove the masks with
        return gm, 0
    reader = MaskReader(forked, lengths)
    checks = sorted({min(MASK_CHECK, longest), longest})
    rewritten, verdicts = 0, {}
    for node in [n for n in forked.graph.nodes if n.op == "call_function" and n.target in SDPA_OPS]:
        a = sdpa_arguments(node)
        mask = a.get("attn_mask")
        if not isinstance(mask, Node) or a.get("dropout_p") or not square_attention(node, lengths, MASK_CHECK):
            continue
        if mask not in verdicts:
            verdicts[mask] = is_plain_causal(MaskRule(mask, mask_mode(mask.meta["val"].dtype)), reader, checks)
        if verdicts[mask]:
            rest = {k: v for k, v in a.items() if k not in ("query", "key", "value")}
            node.args, node.kwargs = (a["query"], a["key"], a["value"]), rest | {"attn_mask": None, "is_causal": True}
            rewritten += 1
    if rewritten:
        drop_unread([m for m, causal in verdicts.items() if causal])
        with forked.graph.inserting_after(lengths.ids):
            forked.graph.call_function(check_length, (lengths.ids, longest))
        forked.recompile()
    return forked, rewritten


def drop_unread(masks: list[Node]) -> None:
    """Erase the masks and what only they read (other dead code of the graph is left as it was)."""
    region = set(masks).union(*(ancestors(m) for m in masks))
    for n in reversed(list(masks[0].graph.nodes)):
        if n in region and not n.users and n.op == "call_function" and not n.is_impure():
            n.graph.erase_node(n)


@dataclass(frozen=True)
class CausalFlags:
    """A graph rewrite for the compiled paths (surgery.decode.fast's buckets, maybe_compiled's `prepare`): hashable,
    so a compiled graph is kept per longest length."""

    longest: int

    def __call__(self, gm: GraphModule) -> GraphModule:
        return causal_flags(gm, self.longest)[0]
