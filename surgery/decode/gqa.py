"""SDPA on a grouped-query layer's own key/value heads (enable_gqa) instead of transformers' repeated copies.

transformers' sdpa attention repeats a GQA layer's key and value heads (repeat_kv: unsqueeze, expand,
reshape, a copy of each) unless its call has no mask, so a graph captured with a mask keeps both copies
after the causal-flag rewrite (surgery.decode.causal_flags) has replaced the mask by is_causal: at 2k x 1
the 75% hybrid's eight kept layers spent 0.080 ms of 3.14 in these 16 copies on the H200 (bench/RESULTS.md,
thirty-seventh session). Here each such SDPA call reads the heads as they are, with enable_gqa=True
(PyTorch 2.5 and later; every head group attends with its shared key/value head, what the copies gave).
On one H200 (torch 2.11, bf16, SmolLM2-shaped 75% hybrid, thirty-ninth session) the default route took 3.278 ms
at 2k x 1 against 3.514 without it (2k x 8: 16.35 against 16.80; 8k x 1: 11.51 against 11.35, within the run's
noise), logits bit-identical: the fast route applies it by default; SURGERY_SDPA_GQA=off keeps the copies."""
from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from tcal.switches import enabled

from ..core.rewrite import rewrite_matches
from ..core.slice_fill import shape_of

SWITCH = "SURGERY_SDPA_GQA"
SDPA = torch.ops.aten.scaled_dot_product_attention.default
RESHAPES = (torch.ops.aten.reshape.default, torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)
# aten.scaled_dot_product_attention's arguments after query, key and value, in order
OPTIONS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def switched_on() -> bool:
    """On unless SURGERY_SDPA_GQA=off."""
    return enabled(SWITCH, True)


def _options(node: Node) -> dict:
    """An SDPA call's arguments after query, key and value, by name."""
    return dict(zip(OPTIONS, node.args[3:])) | dict(node.kwargs)


def unrepeated(node) -> tuple[Node, int] | None:
    """(the key/value heads [B, H, T, D] before repeat_kv, the repeat count) when `node` is repeat_kv's output
    (x.unsqueeze(2).expand(B, H, n, T, D).reshape(B, H * n, T, D)) and read only by one call, else None."""
    if not (isinstance(node, Node) and node.op == "call_function" and node.target in RESHAPES and len(node.users) == 1):
        return None
    expand = node.args[0]
    if not (isinstance(expand, Node) and expand.target is torch.ops.aten.expand.default and len(expand.users) == 1):
        return None
    unsqueeze = expand.args[0]
    if not (isinstance(unsqueeze, Node) and unsqueeze.target is torch.ops.aten.unsqueeze.default and unsqueeze.args[1] == 2
            and len(unsqueeze.users) == 1):
        return None
    heads, expanded, out = shape_of(unsqueeze.args[0]), shape_of(expand), shape_of(node)
    if heads is None or expanded is None or out is None or len(heads) != 4 or len(expanded) != 5:
        return None
    b, h, t, d = heads
    repeat = expanded[2]
    if expanded != (b, h, repeat, t, d) or out != (b, h * repeat, t, d) or not isinstance(repeat, int) or repeat < 2:
        return None
    return unsqueeze.args[0], repeat


def gqa_call(node: Node) -> tuple[Node, Node] | None:
    """(key, value) heads to call SDPA with when `node` is an SDPA call without a mask whose key and value are
    repeat_kv's outputs of one repeat count, else None."""
    if node.op != "call_function" or node.target is not SDPA or len(node.args) < 3:
        return None
    options = _options(node)
    if options.get("attn_mask") is not None or options.get("enable_gqa"):
        return None
    key, value = unrepeated(node.args[1]), unrepeated(node.args[2])
    if key is None or value is None or key[1] != value[1]:
        return None
    query = shape_of(node.args[0])
    if query is None or query[1] != shape_of(key[0])[1] * key[1]:
        return None
    return key[0], value[0]


def _rewrite(graph, node: Node, found: tuple[Node, Node]) -> None:
    node.args, node.kwargs = (node.args[0], *found), _options(node) | {"enable_gqa": True}


def sdpa_on_grouped_heads(gm: GraphModule, in_place: bool = False) -> tuple[GraphModule, int]:
    """A fork of `gm` (gm itself with in_place) whose repeat_kv copies feeding unmasked SDPA calls are gone (each
    call with enable_gqa on the heads as they are), and how many calls; `gm` itself (and 0) when none matches."""
    return rewrite_matches(gm, gqa_call, _rewrite, in_place)
