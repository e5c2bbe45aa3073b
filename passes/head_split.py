"""replace for a layer that select splits by heads (select.granularity=head): the kept KV heads and their
query groups stay the teacher's softmax attention, on their slice of the Q, K, V its attention op
receives; the other heads become a GatedDeltaNet on the block's input; the two groups' contexts are
merged in the teacher's head order where the op's output was, before the teacher's o_proj
(tcal.head_split). Checked before any layer is changed: on a probe, the kept slice must give the
op's own output at the kept heads (what it cannot reproduce, a sliding window, ALiBi, sinks, it refuses
by layer)."""
from __future__ import annotations

import torch

from surgery.core.rewrite import nodes_by_name, set_submodule
from surgery.errors import PassConfigError
from surgery.sites import AttentionSite, vocab_size
from surgery.sites.probe import ValueRun
from tcal.head_split import HeadSplitLayer

KEEP_WHOLE = "Keep these layers whole (select.granularity=layer), or convert all their heads."


def kept_query_heads(site: AttentionSite, kept_kv: list[int]) -> list[int]:
    """The query heads that read the kept KV heads, in the teacher's order."""
    return [h for h in range(site.num_heads) if site.kv_map[h] in set(kept_kv)]


def kv_index(site: AttentionSite, kept_kv: list[int], op_kv_heads: int) -> list[int] | None:
    """Which heads of the op's K/V tensor hold the kept KV heads: the KV heads themselves when the op
    receives one per KV head, the first query head of each group when repeat_kv gave it one per query
    head; None for any other layout."""
    if op_kv_heads == site.num_kv_heads:
        return list(kept_kv)
    if op_kv_heads == site.num_heads:
        return [site.kv_map.index(j) for j in kept_kv]
    return None


def split_for_site(site: AttentionSite, kept_kv: list[int], config, index: list[int], window: int) -> HeadSplitLayer:
    """The head-split module of a site (configured like replace's GatedDeltaNet, over the converted heads)."""
    kept = kept_query_heads(site, kept_kv)
    attention = dict(num_heads=len(kept), head_dim=site.head_dim, window=window, scale=float(site.op_scale),
                     softcap=site.softcap, k_transposed=site.k_transposed, layer_idx=site.layer)
    gdn = dict(hidden_size=site.hidden_size, num_heads=site.num_heads - len(kept), head_dim=site.head_dim,
               q_bias=bool(site.q.bias), k_bias=bool(site.k.bias), v_bias=bool(site.v.bias), o_bias=False,
               use_short_conv=config.use_short_conv, conv_size=config.conv_size, norm_eps=config.norm_eps,
               v_activation=config.v_activation, backend=config.backend, layer_idx=site.layer)
    return HeadSplitLayer(site.hidden_size, site.num_heads, site.head_dim, kept, index, sorted(kept_kv), attention, gdn, site.layer)


def converted_columns(module: HeadSplitLayer, site: AttentionSite, params: dict) -> torch.Tensor:
    """The teacher's o_proj columns that read the converted heads, [hidden, Hc*D] (what the layer's
    forward and converted_target take: Phase 1 and 2 measure the layer output through them)."""
    w, _ = site.o.in_matrix(params)
    cols = torch.tensor([h * site.head_dim + d for h in module.converted_heads for d in range(site.head_dim)], device=w.device)
    return w.index_select(1, cols)


def transfer_split_weights(module: HeadSplitLayer, site: AttentionSite, params: dict, target: str) -> list[str]:
    """The converted heads' Q rows and their KV heads' K/V rows (GQA-expanded) copied into the GDN
    (the teacher's o_proj stays in the graph and reads them); returns the `src -> dst` log lines."""
    heads = module.converted_heads
    log = []
    with torch.no_grad():
        for name, proj, rows in (("q_proj", site.q, heads), ("k_proj", site.k, [site.kv_map[h] for h in heads]),
                                 ("v_proj", site.v, [site.kv_map[h] for h in heads])):
            w, b = proj.out_matrix(params, rows)
            layer = getattr(module.gdn, name)
            layer.weight.copy_(w)
            log.append(f"{proj.weight}{'^T' if proj.transposed else ''}[heads {rows}] -> {target}.gdn.{name}.weight")
            if b is not None:
                layer.bias.copy_(b)
                log.append(f"{proj.bias}[heads {rows}] -> {target}.gdn.{name}.bias")
    return log


