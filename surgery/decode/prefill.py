"""A Decoder's first prefill through the fast runner (surgery.decode.fast) instead of the decode graph.

The decode graph keeps its caches in modules that allocate and write buffers as they run, which a
compiled CUDA-graph replay cannot own. The prefill graph is the captured graph itself (so the causal
flags and compiling apply as to any forward) with what the caches need added as outputs: each kept
attention layer's K and V as they reach the attention call (the plan's cache sources), and each GDN
layer's final recurrent and conv state (the layer run with a fresh cache, as the decode graph's
first prefill runs it). After the call they are copied into the Decoder's caches (KVCacheAttention.
fill, GDNState.load), so the steps that follow continue exactly what the eager prefill would have
left; the Decoder's self-check runs its probes through this path (eagerly) when it is on."""
from __future__ import annotations

import operator

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.fx import GraphModule

from ..core.rewrite import fork, nodes_by_name, set_submodule
from .fast import FastGraph

CONV_STREAMS = ("q", "k", "v")  # the GatedDeltaNet's short-convolution streams, in output order
aten = torch.ops.aten
# Ops between the output head and the logits that act on each position alone (a softcap, a cast).
POSITIONWISE = {aten.mul.Tensor, aten.div.Tensor, aten.tanh.default, aten.to.dtype, aten._to_copy.default}
LAST = (slice(None), slice(-1, None))  # [B, T, ...] -> [B, 1, ...]


class GDNTap(nn.Module):
    """A GatedDeltaNet of the graph returning (output, final recurrent state, conv states...)."""

    def __init__(self, gdn: nn.Module):
        super().__init__()
        self.gdn = gdn

    def streams(self) -> tuple[str, ...]:
        return CONV_STREAMS if getattr(self.gdn, "use_short_conv", False) else ()

    def forward(self, hidden_states):
        cache = self.gdn.new_cache()
        out = self.gdn(hidden_states, cache=cache)
        return (out, cache.recurrent, *(cache.conv[name] for name in self.streams()))


class PrefillTaps:
    """The rewrite that turns a (flag-rewritten) fork of the plan's graph into the prefill graph:
    output (logits, K and V of each kept layer by layer order, each GDN's state tensors)."""

    def __init__(self, kv_sources: dict[int, tuple[str, str]], gdn_targets: dict[str, int], last_only: bool = False):
        self.kv_sources, self.gdn_targets, self.last_only = kv_sources, gdn_targets, last_only

    def __call__(self, gm: GraphModule) -> GraphModule:
        gm = fork(gm)
        nodes = nodes_by_name(gm)
        outputs = [nodes[name] for layer in sorted(self.kv_sources) for name in self.kv_sources[layer]]
        states = {}
        for n in [n for n in gm.graph.nodes if n.op == "call_module" and n.target in self.gdn_targets]:
            layer = self.gdn_targets[n.target]
            tap = GDNTap(gm.get_submodule(n.target))
            set_submodule(gm, f"_prefill_gdn.layer{layer}", tap)
            n.target = f"_prefill_gdn.layer{layer}"
            with gm.graph.inserting_after(n):
                parts = [gm.graph.call_function(operator.getitem, (n, i)) for i in range(2 + len(tap.streams()))]
            n.replace_all_uses_with(parts[0], delete_user_cb=lambda user: user not in parts)
            states[layer] = parts[1:]
        outputs += [part for layer in sorted(states) for part in states[layer]]
        output = next(n for n in gm.graph.nodes if n.op == "output")
        logits = pytree.tree_leaves(output.args[0])[0]
        if self.last_only:
            logits = last_position(gm, logits)
        output.args = ((logits, *outputs),)
        info = getattr(gm.graph._codegen, "pytree_info", None)  # export's codegen rebuilds the model's output type
        if info is not None and info.out_spec is not None:
            gm.graph._codegen.pytree_info = info._replace(out_spec=pytree.tree_structure(tuple(range(1 + len(outputs)))))
        gm.graph.lint()
        gm.recompile()
        return gm


def last_position(gm: GraphModule, logits):
    """The logits of the last position only, computed from it alone where the graph allows: the output
    head's input sliced when only position-wise ops follow the head (the head over a 32k prompt is a
    1.9 TFLOP matmul for SmolLM2, and its logits 3.2 GB in bf16); else the logits sliced."""
    head = logits
    while head.op == "call_function" and head.target in POSITIONWISE and len(head.all_input_nodes) == 1:
        head = head.all_input_nodes[0]
    x = head.args[0] if head.op == "call_function" and head.target == aten.linear.default else None
    value = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    if value is not None and value.dim() == 3:
        with gm.graph.inserting_before(head):
            head.replace_input_with(x, gm.graph.call_function(operator.getitem, (x, LAST)))
        return logits
    with gm.graph.inserting_after(logits):
        return gm.graph.call_function(operator.getitem, (logits, LAST))


class Prefill:
    """The fast first prefill of a Decoder: `takes(ids)` says whether a call goes this way."""

    def __init__(self, decoder, plan, flag: bool | None):
        sources = {layer: (p.k_source.name, p.v_source.name) for layer, p in plan.attention.items()}
        self.decoder, self.gm = decoder, fork(plan.gm)
        copies: dict = {}  # both runs read one copy of each group of fused sibling projections
        self.runs = {last: FastGraph(self.gm, decoder.graph.device, "prefill", flag, limit=plan.max_length,
                                     label="prefill graph", rewrite=PrefillTaps(sources, dict(plan.gdn), last),
                                     shared_copies=copies)
                     for last in (False, True)}  # all logits, or the last position's (what generate reads)
        route = self.runs[False].route
        self.on = route.causal_flags or route.compile_after is not None
        self.eager_only = False  # the self-check's probes: the taps checked without compiling for their shapes

    def takes(self, ids: torch.Tensor) -> bool:
        return self.on and self.decoder.state.offset == 0

    def __call__(self, ids: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Logits [B, T, V] ([B, 1, V] with last_only) of a first prefill (checked ids); the caches and
        the offset are left as the eager prefill leaves them."""
        dec, fast = self.decoder, self.runs[last_only]
        with torch.no_grad():
            out = fast.eager(ids) if self.eager_only else fast(ids)
            tensors = list(out[1:])
            for layer in sorted(dec.attention):
                k, v = tensors.pop(0), tensors.pop(0)
                dec.attention[layer].fill(k, v)
            for layer in sorted(dec.gdn):
                module = dec.gdn[layer]
                streams = CONV_STREAMS if getattr(module.gdn, "use_short_conv", False) else ()
                state = [tensors.pop(0) for _ in range(1 + len(streams))]
                module.load(state[0], dict(zip(streams, state[1:])))
            logits = out[0]
            if fast.borrowed and not self.eager_only:
                logits = logits.clone()
        dec.state.offset += ids.shape[1]
        dec.history.add(ids)
        return logits
