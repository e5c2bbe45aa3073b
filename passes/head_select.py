"""select at KV-head granularity (select.granularity=head): which KV heads (each with the query heads
that share it under GQA) stay softmax attention, over all layers at once. A KV head is what the cache
stores, so a budget of kept KV heads is a budget of KV bytes: keep_ratio 0.5 of the KV heads keeps
the same bytes as keep_ratio 0.5 of the layers (when every layer has as many KV heads).

Policies score each KV head from the teacher's per-head attention statistics on calibration text
(tcal.stats, the statistics Phase 1 reads), averaged over its query group, and keep the best:
distance  the mean attention distance: a long-range head is what a fixed-size state serves worst
entropy   the attention entropy: a head spread over many keys is what a decaying state loses first
output    the output scale: the squared norm of what the head adds to the layer output (its context
          through its o_proj columns): a head that adds little costs little to approximate
keep      keep exactly `heads` ({layer: [KV heads]}); layers not named are converted whole.
With `kv_bytes`, the budget is bytes instead of a count: the best-scoring KV heads are kept, in rank
order, each one that still fits the KV cache at 32k tokens (kv_budget.kv_report: a sliding-window
layer's head costs its window, not the length) into kv_bytes; what is left is converted."""
from __future__ import annotations

import torch

from surgery.data.windows import calibration_ids
from surgery.errors import PassConfigError

from .kv_budget import KV_LENGTH, kv_cache_bytes, kv_report, layer_windows
from .selection import LayerSelection
from .teacher_data import collect

HEAD_POLICIES = ("distance", "entropy", "output", "keep")
HEAD_METRICS = {"distance": "mean attention distance of the KV head's query group (higher: keep)",
                "entropy": "mean attention entropy of the KV head's query group (higher: keep)",
                "output": "mean squared norm of the query group's heads' share of the layer output (higher: keep)"}


def head_count(config, total: int) -> int:
    """How many KV heads are kept: keep_count, else round(keep_ratio * total)."""
    k = config.keep_count if config.keep_count is not None else round(config.keep_ratio * total)
    if k >= total:
        raise PassConfigError(f"select keeps {k} of the model's {total} KV heads: nothing would be converted.",
                              f"Keep fewer KV heads (keep_count < {total} or keep_ratio < 1).")
    return k


def named_heads(config, sites) -> dict[int, list[int]]:
    """policy keep: {layer: [KV heads kept]} from `heads`, checked against the model."""
    out = {}
    for key, heads in (config.heads or {}).items():
        if not str(key).isdigit() or not isinstance(heads, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in heads):
            raise PassConfigError(f"select.heads maps {key!r} to {heads!r}, not a layer number to a list of KV head numbers.",
                                  'Write e.g. select.heads={"1": [0, 2]}.')
        layer = int(key)
        if not 0 <= layer < len(sites):
            raise PassConfigError(f"select.heads names layer {layer}; this model has {len(sites)} attention layers.", "Name layers inside that range.")
        bad = [h for h in heads if not 0 <= h < sites[layer].num_kv_heads]
        if bad:
            raise PassConfigError(f"select.heads names KV heads {bad} of layer {layer}, which has {sites[layer].num_kv_heads}.",
                                  f"Name KV heads 0..{sites[layer].num_kv_heads - 1}.")
        out[layer] = sorted(set(heads))
    return out


def check_heads(config, sites) -> None:
    """select's check at granularity head: the named heads exist, or the count leaves a head to convert."""
    if config.policy == "keep":
        named_heads(config, sites)
    elif config.kv_bytes is None:
        head_count(config, sum(s.num_kv_heads for s in sites))


def split_problem(selection: LayerSelection, sites) -> str | None:
    """What is wrong with a selection's split layers (None: each keeps some but not all KV heads of a converted layer)."""
    for layer, heads in selection.split_layers().items():
        if layer not in selection.convert or not 0 < len(heads) < sites[layer].num_kv_heads:
            return f"layer {layer} keeps KV heads {heads}: not some but not all heads of a converted layer."
    return None


