"""Recovery distillation, baseline init vs Taylor-Calibrate init (issue 5), plus passkey retrieval of
each model (issue 6), in one process so the teacher is loaded and captured once.

Both students start from the same teacher with the same layers converted and then get the SAME
distillation: stage 2 (KL on logits), same token budget, seed, data order, global batch, constant
learning rate (no warmup, so a shorter run is a prefix of a longer one). WikiText-2 perplexity is
measured every --eval-every tokens on the first --eval-tokens tokens of the test file; the final
models are also scored on the whole file. Tokens-to-target is read off those curves for a ladder of
multiples of the teacher's perplexity; a target a run never reaches is reported as "not reached in
budget", and the ratio then as a lower bound.

A plain training step (student only, cross-entropy, AdamW, same batch and autocast) is timed on the
same model, for the "distillation reaches >= 40% of plain-step FLOP/s" check.

--two-gpu also saves the Taylor-Calibrate init and the teacher and reruns that student's
distillation with torchrun on 2 GPUs (same global batch, same data order), for tokens/s scaling and
the curve.

    python bench/recovery.py --model /root/m/smol.gguf --data .gpu/data/*.txt.xz \
        --eval .gpu/data/wiki.test.raw --tokens 4000000 --out /root/rec --two-gpu
    python bench/recovery.py --model tests/assets/stories260k/stories260K.gguf --data surgery/data/calibration_sample.txt \
        --eval surgery/data/calibration_sample.txt --tokens 4096 --seq-len 128 --global-batch 4 --tiny --set align.steps=30 --two-gpu  # CPU smoke run
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from surgery import PassManager, capture, load, save  # noqa: E402
from surgery.distill import DistillConfig, distill, forward_params  # noqa: E402
from surgery.evaluate import perplexity, read_text, tokenize  # noqa: E402
from surgery.load import load_model  # noqa: E402
from surgery.passkey import passkey  # noqa: E402
from surgery.pass_base import parse_options  # noqa: E402

LADDER = (1.2, 1.5, 2.0, 3.0, 5.0)


def log(msg: str) -> None:
    print(msg, flush=True)


def tokens_to(curve: list[tuple[int, float]], target: float) -> int | None:
    """First evaluated token count at which the perplexity is at or below target."""
    for tokens, ppl in curve:
        if ppl <= target:
            return tokens
    return None


def plain_step_flops(graph, ids: torch.Tensor, steps: int, autocast: bool) -> dict:
    """FLOP/s of a plain training step of the student alone: CE loss, AdamW, every parameter trained."""
    gm = graph.gm
    params = [p for p in gm.parameters()]
    flags = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(True)
    n = forward_params(gm)  # the same count distillation's FLOP/s uses (a tied embedding is the LM head too)
    opt = torch.optim.AdamW(params, lr=1e-6)
    ctx = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if autocast else (lambda: torch.autocast("cpu", enabled=False))
    times = []
    for i in range(steps + 2):
        if ids.is_cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with ctx():
            logits = graph(ids)
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        if ids.is_cuda:
            torch.cuda.synchronize()
        if i >= 2:  # the first steps allocate optimizer state and warm kernels up
            times.append(time.perf_counter() - t)
    for p, f in zip(params, flags):
        p.requires_grad_(f)
    seconds = sorted(times)[len(times) // 2]
    return {"params": n, "tokens_per_s": ids.numel() / seconds, "flops_per_s": 6 * n * ids.numel() / seconds}


def read_curve(out: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines() if line.strip()]
    return [(r["tokens"], r["eval_ppl"]) for r in rows if r.get("eval_ppl") is not None]


def mean_rate(out: Path, key: str) -> float:
    rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines() if line.strip()]
    vals = [r[key] for r in rows if r.get(key) is not None]
    vals = vals[len(vals) // 5:] or vals  # drop the warm-up steps
    return sum(vals) / len(vals)


def plot(curves: dict, teacher_ppl: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, curve in curves.items():
        ax.plot([t / 1e6 for t, _ in curve], [p for _, p in curve], marker="o", ms=3, label=label)
    for m in (1.2, 1.5):
        ax.axhline(teacher_ppl * m, ls="--", lw=0.8, color="grey")
        ax.text(0, teacher_ppl * m, f" {m}x teacher", va="bottom", fontsize=8, color="grey")
    ax.set_yscale("log")
    ax.set_xlabel("distillation tokens (millions)")
    ax.set_ylabel("WikiText-2 perplexity (eval subset)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def save_plain(model, tokenizer, path: Path) -> None:
    """save_pretrained refuses a model loaded from GGUF: rebuild it from its config without the
    quantization entry, copy the (dequantised) weights, save that."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(path)
    tokenizer.save_pretrained(path)


