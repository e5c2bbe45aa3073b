"""Census of the copies in one hybrid forward on the default fast route (issue 29): every dtype
conversion (aten._to_copy), copy_ and clone, counted per source line that asked for it (the traced
graph's own line, tcal's, fla's, transformers'), with the input dtype, output dtype and shape.

The graph is the route's eager graph (causal flags and the elementwise fusions of
surgery.decode.fusions, on every device here), not replayed, so each copy is seen.

    python bench/casts.py --random                 # SmolLM2-135M's shapes, random weights, 75% GDN
    python bench/casts.py --random --device cuda --length 32768
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from bench.harness import STORIES, random_smollm2  # noqa: E402
from surgery import PassManager, capture  # noqa: E402
from surgery.decode.fast import FastGraph  # noqa: E402

COPIES = {"_to_copy", "copy_", "clone"}
OWN_FILES = (os.sep + "tcal" + os.sep, os.sep + "surgery" + os.sep, os.sep + "fla" + os.sep, os.sep + "transformers" + os.sep, "<eval_with_key")


def origin() -> str:
    """The innermost frame of ours, fla's, transformers' or the traced graph's code: file:line and its text."""
    frames = [f for f in traceback.extract_stack() if any(part in f.filename for part in OWN_FILES)]
    if not frames:
        return "?"
    f = frames[-1]
    if f.filename.startswith("<eval_with_key"):  # the traced graph: its op, not its (per-node) line
        return "graph: " + ", ".join(re.findall(r"torch\.ops\.aten\.[\w.]+", f.line or "")[:1])
    return f"{os.path.basename(f.filename)}:{f.lineno} {(f.line or '').strip()[:90]}"


class Census(TorchDispatchMode):
    """Counts (op, dtype in, dtype out, shape, origin) of every copy dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.seen = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in COPIES:
            source = args[1] if name == "copy_" else args[0]
            target = args[0].dtype if name == "copy_" else kwargs.get("dtype") or source.dtype
            self.seen[(name, str(source.dtype).removeprefix("torch."), str(target).removeprefix("torch."),
                       tuple(source.shape), origin())] += 1
        return func(*args, **kwargs)


def main(argv=None) -> collections.Counter:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--random", action="store_true", help="SmolLM2-135M's shapes, random weights (else stories260K)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--keep-ratio", type=float, default=0.25)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    model = random_smollm2(max(args.length, 256)) if args.random else str(STORIES)
    graph = capture(model, device=device, dtype=torch.bfloat16, max_length=max(args.length, 256))
    PassManager(["select", "replace"], {"select": {"keep_ratio": args.keep_ratio}, "replace": {"mixer": "gdn"}})(graph)
    fast = FastGraph(graph.gm, device, "eval", None, limit=graph.max_length, label="census")
    fast.route = dataclasses.replace(fast.route, causal_flags=True, fused=True, replay=False)
    fast.replays = None
    ids = torch.randint(0, graph.config.vocab_size, (1, args.length), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        fast.eager(ids)  # the bucket's first call builds its graph (and fla's autotuning): not counted
        with Census() as census:
            fast.eager(ids)
    print(f"| count | op | from | to | shape | origin |\n|---:|---|---|---|---|---|")
    for (op, src, dst, shape, where), n in sorted(census.seen.items(), key=lambda kv: kv[0][-1]):
        print(f"| {n} | {op} | {src} | {dst} | {list(shape)} | {where} |")
    print(f"\n{sum(census.seen.values())} copies in one forward of {args.length} tokens on {device}")
    return census.seen


if __name__ == "__main__":
    main()
