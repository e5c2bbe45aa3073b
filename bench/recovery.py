"""Recovery distillation, baseline init vs Taylor-Calibrate init (issue 5), plus passkey retrieval of
each model (issue 6), in one process so the teacher is loaded and captured once.

Both students start from the same teacher with the same layers converted and then get the SAME
distillation: stage 2 (KL on logits), same token budget, seed, data order, global batch, and by
default a constant learning rate without warmup, so a shorter run is a prefix of a longer one
(--schedule cosine decays over --tokens instead). WikiText-2 perplexity is
measured every --eval-every tokens on the first --eval-tokens tokens of the test file; the final
models are also scored on the whole file. Tokens-to-target is read off those curves for a ladder of
multiples of the teacher's perplexity; a target a run never reaches is reported as "not reached in
budget", and the ratio then as a lower bound.

A plain training step (student only, cross-entropy, AdamW, same batch and autocast) is timed on the
same model, for the "distillation reaches >= 40% of plain-step FLOP/s" check.

--concurrent distils the two inits at the same time, one `surgery distill` process per GPU; with
--stop-after each stops cleanly after that many seconds (a checkpoint), and the same command with
--resume continues; --finish measures the runs as they stand.

--select-policy ar|greedy picks the kept layers once, on the teacher with the calibration text, and
both students convert exactly those (default: uniform spacing). --stop-at UNIX_TIME ends a
--concurrent run's training at a deadline (a device budget), less the processes' start-up.

Issue 30 (bench/recovery_one.py, recovery_recipes.py, recovery_points.py): --init baseline|tcal
distils ONE init per GPU stay to 1.2x the teacher's perplexity or --deadline-s, appending to
--records; --table RECORDS prints both inits' tokens to 1.5x / 1.3x / 1.2x and passkey rows;
--recipes FILE.json runs the recipe study on both inits at equal tokens.

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
import gc
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
from surgery.train import DistillConfig, distill  # noqa: E402
from surgery.train.stages import forward_params  # noqa: E402
from surgery.data.text import read_text, tokenize
from surgery.eval.perplexity import perplexity  # noqa: E402
from surgery.core.load import load_model  # noqa: E402
from surgery.eval.passkey import passkey  # noqa: E402
from surgery.core.pipeline import parse_options  # noqa: E402

STARTED = time.time()  # --deadline-s counts from here: the start of the process
LADDER = (1.2, 1.3, 1.5, 2.0, 3.0, 5.0)  # multiples of the teacher's perplexity (issue 17 asks for 1.5x, 1.3x and 1.2x)
DISTILL_STARTUP_S = 60.0  # a `surgery distill` process on the H200 loads and captures teacher and student first


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


def median_rate(out: Path, key: str) -> float:
    """The median over steps: robust to the warm-up steps at the start of each (resumed) process."""
    rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines() if line.strip()]
    vals = sorted(r[key] for r in rows if r.get(key) is not None)
    return vals[len(vals) // 2]


def plot(curves: dict, teacher_ppl: float, path: Path, title: str) -> None:
    """The curves as a PNG; without matplotlib (not a dependency of the project) a note instead, so
    the tables after it are still printed."""
    try:
        import matplotlib
    except ImportError:
        log(f"matplotlib is not installed: no {path.name} (pip install matplotlib)")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, curve in curves.items():
        ax.plot([t / 1e6 for t, _ in curve], [p for _, p in curve], marker="o", ms=3, label=label)
    for m in (1.2, 1.3, 1.5):
        ax.axhline(teacher_ppl * m, ls="--", lw=0.8, color="grey")
        ax.text(0, teacher_ppl * m, f" {m}x teacher", va="bottom", fontsize=8, color="grey")
    ax.set_yscale("log")
    ax.set_xlabel("distillation tokens (millions)")
    ax.set_ylabel("WikiText-2 perplexity (eval subset)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_title(args) -> str:
    return f"{Path(args.model).name}, {100 - args.keep_ratio * 100:.0f}% GDN ({args.select_policy} selection): recovery by KL distillation"


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


def two_process_config(cfg: dict, **changes) -> dict:
    """cfg for two processes: a micro-batch must divide each process's share; one that does not is
    dropped (each process then takes its share at once)."""
    cfg = dict(cfg, **changes)
    if cfg.get("micro_batch") and (cfg["global_batch"] // 2) % cfg["micro_batch"]:
        del cfg["micro_batch"]
    return cfg


def plain_teacher(model: str, path: Path) -> Path:
    """The teacher as a plain HF directory (once): every distillation process loads it fast."""
    if not path.exists():
        loaded, tokenizer, _ = load_model(model, dtype=torch.float32)
        save_plain(loaded, tokenizer, path)
    return path


def two_gpu(args, out: Path, report: dict, dump) -> None:
    """The Taylor-Calibrate init distilled again under torchrun on two GPUs, same global batch:
    tokens/s scaling and the curve against the one-GPU run."""
    runs = report["runs"]
    tokens2 = args.two_gpu_tokens or report["distill_config"]["tokens"] // 2
    run2 = out / "distill-taylor-calibrate-2gpu"
    cfg2 = two_process_config(report["distill_config"], tokens=tokens2)
    cmd = distill_command(["torchrun", "--standalone", "--nproc-per-node", "2"], out / "taylor-calibrate-init", run2, args.data, cfg2, False)
    log("two GPUs: " + " ".join(cmd))
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    report["two_gpu"] = {"returncode": proc.returncode, "wall_s": time.perf_counter() - t, "stderr_tail": proc.stderr[-3000:]}
    if proc.returncode == 0:
        curve2 = read_curve(run2)
        rate2 = median_rate(run2, "tokens_per_s")
        one = runs["taylor-calibrate"]
        same = [(t2, p2, dict(one["curve"]).get(t2)) for t2, p2 in curve2]
        report["two_gpu"] |= {"curve": curve2, "tokens_per_s": rate2, "scaling": rate2 / one["tokens_per_s"], "vs_one_gpu": same}
        log(f"two GPUs: {rate2:,.0f} tokens/s = {rate2 / one['tokens_per_s']:.2f}x one GPU; curve {same}")
    else:
        log("two-GPU run failed:\n" + proc.stderr[-3000:])
    dump()


def selection(args, teacher, calibration, report: dict) -> dict:
    """The select options both students get: uniform spacing, or the layers a data-driven policy
    (ar, retrieval, greedy) keeps, decided once on the teacher with the calibration text and then named
    explicitly, so the two inits convert exactly the same layers."""
    if args.select_policy == "uniform":
        return {"keep_ratio": args.keep_ratio}
    probe = teacher.branch()
    t = time.perf_counter()
    PassManager(["select"], {"select": {"policy": args.select_policy, "keep_ratio": args.keep_ratio, "calibration": calibration}})(probe)
    meta = probe.meta["select"].to_dict()
    report["selection"] = {"seconds": time.perf_counter() - t, **meta}
    log(f"{args.select_policy} selection in {report['selection']['seconds']:.1f} s keeps {meta['keep']}")
    return {"policy": "keep", "layers": meta["keep"]}


def build_inits(args, teacher, calibration, out: Path, report: dict, measure) -> None:
    """Both students from the teacher (copy-only baseline; Taylor-Calibrate with the defaults plus
    --set), saved as hybrids, and measured with the teacher."""
    select = selection(args, teacher, calibration, report)
    students = {"baseline": teacher.branch()}
    PassManager(["select", "replace"], {"select": select})(students["baseline"])
    t = time.perf_counter()
    students["taylor-calibrate"] = teacher.branch()
    configs = {"select": dict(select), "calibrate": {"calibration": calibration}, "align": {"calibration": calibration}}
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
    return kl_config(args, args.tokens, eval_every, save_every)


def fixed_config(args, step_tokens: int) -> dict:
    """The stage-2 KL config of a --concurrent run: a fixed budget (--tokens), evaluated every
    --eval-every tokens, checkpointed every --save-every (default: each evaluation)."""
    if args.tokens is None or args.eval_every is None:
        raise SystemExit("--concurrent needs --tokens and --eval-every")
    steps = lambda n: max(n // step_tokens, 1) * step_tokens  # noqa: E731
    return kl_config(args, steps(args.tokens), args.eval_every, steps(args.save_every or args.eval_every))


def kl_config(args, tokens: int, eval_every: int, save_every: int) -> dict:
    """The DistillConfig fields both runs share (stage 2, seed 0), from the command line."""
    cfg = dict(tokens=tokens, stage="kl", seq_len=args.seq_len, global_batch=args.global_batch, schedule=args.schedule,
               warmup=args.warmup, eval_text=args.eval, eval_tokens=args.eval_tokens, eval_every=eval_every, save_every=save_every,
               seed=0, keep_checkpoints=1)
    if args.lr is not None:
        cfg |= {"lr_kl_new": args.lr, "lr_kl_copied": args.lr}
    if args.lr_rest is not None:
        cfg["lr_kl_rest"] = args.lr_rest
    if args.micro_batch:
        cfg["micro_batch"] = args.micro_batch
    if args.no_compile:
        cfg["compile"] = False
    return cfg


def distill_command(launcher: list[str], init: Path, run_out: Path, data: list[str], cfg: dict, resume: bool,
                    time_limit: float | None = None) -> list[str]:
    """`surgery distill` with the DistillConfig fields cfg (each as --set key=value), as a command line."""
    cmd = [*launcher, "-m", "surgery.cli.app", "distill", "--model", str(init), "--teacher", str(init.parent / "teacher"),
           "--data", *data, "--tokens", str(cfg["tokens"]), "--out", str(run_out), "--resume" if resume else "--force", "--json"]
    for key, value in cfg.items():
        if key != "tokens" and value is not None:
            cmd += ["--set", f"{key}={value}"]
    if time_limit:
        cmd += ["--time-limit", str(time_limit)]
    return cmd


def run_record(run_out: Path, summary: dict) -> dict:
    curve = read_curve(run_out)
    first = json.loads((run_out / "log.jsonl").read_text().splitlines()[0])
    return {"summary": summary, "curve": curve, "tokens_per_s": median_rate(run_out, "tokens_per_s"),
            "flops_per_s": median_rate(run_out, "flops_per_s"), "teacher_ppl_subset": first.get("teacher_ppl"),
            "complete": bool(summary.get("complete", True))}


def measure_distilled(report: dict, name: str, measure, graph_of) -> None:
    """The distilled model's whole-file perplexity and passkey, once per checkpoint (a later call that
    trained further measures again); graph_of(checkpoint) gives the model to measure."""
    summary = report["runs"][name]["summary"]
    checkpoint = summary["checkpoint"]
    if report["models"].get(f"{name} (distilled)", {}).get("checkpoint") != checkpoint:
        report["models"][f"{name} (distilled)"] = measure(f"{name} distilled", graph_of(checkpoint)) | {
            "checkpoint": checkpoint, "tokens": summary["tokens"]}


def concurrent(args, out: Path, report: dict, cfg: dict, dump, resuming: bool) -> None:
    """Both students distilled at once, each by its own `surgery distill` process on its own GPU
    (round-robin over the visible ones); with --stop-after each stops cleanly after that many
    seconds of training and a later call with --resume continues from its checkpoint."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = [d for d in visible.split(",") if d.strip()] if visible else [str(i) for i in range(torch.cuda.device_count())]
    runs = report.setdefault("runs", {})
    procs, logs = {}, {}
    for index, name in enumerate(("baseline", "taylor-calibrate")):
        if resuming and runs.get(name, {}).get("complete"):
            continue
        run_out = out / f"distill-{name}"
        resume = resuming and any(run_out.glob("checkpoint-*"))
        cmd = distill_command([sys.executable], out / f"{name}-init", run_out, args.data, cfg, resume, args.stop_after)
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpus[index % len(gpus)]) if gpus else dict(os.environ)
        log(f"distilling {name}" + (" (resumed)" if resume else "") + ": " + " ".join(cmd))
        logs[name] = open(out / f"distill-{name}.stderr", "a")
        procs[name] = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=logs[name], text=True)
    outputs = {name: proc.communicate()[0] for name, proc in procs.items()}  # wait for all before judging any
    for f in logs.values():
        f.close()
    failed = [name for name, proc in procs.items() if proc.returncode != 0]
    for name in procs:
        if name in failed:
            continue
        summary = json.loads(outputs[name].strip().splitlines()[-1])
        runs[name] = run_record(out / f"distill-{name}", summary)
        curve = runs[name]["curve"]
        log(f"{name}: {summary['tokens']:,} tokens so far, {runs[name]['tokens_per_s']:,.0f} tokens/s, curve {[(t, round(p, 2)) for t, p in curve]}")
    dump()
    if failed:
        tails = "\n".join(f"--- {name} ({procs[name].returncode}):\n" + (out / f"distill-{name}.stderr").read_text()[-3000:] for name in failed)
        raise SystemExit(f"distilling {', '.join(failed)} failed:\n{tails}")