def two_gpu(args, out: Path, report: dict, dump) -> None:
    """The Taylor-Calibrate init distilled again under torchrun on two GPUs, same global batch:
    tokens/s scaling and the curve against the one-GPU run."""
    runs = report["runs"]
    teacher_dir = out / "teacher"
    eval_every = report["distill_config"]["eval_every"]
    args.tokens = report["distill_config"]["tokens"]
    tokens2 = args.two_gpu_tokens or args.tokens // 2
    run2 = out / "distill-taylor-calibrate-2gpu"
    cmd = ["torchrun", "--standalone", "--nproc-per-node", "2", "-m", "surgery.cli.app", "distill",
           "--model", str(out / "taylor-calibrate-init"), "--teacher", str(teacher_dir), "--data", *args.data,
           "--tokens", str(tokens2), "--out", str(run2), "--force", "--stage", "kl", "--seq-len", str(args.seq_len),
           "--batch-size", str(args.global_batch), "--schedule", "constant", "--warmup", "0",
           "--eval-text", args.eval, "--eval-every", str(eval_every), "--eval-tokens", str(args.eval_tokens),
           "--seed", "0", "--json"]
    if args.lr is not None:
        cmd += ["--lr", str(args.lr)]
    log("two GPUs: " + " ".join(cmd))
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    report["two_gpu"] = {"returncode": proc.returncode, "wall_s": time.perf_counter() - t, "stderr_tail": proc.stderr[-3000:]}
    if proc.returncode == 0:
        curve2 = read_curve(run2)
        rate2 = mean_rate(run2, "tokens_per_s")
        one = runs["taylor-calibrate"]
        same = [(t2, p2, dict(one["curve"]).get(t2)) for t2, p2 in curve2]
        report["two_gpu"] |= {"curve": curve2, "tokens_per_s": rate2, "scaling": rate2 / one["tokens_per_s"], "vs_one_gpu": same}
        log(f"two GPUs: {rate2:,.0f} tokens/s = {rate2 / one['tokens_per_s']:.2f}x one GPU; curve {same}")
    else:
        log("two-GPU run failed:\n" + proc.stderr[-3000:])
    dump()


def build_inits(args, teacher, calibration, out: Path, report: dict, measure) -> None:
    """Both students from the teacher (copy-only baseline; Taylor-Calibrate with the defaults plus
    --set), saved as hybrids, and measured with the teacher."""
    students = {"baseline": teacher.branch()}
    PassManager(["select", "replace"], {"select": {"keep_ratio": args.keep_ratio}})(students["baseline"])
    t = time.perf_counter()
    students["taylor-calibrate"] = teacher.branch()
    configs = {"select": {"keep_ratio": args.keep_ratio}, "calibrate": {"calibration": calibration}, "align": {"calibration": calibration}}
    parse_options(args.set, into=configs)
    PassManager(["select", "replace", "calibrate", "align"], configs)(students["taylor-calibrate"])
    report["calibrate_align_s"] = time.perf_counter() - t
    log(f"Taylor-Calibrate init in {report['calibrate_align_s']:.1f} s")
    for name, graph in students.items():
        save(graph, out / f"{name}-init", force=True)
    report["models"] = {"teacher": measure("teacher", teacher.branch())}
    for name, graph in students.items():
        report["models"][f"{name} (init)"] = measure(f"{name} init", graph)


