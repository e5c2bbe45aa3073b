"""The recipe: everything needed to rebuild a hybrid from the teacher's config alone — the source,
the config, the passes with their configs, the decisions they took, and a per-layer map."""
from __future__ import annotations

import importlib.metadata
import platform

from ..core.graph import Graph
from ..errors import CheckpointError

FORMAT = "surgery-hybrid"
VERSION = 1


def library_versions() -> dict:
    out = {"python": platform.python_version()}
    for name in ("surgery", "torch", "transformers", "safetensors", "flash-linear-attention", "gguf"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def layer_map(graph: Graph) -> list[dict]:
    targets = graph.gdn_targets()
    rows = []
    for site, kind in zip(graph.sites, graph.layer_kinds):
        rows.append({"layer": site.layer, "kind": kind, "attention_path": site.module_path,
                     "module": targets.get(site.layer, site.module_path)})
    return rows


def build(graph: Graph, weights: dict) -> dict:
    from ..core.pipeline import REGISTRY

    structural = [h["pass"] for h in graph.history if getattr(REGISTRY.get(h["pass"]), "structural", False)]
    config = graph.config.to_dict()
    return {
        "format": FORMAT,
        "version": VERSION,
        "source": graph.source,
        "model_type": graph.config.model_type,
        "config": config,
        "capture": graph.meta.get("capture", {}),
        "passes": graph.history,
        "decisions": {name: _jsonable(graph.meta[name]) for name in dict.fromkeys(structural) if name in graph.meta},
        "results": {k: _jsonable(v) for k, v in graph.meta.items() if k not in ("capture",) and k not in structural},
        "layers": layer_map(graph),
        "sites": [s.to_dict() for s in graph.sites],
        "weights": weights,
        "versions": library_versions(),
    }


def check(recipe: dict, where: str) -> None:
    if recipe.get("format") != FORMAT:
        raise CheckpointError(f"'{where}' is not a surgery hybrid (format {recipe.get('format')!r}).", "Point at a directory written by `surgery apply --out`.")
    if recipe.get("version", 0) > VERSION:
        raise CheckpointError(f"'{where}' was written by a newer surgery (recipe version {recipe['version']}).", "Upgrade surgery.")
    for key in ("config", "passes", "decisions", "weights", "sites", "capture"):
        if key not in recipe:
            raise CheckpointError(f"The recipe in '{where}' lacks '{key}'.", "The checkpoint is incomplete; write it again with `surgery apply`.")


def _jsonable(value):
    """Decisions and results hold tensors and tuples at times; the recipe stores plain JSON."""
    import torch

    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist()
    if isinstance(value, float) and value != value:
        return None
    return value
