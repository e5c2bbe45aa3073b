"""Ablation of Taylor-Calibrate's phases: zero-shot perplexity and wall time per row.

One teacher capture, then for each keep ratio and row a fresh branch of it runs the passes:
  baseline      select, replace (copy projections, fla default init for the new parameters)
  zero-gate     + g_proj = 0 (the layer outputs nothing: the replaced attention is dropped)
  phase1        + calibrate (our default options)
  phase1-ref    + calibrate with the reference code's choices (gate=reference, concentration=minmax)
  phase2        + align only
  phase1+2      + calibrate + align
Calibration text from the corpus files given (never the evaluation file); evaluation with the
WikiText-2 protocol (surgery.eval.perplexity). Prints a markdown table and writes JSON.

    python bench/ablation.py --model /root/m/smol.gguf --calibration data/corpus/austen.txt.xz ... \
        --eval data/wikitext-2-raw/wiki.test.raw --keep-ratios 0.5 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from surgery import PassManager, capture  # noqa: E402
from surgery.data.text import read_text, tokenize
from surgery.eval.perplexity import perplexity  # noqa: E402
from surgery.core.pipeline import parse_options  # noqa: E402

ZERO_GATE = {"gate": "zero", "decay": False, "write_gate": False, "value_scale": False}
REFERENCE = {"gate": "reference", "concentration": "minmax"}
ROWS = {
    "baseline": (["select", "replace"], {}),
    "baseline-silu": (["select", "replace"], {"replace": {"v_activation": "silu"}}),
    "zero-gate": (["select", "replace", "calibrate"], {"calibrate": ZERO_GATE}),
    "phase1-ref": (["select", "replace", "calibrate"], {"calibrate": REFERENCE}),
    "phase1": (["select", "replace", "calibrate"], {}),
    "phase2": (["select", "replace", "align"], {}),
    "phase1+2": (["select", "replace", "calibrate", "align"], {}),
    "phase1+2-16x256": (["select", "replace", "calibrate", "align"], {"calibrate": {"samples": 16}, "align": {"samples": 16}}),
    "phase1+2-4x256": (["select", "replace", "calibrate", "align"], {"calibrate": {"samples": 4}, "align": {"samples": 4}}),
}


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_conversion(teacher, passes, configs):
    """(graph, PassResult, seconds) of one conversion on a fresh branch of the teacher, timed with the device synchronised."""
    graph = teacher.branch()
    sync()
    start = time.perf_counter()
    result = PassManager(passes, configs)(graph)
    sync()
    return graph, result, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--calibration", nargs="+", required=True)
    ap.add_argument("--eval", required=True)
    ap.add_argument("--keep-ratios", default="0.5")
    ap.add_argument("--rows", default="baseline,zero-gate,phase1-ref,phase1,phase2,phase1+2")
    ap.add_argument("--rows-other", default=None, help="rows for keep ratios after the first (default: --rows)")
    ap.add_argument("--set", nargs="*", default=[], help="pass.key=value applied to every row that runs the pass")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-eval-tokens", type=int, default=0, help="truncate the evaluation stream (0: all)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    overrides = parse_options(args.set)

    t0 = time.perf_counter()
    teacher = capture(args.model, device=args.device, dtype=getattr(torch, args.dtype))
    print(f"captured {args.model}: {teacher.num_layers} attention layers in {time.perf_counter() - t0:.1f} s", flush=True)
    ids = tokenize(teacher.tokenizer, read_text(args.eval))
    if args.max_eval_tokens:
        ids = ids[: args.max_eval_tokens]
    results = []
    ev = perplexity(teacher, ids, chunk=args.chunk, batch_size=args.batch_size)
    results.append({"keep_ratio": 1.0, "row": "teacher", "perplexity": ev["perplexity"], "tokens": ev["tokens"]})
    print(f"teacher: ppl {ev['perplexity']:.2f} over {ev['tokens']} tokens", flush=True)
    for index, ratio in enumerate(float(r) for r in args.keep_ratios.split(",")):
        rows = args.rows if index == 0 or not args.rows_other else args.rows_other
        for row in rows.split(","):
            passes, configs = ROWS[row]
            configs = {name: {**configs.get(name, {}), **overrides.get(name, {})} for name in passes if name in configs or name in overrides}
            configs.setdefault("select", {})["keep_ratio"] = ratio
            for name in ("calibrate", "align"):
                if name in passes:
                    configs.setdefault(name, {})["calibration"] = args.calibration
            graph, result, seconds = timed_conversion(teacher, passes, configs)
            ev = perplexity(graph, ids, chunk=args.chunk, batch_size=args.batch_size)
            entry = {
                "keep_ratio": ratio, "row": row, "perplexity": ev["perplexity"], "tokens": ev["tokens"],
                "converted": graph.meta["select"].convert, "passes_seconds": seconds,
                "calibrate_seconds": graph.meta.get("calibrate", {}).get("seconds"),
                "align_seconds": graph.meta.get("align", {}).get("seconds"),
                "align_steps": graph.meta.get("align", {}).get("steps"),
                "calibrate_rel_error": result.info.get("calibrate", {}).get("mean_rel_error_after"),
                "align_best_loss": result.info.get("align", {}).get("mean_best_loss"),
            }
            results.append(entry)
            print(json.dumps(entry), flush=True)
            if args.json:  # written after every row: a run cut short keeps what it measured
                with open(args.json, "w") as f:
                    json.dump(results, f, indent=1)
            del graph
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    print()
    table(results)


def table(results: list) -> None:
    print("| keep | row | perplexity | x better than baseline | calibrate s | align s |")
    print("|---|---|---|---|---|---|")
    base = {r["keep_ratio"]: r["perplexity"] for r in results if r["row"] == "baseline"}
    for r in results:
        gain = base.get(r["keep_ratio"], float("nan")) / r["perplexity"]
        fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        print(f"| {r['keep_ratio']:.2f} | {r['row']} | {r['perplexity']:.2f} | {gain:.1f} | {fmt(r.get('calibrate_seconds'))} | {fmt(r.get('align_seconds'))} |")


if __name__ == "__main__":
    main()