def head_scores(graph, config) -> tuple[list[dict], int]:
    """Per KV head of every layer its score (the policy's statistic averaged over its query group),
    from the teacher on the select text; and the number of tokens read."""
    ids = calibration_ids(graph, config.calibration, config.samples, min(config.length, graph.max_length), config.seed)
    data = collect(graph, list(range(graph.num_layers)), ids, with_stats=True, batch_size=config.batch_size)
    params = dict(graph.teacher_gm.named_parameters(remove_duplicate=False))
    rows = []
    for site in graph.sites:
        d = data[site.layer]
        stat = (output_scale(d.ctx, site, params) if config.policy == "output" else d.stats[config.policy]).tolist()
        for j in range(site.num_kv_heads):
            group = [stat[h] for h in range(site.num_heads) if site.kv_map[h] == j]
            rows.append({"layer": site.layer, "kv_head": j, "score": sum(group) / len(group)})
    return rows, int(ids.numel())


def output_scale(ctx: torch.Tensor, site, params: dict) -> torch.Tensor:
    """Per query head, the mean squared norm of what it adds to the layer output: its context ctx
    [N, T, H, D] through its columns of the teacher's o_proj, [H] (float64)."""
    w, _ = site.o.in_matrix(params)
    w = w.double().unflatten(1, (site.num_heads, site.v_head_dim or site.head_dim))  # [hidden, H, D]
    total = torch.zeros(site.num_heads, dtype=torch.float64)
    for chunk in ctx.flatten(0, 1).split(1024):                          # [tokens, H, D]
        total += torch.einsum("thd,khd->thk", chunk.double(), w).pow(2).sum((0, 2)).cpu()
    return total / (ctx.shape[0] * ctx.shape[1])


def within_budget(graph, ranked: list[dict], budget: int) -> list[dict]:
    """The rows of `ranked` kept, best first, each that still fits the byte budget (module docstring)."""
    windows = layer_windows(graph)
    size = torch.empty((), dtype=graph.dtype).element_size()
    counts, used, chosen = [0] * graph.num_layers, 0, []
    for row in ranked:
        layer = row["layer"]
        cost = kv_cache_bytes(graph.sites[layer], windows[layer], KV_LENGTH, size, heads=counts[layer] + 1) - (
            kv_cache_bytes(graph.sites[layer], windows[layer], KV_LENGTH, size, heads=counts[layer]) if counts[layer] else 0)
        if used + cost <= budget:
            counts[layer], used = counts[layer] + 1, used + cost
            chosen.append(row)
    return chosen


def head_selection(graph, config) -> LayerSelection:
    """The selection at KV-head granularity (module docstring)."""
    sites = graph.sites
    extra = {}
    if config.policy == "keep":
        kept = named_heads(config, sites)
    else:
        rows, tokens = head_scores(graph, config)
        ranked = sorted(rows, key=lambda r: (-r["score"], r["layer"], r["kv_head"]))
        for rank, row in enumerate(ranked, 1):
            row["rank"] = rank
        chosen = ranked[:head_count(config, len(rows))] if config.kv_bytes is None else within_budget(graph, ranked, config.kv_bytes)
        kept = {}
        for row in chosen:
            kept.setdefault(row["layer"], []).append(row["kv_head"])
        extra = {"keep_count": len(chosen), "metric": HEAD_METRICS[config.policy], "tokens": tokens, "scores": rows}
    kept = {l: sorted(h) for l, h in kept.items() if h}
    whole = [l for l, h in kept.items() if len(h) == sites[l].num_kv_heads]
    convert = [l for l in range(len(sites)) if l not in whole]
    if not convert:
        raise PassConfigError("select.heads keeps every KV head of every layer: nothing would be converted.", "Keep fewer heads.")
    split = {str(l): h for l, h in sorted(kept.items()) if l not in whole}
    return LayerSelection(config.policy, convert, sorted(whole), **extra, granularity="head", kept_heads=split,
                          kv_cache=kv_report(graph, convert, kept_heads={int(l): h for l, h in split.items()}))