def plain_and_plot(args, out: Path, report: dict, device, cuda: bool, dump, results_dir: Path, graph=None) -> None:
    """The plain-step FLOP/s (once) and the curves' PNG."""
    runs = report["runs"]
    if "plain_step" not in report:  # the same hybrid (its weights do not change the FLOP/s)
        graph = graph or load(out / "taylor-calibrate-init", device=device, dtype=torch.float32)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, graph.config.vocab_size, (args.micro_batch or args.global_batch, args.seq_len), generator=g).to(device)
        report["plain_step"] = plain_step_flops(graph, ids, args.plain_steps, cuda)
    report["distill_vs_plain_flops"] = runs["taylor-calibrate"]["flops_per_s"] / report["plain_step"]["flops_per_s"]
    dump()
    plot({k: v["curve"] for k, v in runs.items()}, runs["taylor-calibrate"]["teacher_ppl_subset"], results_dir / "recovery.png",
         plot_title(args))


def tokens_to_target(runs: dict) -> list[dict]:
    """Tokens to each multiple of the teacher's subset perplexity; where the baseline never gets
    there, the ratio is a lower bound from the tokens it was trained on."""
    teacher_subset = runs["taylor-calibrate"]["teacher_ppl_subset"]
    baseline_budget = max(t for t, _ in runs["baseline"]["curve"])
    ladder = []
    for m in LADDER:
        target = teacher_subset * m
        b = tokens_to(runs["baseline"]["curve"], target)
        tc = tokens_to(runs["taylor-calibrate"]["curve"], target)
        if tc == 0 and b == 0:
            ratio = "both start below"
        elif tc is not None and b is not None:
            ratio = f"{b / max(tc, 1):.1f}x" if tc > 0 else "inf (TC starts there)"
        elif tc is not None:
            ratio = f"> {baseline_budget / max(tc, 1):.1f}x (baseline not reached)" if tc > 0 else "TC starts below; baseline not reached"
        else:
            ratio = "not reached by TC"
        ladder.append({"multiple": m, "target_ppl": target, "baseline_tokens": b, "tc_tokens": tc, "ratio": ratio})
    return ladder


