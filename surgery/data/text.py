"""Reading text files (plain or .xz, newlines normalised) and turning text into token ids."""
from __future__ import annotations

from pathlib import Path

import torch

from ..errors import SurgeryError


def read_text(path: str | Path) -> str:
    path = Path(path)
    if not path.exists():
        raise SurgeryError(f"Text file '{path}' does not exist.", "Check the path.")
    if path.suffix == ".xz":
        import lzma

        with lzma.open(path, "rt", encoding="utf-8") as f:
            return f.read()
    return path.read_text(encoding="utf-8")


def tokenize(tokenizer, text: str) -> torch.Tensor:
    if tokenizer is None:
        raise SurgeryError("This model has no tokenizer.", "Load it from a directory or GGUF that carries one.")
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)
