"""One init of issue 30 inside one stay on the GPU machine (`bench/recovery.py --init baseline|tcal`).

The init is built from the teacher (copy-only, or Taylor-Calibrate), saved, and distilled with the
recipe of the command line until its WikiText-2 perplexity (eval subset) reaches --stop-multiple x
the teacher's, or the deadline (--deadline-s from the start of the process, less the time the
passkey rows at the end need), or the token budget. Every record (the run with its curve, its
tokens to 1.5x / 1.3x / 1.2x, passkey rows) is appended as a JSON line to --records; the other
init, run with the same seed and data, appends to the same file and `--table` compares them.

Passkey rows (1k-8k, --passkey-trials per length): the teacher once per records file, the student at
init, where it first crosses 1.5x and 1.3x, and at the end. At a crossing the student's weights go
to local disk (--passkey-at end, the default: scored after training) or are scored at once
(--passkey-at crossing); both record their seconds, so which is cheaper is a measurement.

--resume continues a cut-off run only when its checkpoint is on this machine: the host that wrote
the run directory and a complete checkpoint in it. Otherwise one line, "start over: ...", exit 2.
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
import time
import uuid
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from bench.recovery import kl_config, median_rate, read_curve, selection
from bench.recovery_points import PIPELINES, crossing, describe, retrieval_tables, target_rows, targets_table
from surgery import PassManager, capture, load, save
from surgery.core.pipeline import parse_options
from surgery.eval.retrieval import retrieval_task
from surgery.train import DistillConfig, distill
from surgery.train.run_dir import RunDir

SNAPSHOT_POINTS = (1.5, 1.3)  # crossings that get a passkey row
ANSWER_ROOM = 16               # tokens a passkey answer may take past its prompt
UNKNOWN_PASSKEY_S = 60.0       # reserve per passkey row when none has been timed yet


class TargetReached(Exception):
    """Raised from a step hook: the run reached --stop-multiple, training ends there."""


class Records:
    """The JSON-lines results file: every row carries the run id, host and time it was written."""

    def __init__(self, path: Path, run_id: str | None = None):
        self.path, self.run_id = path, run_id
        path.parent.mkdir(parents=True, exist_ok=True)

    def read(self) -> list[dict]:
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()] if self.path.exists() else []

    def add(self, row: dict) -> dict:
        row = {**row, "run_id": self.run_id, "host": socket.gethostname(), "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        return row


def log(msg: str) -> None:
    print(msg, flush=True)


def marker_path(out: Path, init: str) -> Path:
    return out / f"distill-{init}.host.json"


def resume_problem(out: Path, init: str) -> str | None:
    """Why a --resume of this init cannot continue here (None: it can)."""
    run, marker = out / f"distill-{init}", marker_path(out, init)
    if not run.is_dir() or not marker.exists():
        return f"no run of {init} in {out} on this machine (a checkpoint does not outlive the machine that wrote it)"
    host = json.loads(marker.read_text()).get("host")
    if host != socket.gethostname():
        return f"the run in {run} was written on {host}, this is {socket.gethostname()}"
    if not RunDir(run).checkpoints():
        return f"{run} holds no complete checkpoint"
    return None


def passkey_lengths(graph, lengths: list[int]) -> list[int]:
    """The lengths asked for, each clipped to what the graph holds with the answer (8k on an 8192-position
    model becomes 8176): the row then names the length measured."""
    return sorted({min(x, graph.max_length - ANSWER_ROOM) for x in lengths})


def retrieval_rows(graph, args, model: str, point: str, tokens: int | None) -> list[dict]:
    """Each --retrieval task (passkey; multikey, vartrack: surgery.eval.<task>) at each length,
    --passkey-trials per length (5 depths), timed: one row per task, its kind the task's name."""
    lengths = passkey_lengths(graph, args.lengths)
    depths, rows = 5, []
    for task in args.retrieval:
        run = retrieval_task(task)
        t = time.perf_counter()
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=torch.cuda.is_available()):
            result = run(graph, args.calibration or args.data, lengths, depths, max(args.passkey_trials // depths, 1), args.seed, batch_size=4)
        seconds = time.perf_counter() - t
        log(f"{task} {model} at {point}: {result['by_length']} ({seconds:.1f} s)")
        rows.append({"kind": task, "model": model, "point": point, "tokens": tokens, "by_length": result["by_length"],
                     "trials_per_length": result["trials"] // len(lengths), "seconds": seconds})
    return rows


def add_all(records: "Records", rows: list[dict], **changes) -> None:
    for row in rows:
        records.add(row | changes)


def build_init(args, teacher, out: Path, select: dict | None = None) -> tuple[Path, dict]:
    """The init from the teacher, saved to out/INIT-init; (its directory, the select options: given,
    or decided here by --select-policy)."""
    calibration = args.calibration or args.data
    select = select or selection(args, teacher, calibration, {})
    configs = {"select": dict(select)}
    passes = pipeline(args)
    if args.init == "tcal":
        configs |= {name: {"calibration": calibration} for name in passes[2:]}
        parse_options(args.set, into=configs)
    graph = teacher.branch()
    t = time.perf_counter()
    PassManager(passes, configs)(graph)
    log(f"{args.init} init built in {time.perf_counter() - t:.1f} s: GDN layers {graph.gdn_targets()}")
    return save(graph, out / f"{args.init}-init", force=True), select


def pipeline(args) -> list[str]:
    """The init's passes: the baseline's, or select, replace and --tcal-passes (default calibrate, align)."""
    if args.init == "baseline":
        return PIPELINES["baseline"]
    return PIPELINES["baseline"] + args.tcal_passes.split(",")


def init_options(args) -> list[str]:
    """The --set options the init was built with (they apply to Taylor-Calibrate's passes only)."""
    return list(args.set) if args.init == "tcal" else []


def run_config(args, time_limit: float, **fields) -> DistillConfig:
    """The stage-2 KL recipe of the command line (plus `fields`), the same for both inits."""
    step = args.seq_len * args.global_batch
    tokens = max(args.tokens // step, 1) * step
    cfg = kl_config(args, tokens, args.eval_every or max(tokens // 20, step), args.save_every or max(tokens // 10, step))
    return DistillConfig.from_dict(cfg | {"seed": args.seed, "time_limit": time_limit} | fields)


class Crossings:
    """The step hook: notes where the eval perplexity first crosses 1.5x and 1.3x the teacher's
    (weights to disk, or a passkey row at once), and stops the run at --stop-multiple."""

    def __init__(self, args, run_out: Path, records: Records, crossed: dict, init_rows: list[dict]):
        self.args, self.run_out, self.records, self.crossed, self.init_rows = args, run_out, records, crossed, init_rows
        self.student, self.teacher_ppl, self.snapshot_s = None, None, []
        self.curve: list[tuple[int, float]] = []  # (tokens, eval perplexity), each also logged: the log alone holds the curve
        self.config, self.time_left = None, None  # with --deadline-s: the run's config and the seconds of training left now

    def open(self, student) -> None:
        self.student = student
        if self.time_left is not None:  # opening the run (hashing and tokenising the data, loading the init) is not training time
            self.config.time_limit = max(1.0, self.time_left())

    def step(self, record: dict) -> None:
        ppl = record.get("eval_ppl")
        if ppl is None:
            return
        if self.teacher_ppl is None:
            first = json.loads((self.run_out / "log.jsonl").read_text().splitlines()[0])  # step 0: teacher and init
            self.teacher_ppl = first["teacher_ppl"]
            for m in SNAPSHOT_POINTS:
                if m not in self.crossed and first["eval_ppl"] <= self.teacher_ppl * m:  # the init row is that point
                    self.crossed[m] = 0
                    add_all(self.records, self.init_rows, point=f"{m}x", same_as="init")
            self.curve.append((0, first["eval_ppl"]))
            log(f"eval at 0 tokens: perplexity {first['eval_ppl']:.3f} (teacher {self.teacher_ppl:.3f})")
        if record["tokens"] > 0:
            self.curve.append((record["tokens"], ppl))
            log(f"eval at {record['tokens']:,} tokens: perplexity {ppl:.3f} ({ppl / self.teacher_ppl:.3f}x the teacher)")
        for m in SNAPSHOT_POINTS:
            if m not in self.crossed and ppl <= self.teacher_ppl * m:
                self.crossed[m] = record["tokens"]
                self.at_crossing(m, record["tokens"])
        if ppl <= self.teacher_ppl * self.args.stop_multiple:
            raise TargetReached

    def at_crossing(self, m: float, tokens: int) -> None:
        if self.args.passkey_at == "crossing":
            add_all(self.records, retrieval_rows(self.student, self.args, self.args.init, f"{m}x", tokens))
            return
        t = time.perf_counter()
        save_file({k: v.detach().to("cpu", copy=True).contiguous() for k, v in self.student.gm.state_dict().items()},
                  str(snapshot_path(self.run_out, m)), metadata={"tokens": str(tokens)})
        self.snapshot_s.append(time.perf_counter() - t)
        at = crossing(self.curve, self.teacher_ppl * m)
        log(f"crossed {m}x at {tokens:,} tokens ({at / 1e6:.2f}M interpolated): weights saved in {self.snapshot_s[-1]:.2f} s")


def snapshot_path(run_out: Path, m: float) -> Path:
    return run_out.parent / f"{run_out.name}-snapshot-{m}x.safetensors"


def end_rows(args, hook: Crossings, records: Records, trained: int) -> None:
    """Passkey at the end, then at each crossing whose weights wait on disk (loaded into the same graph)."""
    graph = hook.student
    add_all(records, retrieval_rows(graph, args, args.init, "end", trained))
    for m, tokens in sorted(hook.crossed.items(), reverse=True):
        path = snapshot_path(hook.run_out, m)
        if args.passkey_at == "end" and path.exists():
            t = time.perf_counter()
            graph.gm.load_state_dict({k: v.to(next(graph.gm.parameters()).device) for k, v in load_file(str(path)).items()})
            rows = retrieval_rows(graph, args, args.init, f"{m}x", tokens)
            add_all(records, rows, load_s=time.perf_counter() - t - sum(r["seconds"] for r in rows))
            path.unlink()


def args_with(args, **changes):
    return argparse.Namespace(**(vars(args) | changes))


def reserve_seconds(args, records: list[dict]) -> float:
    """Seconds kept after training for the passkey rows still to come (end, 1.5x, 1.3x)."""
    if args.reserve_s is not None:
        return args.reserve_s
    timed = {r["kind"]: r.get("warm_seconds", r["seconds"]) for r in records if r.get("kind") in args.retrieval and r.get("point") == "init"}
    return 3 * sum(timed.get(task, UNKNOWN_PASSKEY_S) for task in args.retrieval) + 30.0


def earlier_selection(args, records: list[dict]) -> dict | None:
    """The layers an earlier run in this records file converted (the same teacher, a data-driven
    policy): the other init converts exactly those, not a fresh scoring that bf16 could tip."""
    if args.select_policy == "uniform":
        return None
    runs = [r for r in records if r.get("kind") == "run" and r.get("teacher") == str(args.model)
            and (r.get("layers") or {}).get("policy") == "keep"]
    if runs:
        log(f"layers from the records' {runs[-1]['init']} run ({runs[-1]['run_id']}): {runs[-1]['layers']['layers']}")
        return dict(runs[-1]["layers"])
    return None


def start(args, out: Path, teacher) -> tuple[Records, dict, Path]:
    """A new run: the init built and saved, the host marker, the teacher's passkey row (once per
    records file) and the init's. -> (records, the marker's content, the init directory)."""
    marker = {"host": socket.gethostname(), "run_id": f"{args.init}-{uuid.uuid4().hex[:8]}", "init": args.init}
    records = Records(Path(args.records), marker["run_id"])
    init_dir, select = build_init(args, teacher, out, earlier_selection(args, records.read()))
    marker["select"] = select
    marker_path(out, args.init).write_text(json.dumps(marker))
    done = {r.get("kind") for r in records.read() if r.get("model") == "teacher"}
    args_missing = [task for task in args.retrieval if task not in done]  # the teacher once per records file and task
    add_all(records, retrieval_rows(teacher, args_with(args, retrieval=args_missing), "teacher", "teacher", None))
    student = load(init_dir, device=teacher.device, dtype=torch.float32)
    rows = retrieval_rows(student, args, args.init, "init", 0)
    # The first pass compiled kernels for each length (38 s against 4 s warm on the H200, 2026-12-03), which the
    # later rows do not pay: a warm repeat sizes the reserve, so the deadline is not spent waiting.
    warm = {r["kind"]: r["seconds"] for r in retrieval_rows(student, args, args.init, "init, warm repeat", 0)}
    add_all(records, [r | {"warm_seconds": warm[r["kind"]]} for r in rows])
    del student
    return records, marker, init_dir


def run_one(args, began: float) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.records = args.records or str(out / "recovery.jsonl")
    if args.resume and (why := resume_problem(out, args.init)):
        print(f"start over: {why}", flush=True)
        sys.exit(2)
    if args.deadline_s is not None and args.deadline_s - (time.time() - began) <= (args.reserve_s or 0.0):
        raise SystemExit(f"--deadline-s {args.deadline_s:g} is already past (less the --reserve-s kept for the passkey rows): raise it")
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    teacher = capture(args.model, device=device, dtype=torch.bfloat16 if cuda else torch.float32)
    if args.resume:
        marker = json.loads(marker_path(out, args.init).read_text())
        records, init_dir = Records(Path(args.records), marker["run_id"]), out / f"{args.init}-init"
        ended = [r for r in records.read() if r.get("kind") == "run" and r.get("run_id") == marker["run_id"] and r["stopped"] != "deadline"]
        if ended:  # stopped by the target or the budget: resuming would only train past it
            print(f"nothing to resume: {marker['run_id']} ended ({ended[-1]['stopped']}) after {ended[-1]['curve'][-1][0]:,} tokens; "
                  f"--table {args.records} prints it", flush=True)
            return
        log(f"resuming {marker['run_id']} from {RunDir(out / f'distill-{args.init}').last()[0]}")
    else:
        records, marker, init_dir = start(args, out, teacher)
    earlier = records.read()
    left = args.deadline_s - (time.time() - began) - reserve_seconds(args, earlier) if args.deadline_s else 0.0
    if args.deadline_s and left < 1:
        raise SystemExit(f"--deadline-s {args.deadline_s:g} leaves no time to train after set-up and the passkey reserve: raise it")
    config = run_config(args, max(left, 0.0))
    run_out = out / f"distill-{args.init}"
    crossed = {float(r["point"][:-1]): r["tokens"] for r in earlier if r.get("run_id") == marker["run_id"] and r.get("kind") == "crossing"}
    init_rows = [{k: v for k, v in r.items() if k not in ("run_id", "host", "written")} for r in earlier
                 if r.get("run_id") == marker["run_id"] and r.get("point") == "init"]  # none on a resume with another --records
    hook = Crossings(args, run_out, records, crossed, init_rows)
    if args.deadline_s:
        hook.config, hook.time_left = config, lambda: args.deadline_s - (time.time() - began) - reserve_seconds(args, earlier)
    stopped = "budget"
    log(f"distilling {args.init} for up to {config.tokens:,} tokens" + (f", {left:.0f} s of training" if args.deadline_s else ""))
    try:
        summary = distill(str(init_dir), args.data, run_out, config, teacher=teacher, resume=args.resume, force=not args.resume,
                          progress=False, on_step=hook.step, on_open=hook.open)
        stopped = "deadline" if summary.get("stopped") == "time_limit" else (summary.get("stopped") or "budget")
    except TargetReached:
        stopped = "target"
    for m, tokens in crossed.items():
        if not any(r.get("kind") == "crossing" and r["point"] == f"{m}x" and r.get("run_id") == marker["run_id"] for r in earlier):
            records.add({"kind": "crossing", "init": args.init, "point": f"{m}x", "tokens": tokens})
    finish(args, hook, records, marker, run_out, stopped, config, began)


def finish(args, hook: Crossings, records: Records, marker: dict, run_out: Path, stopped: str, config, began: float) -> None:
    """The passkey rows at the end and at the crossings, the run record, the table so far."""
    curve = read_curve(run_out)
    teacher_ppl = hook.teacher_ppl or json.loads((run_out / "log.jsonl").read_text().splitlines()[0])["teacher_ppl"]
    if hook.student is None:  # a resumed run that had nothing left to train
        hook.student = load(RunDir(run_out).last()[0], device="cuda" if torch.cuda.is_available() else "cpu", dtype=torch.float32)
    end_rows(args, hook, records, curve[-1][0])
    shared = {k: v for k, v in config.to_dict().items() if k not in ("time_limit", "save_every", "eval_every", "micro_batch", "compile")}
    row = records.add({"kind": "run", "init": args.init, "passes": pipeline(args), "set": init_options(args), "config": shared, "layers": marker.get("select"), "teacher": str(args.model),
                       "data": [str(d) for d in args.data], "eval": str(args.eval), "teacher_ppl": teacher_ppl, "curve": curve,
                       "stopped": stopped, "tokens_per_s": median_rate(run_out, "tokens_per_s"), "snapshot_s": hook.snapshot_s,
                       "wall_s": time.time() - began, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"})
    log(f"{args.init}: stopped by {stopped} after {curve[-1][0]:,} tokens ({row['tokens_per_s']:,.0f} tokens/s), "
        f"perplexity {curve[-1][1]:.3f} (teacher {teacher_ppl:.3f})")
    for target in target_rows(curve, teacher_ppl):
        log(f"  tokens to {target['multiple']}x ({target['target_ppl']:.3f}): {describe(target)}")
        records.add({"kind": "target", "init": args.init, **target})
    print_table(records.read())


def print_table(records: list[dict]) -> None:
    for line in ["", *targets_table(records), "", *retrieval_tables(records)]:
        print(line, flush=True)
