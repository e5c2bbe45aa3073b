"""Which layers to keep: the same conversion with layers chosen by `uniform`, `ar` and (optionally)
`greedy` selection, scored by zero-shot perplexity on the evaluation text.

Each policy keeps the same number of attention layers; the converted layers then get the same init
(the passes named by --init, default calibrate + align). Selection scores come from calibration text
only; the evaluation text is used for the final perplexity alone.

    python bench/selection.py --model /root/m/smol.gguf --calibration .gpu/data/*.txt.xz \
        --eval .gpu/data/wiki.test.raw --policies uniform,ar,greedy
    python bench/selection.py --model smollm2-135m-instruct --calibration ../shared/data/corpus/austen.txt.xz \
        --eval ../shared/data/wikitext-2-raw/wiki.test.raw --init calibrate --max-eval-tokens 32768   # CPU
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--calibration", nargs="+", required=True)
    ap.add_argument("--eval", required=True)
    ap.add_argument("--policies", default="uniform,ar")
    ap.add_argument("--keep-ratio", type=float, default=0.5)
    ap.add_argument("--init", default="calibrate,align", help="passes after replace, for every policy (and greedy's probes)")
    ap.add_argument("--set", nargs="*", default=[], help="pass.key=value")
    ap.add_argument("--max-eval-tokens", type=int, default=0, help="score only the first N tokens (0: all)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    teacher = capture(args.model, device="cuda" if cuda else "cpu", dtype=torch.bfloat16 if cuda else torch.float32)
    ids = tokenize(teacher.tokenizer, read_text(args.eval))
    if args.max_eval_tokens:
        ids = ids[: args.max_eval_tokens]
    init = [p for p in args.init.split(",") if p]
    rows = [{"policy": "teacher", "perplexity": perplexity(teacher.branch(), ids, batch_size=4)["perplexity"]}]
    print(json.dumps(rows[-1]), flush=True)
    for policy in args.policies.split(","):
        configs = {"select": {"policy": policy, "keep_ratio": args.keep_ratio, "calibration": args.calibration}}
        configs |= {name: {"calibration": args.calibration} for name in init}
        parse_options(args.set, into=configs)
        graph = teacher.branch()
        start = time.perf_counter()
        PassManager(["select", "replace", *init], configs)(graph)
        seconds = time.perf_counter() - start
        with torch.no_grad():
            ppl = perplexity(graph, ids, batch_size=4)["perplexity"]
        rows.append({"policy": policy, "keep": graph.meta["select"].keep, "perplexity": ppl, "seconds": seconds})
        print(json.dumps(rows[-1]), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    print("\n| selection | kept layers | perplexity | select + init s |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['policy']} | {r.get('keep', 'all')} | {r['perplexity']:.2f} | {r.get('seconds', 0):.0f} |")


if __name__ == "__main__":
    main()
