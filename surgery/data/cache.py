"""The on-disk token cache: text files tokenised once per (file content, tokenizer), so a second run,
a second pass or a second rank reads ids instead of tokenising again."""
from __future__ import annotations

import hashlib
import json
import os
from importlib import resources
from pathlib import Path

import torch

from ..core.files import sha256_file
from ..errors import CalibrationError
from .text import read_text, tokenize

BUILTIN = "built-in sample"


def builtin_sample() -> Path:
    return Path(str(resources.files("surgery.data") / "calibration_sample.txt"))


def cache_dir(kind: str = "tokens") -> Path:
    """Where tokenised text is cached: $SURGERY_CACHE, else $XDG_CACHE_HOME/surgery or ~/.cache/surgery."""
    root = os.environ.get("SURGERY_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"), "surgery")
    return Path(root) / kind


def tokenizer_fingerprint(tokenizer) -> str:
    """Changes whenever the ids a text gets could change: the class, the whole vocabulary, a probe.
    Keys every on-disk token cache (calibration streams here, training corpora in surgery.data.corpus)."""
    vocab = sorted(tokenizer.get_vocab().items()) if hasattr(tokenizer, "get_vocab") else []
    probe = tokenizer("The corpus probe, 123 \n\t end. Ünïcödé", add_special_tokens=False)["input_ids"]
    blob = json.dumps([type(tokenizer).__name__, vocab, probe, getattr(tokenizer, "eos_token_id", None)], ensure_ascii=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def token_stream(tokenizer, files: list[str] | None) -> torch.Tensor:
    """All files tokenised and concatenated (1-D), cached on disk by content and tokenizer."""
    paths = [Path(f) for f in files] if files else [builtin_sample()]
    pieces = []
    fingerprint = tokenizer_fingerprint(tokenizer)  # hashes the whole vocabulary: once, not per file
    for path in paths:
        if not path.exists():
            raise CalibrationError(f"Calibration file '{path}' does not exist.", "Check the path given to --calibration.")
        cache = cache_dir() / f"{sha256_file(path)[:24]}-{fingerprint}.pt"
        if cache.exists():
            pieces.append(torch.load(cache))
            continue
        ids = tokenize(tokenizer, read_text(path))
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(f".tmp{os.getpid()}")
            torch.save(ids, tmp)
            os.replace(tmp, cache)
        except OSError:
            pass  # a read-only home only costs a re-tokenisation next time
        pieces.append(ids)
    ids = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
    if ids.numel() == 0:
        raise CalibrationError("The calibration text is empty.", "Pass --calibration with a non-empty text file.")
    return ids
