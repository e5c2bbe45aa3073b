"""Sibling projections of a static decode step, and of the fast route's prefill, as one matmul each.

At one token per row a step is a chain of tiny kernels, and their count sets its time, not the bytes
they read: bench/decode_profile.py counted 573 kernels in one step of SmolLM2's 75% GDN hybrid at
64k, 278 of them matmuls of 3-5 microseconds each (fused: 417 and 122, and 1.91 -> 1.38 ms a step on
the H200, bench/RESULTS.md). Linears that read the same input (q/k/v, gate/up, a GDN layer's six
input projections) become one matmul over a concatenated copy of their weights. The copy costs the memory of the weights it fuses. The Decoder checks it
against its sources (storage and version counter) at every reset and refreshes it in place when one
changed, so a captured CUDA graph keeps reading the same memory; checking before every step instead
cost about 0.2 ms a step for SmolLM2's hybrid (60 fused weights), a tenth of the step.

The fast route's prefill (surgery.decode.fast) fuses them too (`fused_siblings`): at 2k x 1 its
replayed kernels are a few microseconds each, gate/up two launches of 8 us in every layer (thirty-seventh
session's profile). There the copies are refreshed before every call, and made only while they take at most
MEMORY_SHARE of the device's free memory (an 8B teacher's gate/up alone would copy 7.5 GB); SWITCH=off turns it off."""
from __future__ import annotations

import operator
from collections import defaultdict

import torch
from torch.fx import GraphModule

from tcal.gdn import concatenated, row_aligned
from tcal.switches import enabled

from ..core.rewrite import fork, prune
from ..io.memory import available_bytes

LINEAR = torch.ops.aten.linear.default
SWITCH = "SURGERY_PREFILL_SIBLINGS"  # "off": the fast route's prefill keeps each projection its own matmul
MEMORY_SHARE = 0.05  # the most of the device's free memory the fast route's fused copies may take


class FusedWeight:
    """The concatenation of several linears' weights (and biases: zeros where one has none). With
    `align_rows`, for a consumer that slices the parts out of the output itself (a GDN layer's input
    projections), zero rows up to tcal.gdn.CUDA_ROW_ALIGN on CUDA: SmolLM2's 2,322 rows took cuBLAS's
    gemv (4.7 us at batch 1) and an sm80 cutlass fallback (8.4 us at batch 16) where aligned GEMMs of
    the same step took 3.9 (bench/RESULTS.md, twenty-first session)."""

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor | None], align_rows: bool = False):
        self.weights, self.biases = list(weights), list(biases)
        self.sizes = [w.shape[0] for w in self.weights]
        with torch.no_grad():
            self.weight, self.bias = concatenated(self.weights, self.biases)
            if align_rows:
                self.weight, self.bias = row_aligned(self.weight, self.bias)
        self.key = self._key()

    def _key(self) -> tuple:
        return tuple((t.data_ptr(), t._version) for t in self.weights + self.biases if t is not None)

    def refresh(self) -> bool:
        """Copy the sources again if any changed since the last copy; False (nothing copied) when one was
        cast or moved, which a copy of fixed dtype and device cannot follow."""
        key = self._key()
        if key == self.key:
            return True
        if any(w.dtype != self.weight.dtype or w.device != self.weight.device for w in self.weights):
            return False
        with torch.no_grad():
            weight, bias = concatenated(self.weights, self.biases)
            self.weight[:weight.shape[0]].copy_(weight)  # aligned: the zero rows after stay zero
            if self.bias is not None:
                self.bias[:bias.shape[0]].copy_(bias)
        self.key = key
        return True

    def pair(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.weight, self.bias


def _attr(gm: GraphModule, target: str) -> torch.Tensor:
    return operator.attrgetter(target)(gm)


def _siblings(gm: GraphModule) -> list[list]:
    """Groups of aten.linear nodes with one input, weights (and biases) read from the module, one
    dtype, device and input width; each group in graph order."""
    groups: dict = defaultdict(list)
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is not LINEAR:
            continue
        x, w = n.args[0], n.args[1]
        b = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
        if getattr(w, "op", None) != "get_attr" or (b is not None and getattr(b, "op", None) != "get_attr"):
            continue
        weight = _attr(gm, w.target)
        groups[(x, weight.dtype, weight.device, weight.shape[-1])].append(n)
    return [nodes for nodes in groups.values() if len(nodes) > 1]


def fuse_sibling_linears(gm: GraphModule, shared: dict | None = None) -> list[FusedWeight]:
    """Rewrite gm in place: every group of sibling linears becomes one linear over a FusedWeight
    (registered on gm as non-persistent buffers) split back into the parts. Returns the FusedWeights,
    whose refresh() the caller runs when a source may have changed. `shared` (sources -> FusedWeight)
    lets graphs over the same weights (a runner's length buckets) read one copy."""
    fused = []
    for index, nodes in enumerate(_siblings(gm)):
        weights = [_attr(gm, n.args[1].target) for n in nodes]
        bias_nodes = [n.args[2] if len(n.args) > 2 else n.kwargs.get("bias") for n in nodes]
        biases = [None if b is None else _attr(gm, b.target) for b in bias_nodes]
        sources = tuple(id(t) for t in weights + biases if t is not None)
        weight = shared.get(sources) if shared is not None else None
        if weight is None:
            weight = FusedWeight(weights, biases)
            if shared is not None:
                shared[sources] = weight
        name = f"_fused_linear{index}"
        gm.register_buffer(f"{name}_weight", weight.weight, persistent=False)
        if weight.bias is not None:
            gm.register_buffer(f"{name}_bias", weight.bias, persistent=False)
        graph = gm.graph
        with graph.inserting_before(nodes[0]):
            w_node = graph.get_attr(f"{name}_weight")
            b_node = graph.get_attr(f"{name}_bias") if weight.bias is not None else None
            out = graph.call_function(LINEAR, (nodes[0].args[0], w_node, b_node))
            parts = graph.call_function(torch.ops.aten.split_with_sizes.default, (out, weight.sizes, -1))
            pieces = [graph.call_function(operator.getitem, (parts, i)) for i in range(len(nodes))]
        for n, piece in zip(nodes, pieces):
            n.replace_all_uses_with(piece)
            graph.erase_node(n)
        fused.append(weight)
    prune(gm)  # the parts' own weights are no longer read
    gm.graph.lint()
    gm.recompile()
    return fused


def fused_siblings(gm: GraphModule, device, shared: dict | None = None) -> tuple[GraphModule, list[FusedWeight]]:
    """A fork of gm with its sibling linears fused (fuse_sibling_linears, over `shared` copies), or gm
    itself when it has none, when SWITCH is off, or when the copies would take more than MEMORY_SHARE of
    the device's free memory (surgery.io.memory.available_bytes)."""
    groups = _siblings(gm)
    if not groups or not enabled(SWITCH, True):
        return gm, []
    copied = 0
    for nodes in groups:
        for n in nodes:
            copied += _attr(gm, n.args[1].target).nbytes
    free = available_bytes(device)
    if free is None or copied > MEMORY_SHARE * free:
        return gm, []
    forked = fork(gm)
    return forked, fuse_sibling_linears(forked, shared)

