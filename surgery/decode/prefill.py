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

    def __init__(self, kv_sources: dict[int, tuple[str, str]], gdn_targets: dict[str, int]):
        self.kv_sources, self.gdn_targets = kv_sources, gdn_targets

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
        output.args = ((logits, *outputs),)
        info = gm.graph._codegen.pytree_info
        gm.graph._codegen.pytree_info = info._replace(out_spec=pytree.tree_structure(tuple(range(1 + len(outputs)))))
        gm.graph.lint()
        gm.recompile()
        return gm


class Prefill:
    """The fast first prefill of a Decoder: `takes(ids)` says whether a call goes this way."""

    def __init__(self, decoder, plan, flag: bool | None):
        sources = {layer: (p.k_source.name, p.v_source.name) for layer, p in plan.attention.items()}
        self.taps = PrefillTaps(sources, dict(plan.gdn))
        self.decoder = decoder
        self.fast = FastGraph(fork(plan.gm), decoder.graph.device, "prefill", flag, limit=plan.max_length,
                              label="prefill graph", rewrite=self.taps)
        self.on = self.fast.route.causal_flags or self.fast.route.compile_after is not None
        self.eager_only = False  # the self-check's probes: the taps checked without compiling for their shapes

    def takes(self, ids: torch.Tensor) -> bool:
        return self.on and self.decoder.state.offset == 0

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, V] of a first prefill (checked ids); the caches and the offset are left as the
        eager prefill leaves them."""
        dec = self.decoder
        with torch.no_grad():
            out = self.fast.eager(ids) if self.eager_only else self.fast(ids)
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
            if self.fast.borrowed and not self.eager_only:
                logits = logits.clone()
        dec.state.offset += ids.shape[1]
        dec.history.add(ids)
        return logits
