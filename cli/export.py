"""`surgery export`: write a saved hybrid as a directory other libraries load (surgery.export)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .common import emit_json, err, guard, model_inputs, parse_dtype
from .options import DebugOpt, JsonOpt

FormatOpt = typer.Option("hf", "--format", help="hf: a transformers directory (AutoModelForCausalLM, trust_remote_code=True). "
                        "qwen3_5: a native Qwen3.5 text model (Qwen3_5ForCausalLM, no remote code; vLLM, SGLang), "
                        "kimi_linear: a native Kimi Linear model (KimiLinearForCausalLM, no remote code) of a hybrid whose "
                        "every layer is KDA (replace.mixer=kda, replace.kimi_form=true); "
                        "each native format only where the hybrid fits that class exactly.")
ExportDtypeOpt = typer.Option(None, "--dtype", help="float32, bfloat16, float16 for the written weights (default: the hybrid's own).")


def export(
    model: str = typer.Option(..., "--model", "-m", help="Saved hybrid (a directory written by `surgery apply --out`)."),
    out: Path = typer.Option(..., "--out", "-o", help="Directory to write."),
    format: str = FormatOpt,
    dtype: Optional[str] = ExportDtypeOpt,
    force: bool = typer.Option(False, "--force", help="Replace --out when it holds a hybrid or an export surgery wrote."),
    debug: bool = DebugOpt,
    as_json: bool = JsonOpt,
):
    """Export a hybrid: --format hf writes config.json, model.safetensors, the tokenizer and a modeling file that needs no surgery."""
    from surgery.io.export import export as export_model
    from surgery.io.lock import output_lock

    with guard(debug), output_lock(out):  # one writer per --out, before the model loads
        model_inputs(model)
        written = export_model(model, out, format=format, dtype=parse_dtype(dtype) if dtype else None, force=force)
        err.print(f"exported {model} as {format} to {written}")
        if as_json:
            emit_json({"model": model, "format": format, "out": str(written), "files": sorted(p.name for p in Path(written).iterdir())})
