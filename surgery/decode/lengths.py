"""The input of a decode graph and its symbolic batch and length, from which positions and masks are
computed; and FIX_FULL, what every refusal of the decoder offers instead."""
from __future__ import annotations

import torch
from torch.fx import Node

from ..errors import DecodeError

FIX_FULL = "Score this model with full recomputation (graph.logits on the growing sequence) instead of the Decoder."


def input_ids_node(gm) -> Node:
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            return n  # capture's first input is input_ids
    raise DecodeError("The graph has no input.", "Decode a graph made by surgery.capture.")


def symbolic(n: Node):
    """The sympy expression of a node whose value is a SymInt (a shape query), else None."""
    v = n.meta.get("val") if isinstance(n, Node) else None
    return v.node.expr if isinstance(v, torch.SymInt) else None


class Lengths:
    """The input's symbolic batch and length, to read any node's shape at another length."""

    def __init__(self, gm):
        self.ids = input_ids_node(gm)
        shape = self.ids.meta["val"].shape
        if not isinstance(shape[1], torch.SymInt):
            raise DecodeError("The graph was captured for one fixed length.", "Capture it with a dynamic length (surgery.capture does).")
        self.seq = shape[1].node.expr
        self.batch = shape[0].node.expr if isinstance(shape[0], torch.SymInt) else None

    def at(self, length: int) -> dict:
        """The substitution of a batch-1 input of `length` tokens."""
        return {self.seq: length} | ({self.batch: 1} if self.batch is not None else {})

    def shape_at(self, node: Node, length: int) -> tuple:
        subs = self.at(length)
        return tuple(int(d.node.expr.subs(subs)) if isinstance(d, torch.SymInt) else int(d) for d in node.meta["val"].shape)