def matched_tokens(runs: dict) -> list[dict]:
    """For each evaluation of the Taylor-Calibrate run, the tokens the baseline needed to reach the
    same perplexity (None where it never did): the token saving at equal quality, along the curve."""
    rows = []
    for tokens, ppl in runs["taylor-calibrate"]["curve"]:
        if tokens == 0:
            continue
        b = tokens_to(runs["baseline"]["curve"], ppl)
        rows.append({"tc_tokens": tokens, "ppl": ppl, "baseline_tokens": b, "ratio": b / tokens if b is not None else None})
    return rows


def summarize(args, report: dict, lengths: list[int], dump, results_dir: Path) -> None:
    """Tokens-to-target and the tables, from whatever the runs reached so far."""
    runs = report["runs"]
    if not all(name in runs for name in ("baseline", "taylor-calibrate")):
        return
    report["tokens_to_target"] = ladder = tokens_to_target(runs)
    report["matched_tokens"] = matched = matched_tokens(runs)
    dump()
    if not report.get("plain_step"):
        plot({k: v["curve"] for k, v in runs.items()}, runs["taylor-calibrate"]["teacher_ppl_subset"], results_dir / "recovery.png",
             plot_title(args))
    log("\n| model | WikiText-2 ppl | passkey " + " | ".join(f"{x}" for x in lengths) + " |")
    log("|---|---|" + "---|" * len(lengths))
    for name, row in report["models"].items():
        pk = row["passkey"]["by_length"] if row["passkey"] else {}
        log(f"| {name} | {row['wikitext_ppl']:.2f} | " + " | ".join(f"{pk[str(x)]:.0%}" if str(x) in pk else "-" for x in lengths) + " |")
    log(f"\nteacher on the eval subset: {runs['taylor-calibrate']['teacher_ppl_subset']:.2f}; tokens trained: "
        + ", ".join(f"{k} {v['summary']['tokens']:,}" for k, v in runs.items()))
    log("| target | baseline tokens | TC tokens | ratio |\n|---|---|---|---|")
    for r in ladder:
        log(f"| {r['multiple']}x ({r['target_ppl']:.1f}) | {r['baseline_tokens']} | {r['tc_tokens']} | {r['ratio']} |")
    log("| TC tokens | TC ppl | baseline tokens to the same ppl | ratio |\n|---|---|---|---|")
    for r in matched:
        if r["ratio"] is None:  # later points are lower still: the baseline reaches none of them
            trained = max(t for t, _ in runs["baseline"]["curve"])
            log(f"| {r['tc_tokens']:,} on | {r['ppl']:.2f} and below | not in the baseline's {trained:,} | > {trained / r['tc_tokens']:.1f}x |")
            break
        log(f"| {r['tc_tokens']:,} | {r['ppl']:.2f} | {r['baseline_tokens']:,} | {r['ratio']:.1f}x |")
    if report.get("plain_step"):
        log(f"distill FLOP/s {runs['taylor-calibrate']['flops_per_s']:.3e} vs plain step {report['plain_step']['flops_per_s']:.3e}: "
            f"{report['distill_vs_plain_flops']:.0%}")


