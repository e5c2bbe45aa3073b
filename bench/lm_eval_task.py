"""The shipped local task (surgery_next_sentence: the true next sentence among four, from a held-out
slice of the corpus) for a teacher, its copy-only baseline (select, replace) and its Taylor-Calibrate
hybrid (select, replace, calibrate, align), in one process: one capture, a fresh branch per hybrid.

acc and acc_norm come from the project's own scoring (surgery.eval.choice_task, which
tests/test_lm_eval.py checks equals lm-eval item by item); when lm_eval is importable, lm-eval's own
numbers (the hybrid through its hf export) are added beside them. Calibration text: the corpus files
with the task's held-out lines cut off (surgery.eval.choice_items.training_files), unless
--calibration is given. Prints a markdown table and writes JSON (--json, default $OUT/lm_eval_task.json).

An entry point, run directly: lm-eval never loads this file. The task lm-eval loads lives in
surgery/eval/tasks/ (its --include_path, surgery.eval.choice_task.TASKS_DIR).

    python bench/lm_eval_task.py --model /root/m/smol.gguf --corpus .gpu/data --device cuda --dtype bfloat16
    python bench/lm_eval_task.py --model tests/assets/stories260k/stories260K.gguf --limit 20 \
        --set calibrate.samples=4 --set align.samples=4 --set align.steps=5   # CPU smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from surgery import PassManager, capture  # noqa: E402
from surgery.core.pipeline import parse_options  # noqa: E402
from surgery.eval.choice_items import CORPUS, training_files  # noqa: E402
from surgery.eval.choice_task import TASK, score  # noqa: E402

ROWS = {"teacher": None, "baseline": ["select", "replace"], "taylor-calibrate": ["select", "replace", "calibrate", "align"]}


def lm_eval_scores(graph, args) -> dict | None:
    """lm-eval's acc/acc_norm of the graph (a hybrid is exported first), or None without lm_eval."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        return None
    from surgery.eval.lm_harness import evaluate

    dtype = str(graph.dtype).removeprefix("torch.")
    return evaluate(graph, [TASK], limit=args.limit, device=str(graph.device), dtype=dtype, batch_size=1)["tasks"][TASK]


def build(teacher, passes, args, calibration: list[str]):
    if passes is None:
        return teacher
    configs = parse_options(args.set, {"select": {"keep_ratio": args.keep_ratio}})
    for name in ("calibrate", "align"):
        if name in passes:
            configs.setdefault(name, {})["calibration"] = calibration
    graph = teacher.branch()
    PassManager(passes, {name: c for name, c in configs.items() if name in passes})(graph)
    return graph


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2", help="teacher: a .gguf, a directory or a short name (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--corpus", type=Path, default=CORPUS, help="folder of the corpus *.txt.xz (calibration text, held-out lines cut off)")
    ap.add_argument("--calibration", nargs="*", default=None, help="calibration files instead of the corpus' training part")
    ap.add_argument("--keep-ratio", type=float, default=0.5)
    ap.add_argument("--limit", type=int, default=None, help="score only the first N items")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--set", action="append", default=[], help="pass option pass.key=value (repeatable)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="float32, bfloat16 (default: bfloat16 on CUDA, float32 on CPU)")
    ap.add_argument("--json", type=Path, default=Path(os.environ.get("OUT", ".")) / "lm_eval_task.json")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))

    with tempfile.TemporaryDirectory(prefix="lm-eval-task-") as tmp:
        calibration = args.calibration or [str(p) for p in training_files(args.corpus, Path(tmp))]
        teacher = capture(args.model, device=args.device, dtype=dtype)
        report = {"model": args.model, "task": TASK, "keep_ratio": args.keep_ratio, "dtype": str(dtype), "calibration": calibration, "rows": {}}
        for row in args.rows.split(","):
            start = time.time()
            graph = build(teacher, ROWS[row], args, calibration)
            built = time.time() - start
            own = score(graph, limit=args.limit)
            entry = {"acc": own["acc"], "acc_norm": own["acc_norm"], "items": own["items"], "build_s": round(built, 1),
                     "score_s": round(time.time() - start - built, 1)}
            entry["lm_eval"] = lm_eval_scores(graph, args)
            report["rows"][row] = entry
            print(f"{row}: {json.dumps(entry)}", flush=True)
            del graph
    print(f"\n{args.model}, {TASK}, keep ratio {args.keep_ratio} ({report['rows'][next(iter(report['rows']))]['items']} items)\n")
    print("| model | acc | acc_norm | lm-eval acc | lm-eval acc_norm |\n|---|---:|---:|---:|---:|")
    for row, e in report["rows"].items():
        theirs = e["lm_eval"] or {}
        print(f"| {row} | {e['acc']:.4f} | {e['acc_norm']:.4f} | {theirs.get('acc', float('nan')):.4f} | {theirs.get('acc_norm', float('nan')):.4f} |")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