def distill_config(args, students: dict, teacher, out: Path, report: dict, step_tokens: int) -> dict:
    """The stage-2 KL config both students get; with --seconds-per-run the token budget comes from
    timing three steps of the Taylor-Calibrate student first."""
    if args.tokens is None:
        if args.seconds_per_run is None:
            raise SystemExit("give --tokens or --seconds-per-run")
        tc = students["taylor-calibrate"]
        probe = dataclasses.replace(tc, gm=copy.deepcopy(tc.gm), cache={})
        probe_cfg = DistillConfig(tokens=3 * step_tokens, stage="kl", seq_len=args.seq_len, global_batch=args.global_batch,
                                  schedule="constant", warmup=0.0, save_every=0, seed=0)
        probe_summary = distill(probe, args.data, out / "probe", probe_cfg, teacher=teacher, force=True, progress=False)
        rows = [json.loads(x) for x in (out / "probe" / "log.jsonl").read_text().splitlines() if x.strip()]
        rate = max(r["tokens_per_s"] for r in rows if r.get("tokens_per_s"))
        args.tokens = max(int(rate * args.seconds_per_run) // step_tokens, 10) * step_tokens
        report["probe"] = {"tokens_per_s": rate, "tokens": args.tokens, "summary": probe_summary}
        log(f"probe: {rate:,.0f} tokens/s -> {args.tokens:,} tokens per init")
    eval_every = args.eval_every or max(args.tokens // 10, 1)
    # checkpoints every ~tenth of the run, so a call that runs out of time leaves one to --resume from
    save_every = max(args.tokens // 10 // step_tokens, 1) * step_tokens
    cfg = dict(tokens=args.tokens, stage="kl", seq_len=args.seq_len, global_batch=args.global_batch, schedule="constant",
               warmup=0.0, eval_text=args.eval, eval_tokens=args.eval_tokens, eval_every=eval_every, save_every=save_every,
               seed=0, keep_checkpoints=1)
    if args.lr is not None:
        cfg |= {"lr_kl_new": args.lr, "lr_kl_copied": args.lr}
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", nargs="+", required=True)
    ap.add_argument("--calibration", nargs="*", default=None, help="Taylor-Calibrate text (default: --data)")
    ap.add_argument("--eval", required=True)
    ap.add_argument("--keep-ratio", type=float, default=0.5)
    ap.add_argument("--tokens", type=int, default=None, help="distillation tokens per init")
    ap.add_argument("--seconds-per-run", type=float, default=None,
                    help="instead of --tokens: time 3 steps first, then give each init the tokens of about this many seconds")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=None, help="stage-2 lr of the GDN layers (default: DistillConfig's)")
    ap.add_argument("--eval-every", type=int, default=None, help="tokens (default: tokens / 10)")
    ap.add_argument("--eval-tokens", type=int, default=65536)
    ap.add_argument("--passkey-lengths", default="1024,2048,4096")
    ap.add_argument("--plain-steps", type=int, default=5)
    ap.add_argument("--two-gpu", action="store_true")
    ap.add_argument("--two-gpu-tokens", type=int, default=None, help="default: half of --tokens")
    ap.add_argument("--two-gpu-only", action="store_true",
                    help="only the two-GPU rerun, from the inits and recovery.json an earlier run left in --out")
    ap.add_argument("--resume", action="store_true",
                    help="continue the run in --out (inits, finished runs and the distillation checkpoints are kept): "
                         "a run longer than one device call is several calls")
    ap.add_argument("--two-gpu-later", action="store_true",
                    help="prepare the teacher directory for a later --two-gpu-only call instead of running it now")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: skip passkey lengths the model cannot hold")
    ap.add_argument("--set", nargs="*", default=[], help="pass.key=value for the Taylor-Calibrate init (e.g. align.steps=30)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--results", default=None, help="directory for the JSON and PNG (default: --out)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = True
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results_dir = Path(args.results or out)
    results_dir.mkdir(parents=True, exist_ok=True)
    report: dict = {"args": vars(args), "device": torch.cuda.get_device_name() if cuda else "cpu"}

    def dump() -> None:
        for d in {results_dir, out}:
            (d / "recovery.json").write_text(json.dumps(report, indent=1))

    if args.two_gpu_only:
        report = json.loads((out / "recovery.json").read_text())
        two_gpu(args, out, report, dump)
        return
    resuming = args.resume and (out / "recovery.json").exists()
    if resuming:
        report = json.loads((out / "recovery.json").read_text())
        log(f"resuming the run in {out}: {', '.join(report.get('runs', {})) or 'no distillation'} finished")

    # The teacher and both inits are built in bf16 on CUDA (as `surgery apply` does: fast), saved, and
    # reloaded in float32 for training (float32 master weights under bf16 autocast, as distill wants);
    # reloading also gives each student its own tensors (branches share the teacher's).
    t0 = time.perf_counter()
    build_dtype = torch.bfloat16 if cuda else torch.float32
    teacher_dir = out / "teacher"
    plain_teacher = args.two_gpu or args.two_gpu_later
    if plain_teacher and not teacher_dir.exists():  # a plain HF directory: each torchrun rank loads it fast
        model, tokenizer, _ = load_model(args.model, dtype=torch.float32)
        save_plain(model, tokenizer, teacher_dir)
        del model
    teacher = capture(teacher_dir if plain_teacher else args.model, device=device, dtype=build_dtype)
    log(f"teacher captured in {time.perf_counter() - t0:.1f} s")

    calibration = args.calibration or args.data
    lengths = [int(x) for x in args.passkey_lengths.split(",")]
    if args.tiny:
        lengths = [x for x in lengths if x + 16 <= teacher.max_length]
    eval_ids = tokenize(teacher.tokenizer, read_text(args.eval))

    def measure(name: str, graph) -> dict:
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            ppl = perplexity(graph, eval_ids, batch_size=4)
            pk = passkey(graph, calibration, lengths, depths=5, trials_per_depth=2, batch_size=4) if lengths else None
        row = {"wikitext_ppl": ppl["perplexity"], "wikitext_tokens": ppl["tokens"], "passkey": pk}
        log(f"{name}: wikitext ppl {ppl['perplexity']:.2f}" + (f", passkey {pk['accuracy']:.0%} {pk['by_length']}" if pk else ""))
        return row

    names = ("baseline", "taylor-calibrate")
    if not (resuming and all((out / f"{name}-init").exists() for name in names) and "models" in report):
        build_inits(args, teacher, calibration, out, report, measure)
        dump()
    t = time.perf_counter()
    done = report.get("runs", {})
    students = {name: load(out / f"{name}-init", device=device, dtype=torch.float32) for name in names if name not in done}
    log(f"inits reloaded in float32 in {time.perf_counter() - t:.1f} s")

    step_tokens = args.seq_len * args.global_batch
    if resuming and "distill_config" in report:
        cfg = report["distill_config"]  # the same config, so the checkpoints resume
    else:
        cfg = distill_config(args, students, teacher, out, report, step_tokens)
    report["distill_config"] = cfg
    runs = dict(done)
    for name, graph in students.items():
        run_out = out / f"distill-{name}"
        again = resuming and any(run_out.glob("checkpoint-*"))
        log(f"distilling {name} for {cfg['tokens']:,} tokens" + (" (resumed)" if again else ""))
        summary = distill(graph, args.data, run_out, DistillConfig(**cfg), teacher=teacher, resume=again, force=not again, progress=False)
        if again:  # resume trains the checkpoint, not this graph
            graph = load(summary["checkpoint"], device=device, dtype=torch.float32)
        curve = read_curve(run_out)
        runs[name] = {"summary": summary, "curve": curve, "tokens_per_s": mean_rate(run_out, "tokens_per_s"),
                      "flops_per_s": mean_rate(run_out, "flops_per_s"),
                      "teacher_ppl_subset": json.loads((run_out / "log.jsonl").read_text().splitlines()[0]).get("teacher_ppl")}
        log(f"{name}: {runs[name]['tokens_per_s']:,.0f} tokens/s, curve {[(t, round(p, 2)) for t, p in curve]}")
        report["models"][f"{name} (distilled)"] = measure(f"{name} distilled", graph)
        report["runs"] = runs
        dump()
    args.tokens = cfg["tokens"]

    # tokens-to-target on the eval subset, relative to the teacher's perplexity on the same subset
    teacher_subset = runs["taylor-calibrate"]["teacher_ppl_subset"]
    ladder = []
    for m in LADDER:
        target = teacher_subset * m
        b = tokens_to(runs["baseline"]["curve"], target)
        tc = tokens_to(runs["taylor-calibrate"]["curve"], target)
        if tc is not None and b is not None:
            ratio = f"{b / max(tc, 1):.1f}x" if tc > 0 else "inf (TC starts there)"
        elif tc is not None:
            ratio = f"> {args.tokens / max(tc, 1):.1f}x (baseline not reached)" if tc > 0 else "TC starts below; baseline not reached"
        else:
            ratio = "not reached by TC"
        ladder.append({"multiple": m, "target_ppl": target, "baseline_tokens": b, "tc_tokens": tc, "ratio": ratio})
    report["tokens_to_target"] = ladder

    if "plain_step" not in report:  # the same hybrid (its weights do not change the FLOP/s)
        graph = students.get("taylor-calibrate") or load(out / "taylor-calibrate-init", device=device, dtype=torch.float32)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, teacher.config.vocab_size, (args.global_batch, args.seq_len), generator=g).to(device)
        report["plain_step"] = plain_step_flops(graph, ids, args.plain_steps, cuda)
    report["distill_vs_plain_flops"] = runs["taylor-calibrate"]["flops_per_s"] / report["plain_step"]["flops_per_s"]
    dump()
    plot({k: v["curve"] for k, v in runs.items()}, teacher_subset, results_dir / "recovery.png",
         f"{Path(args.model).name}, {100 - args.keep_ratio * 100:.0f}% GDN: recovery by KL distillation")

    if args.two_gpu:
        two_gpu(args, out, report, dump)

    # the table
    log("\n| model | WikiText-2 ppl | passkey " + " | ".join(f"{x}" for x in lengths) + " |")
    log("|---|---|" + "---|" * len(lengths))
    for name, row in report["models"].items():
        pk = row["passkey"]["by_length"] if row["passkey"] else {}
        log(f"| {name} | {row['wikitext_ppl']:.2f} | " + " | ".join(f"{pk.get(str(x), 0):.0%}" for x in lengths) + " |")
    log(f"\nteacher on the eval subset: {teacher_subset:.2f}")
    log("| target | baseline tokens | TC tokens | ratio |\n|---|---|---|---|")
    for r in ladder:
        log(f"| {r['multiple']}x ({r['target_ppl']:.1f}) | {r['baseline_tokens']} | {r['tc_tokens']} | {r['ratio']} |")
    log(f"distill FLOP/s {runs['taylor-calibrate']['flops_per_s']:.3e} vs plain step {report['plain_step']['flops_per_s']:.3e}: "
        f"{report['distill_vs_plain_flops']:.0%}")


if __name__ == "__main__":
    main()
