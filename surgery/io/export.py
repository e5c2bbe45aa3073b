"""surgery.export: a hybrid leaves the toolkit as a directory another library loads.

Written atomically, as `save` writes: into a staging directory beside `out`, renamed into place
once complete. --force replaces a saved hybrid or an earlier export (its config.json lists the
files the export wrote), never anything else and never the model being exported."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..core import progress
from ..core.graph import Graph
from ..errors import CheckpointError, ExportError
from . import hf_export, kimi_linear_export, qwen3_5_export
from .export_manifest import MANIFEST, write_manifest
from .checkpoint import DEFAULT_SHARD_BYTES, source_paths, write_staged
from .lock import holds_output
from .open import open_model
from .outdir import REPLACE_HINT, check_replaceable, check_writable, inputs_inside

FORMATS = {"hf": hf_export.write_hf, "qwen3_5": qwen3_5_export.write_qwen3_5, "kimi_linear": kimi_linear_export.write_kimi_linear}
PLANS = {"hf": hf_export.plan, "qwen3_5": qwen3_5_export.plan, "kimi_linear": kimi_linear_export.plan}  # each refuses before anything is staged
FILES = "files"  # the surgery_hybrid field listing what the export wrote


@holds_output("out")  # one writer per output directory (surgery.io.lock), from before the model loads
def export(model, out: str | Path, *, format: str = "hf", dtype: torch.dtype | None = None, force: bool = False,
           shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write `model` (a hybrid Graph, or the path of a saved hybrid) to `out` in `format`; returns out.

    dtype casts the floating-point weights (default: the hybrid's own). The directory's last file is
    its manifest (surgery_export.json: each file's sha256, the auto_map), which `verify_export` checks."""
    if format not in FORMATS:
        raise ExportError(f"Unknown export format '{format}'.", f"Use one of: {', '.join(FORMATS)}.")
    out = Path(out)
    inputs = [] if isinstance(model, Graph) else [model]
    check_export_out(out, force=force, inputs=inputs)
    with progress.task("export") as bar:  # stages, no count: a line each interval says which one runs
        bar.update(info="opening the hybrid")
        graph = open_model(model)
        inputs += source_paths(graph.source)
        check_export_out(out, force=force, inputs=inputs)
        PLANS[format](graph)  # refuse before staging anything

        source = None if isinstance(model, Graph) else str(Path(model).resolve())

        def write(folder: Path) -> None:
            bar.update(info=f"writing the {format} weights and files")
            FORMATS[format](graph, folder, dtype=dtype, shard_bytes=shard_bytes)
            record_files(folder)
            bar.update(info="writing the manifest (sha256 of every file)")
            write_manifest(folder, format=format, source=source, teacher_config=type(graph.config).__name__ if format == "hf" else None)

        return write_staged(out, write, what="Exporting the hybrid")


def record_files(folder: Path) -> None:
    """List in config.json what the export wrote, so a later --force knows them as the project's."""
    config = json.loads((folder / "config.json").read_text())
    config[hf_export.HYBRID_KEY][FILES] = sorted([p.name + ("/" if p.is_dir() else "") for p in folder.iterdir()] + [MANIFEST])
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))


def exported_files(out: Path) -> set[str] | None:
    """The files an earlier export to `out` recorded, or None when `out` is no export of ours."""
    try:
        listed = json.loads((out / "config.json").read_text(encoding="utf-8"))[hf_export.HYBRID_KEY][FILES]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return set(listed) if isinstance(listed, list) else None


def check_export_out(out: Path, *, force: bool, inputs: list) -> None:
    """check_replaceable, with an earlier export also replaceable under --force."""
    files = exported_files(out) if force and out.is_dir() and not out.is_symlink() else None
    if files is None:
        check_replaceable(out, force=force, inputs=inputs, kinds=("hybrid",))
        return
    held = inputs_inside(out, inputs)
    if held:
        raise CheckpointError(f"--out '{out}' is or holds an input of this command: {', '.join(held)}.",
                              "Write the output to another directory; --force never replaces a command's own inputs.")
    foreign = sorted(name for name in os.listdir(out) if name not in files and name + "/" not in files)
    if foreign:
        raise CheckpointError(f"--out '{out}' holds files surgery did not write: {', '.join(foreign[:10])}.",
                              f"Move them away or choose another --out ({REPLACE_HINT})")
    check_writable(out)