def splice_split(gm: torch.fx.GraphModule, site: AttentionSite, module: HeadSplitLayer, target: str) -> None:
    """Call the module's parts in place of the site's attention op (module docstring)."""
    nodes = nodes_by_name(gm)
    set_submodule(gm, target, module)
    op = nodes[site.attn_node]
    stack = op.meta.get("nn_module_stack") or {}
    with gm.graph.inserting_before(op):
        def call(part, *args):
            node = gm.graph.call_module(f"{target}.{part}", args)
            node.meta["nn_module_stack"] = dict(stack)
            return node

        q, k, v = (call(f"select_{n}", nodes[name]) for n, name in (("q", site.q_node), ("k", site.k_node), ("v", site.v_node)))
        merged = call("merge", call("kept", q, k, v), call("gdn", nodes[site.input_node]))
    if "val" in op.meta:
        merged.meta["val"] = op.meta["val"]
    op.replace_all_uses_with(merged)
    gm.graph.erase_node(op)


def split_target(site: AttentionSite) -> str:
    return f"{site.module_path}_split"


def build_splits(graph, kept_heads: dict[int, list[int]], config, windows: list[int | None]) -> dict[int, HeadSplitLayer]:
    """A head-split module per layer, its kept heads attending within the layer's own window (`windows`,
    as the graph's masks show them; None: causal), each checked on a probe of the teacher: its kept
    slice must give the attention op's own output at the kept heads. PassConfigError naming every
    layer that fails."""
    refused, modules = [], {}
    run = ValueRun(graph.gm, vocab_size(graph.config, graph.gm))
    nodes = nodes_by_name(graph.gm)
    for layer, kept_kv in sorted(kept_heads.items()):
        site = graph.sites[layer]
        if site.op_scale is None or site.scores_bias:
            refused.append(f"layer {layer}: {'its scores carry a position bias (ALiBi)' if site.scores_bias else 'its site does not record the op scale'}")
            continue
        q, k, v = (run[nodes[name]] for name in (site.q_node, site.k_node, site.v_node))
        index = kv_index(site, kept_kv, k.shape[1])
        if index is None or v.shape[1] != k.shape[1]:
            refused.append(f"layer {layer}: its K/V reach the op with {k.shape[1]}/{v.shape[1]} heads, neither its KV heads nor its query heads")
            continue
        module = split_for_site(site, kept_kv, config, index, windows[layer] or graph.max_length).to(device=q.device)
        want = run[nodes[site.attn_node]]
        with torch.no_grad():
            try:
                got = module.kept(module.select_q(q), module.select_k(k), module.select_v(v))
            except RuntimeError as exc:
                refused.append(f"layer {layer}: its Q, K, V are not laid out as [B, heads, T, D] ({str(exc).splitlines()[0]})")
                continue
        want = want.index_select(1, module.select_q.index) if want.dim() == 4 and want.shape[1] == site.num_heads else None
        tolerance = 1e-4 if q.dtype in (torch.float32, torch.float64) else 2e-2
        if want is None or got.shape != want.shape or (got.float() - want.float()).abs().max() > tolerance * max(1.0, float(want.float().abs().max())):
            refused.append(f"layer {layer}: causal softmax over its kept heads' Q, K, V does not give its attention output there "
                           "(another term in the scores: sinks, a bias)")
            continue
        modules[layer] = module
    if refused:
        raise PassConfigError("select.granularity=head cannot split " + "; ".join(refused) + ".", KEEP_WHOLE)
    return modules


def split_columns(graph, layer: int) -> torch.Tensor:
    """converted_columns of the head split at `layer`, from the teacher's parameters."""
    params = dict(graph.teacher_gm.named_parameters(remove_duplicate=False))
    return converted_columns(graph.gdn_modules()[layer], graph.sites[layer], params)


def split_shares(graph, modules: dict, data: dict) -> dict:
    """For each head split among `modules`: (how align runs it, its target), both the converted heads'
    share of the layer output (tcal.head_split), the o_proj columns in float32 as align runs."""
    out = {}
    for layer, module in modules.items():
        if isinstance(module, HeadSplitLayer):
            w = split_columns(graph, layer).detach().float()
            out[layer] = ((lambda x, m=module, w=w: m(x, w)), module.converted_target(data[layer].ctx.float(), w))
    return out
