"""The items of the shipped lm-eval task `surgery_next_sentence`: choose the true next sentence among four.

Built from a HELD-OUT slice of the project's corpus (/work/shared/data/corpus, see its README), never
from WikiText-2 (evaluation only) nor the built-in calibration sample:

* austen.txt: its last 3,000 of 73,437 lines (the end of Sense and Sensibility), cut into
  paragraphs (blank lines) and sentences; context = the two sentences before the answer in the
  same paragraph.
* kjv.txt: its last 1,200 of 31,102 verses (Titus 1 to Revelation 22), one verse a sentence;
  context = the two verses before the answer.

The three wrong choices of an item are sentences of the same slice, drawn from elsewhere (another
paragraph; verses more than five away), with a length within [2/3, 3/2] of the answer's, so length
alone tells little. To keep the task held out, calibrate and distil on the lines before each slice:
`training_files` writes the corpus without them (bench/lm_eval_task.py calibrates on those).

Deterministic: `python -m surgery.eval.choice_items [--corpus DIR] [--out FILE]` rewrites the shipped
items.jsonl byte for byte (seed 0; tests/test_lm_eval.py checks the sha256 when the corpus is here)."""
from __future__ import annotations

import argparse
import json
import lzma
import random
import re
from pathlib import Path

CORPUS = Path("/work/shared/data/corpus")
HELD_OUT_LINES = {"austen": 3000, "kjv": 1200}  # the last lines of <name>.txt.xz
ITEMS_PER_SOURCE = 150
SEED = 0
SENTENCE_CHARS = (25, 180)  # an answer's (and a distractor's) length in characters
CONTEXT_CHARS = (40, 400)
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"'A-Z])|(?<=[.!?][\"'])\s+(?=[\"'A-Z])")
ABBREVIATIONS = ("Mr.", "Mrs.", "Dr.", "St.", "Col.")


def corpus_lines(corpus: Path, name: str) -> list[str]:
    with lzma.open(corpus / f"{name}.txt.xz", "rt", encoding="utf-8") as f:
        return f.read().split("\n")[:-1]  # the file ends with a newline


def held_out(corpus: Path, name: str) -> list[str]:
    return corpus_lines(corpus, name)[-HELD_OUT_LINES[name]:]


def training_files(corpus: Path, folder: Path) -> list[Path]:
    """Every corpus file with the task's held-out lines cut off (written into `folder` as .txt;
    files without a held-out slice are named as they are): calibration text that leaves the task held out."""
    files = []
    for path in sorted(corpus.glob("*.txt.xz")):
        name = path.name.removesuffix(".txt.xz")
        if name in HELD_OUT_LINES:
            path = folder / f"{name}.txt"
            path.write_text("".join(line + "\n" for line in corpus_lines(corpus, name)[:-HELD_OUT_LINES[name]]), encoding="utf-8")
        files.append(path)
    return files


def sentences(paragraph: str) -> list[str]:
    """A paragraph's sentences; a split after Mr./Mrs./... is undone."""
    out: list[str] = []
    for piece in SENTENCE_END.split(" ".join(paragraph.split())):
        if out and out[-1].endswith(ABBREVIATIONS):
            out[-1] += " " + piece
        else:
            out.append(piece)
    return out


def austen_groups(lines: list[str]) -> list[list[str]]:
    """Paragraphs (blank-line separated) as lists of sentences."""
    text = "\n".join(lines)
    return [sentences(p) for p in re.split(r"\n\s*\n", text) if p.strip()]


def kjv_groups(lines: list[str]) -> list[list[str]]:
    """One group of every verse: neighbours are the context, far verses the distractors."""
    return [[" ".join(v.split()) for v in lines if v.strip()]]


def fits(text: str, bounds: tuple[int, int]) -> bool:
    return bounds[0] <= len(text) <= bounds[1]


def candidates(groups: list[list[str]]) -> list[tuple[int, int]]:
    """(group, position) of every answer with two sentences of context before it."""
    return [(g, i) for g, group in enumerate(groups) for i in range(2, len(group))
            if fits(group[i], SENTENCE_CHARS) and fits(" ".join(group[i - 2:i]), CONTEXT_CHARS)]


def similar_length(a: str, b: str) -> bool:
    return 2 * len(a) <= 3 * len(b) and 2 * len(b) <= 3 * len(a)


def distractors(groups, g: int, i: int, rng: random.Random, pool: list[tuple[int, int]]) -> list[str]:
    """Three sentences from elsewhere in the slice, each of a length near the answer's."""
    answer = groups[g][i]
    near = [(h, j) for h, j in pool if similar_length(groups[h][j], answer) and (h != g if len(groups) > 1 else abs(j - i) > 5)]
    chosen: list[str] = []
    for h, j in rng.sample(near, len(near)):
        if groups[h][j] not in chosen and groups[h][j] != answer:
            chosen.append(groups[h][j])
        if len(chosen) == 3:
            return chosen
    raise ValueError(f"fewer than 3 distractors near {answer!r}")


def source_items(name: str, groups: list[list[str]], rng: random.Random) -> list[dict]:
    pool = [(g, i) for g, group in enumerate(groups) for i in range(len(group)) if fits(group[i], SENTENCE_CHARS)]
    picked = sorted(rng.sample(candidates(groups), ITEMS_PER_SOURCE))
    items = []
    for n, (g, i) in enumerate(picked):
        choices = [groups[g][i], *distractors(groups, g, i, rng, pool)]
        rng.shuffle(choices)
        items.append({"id": f"{name}-{n:03d}", "source": name, "context": " ".join(groups[g][i - 2:i]),
                      "choices": choices, "label": choices.index(groups[g][i])})
    return items


def build_items(corpus: Path = CORPUS, seed: int = SEED) -> list[dict]:
    """Both sources' items, shuffled together so that the first N (lm-eval's --limit) mix them."""
    rng = random.Random(seed)
    items = [*source_items("austen", austen_groups(held_out(corpus, "austen")), rng),
             *source_items("kjv", kjv_groups(held_out(corpus, "kjv")), rng)]
    rng.shuffle(items)
    return items


def write_items(items: list[dict], path: Path) -> None:
    path.write_text("".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items), encoding="utf-8")


def main(argv=None) -> None:
    from .choice_task import items_path

    parser = argparse.ArgumentParser(description="Rebuild the shipped next-sentence items from the corpus.")
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument("--out", type=Path, default=items_path())
    args = parser.parse_args(argv)
    items = build_items(args.corpus)
    write_items(items, args.out)
    print(f"{len(items)} items -> {args.out} ({args.out.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
