"""What `surgery inspect` says about each layer of a teacher or a hybrid: its kind as it runs now
(the recurrent mixer it became: gdn, gla, kda, mamba2; or the attention op's form: sdpa / eager), its
sliding window (read from the graph's masks, as decoding and select.window read it), and what
decoding keeps for it: K and V bytes per token for a softmax layer, a fixed recurrent state for a
recurrent layer (measured from one decoded token)."""
from __future__ import annotations

import torch
from rich.table import Table

from surgery.passes.kv_budget import kv_cache_bytes, layer_windows
from tcal.mixers import MIXERS

RECURRENT = frozenset(name for name, mixer in MIXERS.items() if mixer.replaces == "layer")  # a fixed state, no KV cache


def gdn_state_bytes(gdn: torch.nn.Module, hidden_size: int, dtype: torch.dtype, device) -> int:
    """Bytes of the state a GDN layer carries between decoded tokens (batch 1), from the layer's own
    cache after one token: it does not grow with the length."""
    cache = gdn.new_cache()
    with torch.no_grad():
        gdn(torch.zeros(1, 1, hidden_size, dtype=dtype, device=device), cache=cache)
    return cache.nbytes()


def layer_rows(graph) -> list[dict]:
    """One row per layer: the site's summary, `now` (attention, the converted layer's mixer, or split),
    `kind` (a recurrent mixer's name, split, or sdpa / eager for softmax attention), `window` (None: full
    causal), `kv_bytes_per_token` (0 for a recurrent layer) and `state_bytes` (its fixed state; 0 for
    attention), in the graph's dtype at batch 1; `kept_kv_heads` of every layer (a layer split by heads,
    select.granularity=head, keeps some)."""
    windows = layer_windows(graph)
    size = torch.empty((), dtype=graph.dtype).element_size()
    gdns = graph.gdn_modules()
    rows = []
    for site, now, window in zip(graph.sites, graph.layer_kinds, windows):
        row = site.summary() | {"now": now, "window": window, "kv_bytes_per_token": 0, "state_bytes": 0, "kept_kv_heads": list(range(site.num_kv_heads))}
        if now in RECURRENT:
            row |= {"kind": now, "window": None, "kept_kv_heads": [],
                    "state_bytes": gdn_state_bytes(gdns[site.layer], site.hidden_size, graph.dtype, graph.device)}
        elif now == "split":  # some KV heads kept as attention (their cache only), the others one GDN
            split = gdns[site.layer]
            row |= {"kind": "split", "kept_kv_heads": list(split.kept_kv), "kv_bytes_per_token": kv_cache_bytes(site, None, 1, size, heads=len(split.kept_kv)),
                    "state_bytes": gdn_state_bytes(split.gdn, site.hidden_size, graph.dtype, graph.device)}
        else:
            row["kv_bytes_per_token"] = kv_cache_bytes(site, None, 1, size)
        rows.append(row)
    if "split" not in graph.layer_kinds:  # the kept KV heads column only where some layer is split by heads
        for row in rows:
            del row["kept_kv_heads"]
    return rows


def title(rows: list[dict]) -> str:
    """'30 layers: 15 softmax attention + 15 GDN' (or '+ 15 mamba2', another mixer's name; '+ 2 split by
    heads'), or '5 softmax attention layers' for a teacher."""
    recurrent = [r["now"] for r in rows if r["now"] in RECURRENT]
    split = sum(r["now"] == "split" for r in rows)
    if not recurrent and not split:
        return f"{len(rows)} softmax attention layers"
    kinds = "".join(f" + {recurrent.count(k)} {'GDN' if k == 'gdn' else k}" for k in dict.fromkeys(recurrent))
    return f"{len(rows)} layers: {len(rows) - len(recurrent) - split} softmax attention{kinds}" + (f" + {split} split by heads" if split else "")


def layer_info(graph, model: str) -> dict:
    """inspect's record (its --json): the model, its layer counts and cache sizes, and the rows."""
    return {"model": model, "architecture": type(graph.config).__name__} | counts(layer_rows(graph), graph.config.model_type, graph.dtype)


def export_info(exported, described: dict) -> dict:
    """inspect's record of an export (verified, loaded with its own code): the manifest summary and
    what its own cache keeps per layer."""
    config = exported.model.config
    described = {("gdn_paths" if k == "gdn_layers" else k): v for k, v in described.items()}  # gdn_layers: the count, as for a graph
    return described | {"model": str(exported.path), "architecture": type(config).__name__} | counts(exported.layer_rows(), config.model_type, exported.model.dtype)


def counts(rows: list[dict], model_type: str, dtype: torch.dtype) -> dict:
    return {"model_type": model_type, "dtype": str(dtype).removeprefix("torch."), "layers": len(rows),
            "softmax_layers": sum(r["now"] not in RECURRENT and r["now"] != "split" for r in rows), "gdn_layers": sum(r["now"] in RECURRENT for r in rows),
            "split_layers": sum(r["now"] == "split" for r in rows),
            "kv_bytes_per_token": sum(r["kv_bytes_per_token"] for r in rows), "state_bytes": sum(r["state_bytes"] for r in rows),
            "sites": rows}


COLUMNS = {"layer": "layer", "path": "path", "kind": "kind", "window": "window", "KV B/tok": "kv_bytes_per_token", "state B": "state_bytes",
           "heads": "heads", "kv_heads": "kv_heads", "kept KV": "kept_kv_heads", "head_dim": "head_dim", "fused": "fused_qkv", "bias": "qkv_bias", "rope": "rope",
           "qk_norm": "qk_norm", "softcap": "softcap", "scale": "scale"}  # header -> row key


def cell(row: dict, key: str) -> str:
    value = row[key]
    if key == "kept_kv_heads":
        return "all" if len(value) == row["kv_heads"] else ",".join(map(str, value)) or "-"
    if key == "window":
        return "-" if row["now"] in RECURRENT else "full" if value is None else str(value)
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def layer_table(info: dict) -> Table:
    """inspect's table: a row per layer, the paths whole (the other columns shrink)."""
    rows = info["sites"]
    heading = f"{info['model']}: {title(rows)} ({info['model_type']})"
    table = Table(title=heading, min_width=len(heading),  # the title on one line, however few the columns
                  caption=f"KV cache {info['kv_bytes_per_token']:,} B per token (KV B/tok), recurrent state {info['state_bytes']:,} B "
                          f"(state B), batch 1, {info['dtype']}; window: sliding window, or full")
    columns = {header: key for header, key in COLUMNS.items() if key in rows[0]}  # an export's rows say less than a graph's
    for header, key in columns.items():
        table.add_column(header, min_width=max(len(r["path"]) for r in rows) if key == "path" else None)
    for r in rows:
        table.add_row(*[cell(r, key) for key in columns.values()])
    return table
