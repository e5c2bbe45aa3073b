"""Opening a model: any teacher source captured with its attention sites found (`capture`), or
whatever the user points at, teacher or saved hybrid (`open_model`). The CLI and the library both
open models here."""
from __future__ import annotations

from pathlib import Path

import torch

from ..core.capture import capture_graph
from ..core.graph import Graph
from ..core.meta_capture import capture_offloaded
from ..sites import find_sites
from ..errors import CheckpointError
from .checkpoint import load
from .layouts import refuse_sharded
from .export_manifest import export_refusal, is_export
from .outdir import LAST, RUN_FILE


def capture(source, *, tokenizer=None, max_length: int | None = None, dtype: torch.dtype | None = None,
            device: str | torch.device | None = None, find: bool = True, debug: bool = False, offload: bool = False) -> Graph:
    """Any model source (a loaded model, a directory, a .gguf, a short name) -> Graph with its
    attention sites found (find=False skips discovery). offload: a model directory or .gguf captured
    on the meta device, its weights read from its files a layer at a time (core.meta_capture)."""
    if offload:
        graph = capture_offloaded(source, device=device or "cpu", dtype=dtype, max_length=max_length, debug=debug)
        if tokenizer is not None:
            graph.tokenizer = tokenizer
    else:
        graph = capture_graph(source, tokenizer=tokenizer, max_length=max_length, dtype=dtype, device=device, debug=debug)
    if find:
        graph.sites = find_sites(graph)
    return graph


def is_hybrid(source) -> bool:
    """Whether `source` is a directory written by surgery.save (it holds recipe.json)."""
    return isinstance(source, (str, Path)) and Path(source).is_dir() and (Path(source) / "recipe.json").exists()


def latest_checkpoint(run: Path) -> Path:
    """The newest checkpoint of a distillation run directory (what its `last` link names)."""
    last = run / LAST
    if not is_hybrid(last):
        raise CheckpointError(f"'{run}' is a distillation run directory with no checkpoint yet ({LAST} is missing).",
                              "Open it once the run has written a checkpoint, or point at a checkpoint-N/ directory inside it.")
    return last.resolve()


def open_model(source, *, device=None, dtype: torch.dtype | None = None, debug: bool = False) -> Graph:
    """A saved hybrid (its recipe replayed, surgery.load), a distillation run directory (its latest
    checkpoint) or any teacher source (captured)."""
    if isinstance(source, Graph):
        return source
    if isinstance(source, (str, Path)) and (Path(source) / RUN_FILE).is_file():
        source = latest_checkpoint(Path(source))
    if is_hybrid(source):
        return load(source, device=device, dtype=dtype)
    if isinstance(source, (str, Path)):
        refuse_sharded(source, "model")
    if isinstance(source, (str, Path)) and is_export(source):
        raise export_refusal(source)  # transformers would run its code; surgery runs the hybrid it came from
    return capture(source, device=device, dtype=dtype, debug=debug)
