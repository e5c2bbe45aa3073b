"""`surgery verify-export DIR`: whether an export directory is exactly what surgery wrote, checked
before anything loads it with trust_remote_code (which runs the directory's Python)."""
from __future__ import annotations

import json
from pathlib import Path

import typer

from .common import guard, out
from .options import DebugOpt


def describe(folder: Path) -> dict:
    """The verified export's manifest summary and its converted layers (read from config.json; no code runs)."""
    from surgery.io.export_manifest import verify_export as verify

    manifest = verify(folder)
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    hybrid = config.get("surgery_hybrid") or {}
    layers = hybrid.get("gdn_layers") or {}
    return {"export": str(folder), "verified": True, "format": manifest["format"], "source": manifest.get("source"),
            "model_type": config.get("model_type"), "auto_map": manifest.get("auto_map"), "files": len(manifest["files"]),
            "layer_kinds": hybrid.get("layer_kinds"), "gdn_layers": sorted(layers) or None}


def render(info: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(info, indent=1))
        return
    code = ", ".join(f"{k} -> {v}" for k, v in (info["auto_map"] or {}).items()) or "none (no remote code)"
    out.print(f"{info['export']}: the export surgery wrote (format {info['format']}, {info['files']} files unchanged, "
              f"from {info['source'] or 'a hybrid in memory'}); model_type {info['model_type']}; remote code: {code}")
    if info["layer_kinds"]:
        out.print("layers: " + " ".join(info["layer_kinds"]))


def verify_export(
    directory: Path = typer.Argument(..., help="A directory written by `surgery export --out`."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    debug: bool = DebugOpt,
):
    """Check an export before loading it: every file as surgery wrote it, no added code, auto_map inside the directory. Exit 0 if so, 2 if not."""
    with guard(debug):
        render(describe(directory), as_json)
