"""Every tokenizer surgery writes (a saved hybrid, a distillation checkpoint, an export) encodes and
decodes exactly as the teacher's it was loaded with, checked at write time.

A tokenizer that saves wrongly fails silently: transformers 5.17 built Gemma-3's GGUF tokenizer as a
Unigram model under a BPE config, and its reload split text into one token per character, so a
hybrid scored 2.25x the tokens its teacher did. So the writer reloads what it just wrote and compares
it with the tokenizer in memory on a fixed probe (ASCII, accents, CJK, emoji, whitespace runs, tabs,
newlines, digits, code): the same ids for every part, BOS/EOS handling included, and the same text
back from decoding. A difference raises TokenizerMismatchError inside the writer's staging
directory, so nothing is saved."""
from __future__ import annotations

from pathlib import Path

from ..core.versions import INSTALL, REQUIREMENT
from ..errors import CheckpointError, first_line

PROBE = {
    "ascii": "The quick brown fox jumps over the lazy dog. It's 3:45 p.m.; \"quoted\" (parens) [brackets] {braces} a-b_c/d\\e!",
    "accents": "Café, naïve façade; Ærøskøbing; Straße; São Paulo; Dvořák; Ελληνικά; русский текст.",
    "CJK": "東京都の日本語テキスト。中文文本，简体与繁體。한국어 문장입니다.",
    "emoji": "emoji 🙂👍🏽 🚀🇫🇷 👨‍👩‍👧 ❤️",
    "whitespace runs": "one two  three   four    eight        end   ",
    "tabs": "\tlead\ttab\t\tdouble\t \t mixed\t",
    "newlines": "line one\nline two\n\n\nafter three blank\r\nwindows line\n \n",
    "digits": "0 7 42 123 1234 12345 123456789 3.14159 -2.5e-10 1,000,000 2026-12-02 0x1F",
    "code": "def f(x):\n    return {'a': [x ** 2, x // 3]}  # comment\n\nif __name__ == \"__main__\":\n\tprint(f(7) != None)\n",
}
WHOLE = "".join(PROBE.values())


class TokenizerMismatchError(CheckpointError):
    """A tokenizer written to disk does not tokenize as the one it was saved from."""


def ids(tokenizer, text: str, special: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special, return_attention_mask=False)["input_ids"])


def difference(saved, teacher) -> str | None:
    """The first way `saved` tokenizes the probe unlike `teacher`, in words; None when they agree."""
    parts = [(name, text, False) for name, text in PROBE.items()] + [("whole probe with special tokens (BOS/EOS)", WHOLE, True)]
    for name, text, special in parts:
        mine, theirs = ids(saved, text, special), ids(teacher, text, special)
        if mine != theirs:
            return f"the '{name}' part: the saved tokenizer gives {len(mine)} tokens, the teacher's {len(theirs)}"
        if saved.decode(mine) != teacher.decode(theirs):
            return f"the '{name}' part decodes to different text ({len(mine)} tokens)"
    return None


def save_tokenizer(tokenizer, folder: str | Path) -> None:
    """tokenizer.save_pretrained(folder), then check_saved."""
    tokenizer.save_pretrained(folder)
    check_saved(tokenizer, folder)


def check_saved(tokenizer, folder: str | Path) -> None:
    """Reload the tokenizer written in `folder` (after any edit of its files) and refuse any difference from `tokenizer`."""
    import transformers
    from transformers import AutoTokenizer

    try:
        reloaded = AutoTokenizer.from_pretrained(folder)
    except Exception as exc:  # transformers raises many kinds; the writer only needs to know it failed
        found = f"the saved tokenizer cannot be loaded back ({first_line(exc)})"
    else:
        found = difference(reloaded, tokenizer)
    if found is not None:
        raise TokenizerMismatchError(
            f"The tokenizer saved with transformers {transformers.__version__} does not tokenize as the teacher's: {found}. Nothing was saved.",
            f"Use a transformers whose tokenizers save faithfully: surgery supports {REQUIREMENT} ({INSTALL}); "
            "if it already is one, report the teacher with this message.")