def one_init_options(ap) -> None:
    """Issue 30's modes: one init per stay (--init), the table of both (--table), the recipe study (--recipes)."""
    ap.add_argument("--init", choices=("baseline", "tcal"), default=None,
                    help="distil ONE init until --stop-multiple x the teacher's perplexity, --deadline-s or --tokens; append to --records")
    ap.add_argument("--tcal-passes", default="calibrate,align", choices=("calibrate,align", "calibrate", "align"),
                    help="with --init tcal: the Taylor-Calibrate passes after select and replace (calibrate: Phase 1 only)")
    ap.add_argument("--deadline-s", type=float, default=None, help="with --init/--recipes: seconds from the start of this process to be done in")
    ap.add_argument("--stop-multiple", type=float, default=1.2, help="with --init: stop once the eval perplexity is this multiple of the teacher's")
    ap.add_argument("--records", default=None, help="JSON-lines results both inits append to (default: OUT/recovery.jsonl)")
    ap.add_argument("--seed", type=int, default=0, help="data order (and passkey keys) of --init / --recipes runs")
    ap.add_argument("--passkey-trials", type=int, default=20, help="with --init: passkey trials per length (5 depths)")
    ap.add_argument("--retrieval", default="passkey",
                    help="with --init: retrieval tasks scored at each point, comma-separated: passkey, multikey, vartrack")
    ap.add_argument("--recipe-retrieval", action="store_true", help="with --recipes: each run's --retrieval tasks at its end "
                    "(--passkey-lengths, --passkey-trials), a column of the recipe table")
    ap.add_argument("--passkey-at", choices=("end", "crossing"), default="end",
                    help="with --init: score the 1.5x / 1.3x crossings after training from weights saved to disk, or at once")
    ap.add_argument("--reserve-s", type=float, default=None,
                    help="with --init: seconds kept after training for the passkey rows (default: 3 x the init's passkey time + 30)")
    ap.add_argument("--table", default=None, metavar="RESULTS.jsonl", help="print the tables of a records file and exit")
    ap.add_argument("--plot", default=None, metavar="CURVES.png", help="with --table: also draw each init's eval curve from the records (needs matplotlib)")
    ap.add_argument("--recipes", default=None, metavar="FILE.json",
                    help="recipe study: a JSON list of DistillConfig field dicts (a 'name' each), each run for --tokens on both inits")
    ap.add_argument("--recipe-indices", default=None, metavar="I,J",
                    help="with --recipes: only these recipes of the file (0-based), e.g. to spread one study over processes "
                         "sharing a GPU, each with its own --records and --out")


