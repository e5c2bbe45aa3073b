"""Precision of the chunked PyTorch gated delta rule under bf16 autocast (how training runs it),
against a float64 token recurrence, for slow-decay heads; optionally for the kernel as it was at
earlier commits, to compare versions.

    python bench/kernel_precision.py --commits 2631943 eea3e43
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import torch  # noqa: E402

import tcal.kernels  # noqa: E402
from test_gdn import make_inputs, reference_recurrence, rel_err  # noqa: E402

CASES = [  # T, heads, head dim, g_min, beta
    (4096, 1, 64, -2e-4, "near0"),
    (4096, 1, 64, -2e-5, "uniform"),
    (4096, 2, 16, -1.0, "uniform"),
]


def kernel_at(commit: str):
    """tcal/kernels.py as of a commit, loaded as its own module."""
    source = subprocess.run(["git", "show", f"{commit}:tcal/kernels.py"], capture_output=True, text=True, check=True).stdout
    path = os.path.join(tempfile.mkdtemp(), f"kernels_{commit}.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(f"kernels_{commit}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--commits", nargs="*", default=[])
    args = ap.parse_args()
    torch.set_num_threads(1)
    kernels = {"working tree": tcal.kernels, **{c: kernel_at(c) for c in args.commits}}
    print("| T | heads x dim | g_min | beta | kernel | state rel. err | output rel. err |\n|---|---|---|---|---|---|---|")
    for seq_len, heads, dim, g_min, beta in CASES:
        (q, k, v, g, b), _ = make_inputs(1, seq_len, heads, dim, dim, g_min=g_min, beta=beta, seed=3)
        o_ref, s_ref = reference_recurrence(q, k, v, g, b, dim**-0.5)
        for name, module in kernels.items():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                o, s = module.chunked_gated_delta_rule_torch(q, k, v, g, b, output_final_state=True)
            print(f"| {seq_len} | {heads} x {dim} | {g_min:g} | {beta} | {name} | {rel_err(s, s_ref):.4f} | {rel_err(o, o_ref):.4f} |")


if __name__ == "__main__":
    main()
