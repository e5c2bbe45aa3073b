"""A text's token count with a teacher's tokenizer and with the tokenizer a hybrid saves from it
(bench/RESULTS.md, 2026-12-02: Gemma-3-270M under transformers 5.17, 5.24 and 5.25).

    python bench/tokenizer_fidelity.py --model gemma3-270m --text /work/shared/data/wikitext-2-raw/wiki.test.raw

The teacher's tokenizer is built as surgery.core.load builds it (a GGUF's add_bos_token decides its
BOS); the saved one is what surgery.io.tokenizer_check.save_tokenizer writes (refused, and then
written unchecked to count what an unchecked save gives). Only the tokenizer is loaded, not the model.
Nothing is written outside a temporary directory."""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import transformers
from transformers import AutoTokenizer

from surgery.core.bos import align_leading
from surgery.core.load import check_gguf, gguf_adds_bos, one_gguf_parse, resolve
from surgery.data.text import read_text, tokenize
from surgery.errors import SurgeryError
from surgery.io.tokenizer_check import save_tokenizer

WINDOW_TEXT = 2047  # surgery eval's default chunk of 2048 tokens, BOS first


def teacher_tokenizer(model: str):
    path = resolve(model)
    if path.suffix != ".gguf":
        return AutoTokenizer.from_pretrained(path)
    reader = check_gguf(path)
    with one_gguf_parse(path, reader):
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    align_leading(tokenizer, gguf_adds_bos(reader), str(path))
    return tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--text", required=True)
    args = parser.parse_args()
    start = time.time()
    teacher = teacher_tokenizer(args.model)
    loaded = time.time() - start
    text = read_text(args.text)
    row = {"transformers": transformers.__version__, "tokenizer_load_s": round(loaded, 1), "teacher_tokens": tokenize(teacher, text).numel()}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "tokenizer"
        try:
            save_tokenizer(teacher, folder)
            row["save"] = "round trip exact"
        except SurgeryError as exc:
            row["save"] = f"refused: {type(exc).__name__}: {exc.problem}"
            teacher.save_pretrained(folder)  # unchecked, to count what it would have given
        row["saved_tokens"] = tokenize(AutoTokenizer.from_pretrained(folder), text).numel()
    row.update({f"{k}_predicted": row[f"{k}_tokens"] // WINDOW_TEXT * WINDOW_TEXT for k in ("teacher", "saved")})
    print(json.dumps(row))


if __name__ == "__main__":
    main()
