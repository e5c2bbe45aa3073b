"""The same figure through every path a user takes (issue 27), for one teacher, in one run.

Rows (WikiText-2 protocol: non-overlapping chunks, the same --chunk and --batch-size everywhere):
  teacher   in memory    capture(M) -> perplexity()                       (what the benches score)
  teacher   CLI          `surgery eval --model M --text T --json`
  hybrid    in memory    PassManager(README's default passes and options) on capture(M) -> perplexity()
  hybrid    saved        that same graph -> surgery.save(DIR) -> `surgery eval --model DIR`
  hybrid    CLI          `surgery apply --model M --out DIR2` (README's defaults) -> `surgery eval --model DIR2`
Each row gives perplexity, predicted tokens and the gap to its in-memory row (issue 27: within 0.5%).
Token counts of the whole eval file by the teacher's tokenizer and by each saved hybrid's must be
equal (a hybrid that tokenizes unlike its teacher scores a different text).

The CLI rows run the installed `surgery` command in a subprocess, as a user would; the hybrid's
in-memory build uses the same seeds as `apply` (replace and align are seeded), so the CLI row differs
from it only by GPU nondeterminism in align.

    python bench/through_save.py --model smollm2-135m-instruct --eval ../shared/data/wikitext-2-raw/wiki.test.raw --json /tmp/ts.json
    # quick check on the CPU (stories260K, 2 align steps, a cut text):
    python bench/through_save.py --model ../shared/models/stories260k --eval ../shared/data/wikitext-2-raw/wiki.test.raw --set align.steps=2 --max-chars 20000
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from surgery import PassManager, capture, save  # noqa: E402
from surgery.core.pipeline import parse_options  # noqa: E402
from surgery.data.cache import text_ids  # noqa: E402
from surgery.eval.perplexity import perplexity  # noqa: E402

DEFAULT_PASSES = "select,replace,calibrate,align"


def arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="a model source the CLI takes (GGUF, directory, short name)")
    ap.add_argument("--eval", required=True, help="the text to score (WikiText-2 test)")
    ap.add_argument("--passes", default=DEFAULT_PASSES)
    ap.add_argument("--set", dest="options", action="append", default=[], help="pass.key=value, as `surgery apply --set`")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--dtype", default=None, help="default: the CLI's (bfloat16 on CUDA, float32 on the CPU)")
    ap.add_argument("--max-chars", type=int, default=0, help="score only the eval file's first N characters (0: all)")
    ap.add_argument("--workdir", default=None, help="where the saved hybrids go (default: a temporary directory)")
    ap.add_argument("--label", default="", help="a tag for the JSON (e.g. the transformers version under test)")
    ap.add_argument("--json", default=None)
    return ap.parse_args()


def cli(*args: str) -> dict:
    """One `surgery ...` command as a user runs it; its --json output, and its wall seconds."""
    exe = shutil.which("surgery")
    command = [exe] if exe else [sys.executable, "-m", "surgery.cli.app"]
    start = time.perf_counter()
    done = subprocess.run([*command, *args], capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"`surgery {' '.join(args)}` failed ({done.returncode}):\n{done.stderr[-3000:]}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return (json.loads(lines[-1]) if lines else {}) | {"seconds": seconds}


def main() -> None:
    a = arguments()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = a.dtype or ("bfloat16" if device == "cuda" else "float32")
    work = a.workdir or tempfile.mkdtemp(prefix="through_save.")
    text = a.eval
    if a.max_chars:
        text = os.path.join(work, "eval_cut.txt")
        with open(a.eval, encoding="utf-8") as src, open(text, "w", encoding="utf-8") as dst:
            dst.write(src.read(a.max_chars))
    score_args = ["--text", text, "--chunk", str(a.chunk), "--batch-size", str(a.batch_size), "--dtype", dtype, "--json"]
    sets = [x for o in a.options for x in ("--set", o)]
    results = {"model": a.model, "text": a.eval, "max_chars": a.max_chars, "label": a.label, "device": device, "dtype": dtype,
               "transformers": transformers.__version__, "torch": torch.__version__, "passes": a.passes, "options": a.options,
               "chunk": a.chunk, "batch_size": a.batch_size, "rows": []}

    def row(model: str, path: str, got: dict, ref: dict | None = None) -> None:
        entry = {"model": model, "path": path, "perplexity": got["perplexity"], "tokens": got["tokens"],
                 "seconds": got.get("seconds")}
        if ref is not None:
            entry["gap"] = got["perplexity"] / ref["perplexity"] - 1
            entry["same_tokens"] = got["tokens"] == ref["tokens"]
        results["rows"].append(entry)
        print(json.dumps(entry), flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(results, f, indent=1)

    def memory(graph) -> dict:
        start = time.perf_counter()
        got = perplexity(graph, text_ids(text, graph.tokenizer), chunk=a.chunk, batch_size=a.batch_size)
        return got | {"seconds": time.perf_counter() - start}

    teacher = capture(a.model, device=device, dtype=getattr(torch, dtype))
    results["teacher_tokens_whole_file"] = int(text_ids(a.eval, teacher.tokenizer).numel())
    t_mem = memory(teacher)
    row("teacher", "in memory", t_mem)
    row("teacher", "CLI eval", cli("eval", "--model", a.model, *score_args), t_mem)

    names = [p for p in a.passes.split(",") if p]
    start = time.perf_counter()
    PassManager(names, parse_options(a.options))(teacher)  # the graph becomes the hybrid
    results["passes_seconds_in_memory"] = time.perf_counter() - start
    h_mem = memory(teacher)
    row("hybrid", "in memory", h_mem)
    saved = os.path.join(work, "hybrid_saved")
    save(teacher, saved, force=True)
    del teacher
    if device == "cuda":
        torch.cuda.empty_cache()
    row("hybrid", "surgery.save -> CLI eval", cli("eval", "--model", saved, *score_args), h_mem)

    applied = os.path.join(work, "hybrid_cli")
    applied_run = cli("apply", "--model", a.model, "--passes", a.passes, *sets, "--dtype", dtype, "--out", applied, "--force")
    results["apply_seconds"] = applied_run["seconds"]
    row("hybrid", "CLI apply -> CLI eval", cli("eval", "--model", applied, *score_args), h_mem)

    for label, path in (("saved", saved), ("cli", applied)):
        tok = AutoTokenizer.from_pretrained(os.path.join(path, "tokenizer"))  # what surgery.load reads
        results[f"{label}_hybrid_tokens_whole_file"] = int(text_ids(a.eval, tok).numel())
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    print_table(results)


def print_table(r: dict) -> None:
    print(f"\n{r['model']} on {os.path.basename(r['text'])} ({r['device']}, {r['dtype']}, transformers {r['transformers']}); "
          f"whole-file tokens: teacher {r['teacher_tokens_whole_file']:,}, saved hybrid {r['saved_hybrid_tokens_whole_file']:,}, "
          f"CLI hybrid {r['cli_hybrid_tokens_whole_file']:,}")
    print("| model | path | perplexity | predicted tokens | gap to in-memory |\n|---|---|---:|---:|---:|")
    for e in r["rows"]:
        gap = f"{100 * e['gap']:+.3f}%" if "gap" in e else "-"
        print(f"| {e['model']} | {e['path']} | {e['perplexity']:.3f} | {e['tokens']:,} | {gap} |")


if __name__ == "__main__":
    main()