def one_init_modes(args, ap) -> None:
    """--table, --init, --recipes (bench/recovery_one.py, bench/recovery_recipes.py)."""
    from bench import recovery_one, recovery_points, recovery_recipes

    if args.table:
        if not Path(args.table).exists():
            ap.error(f"--table {args.table}: no such file (the --records of an --init run)")
        records = recovery_one.Records(Path(args.table)).read()
        for line in [*recovery_points.targets_table(records), "", *recovery_points.retrieval_tables(records),
                     *recovery_points.recipe_table(records)]:
            print(line)
        runs = recovery_points.latest_runs(records)
        if args.plot and runs:
            first = next(iter(runs.values()))
            plot({init: run["curve"] for init, run in runs.items()}, first["teacher_ppl"], Path(args.plot),
                 f"{Path(first['teacher']).stem}: {' vs '.join(runs)}")
        return
    missing = [f"--{k}" for k in ("model", "data", "eval", "out", "tokens") if getattr(args, k) is None]
    if missing:
        ap.error(f"--{'init' if args.init else 'recipes'} needs {', '.join(missing)}")
    args.lengths = [int(x) for x in (args.passkey_lengths or "1024,2048,4096,8192").split(",")]
    args.retrieval = [t.strip() for t in args.retrieval.split(",") if t.strip()]
    if not args.retrieval or set(args.retrieval) - set(recovery_points.RETRIEVAL):
        ap.error(f"--retrieval {','.join(args.retrieval)}: choose among {', '.join(recovery_points.RETRIEVAL)}")
    if args.recipes:
        return recovery_recipes.study(args, STARTED)
    recovery_one.run_one(args, STARTED)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--data", nargs="+")
    ap.add_argument("--calibration", nargs="*", default=None, help="Taylor-Calibrate text (default: --data)")
    ap.add_argument("--eval")
    ap.add_argument("--keep-ratio", type=float, default=0.5)
    ap.add_argument("--select-policy", default="uniform", choices=("uniform", "ar", "retrieval", "greedy"),
                    help="which layers stay attention, the same for both students (ar, retrieval, greedy: scored on the calibration text)")
    ap.add_argument("--tokens", type=int, default=None, help="distillation tokens per init")
    ap.add_argument("--seconds-per-run", type=float, default=None,
                    help="instead of --tokens: time 3 steps first, then give each init the tokens of about this many seconds")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=None, help="stage-2 lr of the GDN layers (default: DistillConfig's)")
    ap.add_argument("--schedule", default="constant", choices=("constant", "cosine"),
                    help="lr schedule of both runs (constant: a shorter run is a prefix of a longer one; cosine decays over --tokens)")
    ap.add_argument("--warmup", type=float, default=0.0, help="warmup fraction of the steps")
    ap.add_argument("--lr-rest", type=float, default=None, help="stage-2 lr outside the GDN layers (default: DistillConfig's)")
    ap.add_argument("--eval-every", type=int, default=None, help="tokens (default: tokens / 10)")
    ap.add_argument("--eval-tokens", type=int, default=65536)
    ap.add_argument("--passkey-lengths", default=None, help="default 1024,2048,4096 (with --init: 1024,2048,4096,8192)")
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
    ap.add_argument("--concurrent", action="store_true",
                    help="distil the two inits at once, one `surgery distill` process per GPU (needs --tokens, --eval-every)")
    ap.add_argument("--stop-after", type=float, default=None,
                    help="with --concurrent: seconds of training per call; the runs checkpoint and stop, --resume continues")
    ap.add_argument("--stop-at", type=float, default=None,
                    help="with --concurrent: a Unix time by which training should have stopped (sets --stop-after from "
                         "the clock when the distillation processes start, less their start-up): for a fixed device budget")
    ap.add_argument("--finish", action="store_true",
                    help="with --concurrent: measure the runs as they stand (whole file, passkey, plain step) even if unfinished")
    ap.add_argument("--micro-batch", type=int, default=None, help="sequences per forward on one process (default: its whole share)")
    ap.add_argument("--no-compile", action="store_true", help="train eagerly (default: DistillConfig's rule, compiled where it pays)")
    ap.add_argument("--save-every", type=int, default=None, help="with --concurrent: tokens between checkpoints (default: --eval-every)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: skip passkey lengths the model cannot hold")
    ap.add_argument("--set", nargs="*", default=[], help="pass.key=value for the Taylor-Calibrate init (e.g. align.steps=30)")
    ap.add_argument("--out")
    ap.add_argument("--results", default=None, help="directory for the JSON and PNG (default: --out)")
    one_init_options(ap)
    args = ap.parse_args()
    if args.plot and not args.table:
        ap.error("--plot draws the curves of a records file: pass it with --table RECORDS.jsonl")
    if args.table or args.init or args.recipes:
        from surgery.errors import SurgeryError

        try:
            return one_init_modes(args, ap)
        except SurgeryError as exc:  # bad input (lengths, recipe fields): its one-line error and fix, no stack trace
            raise SystemExit(str(exc)) from None
    missing = [f"--{k}" for k in ("model", "data", "eval", "out") if getattr(args, k) is None]
    if missing:
        ap.error(f"the following arguments are required: {', '.join(missing)}")
    args.passkey_lengths = args.passkey_lengths or "1024,2048,4096"
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
        log(f"resuming the run in {out}: {', '.join(k for k, v in report.get('runs', {}).items() if v.get('complete', True)) or 'no distillation'} finished")

    # The teacher and both inits are built in bf16 on CUDA (as `surgery apply` does: fast), saved, and
    # reloaded in float32 for training (float32 master weights under bf16 autocast, as distill wants);
    # reloading also gives each student its own tensors (branches share the teacher's).
    t0 = time.perf_counter()
    build_dtype = torch.bfloat16 if cuda else torch.float32
    teacher_dir = out / "teacher"
    use_plain = args.two_gpu or args.two_gpu_later or args.concurrent
    if use_plain:
        plain_teacher(args.model, teacher_dir)
    names = ("baseline", "taylor-calibrate")
    inits_ready = resuming and all((out / f"{name}-init").exists() for name in names) and "models" in report
    teacher = None
    if not (args.concurrent and inits_ready):  # concurrent distillation captures the teacher in its own processes
        teacher = capture(teacher_dir if use_plain else args.model, device=device, dtype=build_dtype)
        log(f"teacher captured in {time.perf_counter() - t0:.1f} s")

    calibration = args.calibration or args.data
    lengths = [int(x) for x in args.passkey_lengths.split(",")]
    eval_text, eval_ids = read_text(args.eval), []  # tokenized once, by the first model measured (all share the teacher's tokenizer)

    def measure(name: str, graph) -> dict:
        usable = [x for x in lengths if x + 16 <= graph.max_length] if args.tiny else lengths
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            eval_ids[:] = eval_ids or [tokenize(graph.tokenizer, eval_text)]
            ppl = perplexity(graph, eval_ids[0], batch_size=4)
            pk = passkey(graph, calibration, usable, depths=5, trials_per_depth=2, batch_size=4) if usable else None
        row = {"wikitext_ppl": ppl["perplexity"], "wikitext_tokens": ppl["tokens"], "passkey": pk}
        log(f"{name}: wikitext ppl {ppl['perplexity']:.2f}" + (f", passkey {pk['accuracy']:.0%} {pk['by_length']}" if pk else ""))
        return row

    if not inits_ready:
        build_inits(args, teacher, calibration, out, report, measure)
        dump()
    step_tokens = args.seq_len * args.global_batch
    if args.concurrent:
        del teacher
        gc.collect()
        if cuda:  # the distillation processes use this GPU too
            torch.cuda.empty_cache()
        if "distill_config" not in report:
            report["distill_config"] = fixed_config(args, step_tokens)
        cfg = report["distill_config"]
        if args.stop_at:
            args.stop_after = max(args.stop_at - time.time() - DISTILL_STARTUP_S, 30.0)
            log(f"training stops after {args.stop_after:.0f} s (--stop-at)")
        if not (args.finish and all(name in report.get("runs", {}) for name in names)):  # --finish trains no further
            concurrent(args, out, report, cfg, dump, resuming)
        if not args.finish and not all(r.get("complete") for r in report["runs"].values()):
            log("not finished: run the same command with --resume to continue (--finish to measure the runs as they stand)")
            summarize(args, report, lengths, dump, results_dir)
            return
        for name in names:
            measure_distilled(report, name, measure, lambda c: load(c, device=device, dtype=torch.float32))
        dump()
        plain_and_plot(args, out, report, device, cuda, dump, results_dir)
        if args.two_gpu:
            two_gpu(args, out, report, dump)
        summarize(args, report, lengths, dump, results_dir)
        return
    t = time.perf_counter()
    done = {name: run for name, run in report.get("runs", {}).items() if run.get("complete", True)}
    students = {name: load(out / f"{name}-init", device=device, dtype=torch.float32) for name in names if name not in done}
    log(f"inits reloaded in float32 in {time.perf_counter() - t:.1f} s")

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
        runs[name] = run_record(run_out, summary)
        curve = runs[name]["curve"]
        log(f"{name}: {runs[name]['tokens_per_s']:,.0f} tokens/s, curve {[(t, round(p, 2)) for t, p in curve]}")
        report["runs"] = runs
        measure_distilled(report, name, measure, lambda _, trained=graph: trained)
        dump()
    plain_and_plot(args, out, report, device, cuda, dump, results_dir, students.get("taylor-calibrate"))
    if args.two_gpu:
        two_gpu(args, out, report, dump)
    summarize(args, report, lengths, dump, results_dir)


if __name__ == "__main__":
    main()
