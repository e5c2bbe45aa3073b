"""Each mixer (replace.mixer) on the tiny teacher, on the CPU: the relative squared error of the
converted layers' attention block outputs against the teacher's, on held-out TinyStories-like text
(tests/test_calibrate.py's HELD_OUT, 2 x 256 tokens), for copy-only, Phase 1 and Phase 1 + 2.
Calibration: the built-in sample (never the held-out text).

    python bench/mixers_cpu.py --samples 4 --length 128 --layers 1,3
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import torch  # noqa: E402

import surgery  # noqa: E402
from surgery import PassManager  # noqa: E402
from surgery.core.run import interpret, placeholder_values  # noqa: E402
from surgery.data.text import tokenize  # noqa: E402
from tcal.mixers import MIXERS, get_mixer  # noqa: E402
from test_calibrate import HELD_OUT  # noqa: E402

STORIES = os.path.join(ROOT, "tests", "assets", "stories260k", "stories260K.gguf")
ROWS = {"copy-only": [], "phase1": ["calibrate"], "phase1+2": ["calibrate", "align"]}


def values(gm, ids, names: set) -> dict:
    with torch.no_grad():
        found = interpret(gm, placeholder_values(gm, ids), keep=lambda n: n.name in names)
    return {n.name: v for n, v in found.items() if n.name in names}


def block_error(graph, teacher, ids, layers) -> float:
    """Mean over layers of ||block output - teacher's||^2 / ||teacher's||^2 (the module's call where
    it replaced the whole block, the output projection where it replaced only the op)."""
    names = {}
    for l in layers:
        entry = graph.meta["replace"]["modules"][str(l)]
        if get_mixer(entry["mixer"]).replaces == "op":
            names[l] = graph.sites[l].output_node
        else:
            names[l] = next(n.name for n in graph.gm.graph.nodes if n.op == "call_module" and n.target == entry["target"])
    got = values(graph.gm, ids, set(names.values()))
    want = values(teacher.gm, ids, {graph.sites[l].output_node for l in layers})
    errors = [float((got[names[l]] - want[graph.sites[l].output_node]).pow(2).sum() / want[graph.sites[l].output_node].pow(2).sum()) for l in layers]
    return sum(errors) / len(errors)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--layers", default="1,3")
    ap.add_argument("--mixers", default=",".join(MIXERS))
    args = ap.parse_args()
    torch.manual_seed(0)
    teacher = surgery.capture(STORIES)
    ids = tokenize(teacher.tokenizer, HELD_OUT).flatten()[:512].reshape(2, 256)
    layers = [int(x) for x in args.layers.split(",")]
    data = {"samples": args.samples, "length": args.length}
    print("| mixer | " + " | ".join(ROWS) + " |\n|---|" + "---|" * len(ROWS))
    for mixer in args.mixers.split(","):
        row = []
        for passes in ROWS.values():
            graph = teacher.branch()
            configs = {"select": {"policy": "convert", "layers": layers}, "replace": {"mixer": mixer}}
            configs |= {p: dict(data, **({"progress": False} if p == "align" else {})) for p in passes}
            PassManager(["select", "replace", *passes], configs)(graph)
            row.append(block_error(graph, teacher, ids, layers))
        print(f"| {mixer} | " + " | ".join(f"{e:.3f}" for e in row) + " |", flush=True)


if __name__ == "__main__":
    main()
