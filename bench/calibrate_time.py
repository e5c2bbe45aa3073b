"""Wall time of calibrate + align on a random-weight teacher shaped like Qwen2.5-1.5B (28 layers,
hidden 1536, 12 heads, 2 KV heads, head_dim 128), 21 of 28 layers converted (7 kept, as the paper).

Random weights have no tokenizer of their own: the calibration text is tokenised with the one of
--tokenizer-from (any model file that carries one; ids are valid since the vocabulary is larger).
Timing only; the perplexity of a random model means nothing. The calibration text is tokenised
before the clock starts (the token cache makes that a one-off per corpus and tokenizer).

    python bench/calibrate_time.py --tokenizer-from /root/m/smol.gguf --calibration .gpu/data/austen.txt.xz
    python bench/calibrate_time.py --tiny ...   # a 4-layer, hidden-64 version for a CPU smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench._models import qwen15b_shaped  # noqa: E402
from surgery import PassManager, capture  # noqa: E402
from surgery.data.cache import token_stream  # noqa: E402
from surgery.core.load import load_model  # noqa: E402
from surgery.core.pipeline import parse_options  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer-from", required=True)
    ap.add_argument("--calibration", nargs="+", required=True)
    ap.add_argument("--keep-ratio", type=float, default=0.25)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--set", nargs="*", default=[], help="pass.key=value")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    graph = capture(qwen15b_shaped(device, dtype, 4096, tiny=args.tiny), device=device, dtype=dtype)
    graph.tokenizer = load_model(args.tokenizer_from)[1]
    configs = {"select": {"keep_ratio": args.keep_ratio}, "calibrate": {"calibration": args.calibration},
               "align": {"calibration": args.calibration}}
    parse_options(args.set, into=configs)
    PassManager(["select", "replace"], {"select": configs.pop("select")})(graph)
    # Tokenise the calibration text before the clock starts: the token stream is cached on disk, so
    # every run after a user's first one starts like this.
    token_stream(graph.tokenizer, args.calibration)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    PassManager(["calibrate", "align"], configs)(graph)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    row = {"layers": graph.num_layers, "converted": len(graph.meta["select"].convert), "device": device,
           "calibrate_s": graph.meta["calibrate"]["seconds"], "align_s": graph.meta["align"]["seconds"],
           "align_steps": graph.meta["align"]["steps"], "total_s": seconds}
    print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f)


if __name__ == "__main__":
    main()
