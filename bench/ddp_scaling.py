"""Data-parallel scaling of `surgery distill` (issue 5): the same run on one GPU and under torchrun
on two, same hybrid, global batch, seed and data order; tokens/s of each and the two curves side by
side. Builds its own hybrid (select + replace: the copy-only init, seconds to make; the FLOPs and the
data-parallel arithmetic do not depend on the init), so one device call does the whole measurement.

    python bench/ddp_scaling.py --model /root/m/smol.gguf --data .gpu/data/*.txt.xz --eval .gpu/data/wiki.test.raw \
        --steps 30 --eval-every-steps 10 --global-batch 64 --micro-batch 32 --out /root/ddp --results $OUT
    python bench/ddp_scaling.py --model tests/assets/stories260k/stories260K.gguf --data surgery/data/calibration_sample.txt \
        --eval surgery/data/calibration_sample.txt --steps 4 --eval-every-steps 2 --seq-len 128 --global-batch 4 --out /tmp/ddp  # CPU (gloo)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from recovery import distill_command, kl_config, log, median_rate, plain_teacher, read_curve, two_process_config  # noqa: E402

from surgery import PassManager, capture, save  # noqa: E402


def run(cmd: list[str], env: dict, required: bool = True) -> dict | None:
    """One `surgery distill` process tree; a failure ends the benchmark unless the run is optional
    (a larger one-GPU micro-batch may not fit: it is then reported, not fatal)."""
    log(" ".join(cmd))
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        if required:
            raise SystemExit(f"failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        log(f"failed ({proc.returncode}), left out:\n{proc.stderr[-1500:]}")
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1]) | {"wall_s": time.perf_counter() - t}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", nargs="+", required=True)
    ap.add_argument("--eval", required=True)
    ap.add_argument("--keep-ratio", type=float, default=0.5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--eval-every-steps", type=int, default=10)
    ap.add_argument("--eval-tokens", type=int, default=32768)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=None, help="per forward on one process (default: its whole share)")
    ap.add_argument("--one-micro-batches", default="",
                    help="comma list: also time one GPU at these micro-batches (e.g. 64, the whole batch at once); "
                         "the scaling is then given against the fastest one-GPU run as well")
    ap.add_argument("--lr", type=float, default=None, help="stage-2 lr of the GDN layers (default: DistillConfig's)")
    ap.add_argument("--lr-rest", type=float, default=None, help="stage-2 lr outside the GDN layers (default: DistillConfig's)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--results", default=None)
    ap.set_defaults(schedule="constant", warmup=0.0)  # the fields of recovery.kl_config this script does not vary
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = Path(args.results or out)
    results.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()

    teacher_dir, init = out / "teacher", out / "baseline-init"
    plain_teacher(args.model, teacher_dir)
    if not init.exists():
        graph = capture(teacher_dir, device="cuda" if cuda else "cpu", dtype=torch.float32)
        PassManager(["select", "replace"], {"select": {"keep_ratio": args.keep_ratio}})(graph)
        save(graph, init, force=True)
        del graph

    step = args.global_batch * args.seq_len
    cfg = kl_config(args, args.steps * step, args.eval_every_steps * step, 0)
    env = dict(os.environ)
    if cuda:
        env.setdefault("CUDA_VISIBLE_DEVICES", "0,1")
    report = {"args": vars(args), "device": torch.cuda.get_device_name() if cuda else "cpu", "config": cfg}
    one_env = dict(env, CUDA_VISIBLE_DEVICES=env["CUDA_VISIBLE_DEVICES"].split(",")[0]) if cuda else env
    report["one"] = run(distill_command([sys.executable], init, out / "one", args.data, cfg, False), one_env)
    cfg2 = two_process_config(cfg)
    report["two"] = run(distill_command(["torchrun", "--standalone", "--nproc-per-node", "2"], init, out / "two", args.data, cfg2, False), env)
    micro_of = {"one": cfg.get("micro_batch"), "two": cfg2.get("micro_batch")}
    for micro in [int(x) for x in args.one_micro_batches.split(",") if x.strip()]:
        name = f"one-micro{micro}"
        cfg_m = dict(cfg, micro_batch=micro)
        if run(distill_command([sys.executable], init, out / name, args.data, cfg_m, False), one_env, required=False):
            micro_of[name] = micro
    names = list(micro_of)
    rows = {}
    for name in names:
        rows[name] = {"tokens_per_s": median_rate(out / name, "tokens_per_s"), "curve": read_curve(out / name)}
    report["runs"] = rows
    report["scaling"] = rows["two"]["tokens_per_s"] / rows["one"]["tokens_per_s"]
    best_one = max((n for n in names if n != "two"), key=lambda n: rows[n]["tokens_per_s"])
    report["fastest_one"] = best_one
    report["scaling_vs_fastest_one"] = rows["two"]["tokens_per_s"] / rows[best_one]["tokens_per_s"]
    (results / "ddp_scaling.json").write_text(json.dumps(report, indent=1))

    log(f"\n{report['device']}, global batch {args.global_batch} x {args.seq_len}, micro-batch {cfg.get('micro_batch')} "
        f"(two processes: {cfg2.get('micro_batch')}), {args.steps} steps")
    log("| processes | micro-batch | tokens/s (median step) | two processes over this |\n|---|---|---|---|")
    for name in names:
        rate = rows[name]["tokens_per_s"]
        log(f"| {2 if name == 'two' else 1} | {micro_of[name] or 'whole share'} | {rate:,.0f} | {rows['two']['tokens_per_s'] / rate:.2f}x |")
    log("| tokens | perplexity, 1 process | 2 processes |\n|---|---|---|")
    two = dict(rows["two"]["curve"])
    for tokens, ppl in rows["one"]["curve"]:
        log(f"| {tokens:,} | {ppl:.4f} | {two[tokens]:.4f} |" if tokens in two else f"| {tokens:,} | {ppl:.4f} | - |")


if __name__ == "__main__":
    main()
