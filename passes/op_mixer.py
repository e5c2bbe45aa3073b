"""A mixer that replaces only a site's attention op (swa): the module built for a site, spliced in
the op's place on the Q, K, V the op received, and checked before any layer is changed: with a
window longer than the probe, the module must give the teacher's own attention output (what it
cannot reproduce, such as an ALiBi bias or attention sinks, it refuses by layer)."""
from __future__ import annotations

import torch

from surgery.core.rewrite import nodes_by_name, splice_module
from surgery.errors import PassConfigError
from surgery.sites import AttentionSite, vocab_size
from surgery.sites.probe import ValueRun
from tcal.mixers import get_mixer

KEEP_IT = "Convert these layers with another mixer (replace.mixer=gdn), or keep them as attention (select)."


def op_module_for_site(site: AttentionSite, config, window: int | None = None) -> torch.nn.Module:
    """The op mixer's module for this site, with the op's own scale and softcap."""
    return get_mixer(config.mixer).module(
        site.num_heads, site.head_dim, window or config.window, float(site.op_scale), softcap=site.softcap,
        k_transposed=site.k_transposed, layer_idx=site.layer,
    )


def splice_op_module(gm: torch.fx.GraphModule, site: AttentionSite, module: torch.nn.Module, mixer: str) -> str:
    """Call `module` on the site's Q, K, V in place of its attention op; returns the module's path
    (beside the attention module, whose projections the graph still uses)."""
    nodes = nodes_by_name(gm)
    target = f"{site.module_path}_{mixer}"
    op = nodes[site.attn_node]
    splice_module(gm, target, module, [nodes[site.q_node], nodes[site.k_node], nodes[site.v_node]], op)
    gm.graph.erase_node(op)  # prune keeps SDPA (a seeded op, impure to fx) while its Q, K, V live on
    return target


def verify_op_modules(graph, layers: list[int], config) -> None:
    """PassConfigError naming every layer whose attention op the module cannot stand in for."""
    refused = []
    for layer in layers:
        site = graph.sites[layer]
        if site.op_scale is None:
            refused.append(f"layer {layer}: its site does not record the op's scale (an older site; find the sites again)")
        elif site.scores_bias:
            refused.append(f"layer {layer}: its scores carry a position bias (ALiBi), which a window of softmax attention drops")
    if not refused:
        run = ValueRun(graph.gm, vocab_size(graph.config, graph.gm), graph)  # an offloaded teacher: read a layer at a time
        nodes = nodes_by_name(graph.gm)
        for layer in layers:
            site = graph.sites[layer]
            want = run[nodes[site.attn_node]]
            module = op_module_for_site(site, config, window=1 << 30).to(device=want.device)
            with torch.no_grad():
                try:
                    got = module(*(run[nodes[name]] for name in (site.q_node, site.k_node, site.v_node)))
                except RuntimeError as exc:  # a layout it cannot read: shapes that do not broadcast
                    refused.append(f"layer {layer}: its Q, K, V are not laid out as [B, heads, T, D] ({str(exc).splitlines()[0]})")
                    continue
            tolerance = 1e-4 if want.dtype in (torch.float32, torch.float64) else 2e-2
            if got.shape != want.shape or (got.float() - want.float()).abs().max() > tolerance * max(1.0, float(want.float().abs().max())):
                refused.append(f"layer {layer}: softmax over its Q, K, V does not give its attention output (the scores carry something else)")
    if refused:
        raise PassConfigError(f"mixer '{config.mixer}' cannot stand in for the attention op of " + "; ".join(refused) + ".", KEEP_IT)
