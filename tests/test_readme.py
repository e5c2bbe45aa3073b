"""README's code runs as written: its ```python blocks are executed and its ```bash blocks' `surgery`
commands are run (in-process, typer's CliRunner), in the order README gives them, in an empty
working directory, each checked to succeed.

Substitutions, all of them here (the commands are otherwise README's own text):
* the teacher: the default teacher's short names (smollm2-135m-instruct, smollm2, ...) resolve to
  stories260K (tests/assets), so `surgery inspect` with no --model and `capture("smollm2-135m-instruct")`
  run on the real tiny teacher;
* placeholders: M and path/to/model_dir -> stories260K's GGUF ("any HF model directory or .gguf
  file"), DIR -> out/dir, DIR2 -> out/distilled, HF_DIR -> out/hf; the text files README names
  (my_text.txt, wiki.test.raw, corpus.txt, held_out.txt, austen.txt) are written into the working directory as
  a few paragraphs of TinyStories-like text; `[--option value]` (an optional part) is left out;
* budgets: every `surgery apply` gets `--set align.steps=2 --set align.samples=4 --set
  calibrate.samples=4` (replacing README's own align.steps);
  `--lengths 1024,2048,4096` becomes `--lengths 256` (stories260K takes 512 positions); distill's
  `--tokens 50M` becomes `--tokens 1024 --seq-len 64`; `--task lm-eval` gets `--limit 4`.
Lines not run, each with its reason, are SKIPPED below; a skipped line that left README fails the test."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from surgery.core import load as load_module

from cli_checks import invoke

README = Path(__file__).resolve().parent.parent / "README.md"

SKIPPED = {
    "pip install": "installs packages: the test runs in the environment that is already installed",
    "python -m pytest tests": "runs the whole suite, this test included",
    "torchrun": "starts two processes (DDP); tests/test_distill.py runs distill in two gloo processes",
    "lm_eval --model hf": "lm-evaluation-harness's own program over the whole task; `surgery eval --task lm-eval` above "
                          "runs the same harness in-process, and tests/test_lm_eval.py compares its scores item by item",
    "surgery apply --model QWEN3_DIR": "needs a Qwen3-family teacher with a tokenizer (Qwen3.5's form needs q/k norms, which "
                                       "stories260K's Llama lacks); tests/test_export_qwen3_5.py runs this path on a tiny Qwen3",
    "surgery export --model out/q ": "exports the Qwen3 hybrid of the line above (tests/test_export_qwen3_5.py)",
}
PLACEHOLDERS = {"DIR": "out/dir", "DIR2": "out/distilled", "HF_DIR": "out/hf"}  # and M, path/to/model_dir: stories260K
TEXT_FILES = ("my_text.txt", "wiki.test.raw", "corpus.txt", "held_out.txt", "austen.txt")
STORY = ("Once upon a time, there was a little cat named Tom. Tom liked to play with a red ball in the garden. One day, "
         "the ball rolled under a big bush. Tom was sad because he could not find it. His friend, a small bird, flew down "
         "and said, \"I can help you, Tom!\" The bird looked under the bush and found the ball. Tom was very happy.\n\n")


def blocks() -> list[tuple[str, int, str]]:
    """(language, line, code) of every fenced block of README, in order."""
    text = README.read_text(encoding="utf-8")
    return [(m[1], text[:m.start()].count("\n") + 1, m[2]) for m in re.finditer(r"```(\w+)\n(.*?)```", text, re.S)]


def commands(code: str) -> list[str]:
    """A bash block's commands: continuation lines joined, `a && b` split."""
    joined = re.sub(r"\\\n\s*", " ", code)
    return [part.strip() for line in joined.splitlines() for part in line.split(" && ") if part.strip()]


def skip_reason(command: str) -> str | None:
    return next((why for start, why in SKIPPED.items() if command.startswith(start)), None)


def budgeted(args: list[str], model: str) -> list[str]:
    """README's command with the placeholders filled in and the budgets above (nothing else changes)."""
    names = PLACEHOLDERS | {"M": model, "path/to/model_dir": model}
    args = [names.get(a, a) for a in args]
    args = [a for a in args if not a.startswith("align.steps=")]
    args = [a for i, a in enumerate(args) if not (a == "--set" and (i + 1 == len(args) or args[i + 1].startswith("--")))]
    if args[1] == "apply":
        args += ["--set", "align.steps=2", "--set", "align.samples=4", "--set", "calibrate.samples=4"]
    if "--lengths" in args:
        args[args.index("--lengths") + 1] = "256"
    if args[1] == "distill" and "--tokens" in args:
        args[args.index("--tokens") + 1:args.index("--tokens") + 2] = ["1024", "--seq-len", "64"]
    if "lm-eval" in args and "--limit" not in args:
        args += ["--limit", "4"]
    return args


def test_readme_runs_as_written(stories_path, tmp_path, monkeypatch):
    for name in [n for n in load_module.SHORT_NAMES if n.startswith("smollm2")]:
        monkeypatch.setitem(load_module.SHORT_NAMES, name, lambda: stories_path)
    monkeypatch.chdir(tmp_path)
    for name in TEXT_FILES:
        Path(name).write_text(STORY * 8)
    runner, namespace, ran, skipped = CliRunner(), {}, [], set()
    for language, line, code in blocks():
        where = f"README.md line {line}"
        if language == "python":
            exec(compile(code, where, "exec"), namespace)  # noqa: S102 (README's own code)
            ran.append(where)
            continue
        for command in commands(code):
            if skip_reason(command):
                skipped.add(next(s for s in SKIPPED if command.startswith(s)))
                continue
            command = re.sub(r" \[[^\]]*\]", "", command)  # [--optional parts]
            args = budgeted(shlex.split(command, comments=True), str(stories_path))
            assert args[0] == "surgery", f"{where}: README runs '{args[0]}', which the test neither runs nor skips by name"
            result = invoke(runner, *args[1:])
            assert result.exit_code == 0, f"{where}: {' '.join(args)}\n{result.output}"
            ran.append(" ".join(args))
    assert set(SKIPPED) == skipped, f"skipped lines no longer in README: {set(SKIPPED) - skipped}"
    assert namespace["logits"].shape[:2] == namespace["input_ids"].shape and namespace["logits"].shape[-1] == 512
    assert namespace["changes"]["groups"] and isinstance(namespace["model"], torch.nn.Module)
    assert any(" distill " in f" {r} " for r in ran) and any(r.startswith("surgery verify-export") for r in ran)
