"""Incremental (stateful) decoding over a captured or rewritten graph, and `generate`.

A captured GraphModule recomputes the whole sequence on every call. `Decoder(graph)` builds a second
GraphModule over the same parameter tensors (rewrite.fork) in which

  * every kept softmax-attention core (the SDPA op, or the eager softmax(QK^T)V region) becomes a
    KVCacheAttention: it appends the new K/V to a preallocated cache that is only as wide as the
    model's KV heads (the repeat_kv expansion is found in the graph and undone) and attends over
    [cache; new] with the site's own scale, softcap and causal or sliding-window mask;
  * every GatedDeltaNet placed by the replace pass carries its recurrent and conv state (GDNCache);
  * whatever the graph computes from the input's length alone (the arange behind RoPE or a learned
    position table, OPT's cumsum of ones, the masks) is evaluated at cache+new length and sliced
    to the new tokens, so a call with T tokens after N cached ones sees positions N..N+T-1. For an
    arange this is exactly "shift by the offset"; the general form also covers positions that are
    not an arange.

Everything is read from the graph and its sites, never from model_type or module paths. What the
decoder cannot reproduce exactly (a position bias such as ALiBi, attention sinks, a mask that is
neither causal nor banded, masks that depend on the tokens) raises DecodeError when the Decoder is
built, and a self-check against full recomputation on a short probe guards everything else: a wrong
answer is refused, never returned.

The modules that run in the decode graph and hold the state are in surgery.decode.caches; this module
reads the graph and places them.

Limits: a sliding window is read from the graph's own mask evaluated at min(max_length, 8192)
tokens (`mask_probe`); a window longer than that is not seen, and the layer is treated as full
causal attention past that length (a warning says so when decoding gets there).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch.fx import Node
from torch.fx.node import map_arg

from ..core.rewrite import SHAPE_QUERIES, ancestors, descendants, fork, nodes_by_name, prune, set_submodule, splice_module
from ..core.rewrite import token_dependent as _value_nodes
from ..core.run import graph_logits
from ..errors import DecodeError
from ..sites.attention_op import eager_op, softcap_and_scale
from ..sites.ops import MATMUL_OPS
from ..sites.probe import ValueRun
from ..sites import vocab_size
from .caches import DecodeState, GDNDecode, KVCacheAttention, Prep
from .static_step import StaticStep

aten = torch.ops.aten

# Ops that move K/V between the projection and the attention op without changing values: walking
# back through them from the attention's K finds the tensor before repeat_kv.
LAYOUT_OPS = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default,
    aten.unsqueeze.default, aten.transpose.int, aten.permute.default, aten.clone.default,
    aten.contiguous.default, aten.alias.default, aten.repeat_interleave.self_int, aten.repeat.default,
    aten.flatten.using_ints, aten.unflatten.int, aten.squeeze.dim,
}
MASK_CHECK = 64        # length at which the meaning of each mask is checked (cheap)
MASK_PROBE = 8192      # longest length at which a mask is read to find a sliding window
UNLIMITED = 1 << 62
MASKED = -1e4
SELF_CHECK = 12        # tokens of the construction-time comparison with full recomputation
STEP_MODES = ("auto", "dynamic", "static", "cuda-graph")
FIX_FULL = "Score this model with full recomputation (graph.logits on the growing sequence) instead of the Decoder."


# ------------------------------------------------------------------------------------------------
# reading the graph


def _ids_node(gm) -> Node:
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            return n  # capture's first input is input_ids
    raise DecodeError("The graph has no input.", "Decode a graph made by surgery.capture.")


def _sym(n: Node):
    v = n.meta.get("val") if isinstance(n, Node) else None
    return v.node.expr if isinstance(v, torch.SymInt) else None


class _Lengths:
    """The input's symbolic batch and length, to read any node's shape at another length."""

    def __init__(self, gm):
        self.ids = _ids_node(gm)
        shape = self.ids.meta["val"].shape
        if not isinstance(shape[1], torch.SymInt):
            raise DecodeError("The graph was captured for one fixed length.", "Capture it with a dynamic length (surgery.capture does).")
        self.seq = shape[1].node.expr
        self.batch = shape[0].node.expr if isinstance(shape[0], torch.SymInt) else None

    def shape_at(self, node: Node, length: int) -> tuple:
        subs = {self.seq: length} | ({self.batch: 1} if self.batch is not None else {})
        return tuple(int(d.node.expr.subs(subs)) if isinstance(d, torch.SymInt) else int(d) for d in node.meta["val"].shape)


def _evaluate(gm, targets: list, length: int, replace: dict | None = None):
    """Values of `targets` for a batch-1 input of `length` tokens, computing only their ancestors;
    None when one of those depends on the token values (only shape-derived tensors qualify).
    Shape queries are answered from their symbolic size, so a mask sliced to K's length does not
    pull K (and the whole model before it) into the evaluation."""
    replace = replace or {}
    ids = _ids_node(gm)
    lengths = _Lengths(gm)
    sizes = {}
    needed, todo = set(), list(targets)
    while todo:
        n = todo.pop()
        if n in needed or n in replace:
            continue
        if n.op == "call_function" and n.target in SHAPE_QUERIES and _sym(n) is not None:
            size = _sym(n).subs({lengths.seq: length} | ({lengths.batch: 1} if lengths.batch is not None else {}))
            if size.free_symbols:  # a size that is not a function of batch and length
                return None
            sizes[n] = int(size)
            continue
        if n is ids:  # reached through something other than a shape query: depends on the tokens
            return None
        needed.add(n)
        todo.extend(n.all_input_nodes)
    replace = {**replace, **sizes}
    uses = {n: sum(1 for u in n.users if u in needed) for n in needed}
    extra = gm.meta.get("extra_inputs", {})
    env = dict(replace)
    for n in gm.graph.nodes:
        if n not in needed:
            continue
        if n.op == "placeholder":
            env[n] = extra.get(n.target)
        elif n.op == "get_attr":
            obj = gm
            for part in n.target.split("."):
                obj = getattr(obj, part)
            env[n] = obj
        else:
            args = map_arg(n.args, lambda a: env[a])
            kwargs = map_arg(n.kwargs, lambda a: env[a])
            if n.op == "call_function":
                env[n] = n.target(*args, **kwargs)
            elif n.op == "call_module":
                env[n] = gm.get_submodule(n.target)(*args, **kwargs)
            else:
                env[n] = getattr(args[0], n.target)(*args[1:], **kwargs)
        for a in n.all_input_nodes:  # free what no remaining node reads (long masks are large)
            if a in uses:
                uses[a] -= 1
                if uses[a] == 0 and a not in targets:
                    env.pop(a, None)
    return [env[t] for t in targets]


def _square(m: torch.Tensor, length: int, what: str) -> torch.Tensor:
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


def _band(allowed: torch.Tensor, layer: int) -> int | None:
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


def _threshold(dtype) -> float:
    """Additive mask entries at or below this are "masked": exp(-1e4) is 0 in every float dtype, so
    they weigh exactly what -inf does (GPT-1 masks with -1e4, most models with the dtype's min)."""
    return MASKED if dtype.is_floating_point else 0


@dataclass
class _MaskRule:
    """How to read a layer's allowed-keys pattern at any length: from a tensor of the graph
    (`node`) read as a boolean keep-mask ("keep"), its negation ("drop") or an additive 0/-inf mask
    ("additive"); node None with mode "causal" is SDPA's is_causal flag."""

    node: Node | None
    mode: str

    def allowed(self, gm, length: int, layer: int, memo: dict | None = None) -> torch.Tensor | None:
        if self.mode == "causal":
            i = torch.arange(length)
            return i[None, :] <= i[:, None]
        memo = {} if memo is None else memo
        key = (self.node, length)  # layers share one mask node: evaluate it once per length
        if key not in memo:
            memo[key] = _evaluate(gm, [self.node], length)
        got = memo[key]
        if got is None:
            return None
        m = _square(got[0], length, f"The mask of attention {layer}")
        if self.mode == "additive":
            keep = m > _threshold(m.dtype)
            if (m.masked_fill(~keep, 0) != 0).any():
                raise DecodeError(f"Attention {layer} adds a position bias to its scores (ALiBi or relative positions).", FIX_FULL)
            return keep
        return m.bool() if self.mode == "keep" else ~m.bool()


def _heads_view(val, length: int, dim: int):
    """A [B, n, L, dim] or [B, n, dim, L] tensor as ([B, n, L, dim], transposed?), else None."""
    if not isinstance(val, torch.Tensor) or val.dim() != 4:
        return None
    if tuple(val.shape[2:]) == (length, dim):
        return val, False
    if tuple(val.shape[2:]) == (dim, length):
        return val.transpose(-1, -2), True
    return None


def _cache_source(node: Node, heads: int, run: ValueRun, length: int, dim: int, kv_map: list):
    """The narrowest tensor behind an attention input (K or V) that still holds every head it reads:
    walking back through layout ops undoes repeat_kv, so the cache is KV-heads wide. Returns
    (node, Prep, head_map); the map says which cached head each query head reads."""
    start = _heads_view(run.env.get(node), length, dim)
    if start is None:
        return None
    t0 = start[0]
    per_head = [t0[:, h * t0.shape[1] // heads] for h in range(heads)]  # SDPA enable_gqa / broadcast semantics
    best, cur = None, node
    while isinstance(cur, Node):
        view = _heads_view(run.env.get(cur), length, dim)
        if view is not None:
            t, transposed = view
            found = [next((j for j in range(t.shape[1]) if torch.equal(per_head[h], t[:, j])), None) for h in range(heads)]
            if None not in found and (best is None or t.shape[1] < best[3]):
                best = (cur, transposed, found, t.shape[1])
        if cur.op == "call_function" and cur.target in LAYOUT_OPS and isinstance(cur.args[0], Node):
            cur = cur.args[0]
        else:
            break
    if best is None:
        return None
    src, transposed, head_map, width = best
    select = None
    used = sorted(set(head_map))
    # heads that are copies of one KV head (a repeat the walk could not undo): keep one of each,
    # when the site's own head->KV map (read from the projection rows) agrees that they are copies
    firsts = {}
    for h, j in enumerate(head_map):
        firsts.setdefault(kv_map[h], j)
    if len(firsts) < len(used) and all(torch.equal(per_head[h], per_head[kv_map.index(kv_map[h])]) for h in range(heads)):
        select = tuple(firsts[u] for u in sorted(firsts))
        head_map = [sorted(firsts).index(kv_map[h]) for h in range(heads)]
        width = len(select)
    elif len(used) < width:
        select = tuple(used)
        head_map = [used.index(j) for j in head_map]
        width = len(used)
    if list(head_map) == [h * width // heads for h in range(heads)]:
        head_map = None  # the grouped layout: SDPA's enable_gqa, no copies
    return src, Prep(transposed, select), head_map


def _tolerance(dtype) -> float:
    return 1e-3 if dtype in (torch.float32, torch.float64) else 3e-2


def _close(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, float]:
    diff = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
    scale = max(1.0, b.float().abs().max().item() if b.numel() else 1.0)
    return diff <= _tolerance(b.dtype) * scale, diff


# Per-position relative error (||incremental - full|| / ||full|| over the vocabulary, worst position)
# that bf16/fp16 rounding stays under on the 12-token probe. Measured on CPU in bf16: correct decoders
# 0.019-0.037 on SmolLM2-135M (uncalibrated hybrids amplify rounding most), 0 on stories260K;
# decoders with positions left unshifted 0.12-0.14 (stories260K) and 0.39-3.0 (SmolLM2).
# A coarse guard: over longer probes the rounding of an uncalibrated bf16 hybrid grows as large
# as a structural error, which is why the probe stays short. float32 gets the tight check.
LOW_PRECISION_REL_ERROR = 0.1


def _agrees(got: torch.Tensor, full: torch.Tensor) -> tuple[bool, str]:
    """The self-check's criterion: float32/64 as tight as _close; bf16/fp16 by the worst position's
    relative error, since 30 layers of rounding move single logits by O(1) while a structural
    mistake moves a position's whole distribution."""
    if full.dtype in (torch.float32, torch.float64):
        ok, diff = _close(got, full)
        return ok, f"max logit difference {diff:.3g}"
    g, f = got.float(), full.float()
    rel = ((g - f).norm(dim=-1) / f.norm(dim=-1).clamp_min(1e-6)).max().item()
    return rel <= LOW_PRECISION_REL_ERROR, f"relative logit error {rel:.3g} at the worst position, in {str(full.dtype).removeprefix('torch.')}"


@dataclass
class _Core:
    """A kept attention site as the decoder needs it."""

    layer: int
    attn: Node
    q: Node
    k: Node
    v: Node
    scale: float
    softcap: float | None
    rule: _MaskRule | None
    exact_len: int            # the rule is trusted up to this length (mask probe, or the check)
    window: int | None = None


class Decoder:
    """Incremental decoding of a Graph (teacher or hybrid): reset, prefill, then step token by token.

        dec = Decoder(graph); dec.reset(batch_size=1, capacity=prompt + new)
        logits = dec.prefill(ids)              # [B, T, V]
        logits = dec.step(next_ids)            # next_ids [B, 1] -> [B, 1, V]

    Parameters are shared with graph.gm (nothing is copied), so a Decoder is cheap next to the
    model; graph.gm itself stays stateless. verify=True compares prefill + steps with full
    recomputation on a short probe at construction and refuses the graph if they disagree.

    step_mode: how `step` runs once reset was given a capacity. "dynamic": the graph on exactly the
    tokens cached so far (shapes grow each step). "static": fixed shapes (KV buffers at capacity with
    a position mask, positions picked by a device index, GDN states updated in place; surgery.decode.static_step).
    "cuda-graph": static steps captured once per reset and replayed (CUDA only). "auto": cuda-graph on
    CUDA, dynamic elsewhere."""

    def __init__(self, graph, *, verify: bool = True, mask_probe: int = MASK_PROBE, step_mode: str = "auto"):
        if step_mode not in STEP_MODES:
            raise DecodeError(f"Unknown step_mode {step_mode!r}.", f"Use one of: {', '.join(STEP_MODES)}.")
        if step_mode == "cuda-graph" and graph.device.type != "cuda":
            raise DecodeError(f"step_mode 'cuda-graph' needs the graph on a CUDA device, not {graph.device}.", "Use step_mode 'static' or 'auto'.")
        if step_mode == "auto":
            step_mode = "cuda-graph" if graph.device.type == "cuda" else "dynamic"
        self.step_mode = step_mode
        self.capacity: int | None = None
        if not graph.sites:
            raise DecodeError("The graph has no attention sites.", "Capture it with site discovery on (surgery.capture(..., find=True)).")
        self.graph = graph
        self.max_length = graph.max_length
        self.state = DecodeState()
        gm = fork(graph.gm)
        self.lengths = _Lengths(gm)
        vocab = vocab_size(graph.config, gm)
        run = ValueRun(gm, vocab)  # every node's value on a 7-token probe: shapes, K/V layouts, the site checks
        self._memo: dict = {}
        kinds = graph.layer_kinds
        cores = [self._core(gm, site, run, mask_probe) for site in graph.sites if kinds[site.layer] == "attention"]
        self.attention: dict[int, KVCacheAttention] = {}
        for core in cores:  # check every site before the graph is touched
            self.attention[core.layer] = self._module(core, run, graph.sites[core.layer])
        for core in cores:
            module = self.attention[core.layer]
            inputs = [core.q, module._k_src, module._v_src]
            splice_module(gm, f"_decode_attn.layer{core.layer}", module, inputs, core.attn)
            del module._k_src, module._v_src
        self.gdn: dict[int, GDNDecode] = {}
        layer_of = {t: l for l, t in graph.gdn_targets().items()}  # the fork keeps the module paths
        for n in list(gm.graph.nodes):
            if n.op == "call_module" and n.target in layer_of:
                layer = layer_of[n.target]
                self.gdn[layer] = GDNDecode(gm.get_submodule(n.target), in_place=step_mode != "dynamic")
                set_submodule(gm, f"_decode_gdn.layer{layer}", self.gdn[layer])
                n.target = f"_decode_gdn.layer{layer}"
        prune(gm)
        set_submodule(gm, "_decode", self.state)
        _rewrite_positions(gm, self.lengths, "_decode")
        prune(gm)
        gm.graph.lint()
        gm.recompile()
        self.gm = gm
        self.cores = {c.layer: c for c in cores}
        del self._memo, run
        self._warned = False
        self._static = StaticStep(self, cuda_graph=step_mode == "cuda-graph")
        self.reset()
        if verify:
            self._self_check(vocab)

    # -------------------------------------------------------------------------------- analysis

    def _core(self, gm, site, run: ValueRun, mask_probe: int) -> _Core:
        nodes = nodes_by_name(gm)
        layer = site.layer
        check = min(self.max_length, MASK_CHECK)
        if site.kind == "sdpa":
            attn = nodes[site.attn_node]
            sig = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"]
            a = dict(zip(sig, attn.args)) | dict(attn.kwargs)
            q, k, v = a["query"], a["key"], a["value"]
            scale = a.get("scale")
            scale = float(scale) if scale is not None else run.shape(q)[-1] ** -0.5
            softcap = None
            mask = a.get("attn_mask")
            if isinstance(mask, Node):
                dtype = mask.meta["val"].dtype
                rule = _MaskRule(mask, "keep" if dtype == torch.bool else "additive")
            elif a.get("is_causal"):
                rule = _MaskRule(None, "causal")
            else:
                raise DecodeError(f"Attention {layer} has neither a mask nor is_causal: it is not causal.", "Only causal attention can be decoded incrementally.")
            allowed = rule.allowed(gm, check, layer, self._memo)
            if allowed is None:
                raise DecodeError(f"The mask of attention {layer} depends on the tokens or hidden states.", FIX_FULL)
        else:
            softmax = nodes[site.probs_node]
            found = eager_op(softmax, run)
            if found is None:
                raise DecodeError(f"Attention {layer}: the eager softmax(QK^T)V region could not be read again.", FIX_FULL)
            is_mm = lambda x: x.op == "call_function" and (x.target in MATMUL_OPS or x.target is aten.baddbmm.default)  # noqa: E731
            mms = [x for x in ancestors(softmax, stop=is_mm) if is_mm(x) and len(run.shape(x)) >= 3]
            if len(mms) != 1:
                raise DecodeError(f"Attention {layer}: no single Q.K^T product before the softmax.", FIX_FULL)
            logits_mm = mms[0]
            if logits_mm.target is aten.baddbmm.default:
                raise DecodeError(f"Attention {layer} adds a bias to its scores inside baddbmm (an ALiBi-style position bias).", FIX_FULL)
            attn, q, k, v = found.attn, found.q, found.k, found.v
            region = ((descendants(logits_mm) & ancestors(attn)) | {logits_mm}) - {attn}
            leaks = [u for n in region for u in n.users if u not in region and u is not attn and not u.is_impure()]
            if leaks:
                raise DecodeError(
                    f"Attention {layer}'s scores also feed '{leaks[0].name}', outside softmax(QK^T)V (attention sinks or a score-dependent gate?).",
                    FIX_FULL,
                )
            softcap, scale = softcap_and_scale(found)
            scale *= found.scale or 1.0
            rule, allowed = self._eager_rule(gm, softmax, logits_mm, found.logits_path, check, layer)
        window = _band(allowed, layer)
        exact = check  # the mask is known to be what we think up to this length
        if window is not None or (rule is not None and rule.mode == "causal"):
            exact = UNLIMITED  # a window seen, or SDPA's is_causal flag: the same at every length
        elif rule is not None and self.max_length > check:
            long = min(self.max_length, mask_probe)
            key = ("window", rule.node, rule.mode, long)
            if key not in self._memo:  # one read of a long mask serves every layer that shares it
                self._memo[key] = _band(rule.allowed(gm, long, layer, self._memo), layer)
            window = self._memo[key]
            exact = UNLIMITED if window is not None else long
        if exact >= self.max_length:
            exact = UNLIMITED
        return _Core(layer, attn, q, k, v, float(scale), softcap, rule, exact, window)

    def _eager_rule(self, gm, softmax, logits_mm, path, length, layer):
        """The eager mask: push zero scores through the score path (scale, softcap, mask) at `length`;
        what is left is the mask itself (0 where allowed, very negative elsewhere) or a bias."""
        shape = self.lengths.shape_at(logits_mm, length)
        dtype = logits_mm.meta["val"].dtype
        zeros = torch.zeros(shape, dtype=dtype, device=self.graph.device)
        got = _evaluate(gm, [softmax.args[0]], length, replace={logits_mm: zeros})
        if got is None:
            raise DecodeError(f"The mask of attention {layer} depends on the tokens or hidden states.", FIX_FULL)
        x = got[0]
        if x.shape[-1] != length:
            raise DecodeError(f"Attention {layer}'s softmax runs over {x.shape[-1]} columns for {length} keys (attention sinks?).", FIX_FULL)
        heads = x.reshape(-1, length, length)
        keep = heads > _threshold(x.dtype)
        if (heads.masked_fill(~keep, 0) != 0).any():
            raise DecodeError(f"Attention {layer} adds a position bias to its scores (ALiBi or relative positions).", FIX_FULL)
        allowed = _square(keep, length, f"The mask of attention {layer}")
        # the same pattern from the one mask tensor on the path, so it can be read at long lengths
        operands = [a for n in path for a in n.all_input_nodes if a not in path and a is not logits_mm
                    and isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].dim() >= 2]
        rule = None
        if len(set(operands)) == 1:
            node = operands[0]
            for mode in (("keep", "drop") if node.meta["val"].dtype == torch.bool else ("additive",)):
                candidate = _MaskRule(node, mode)
                try:
                    got = candidate.allowed(gm, length, layer, self._memo)
                except DecodeError:
                    continue
                if got is not None and torch.equal(got, allowed):
                    rule = candidate
                    break
        return rule, allowed

    def _module(self, core: _Core, run: ValueRun, site) -> KVCacheAttention:
        """The KVCacheAttention for a core, checked on the probe run against the graph's own output."""
        heads = run.shape(core.q)[1]
        length = run.shape(core.q)[2]
        out = run.env[core.attn]
        if tuple(out.shape) != (run.shape(core.q)[0], heads, length, out.shape[-1]):
            raise DecodeError(f"Attention {core.layer}'s output has shape {tuple(out.shape)}, not [B, heads, T, D].", FIX_FULL)
        k_found = _cache_source(core.k, heads, run, length, run.shape(core.q)[-1], site.kv_map)
        v_found = _cache_source(core.v, heads, run, length, out.shape[-1], site.kv_map)
        if k_found is None or v_found is None:
            raise DecodeError(f"Attention {core.layer}: K or V is not laid out as [B, heads, T, D].", FIX_FULL)
        (k_src, k_prep, k_map), (v_src, v_prep, v_map) = k_found, v_found
        module = KVCacheAttention(
            self.state, core.layer, k_prep=k_prep, v_prep=v_prep, k_map=k_map, v_map=v_map, scale=core.scale,
            softcap=core.softcap, window=core.window, out_dtype=out.dtype, limit=self.max_length,
        )
        module._k_src, module._v_src = k_src, v_src
        # the probe: the module's prefill of the probe tokens must give the graph's attention output
        self.state.offset = 0
        module.reset()
        with torch.no_grad():
            mine = module(run.env[core.q], run.env[k_src], run.env[v_src])
        module.reset()
        ok, diff = _close(mine, out)
        if not ok:
            raise DecodeError(
                f"Attention {core.layer} cannot be reproduced from Q, K, V with scale {core.scale:.4g}, softcap {core.softcap} and a "
                f"{'causal' if core.window is None else f'window-{core.window}'} mask (max difference {diff:.3g}): the scores carry something else.",
                FIX_FULL,
            )
        return module

    # -------------------------------------------------------------------------------- decoding

    @property
    def offset(self) -> int:
        """Tokens in the caches."""
        return self.state.offset

    def reset(self, batch_size: int | None = None, capacity: int | None = None) -> "Decoder":
        """Empty every cache. capacity (prompt + new tokens) preallocates the KV caches; without it
        they start at the prefill's length and double."""
        if capacity is not None and capacity > self.max_length:
            raise DecodeError(f"A capacity of {capacity} tokens exceeds this graph's position limit of {self.max_length}.", "Use a shorter prompt or fewer new tokens.")
        self._static.release()
        self.state.offset = 0
        self.batch_size, self.capacity = batch_size, capacity
        for m in self.attention.values():
            m.reset(batch_size, capacity)
        for m in self.gdn.values():
            m.reset()
        return self

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Feed T new tokens [B, T] (or one row [T]) after those already cached; logits [B, T, V]."""
        return self._run(self._checked(input_ids))

    __call__ = forward

    def _run(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The graph on checked ids (see _checked), advancing the offset."""
        with torch.no_grad():
            logits = graph_logits(self.gm, input_ids)
        self.state.offset += input_ids.shape[1]
        return logits

    def _checked(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids on the graph's device, after every check of what the caches can take."""
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.dim() != 2 or input_ids.shape[1] < 1:
            raise DecodeError(f"Token ids must be [batch, length >= 1], got shape {tuple(input_ids.shape)}.", "Pass a 2-D LongTensor.")
        if self.batch_size is not None and input_ids.shape[0] != self.batch_size:
            raise DecodeError(f"The decoder was reset for batch {self.batch_size} but got {input_ids.shape[0]} rows.", "Call reset(batch_size) first.")
        need = self.state.offset + input_ids.shape[1]
        if need > self.max_length:
            raise DecodeError(f"{need} tokens exceed this graph's position limit of {self.max_length}.", "Use a shorter prompt or fewer new tokens.")
        for c in self.cores.values():
            if need > c.exact_len and c.rule is None:
                raise DecodeError(f"The mask of attention {c.layer} could only be checked up to {c.exact_len} tokens; {need} were asked for.", FIX_FULL)
            if need > c.exact_len and not self._warned:
                warnings.warn(f"Attention {c.layer} looked like full causal attention up to {c.exact_len} tokens; a longer sliding window "
                              "would not have been seen.", stacklevel=2)
                self._warned = True
        return input_ids.to(self.graph.device)

    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The prompt [B, T] (the whole of it in one call; later calls continue it): logits [B, T, V]."""
        return self.forward(input_ids)

    def step(self, next_ids: torch.Tensor) -> torch.Tensor:
        """One new token per row ([B, 1] or [B]): logits [B, 1, V]."""
        if next_ids.dim() == 2 and next_ids.shape[1] != 1:
            raise DecodeError(f"step takes one token per row, got shape {tuple(next_ids.shape)}.", "Use prefill for several tokens.")
        ids = self._checked(next_ids.reshape(-1, 1))
        if self.step_mode != "dynamic" and self._static.ready(ids):
            return self._static(ids)
        return self._run(ids)

    def cache_bytes(self, per_layer: bool = False) -> dict:
        """Bytes held by the caches, by layer kind ({"attention", "gdn", "total"}) or by layer."""
        att = {i: m.nbytes() for i, m in self.attention.items()}
        gdn = {i: m.nbytes() for i, m in self.gdn.items()}
        if per_layer:
            return dict(sorted((att | gdn).items()))
        return {"attention": sum(att.values()), "gdn": sum(gdn.values()), "total": sum(att.values()) + sum(gdn.values())}

    def _self_check(self, vocab: int) -> None:
        """Prefill + steps against full recomputation on a short random probe."""
        n = min(self.max_length, SELF_CHECK)
        ids = torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(0)).to(self.graph.device)
        with torch.no_grad():
            full = self.graph.logits(ids)
        first = max(1, n - 4)
        self.reset(1, n)
        got = [self.prefill(ids[:, :first])] + [self.step(ids[:, t:t + 1]) for t in range(first, n)]
        self.reset()
        ok, diff = _agrees(torch.cat(got, dim=1), full)
        if not ok:
            raise DecodeError(
                f"Incremental decoding disagrees with full recomputation on a {n}-token probe ({diff}): "
                "the graph computes something from the sequence that the decoder does not carry over (positions in an unusual form?).",
                FIX_FULL,
            )


# ------------------------------------------------------------------------------------------------
# positions


def _rewrite_positions(gm, lengths: _Lengths, state_target: str) -> None:
    """Evaluate what the graph computes from the input's length alone at cache+new length and keep
    the new tokens' part: every such tensor with one sequence-long dimension that feeds the token
    computation is recomputed from length + offset and sliced (for positions = arange(T), that is
    arange(T) + offset). Tensors of the call's tokens only (MoE dispatch over B*T) are left alone."""
    seq = lengths.seq
    value = _value_nodes(gm, lengths.ids)

    def dims(n):
        val = n.meta.get("val")
        return list(val.shape) if isinstance(val, torch.Tensor) else None

    sources, mixed_sources = set(), set()
    for n in gm.graph.nodes:
        expr = _sym(n)
        if n.op == "call_function" and n.target in SHAPE_QUERIES and expr is not None and seq in expr.free_symbols:
            (sources if expr == seq else mixed_sources).add(n)
    tdep, mixed = set(sources | mixed_sources), set(mixed_sources)
    for n in gm.graph.nodes:
        if n in value or n in tdep:
            continue
        if any(a in tdep for a in n.all_input_nodes):
            tdep.add(n)
            if any(a in mixed for a in n.all_input_nodes):
                mixed.add(n)
    rewrite = []
    for n in gm.graph.nodes:
        if n not in tdep or n in value or not any(u in value for u in n.users) or dims(n) is None:
            continue
        shape = dims(n)
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
    if not rewrite:
        return
    copy = set()
    for f, _ in rewrite:
        copy |= (ancestors(f) | {f}) & tdep
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


# ------------------------------------------------------------------------------------------------
# generation


def _eos_ids(graph, eos) -> set:
    if eos == "auto":
        eos = getattr(graph.config, "eos_token_id", None)
        if eos is None and graph.tokenizer is not None:
            eos = getattr(graph.tokenizer, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple, set)) else [eos])}


def check_sampling(temperature: float | None, top_k: int | None, top_p: float | None) -> None:
    """Refuse sampling options that do not describe a distribution."""
    if (temperature is not None and temperature < 0) or (top_p is not None and not 0 < top_p <= 1) or (top_k is not None and top_k < 1):
        raise DecodeError(f"Sampling options out of range (temperature {temperature}, top_k {top_k}, top_p {top_p}).",
                          "Use temperature >= 0, top_k >= 1 and 0 < top_p <= 1.")


def sample(logits: torch.Tensor, *, temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token per row from logits [B, V]: argmax when temperature is 0/None, else sampling
    from softmax(logits / temperature) restricted to the top_k tokens and the top_p nucleus."""
    if not temperature:
        return logits.argmax(dim=-1)
    scores = logits.float() / temperature
    if top_k:
        kth = scores.topk(min(top_k, scores.shape[-1]), dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        ordered, index = scores.sort(dim=-1, descending=True)
        cum = ordered.softmax(-1).cumsum(-1)
        drop = cum - ordered.softmax(-1) > top_p  # keep the smallest prefix whose mass reaches top_p
        scores = scores.scatter(-1, index, ordered.masked_fill(drop, float("-inf")))
    probs = scores.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def generate(model, prompts, max_new_tokens: int, *, temperature: float | None = None, top_k: int | None = None,
             top_p: float | None = None, seed: int | None = None, eos_token_id="auto", stream=None) -> list[list[int]]:
    """Continue each prompt by up to max_new_tokens tokens; returns the new tokens per prompt (the
    end-of-sequence token included when one is produced, as transformers does).

    model     a Graph (a Decoder is built) or a Decoder
    prompts   list of token-id lists, one list, or a [B, T] tensor
    greedy unless temperature > 0; sampling is reproducible with `seed`
    eos_token_id  "auto" (the config's, else the tokenizer's), an id or ids, or None (never stop)
    stream    called as stream(prompt_index, token_id) for each new token as it is chosen

    Prompts of different lengths are grouped by length and each group is decoded as one batch (exact,
    with no padding inside the caches); a row that has ended keeps being fed but its tokens are
    dropped."""
    check_sampling(temperature, top_k, top_p)
    decoder = model if isinstance(model, Decoder) else Decoder(model)
    graph = decoder.graph
    if isinstance(prompts, torch.Tensor):
        prompts = prompts.tolist() if prompts.dim() == 2 else [prompts.tolist()]
    elif prompts and isinstance(prompts[0], int):
        prompts = [prompts]
    prompts = [list(map(int, p)) for p in prompts]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise DecodeError("An empty prompt has nothing to continue.", "Give every prompt at least one token.")
    if max_new_tokens < 0:
        raise DecodeError(f"max_new_tokens must be >= 0, got {max_new_tokens}.", "Pass a positive number.")
    longest = max(len(p) for p in prompts) + max_new_tokens
    if longest > decoder.max_length:
        raise DecodeError(
            f"A prompt of {max(len(p) for p in prompts)} tokens plus {max_new_tokens} new ones exceeds this graph's position limit of {decoder.max_length}.",
            "Use a shorter prompt or fewer new tokens.",
        )
    eos = _eos_ids(graph, eos_token_id)
    generator = None
    if temperature:
        generator = torch.Generator(device=graph.device)
        if seed is None:
            generator.seed()  # a fresh draw each call, as transformers samples without a seed
        else:
            generator.manual_seed(seed)
    results: list[list[int]] = [[] for _ in prompts]
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(len(p), []).append(i)
    for length, rows in groups.items():
        if max_new_tokens == 0:
            continue
        decoder.reset(len(rows), length + max_new_tokens)
        ids = torch.tensor([prompts[i] for i in rows], dtype=torch.long, device=graph.device)
        logits = decoder.prefill(ids)[:, -1]
        done = torch.zeros(len(rows), dtype=torch.bool)
        for t in range(max_new_tokens):
            nxt = sample(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
            chosen = nxt.tolist()  # one device-to-host copy per step, not one per row
            for r, i in enumerate(rows):
                if not done[r]:
                    token = chosen[r]
                    results[i].append(token)
                    if stream is not None:
                        stream(i, token)
                    if token in eos:
                        done[r] = True
            if bool(done.all()) or t == max_new_tokens - 1:
                break
            logits = decoder.step(nxt[:, None])[:, -1]
    decoder.reset()
    return results
