"""Reading text files (plain or .xz, newlines normalised) and turning text into token ids."""
from __future__ import annotations

import lzma
import os
import stat
from pathlib import Path

import torch

from ..errors import DataError, SurgeryError


BLOCK_CHARS = 1 << 20    # text is handed out in blocks of about this many characters, cut at newlines


def require_file(path: str | Path) -> Path:
    """The path of a text input that exists, or the error every reader gives for one that does not."""
    path = Path(path)
    if not path.is_file():
        if path.exists():
            raise SurgeryError(f"Text file '{path}' is {special_kind(path)}, not a regular file.", "Pass a text file.")
        raise SurgeryError(f"Text file '{path}' does not exist.", "Check the path.")
    return path


def special_kind(path: Path) -> str | None:
    """What a path that exists but is no regular file is ('a named pipe (FIFO)', ...), else None.
    Opening a FIFO blocks until a writer comes, a character device may never end: text inputs are
    regular files only (checked with stat, which opens nothing)."""
    mode = os.stat(path).st_mode
    if stat.S_ISREG(mode):
        return None
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "a special file")


def require_tokenizer(tokenizer):
    """The tokenizer, or the error every tokenising reader gives for a model without one."""
    if tokenizer is None:
        raise SurgeryError("This model has no tokenizer.", "Load it from a directory or GGUF that carries one.")
    return tokenizer


def text_blocks(path: str | Path):
    """The file's text (plain or .xz; CRLF and CR read as LF) in blocks cut after a newline, so a
    fast tokenizer never holds a whole corpus. Joined, the blocks are the whole text."""
    path = require_file(path)
    opener = lzma.open if path.suffix == ".xz" else open
    with opener(path, "rt", encoding="utf-8", newline=None) as f:
        rest = ""
        while True:
            chunk = f.read(BLOCK_CHARS)
            if not chunk:
                break
            text = rest + chunk
            cut = text.rfind("\n")
            if cut < 0:
                rest = text
                continue
            yield text[:cut + 1]
            rest = text[cut + 1:]
        if rest:
            yield rest


def read_text(path: str | Path) -> str:
    """The whole text of a file (the one reader: text_blocks, joined)."""
    return "".join(text_blocks(path))


def tokenize(tokenizer, text: str) -> torch.Tensor:
    """Token ids [N] of `text` as one tokenizer call, without special tokens."""
    ids = require_tokenizer(tokenizer)(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


TEXT_PROBE_BYTES = 1 << 16


def check_text_file(path: str | Path, what: str = "Text file") -> Path:
    """Refuse, before any model loads, a text input that is missing, unreadable or not text: NUL
    bytes or invalid UTF-8 in its first block (of the decompressed stream for .xz)."""
    import codecs

    path = Path(path)
    if not path.exists():
        raise DataError(f"{what} '{path}' does not exist.", "Check the path.")
    kind = special_kind(path)
    if kind is not None:
        raise DataError(f"{what} '{path}' is {kind}, not a regular file.", "Pass a text file (a pipe or device cannot be read twice, and may never end).")
    opener = lzma.open if path.suffix == ".xz" else open
    try:
        with opener(path, "rb") as f:
            block = f.read(TEXT_PROBE_BYTES)
    except (OSError, EOFError, lzma.LZMAError) as exc:
        raise DataError(f"{what} '{path}' cannot be read: {exc}.", "Check the file and its permissions.") from exc
    if b"\0" in block:
        raise DataError(f"{what} '{path}' is not text (it holds NUL bytes, at byte {block.index(0)}).", "Pass a UTF-8 text file (or a .xz of one).")
    try:
        codecs.getincrementaldecoder("utf-8")().decode(block, final=len(block) < TEXT_PROBE_BYTES)
    except UnicodeDecodeError as exc:
        raise DataError(f"{what} '{path}' is not UTF-8 text (byte {exc.start} cannot be decoded).", "Pass a UTF-8 text file (or a .xz of one).") from exc
    require_words(path, what, block)
    return path


def require_words(path: Path, what: str, probe: bytes) -> None:
    """Refuse a text input with nothing but whitespace in it (or nothing at all): no model should
    load for it. `probe` is the file's first block; the rest is read only while it is all blank."""
    if probe.strip():
        return
    if len(probe) == TEXT_PROBE_BYTES and any(block.strip() for block in text_blocks(path)):
        return
    kind = "is empty" if not probe else "holds only whitespace"
    raise DataError(f"{what} '{path}' {kind}.", "Pass a file with some text in it.")
