"""What incremental decoding of a graph needs, read from its sites: for each kept attention layer
the attention node and its Q/K/V, the tensors the KV cache holds (repeat_kv undone) and which cached
head each query head reads, the mask rule (causal or a sliding window) and up to what length it is
known; for each GDN layer its module; for each layer split by heads (select.granularity=head) both:
its kept heads as a kept attention layer whose cache holds only them, its converted heads' GDN.
Every reason to refuse a graph is found here, before the graph is touched (surgery.decode.runtime
builds the decode graph from the plan).

Nothing here searches the graph for attention again: the site says which op, which nodes, which
scale and softcap, which mask. What the decoder cannot reproduce exactly (a position bias such as
ALiBi, attention sinks, a mask that is neither causal nor banded, masks that depend on the tokens)
raises DecodeError.

Limits: a sliding window is read from the graph's own mask evaluated at min(max_length, 8192)
tokens (`mask_probe`); a window longer than that is not seen, and the layer is treated as full
causal attention past that length (the Decoder warns when decoding gets there)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule, Node

from ..core.rewrite import ancestors, descendants, fork, nodes_by_name
from ..errors import DecodeError
from ..sites import vocab_size
from ..sites.probe import ValueRun
from .agreement import close
from .caches import CachePrep, DecodeState, KVCacheAttention
from .lengths import FIX_FULL, Lengths
from .masks import MASK_CHECK, MASK_PROBE, UNLIMITED, MaskReader, MaskRule, band, eager_rule
from .sources import cache_source


@dataclass
class AttentionPlan:
    """A kept attention layer as the decoder needs it (nodes of the plan's graph)."""

    layer: int
    attn: Node
    q: Node
    k: Node
    v: Node
    scale: float
    softcap: float | None
    rule: MaskRule | None
    exact_len: int            # the rule is trusted up to this length (mask probe, or the check)
    window: int | None = None
    k_source: Node | None = None   # what the KV cache holds, and how it becomes cache rows
    v_source: Node | None = None
    k_prep: CachePrep | None = None
    v_prep: CachePrep | None = None
    k_map: list | None = None      # the cached head each query head reads (None: grouped)
    v_map: list | None = None
    out_dtype: torch.dtype | None = None

    def module(self, state: DecodeState, limit: int) -> KVCacheAttention:
        """The KV-cache attention that takes this layer's place, sharing `state` with the decode graph."""
        return KVCacheAttention(
            state, self.layer, k_prep=self.k_prep, v_prep=self.v_prep, k_map=self.k_map, v_map=self.v_map, scale=self.scale,
            softcap=self.softcap, window=self.window, out_dtype=self.out_dtype, limit=limit,
        )


@dataclass
class DecodePlan:
    """The analysis of one graph for decoding. `gm` is a fork of graph.gm (parameters shared) whose
    nodes the plan names; the runtime rewrites it in place, so a plan builds one Decoder."""

    gm: GraphModule
    lengths: Lengths
    vocab: int
    max_length: int
    attention: dict[int, AttentionPlan] = field(default_factory=dict)
    gdn: dict[str, int] = field(default_factory=dict)   # module target of each GatedDeltaNet -> layer


def plan_decode(graph, *, mask_probe: int = MASK_PROBE) -> DecodePlan:
    """Read everything decoding `graph` needs from its sites, refusing what cannot be decoded exactly."""
    if not graph.sites:
        raise DecodeError("The graph has no attention sites.", "Capture it with site discovery on (surgery.capture(..., find=True)).")
    gm = fork(graph.gm)
    lengths = Lengths(gm)
    vocab = vocab_size(graph.config, gm)
    run = ValueRun(gm, vocab)  # every node's value on a 7-token probe: shapes, K/V layouts, the site checks
    masks = MaskReader(gm, lengths)  # the masks read while planning, shared by the layers
    nodes = nodes_by_name(gm)
    kinds = graph.layer_kinds
    kept = [site for site in graph.sites if kinds[site.layer] == "attention"]
    plans = [plan_attention(site, nodes, masks, graph.max_length, mask_probe, graph.device) for site in kept]
    windows = window_mixers(graph, gm)  # converted layers decoded as sliding-window attention (swa)
    plans += [plan_window_mixer(layer, call, gm, graph.max_length) for layer, call in windows.items()]
    kv_maps = [site.kv_map for site in kept] + [graph.sites[layer].kv_map for layer in windows]
    splits = split_layers(graph, gm)  # head-split layers: their kept heads' attention, their GDN
    plans += [plan_window_mixer(layer, kept_call, gm, graph.max_length) for layer, (kept_call, _, _) in splits.items()]
    kv_maps += [kv_map for _, _, kv_map in splits.values()]
    for p, kv_map in zip(plans, kv_maps):  # every layer's mask is checked before any cache
        plan_cache(p, run, kv_map, graph.max_length)
    gdn = {t: layer for layer, t in graph.gdn_targets().items() if layer not in windows and layer not in splits}  # the fork keeps the module paths
    gdn |= {target: layer for layer, (_, target, _) in splits.items()}
    return DecodePlan(gm, lengths, vocab, graph.max_length, {p.layer: p for p in plans}, gdn)


def split_layers(graph, gm: GraphModule) -> dict[int, tuple[Node, str, list]]:
    """layer -> (the call of its kept heads' attention, its GDN's target, the kept KV slot each kept
    query head reads) for each layer split by heads (a module whose DECODE is "split", called in parts)."""
    calls = {n.target: n for n in gm.graph.nodes if n.op == "call_module"}
    out = {}
    for layer, t in graph.gdn_targets().items():
        module = graph.gm.get_submodule(t)  # the fork holds only the parts its graph calls
        if getattr(module, "DECODE", None) == "split":
            if f"{t}.kept" not in calls or f"{t}.gdn" not in calls:
                raise DecodeError(f"Layer {layer}'s head split at '{t}' is not called in parts in the graph.", "Apply the passes again (select, replace).")
            out[layer] = (calls[f"{t}.kept"], f"{t}.gdn", module.kept_kv_map)
    return out


def window_mixers(graph, gm: GraphModule) -> dict[int, Node]:
    """layer -> the call of each converted layer's module that decodes as windowed attention (its
    DECODE is "window": it stands in for the attention op on the op's Q, K, V)."""
    calls = {n.target: n for n in gm.graph.nodes if n.op == "call_module"}
    return {layer: calls[t] for layer, t in graph.gdn_targets().items()
            if t in calls and getattr(gm.get_submodule(t), "DECODE", None) == "window"}


def plan_window_mixer(layer: int, call: Node, gm: GraphModule, max_length: int) -> AttentionPlan:
    """A windowed-attention module's call as a kept attention layer: causal, its own window, scale
    and softcap, K and V as it receives them (plan_cache then checks the cache reproduces it). The
    decode graph then drops the call; pruning drops the module from the fork only, never its window
    buffer from the module the graph and the prefill graph still run (core.rewrite.drop_unused_attributes)."""
    module = gm.get_submodule(call.target)
    window = int(module.window)
    q, k, v = call.args
    return AttentionPlan(layer, call, q, k, v, float(module.scale), module.softcap, MaskRule(None, "causal"), UNLIMITED,
                         window if window < max_length else None)


def plan_attention(site, nodes: dict, masks: MaskReader, max_length: int, mask_probe: int, device) -> AttentionPlan:
    """A site's attention op, scale, softcap and mask rule, the rule checked at MASK_CHECK tokens."""
    layer = site.layer
    if site.op_scale is None:
        raise DecodeError(f"Attention {layer}'s site does not record what decoding needs (an older site).",
                          "Find the sites again: graph.sites = surgery.find_sites(graph).")
    check = min(max_length, MASK_CHECK)
    attn = nodes[site.attn_node]
    if site.kind == "sdpa":
        rule, allowed = sdpa_rule(site, nodes, masks, check)
    else:
        rule, allowed = eager_mask(site, nodes, attn, masks, check, device)
    window, exact = read_window(rule, allowed, masks, layer, check, max_length, mask_probe)
    return AttentionPlan(layer, attn, nodes[site.q_node], nodes[site.k_node], nodes[site.v_node], float(site.op_scale),
                         site.softcap, rule, exact, window)


def sdpa_rule(site, nodes: dict, masks: MaskReader, check: int):
    """SDPA's attn_mask (read as its dtype says) or its is_causal flag, and the pattern at `check`."""
    layer = site.layer
    if site.mask_node is not None:
        rule = MaskRule(nodes[site.mask_node], site.mask_mode)
    elif site.is_causal:
        rule = MaskRule(None, "causal")
    else:
        raise DecodeError(f"Attention {layer} has neither a mask nor is_causal: it is not causal.", "Only causal attention can be decoded incrementally.")
    allowed = rule.allowed(masks, check, layer)
    if allowed is None:
        raise DecodeError(f"The mask of attention {layer} depends on the tokens or hidden states.", FIX_FULL)
    return rule, allowed


def eager_mask(site, nodes: dict, attn: Node, masks: MaskReader, check: int, device):
    """The eager form's mask from its score path, after refusing scores that carry anything else."""
    layer = site.layer
    if site.scores_bias:
        raise DecodeError(f"Attention {layer} adds a bias to its scores inside baddbmm (an ALiBi-style position bias).", FIX_FULL)
    scores = nodes[site.scores_node]
    region = ((descendants(scores) & ancestors(attn)) | {scores}) - {attn}
    leaks = [u for n in region for u in n.users if u not in region and u is not attn and not u.is_impure()]
    if leaks:
        raise DecodeError(
            f"Attention {layer}'s scores also feed '{leaks[0].name}', outside softmax(QK^T)V (attention sinks or a score-dependent gate?).",
            FIX_FULL,
        )
    softmax = nodes[site.probs_node]
    path = {nodes[name] for name in site.logits_path}
    return eager_rule(masks, scores, softmax.args[0], path, check, layer, device)


def read_window(rule, allowed: torch.Tensor, masks: MaskReader, layer: int, check: int, max_length: int, mask_probe: int):
    """(window, exact length): a window seen at `check`, else the mask read at the longest probe."""
    window = band(allowed, layer)
    exact = check  # the mask is known to be what we think up to this length
    if window is not None or (rule is not None and rule.mode == "causal"):
        exact = UNLIMITED  # a window seen, or SDPA's is_causal flag: the same at every length
    elif rule is not None and max_length > check:
        long = min(max_length, mask_probe)
        window = masks.window(rule, long, layer)
        exact = UNLIMITED if window is not None else long
    if exact >= max_length:
        exact = UNLIMITED
    return window, exact


def plan_cache(p: AttentionPlan, run: ValueRun, kv_map: list, limit: int) -> None:
    """Fill in what the layer's KV cache holds, checked on the probe run: a KVCacheAttention's
    prefill of the probe tokens must give the graph's own attention output."""
    heads = run.shape(p.q)[1]
    length = run.shape(p.q)[2]
    out = run.env[p.attn]
    if tuple(out.shape) != (run.shape(p.q)[0], heads, length, out.shape[-1]):
        raise DecodeError(f"Attention {p.layer}'s output has shape {tuple(out.shape)}, not [B, heads, T, D].", FIX_FULL)
    k_found = cache_source(p.k, heads, run.env, length, run.shape(p.q)[-1], kv_map)
    v_found = cache_source(p.v, heads, run.env, length, out.shape[-1], kv_map)
    if k_found is None or v_found is None:
        raise DecodeError(f"Attention {p.layer}: K or V is not laid out as [B, heads, T, D].", FIX_FULL)
    (p.k_source, p.k_prep, p.k_map), (p.v_source, p.v_prep, p.v_map) = k_found, v_found
    p.out_dtype = out.dtype
    module = p.module(DecodeState(), limit)
    with torch.no_grad():
        mine = module(run.env[p.q], run.env[p.k_source], run.env[p.v_source])
    ok, diff = close(mine, out)
    if not ok:
        raise DecodeError(
            f"Attention {p.layer} cannot be reproduced from Q, K, V with scale {p.scale:.4g}, softcap {p.softcap} and a "
            f"{'causal' if p.window is None else f'window-{p.window}'} mask (max difference {diff:.3g}): the scores carry something else.",
            FIX_FULL,
        )
