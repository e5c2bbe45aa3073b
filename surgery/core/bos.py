"""The BOS token that starts every window a model is scored, calibrated or trained on.

Text is tokenised without special tokens (surgery.data.text.tokenize), so a window cut from the
stream starts mid-text. Models trained with a BOS first (Gemma) score far worse without it, so each
window producer puts the tokenizer's BOS in front, when (and only when) the tokenizer itself puts
one first: a model that never saw BOS (SmolLM2) keeps its windows exactly as cut. The fact is read
from the tokenizer's behaviour, not from an attribute, because transformers versions and saved
tokenizers disagree on the attribute while the behaviour survives a save."""
from __future__ import annotations

import warnings

import torch

PROBE = "The window probe"


def leading_token(tokenizer) -> int | None:
    """The BOS id when encoding with special tokens puts it first; None for no tokenizer or no BOS."""
    bos = getattr(tokenizer, "bos_token_id", None) if tokenizer is not None else None
    if bos is None:
        return None
    ids = tokenizer(PROBE, add_special_tokens=True, return_attention_mask=False)["input_ids"]
    return int(bos) if ids and ids[0] == bos else None


def text_length(length: int, lead: int | None) -> int:
    """How many text tokens a window of `length` tokens holds: one fewer when a BOS leads it."""
    return length - 1 if lead is not None else length


def lead_windows(text: torch.Tensor, lead: int | None) -> torch.Tensor:
    """[N, T-1] text windows -> [N, T] with `lead` first; the windows unchanged when lead is None."""
    if lead is None:
        return text
    return torch.cat([text.new_full((text.shape[0], 1), lead), text], dim=1)


def lead_ids(ids: list[int], lead: int | None) -> list[int]:
    """One prompt's ids with `lead` first (unchanged when lead is None)."""
    return ids if lead is None else [lead, *ids]


def align_leading(tokenizer, wanted: bool, source: str = "") -> None:
    """Make the tokenizer put BOS first exactly when `wanted` (a GGUF's tokenizer.ggml.add_bos_token),
    so every transformers version gives the same windows; warn (once per source) if it will not."""
    if tokenizer is None or getattr(tokenizer, "bos_token_id", None) is None:
        return
    if (leading_token(tokenizer) is not None) == wanted:
        return
    try:
        tokenizer.add_bos_token = wanted
    except (AttributeError, TypeError, ValueError):
        pass
    if (leading_token(tokenizer) is not None) != wanted:
        warnings.warn(f"The tokenizer of {source or 'this model'} {'does not add' if wanted else 'adds'} a BOS token, "
                      f"against its GGUF metadata (add_bos_token={wanted}); windows follow the tokenizer.", stacklevel=2)
