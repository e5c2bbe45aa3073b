"""Graph diff: what a pass (or a whole conversion) changed, per layer, in nodes and parameters."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch

from ..core.graph import Graph
from ..core.load import resolve
from ..io.open import open_model

OUTSIDE = "outside layers"


def _op_kind(node) -> str:
    if node.op == "call_function":
        name = getattr(node.target, "__name__", str(node.target))
        return name.split(".")[0] if hasattr(node.target, "_schema") else name
    if node.op == "call_module":
        return f"module:{type(node.graph.owning_module.get_submodule(node.target)).__name__}"
    return node.op


def _layer_prefixes(graph: Graph) -> list[tuple[str, int]]:
    """The decoder block of each attention site: the parent of its module path."""
    out = []
    for s in graph.sites:
        parent = s.module_path.rpartition(".")[0] or s.module_path
        out.append((parent + ".", s.layer))
    return sorted(out, key=lambda p: -len(p[0]))


def _layer_of(name: str, prefixes) -> int | str:
    for prefix, layer in prefixes:
        if name.startswith(prefix) or name + "." == prefix:
            return layer
    return OUTSIDE


def _node_path(node) -> str:
    if node.op in ("get_attr", "call_module"):
        return node.target
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else ""


def _nodes(graph: Graph, prefixes) -> dict:
    per = {}
    for n in graph.gm.graph.nodes:
        if n.op in ("placeholder", "output", "get_attr"):
            continue
        per.setdefault(_layer_of(_node_path(n), prefixes), Counter())[_op_kind(n)] += 1
    return per


def _params(graph: Graph, prefixes) -> dict:
    per = {}
    for name, p in graph.gm.named_parameters(remove_duplicate=False):
        per.setdefault(_layer_of(name, prefixes), {})[name] = p
    return per


def valued(graph: Graph, name: str, p: torch.Tensor) -> torch.Tensor:
    """A parameter's values: an offloaded teacher's (meta) read from its files."""
    return graph.weights.load(name, "cpu", p.dtype) if p.is_meta and graph.weights is not None else p


def open_pair(a, b) -> tuple[Graph, Graph]:
    """What `surgery diff A B` takes: Graphs, or model names, paths, saved hybrids and run
    directories (both checked to exist before either loads)."""
    for source in (a, b):
        if isinstance(source, (str, Path)):
            resolve(source)
    return open_model(a), open_model(b)


def same_tensor(x: torch.Tensor, y: torch.Tensor) -> bool:
    """x and y are one tensor (the same memory, shape, strides and dtype): equal without reading them.
    A branch shares the teacher's weights, so most of a conversion's parameters are compared this way."""
    return x is y or (not x.is_meta and x.dtype == y.dtype and x.device == y.device and x.shape == y.shape
                      and x.stride() == y.stride() and x.data_ptr() == y.data_ptr())


def diff(a, b, *, compare_values: bool = True) -> dict:
    """Per-layer differences from a to b (Graphs, or anything `surgery diff` takes); JSON-ready.
    compare_values: parameters of equal shape are compared by value too (else by shape only).
    "groups" holds the same layers with identical rows joined ("layers 1,3,5-29")."""
    a, b = open_pair(a, b)
    prefixes = _layer_prefixes(a if a.sites else b)
    nodes_a, nodes_b = _nodes(a, prefixes), _nodes(b, prefixes)
    params_a, params_b = _params(a, prefixes), _params(b, prefixes)
    kinds_a = dict(enumerate(a.layer_kinds)) if a.sites else {}
    kinds_b = dict(enumerate(b.layer_kinds)) if b.sites else {}
    keys = sorted({*nodes_a, *nodes_b, *params_a, *params_b}, key=lambda k: (isinstance(k, str), k if isinstance(k, int) else 0))
    layers = []
    for key in keys:
        na, nb = nodes_a.get(key, Counter()), nodes_b.get(key, Counter())
        pa, pb = params_a.get(key, {}), params_b.get(key, {})
        entry = {
            "layer": key,
            "before": kinds_a.get(key, "-") if isinstance(key, int) else "-",
            "after": kinds_b.get(key, "-") if isinstance(key, int) else "-",
            "nodes_removed": dict(sorted((na - nb).items())),
            "nodes_added": dict(sorted((nb - na).items())),
            "params_removed": [{"name": n, "shape": list(pa[n].shape)} for n in sorted(set(pa) - set(pb))],
            "params_added": [{"name": n, "shape": list(pb[n].shape)} for n in sorted(set(pb) - set(pa))],
            "params_changed": [],
        }
        for n in sorted(set(pa) & set(pb)):
            shared = same_tensor(pa[n], pb[n])  # unchanged without reading (an offloaded teacher's are meta)
            x, y = (pa[n], pb[n]) if shared else (valued(a, n, pa[n]), valued(b, n, pb[n]))
            if tuple(x.shape) != tuple(y.shape):
                entry["params_changed"].append({"name": n, "shape": [list(x.shape), list(y.shape)], "what": "shape"})
            elif compare_values and not shared and not torch.equal(x.detach().cpu().to(y.dtype), y.detach().cpu()):
                entry["params_changed"].append({"name": n, "shape": list(x.shape), "what": "values"})
        entry["summary"] = _summary(entry)
        if entry["nodes_removed"] or entry["nodes_added"] or entry["params_removed"] or entry["params_added"] or entry["params_changed"] or entry["before"] != entry["after"]:
            layers.append(entry)
    return {"layers": layers, "groups": grouped(layers), "unchanged_layers": [k for k in keys if k not in {e["layer"] for e in layers}],
            "compared": "values" if compare_values else "shapes", "copies": b.meta.get("replace", {}).get("copies", [])}


def grouped(layers: list[dict]) -> list[dict]:
    """The diff's rows with identical ones joined: one row per (before, after, summary), in order
    of first appearance, with the layers it covers and their short form ("1,3,5-29")."""
    groups: dict = {}
    for e in layers:
        row = groups.setdefault((e["before"], e["after"], e["summary"]),
                                {"layers": [], "before": e["before"], "after": e["after"], "summary": e["summary"]})
        row["layers"].append(e["layer"])
    return [row | {"label": layer_ranges(row["layers"])} for row in groups.values()]


def layer_ranges(layers: list) -> str:
    """[1, 3, 5, 6, 7, 8] -> "1,3,5-8" (runs of three or more as a range); names stay as they are."""
    numbers = sorted(x for x in layers if isinstance(x, int))
    parts, start = [], 0
    for i in range(1, len(numbers) + 1):
        if i == len(numbers) or numbers[i] != numbers[i - 1] + 1:
            run = numbers[start:i]
            parts += [f"{run[0]}-{run[-1]}"] if len(run) >= 3 else [str(x) for x in run]
            start = i
    return ",".join(parts + [str(x) for x in layers if not isinstance(x, int)])


def _counts(c: dict) -> str:
    return ", ".join(f"{k}×{v}" if v > 1 else k for k, v in sorted(c.items(), key=lambda kv: -kv[1]))


def _summary(e: dict) -> str:
    parts = []
    if e["before"] != e["after"]:
        parts.append(f"{e['before']} -> {e['after']}")
    if e["nodes_removed"]:
        parts.append(f"-{sum(e['nodes_removed'].values())} nodes ({_counts(e['nodes_removed'])})")
    if e["nodes_added"]:
        parts.append(f"+{sum(e['nodes_added'].values())} nodes ({_counts(e['nodes_added'])})")
    short = lambda items: ", ".join(i["name"].rpartition(".")[0].rpartition(".")[2] + "." + i["name"].rpartition(".")[2] for i in items)  # noqa: E731
    if e["params_removed"]:
        parts.append(f"-{len(e['params_removed'])} params ({short(e['params_removed'])})")
    if e["params_added"]:
        parts.append(f"+{len(e['params_added'])} params ({short(e['params_added'])})")
    if e["params_changed"]:
        parts.append(f"~{len(e['params_changed'])} params ({short(e['params_changed'])})")
    return "; ".join(parts) or "unchanged"
