"""The on-disk token cache: each text file tokenised once per (file content, tokenizer, rule) into a
flat array of ids, so a second run, a second pass or a second rank reads ids instead of tokenising.
Calibration text, evaluation text and training corpora all come through here.

Two tokenisation rules, because they are different protocols, not two caches:
  whole   the file's text in one tokenizer call (the WikiText-2 perplexity protocol; calibration)
  blocks  the text in newline-cut blocks (surgery.data.text.text_blocks), so a multi-GB corpus is
          never one string; ids can differ from "whole" at block edges for tokenizers that mark the
          start of a call (SentencePiece)."""
from __future__ import annotations

import hashlib
import json
import os
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from ..core.files import sha256_file
from ..errors import CalibrationError
from .text import read_text, require_file, require_tokenizer, text_blocks, tokenize

FORMAT = 2               # bump when the on-disk layout or a tokenisation rule changes
RULES = ("whole", "blocks")


def builtin_sample() -> Path:
    return Path(str(resources.files("surgery.data") / "calibration_sample.txt"))


def cache_dir() -> Path:
    """Where tokenised text is cached: $SURGERY_CACHE, else $XDG_CACHE_HOME/surgery or ~/.cache/surgery."""
    root = os.environ.get("SURGERY_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"), "surgery")
    return Path(root) / "tokens"


def tokenizer_fingerprint(tokenizer) -> str:
    """Changes whenever the ids a text gets could change: the class, the whole vocabulary, a probe."""
    vocab = sorted(tokenizer.get_vocab().items()) if hasattr(tokenizer, "get_vocab") else []
    probe = tokenizer("The corpus probe, 123 \n\t end. Ünïcödé", add_special_tokens=False)["input_ids"]
    blob = json.dumps([type(tokenizer).__name__, vocab, probe, getattr(tokenizer, "eos_token_id", None)], ensure_ascii=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def token_dtype(tokenizer) -> np.dtype:
    size = len(tokenizer) if hasattr(tokenizer, "__len__") else len(tokenizer.get_vocab())
    return np.dtype(np.uint16) if size <= np.iinfo(np.uint16).max else np.dtype(np.uint32)


def _pieces(path: Path, tokenizer, rule: str, dtype: np.dtype):
    """The file's ids by `rule`, as arrays in order."""
    if rule == "whole":
        yield tokenize(tokenizer, read_text(path)).numpy().astype(dtype)
        return
    for block in text_blocks(path):
        yield np.asarray(tokenizer(block, add_special_tokens=False, return_attention_mask=False)["input_ids"], dtype=dtype)


def _write_ids(target: Path, path: Path, tokenizer, rule: str, dtype: np.dtype) -> None:
    """Tokenise `path` by `rule` into a temporary file, then rename it onto `target`."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            for piece in _pieces(path, tokenizer, rule, dtype):
                piece.tofile(f)
        os.replace(tmp, target)  # concurrent builders write identical bytes; the last rename wins
    finally:
        tmp.unlink(missing_ok=True)


def file_tokens(path, tokenizer, *, rule: str = "whole", fingerprint: str | None = None,
                digest: str | None = None) -> tuple[np.ndarray, Path | None]:
    """(ids, cache file) of one text file: a read-only memmap of the cached ids, tokenised first if
    needed. fingerprint/digest: the tokenizer's and the file's, when the caller has them already.
    A cache that cannot be written (a read-only home) costs only a re-tokenisation next time."""
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    path, dtype = require_file(path), token_dtype(require_tokenizer(tokenizer))
    fingerprint = fingerprint or tokenizer_fingerprint(tokenizer)
    key = hashlib.sha256(json.dumps([FORMAT, rule, digest or sha256_file(path), fingerprint]).encode()).hexdigest()[:24]
    target = cache_dir() / f"{key}.{dtype.name}"
    if not target.exists():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            _write_ids(target, path, tokenizer, rule, dtype)
        except OSError:
            return np.concatenate([np.zeros(0, dtype), *_pieces(path, tokenizer, rule, dtype)]), None
    ids = np.memmap(target, dtype=dtype, mode="r") if target.stat().st_size else np.zeros(0, dtype)
    return ids, target


def text_ids(path, tokenizer) -> torch.Tensor:
    """One text file's ids [N] (int64) by the whole-file rule, through the cache."""
    return torch.from_numpy(np.asarray(file_tokens(path, tokenizer)[0], dtype=np.int64))


def token_stream(tokenizer, files: list[str] | None) -> torch.Tensor:
    """Calibration text: all files tokenised (whole-file rule) and concatenated (1-D int64)."""
    paths = [Path(f) for f in files] if files else [builtin_sample()]
    fingerprint = tokenizer_fingerprint(tokenizer) if tokenizer is not None else None  # the whole vocabulary: once
    pieces = []
    for path in paths:
        if not path.exists():
            raise CalibrationError(f"Calibration file '{path}' does not exist.", "Check the path given to --calibration.")
        ids, _ = file_tokens(path, tokenizer, fingerprint=fingerprint)
        pieces.append(torch.from_numpy(np.asarray(ids, dtype=np.int64)))
    ids = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
    if ids.numel() == 0:
        raise CalibrationError("The calibration text is empty.", "Pass --calibration with a non-empty text file.")
    return ids
