"""How much alignment the README's main job needs: zero-shot perplexity against align steps and
calibration tokens, with the main job's own settings (keep ratio 0.5, built-in calibration sample).

The CPU main job spends nearly all its time in align, whose cost is steps x samples x length; this
measures what fewer steps or fewer samples cost in WikiText-2 perplexity, so a CPU default can be
chosen by measurement. One teacher capture; each row is a fresh branch running
select, replace, calibrate, align with the row's settings. A row `SxN+qwen3_5` builds its GDNs in the
form `surgery export --format qwen3_5` needs (v_activation silu, the teacher's RMSNorm eps), and
`+qwen3_5-conv` adds learned short convolutions: what the native format costs against the default.
A row may end in `/key=value` align options (tcal.phase2.AlignOptions), e.g.
`16x60/schedule=cosine/lr_qkv=3e-4/lr_gates=3e-3`, to find settings that converge in fewer steps.
Prints a markdown table, writes JSON.

    python bench/align_budget.py --model /root/m/smol.gguf --eval .gpu/data/wiki.test.raw \
        --rows 16x300,16x300+qwen3_5,16x100,16x60,8x100 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.ablation import timed_conversion  # noqa: E402
from surgery import capture  # noqa: E402
from surgery.data.text import read_text, tokenize  # noqa: E402
from surgery.eval.perplexity import perplexity  # noqa: E402

PASSES = ["select", "replace", "calibrate", "align"]


def gdn_form(teacher, form: str) -> dict:
    """replace options of a row's GDN form ("" = the defaults)."""
    if not form:
        return {}
    options = {"v_activation": "silu", "norm_eps": teacher.config.rms_norm_eps}
    return options | ({"use_short_conv": True} if form == "qwen3_5-conv" else {})


def align_overrides(parts: list[str]) -> dict:
    """`key=value` strings as align options (numbers where they parse as one)."""
    out = {}
    for part in parts:
        key, _, value = part.partition("=")
        try:
            out[key] = int(value) if value.lstrip("-").isdigit() else float(value)
        except ValueError:
            out[key] = value
    return out


def run_row(teacher, samples: int, steps: int, form: str, ids, args, overrides: dict | None = None) -> dict:
    """One conversion with `samples` x 256 calibration tokens for both phases and `steps` align steps."""
    configs = {"select": {"keep_ratio": 0.5}, "replace": gdn_form(teacher, form), "calibrate": {"samples": samples},
               "align": {"samples": samples, "steps": steps, "progress": False, **(overrides or {})}}
    graph, result, seconds = timed_conversion(teacher, PASSES, configs)
    ev = perplexity(graph, ids, chunk=args.chunk, batch_size=args.batch_size)
    align = graph.meta["align"]
    return {"samples": samples, "steps": steps, "form": form or "default", "align": overrides or {}, "perplexity": ev["perplexity"], "tokens": ev["tokens"],
            "passes_seconds": seconds, "align_seconds": align["seconds"], "align_steps_run": align["steps"],
            "align_best_loss": result.info["align"]["mean_best_loss"],
            "layer_steps_x_tokens": align["steps"] * samples * 256 * len(graph.meta["select"].convert)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--eval", required=True)
    ap.add_argument("--rows", default="16x300,16x300+qwen3_5,16x300+qwen3_5-conv,16x100,16x60,16x40,8x100")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32")
    ap.add_argument("--max-eval-tokens", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    teacher = capture(args.model, device=args.device, dtype=getattr(torch, args.dtype))
    ids = tokenize(teacher.tokenizer, read_text(args.eval))
    if args.max_eval_tokens:
        ids = ids[: args.max_eval_tokens]
    results = []
    for row in args.rows.split(","):
        head, *options = row.split("/")
        size, _, form = head.partition("+")
        samples, steps = (int(v) for v in size.split("x"))
        results.append(run_row(teacher, samples, steps, form, ids, args, align_overrides(options)))
        print(json.dumps(results[-1]), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print("\n| samples x 256 | align steps (run) | GDN form | align options | perplexity | align s | layer-steps x tokens (CPU cost) |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        options = " ".join(f"{k}={v}" for k, v in r["align"].items()) or "defaults"
        print(f"| {r['samples']} | {r['steps']} ({r['align_steps_run']}) | {r['form']} | {options} | {r['perplexity']:.2f} | {r['align_seconds']:.1f} | {r['layer_steps_x_tokens']:,} |")


if __name__ == "__main__":
    main()
