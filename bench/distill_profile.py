"""Where the time of one distillation optimizer step goes (issue 17's 200k tokens/s target for the
50% GDN hybrid, SmolLM2-135M shapes). At 8 and 32 x 512 a compiled step took ~130 ms either way; at
64 and 128 it scales with the batch, and the profile found the eager KL chunks as the largest cost
after the GEMMs (bench/RESULTS.md, twelfth session). This runs distill() as bench/compile_speed.py's distill_rows does and, on
one step after compiling and warm-up (--profile-step), runs the trainer's optimizer_step under
torch.profiler: wall ms against GPU busy ms (CUDA kernels' own time), kernel launches, device time by
kernel family, the top kernels, and the top CPU ops by self time (syncs, launches, Python-side ops).

    PYTHONPATH=. python bench/distill_profile.py --random --batches 64,128 --modes compiled,eager --json distill_profile.json
    PYTHONPATH=. python bench/distill_profile.py --smoke --modes eager     # CPU check, stories260K

On CPU there are no CUDA events: busy is then the CPU ops' self time (the row's busy_source says so).
The profiler starts one step early (a warm-up step, so CUPTI's start-up is not in the measured step);
both steps are left out of unprofiled_step_ms (their log_step_ms include the profiler's own work, the
trace summarised inside the trainer's timing). GPU set-up as in bench/RESULTS.md (fla's wheels; Triton
>= 3.7.1 for fla's backward, else the row says gdn_backward=torch). Prints a markdown table per run
and writes the rows as JSON (--json)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, schedule  # noqa: E402

import surgery.core.compiled as compiled  # noqa: E402
import surgery.train.trainer as trainer  # noqa: E402
from surgery import capture  # noqa: E402
from surgery.core.load import load_model  # noqa: E402
from surgery.train import DistillConfig, distill  # noqa: E402
from bench._models import smollm2_shaped  # noqa: E402
from bench.compile_speed import SAMPLE, STORIES, Rows, graph_dtype, hybrid_of, steady_tokens_per_s, sync  # noqa: E402
from tcal.kernels import fla_backward_supported  # noqa: E402

# first match wins: "mm" alone would also catch other names, so GEMM is tried late; inductor's own
# fused kernels are named triton_* (its GEMM templates, triton_tem_fused_mm*, are caught as GEMM first)
BUCKETS = (("optimizer", ("multi_tensor", "foreach", "adam")),
           ("fla/triton gdn", ("chunk", "fused_recurrent", "wy", "gated_delta", "solve_tril", "l2norm", "kkt", "recompute_w_u")),
           ("attention", ("flash", "sdpa", "cudnn", "fmha")),
           ("gemm", ("gemm", "nvjet", "cutlass", "sm90_xmma", "mm")),
           ("inductor triton", ("triton_",)))
HOST = {"sync": ("synchronize",), "launch": ("launchkernel", "culaunch")}  # CUDA runtime/driver calls, by CPU self time


def bucket(name: str) -> str:
    low = name.lower()
    return next((label for label, keys in BUCKETS if any(k in low for k in keys)), "other")


def device_events(prof) -> tuple[list, str]:
    """The CUDA kernels (as kernel_profile counts them: not the ops that launched them, nor '## '
    CUDA-graph spans), else every CPU op, so a CPU run still gives a busy figure."""
    events = [e for e in prof.key_averages() if not e.key.startswith("## ")]
    # on CUDA, record_function spans ("ProfilerStep#6", "Optimizer.step#AdamW.step") come back as
    # device events too, spanning kernels already counted: the first GPU run counted them twice
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0
               and not e.key.startswith("ProfilerStep") and "#" not in e.key]
    if kernels:
        return [(e.key, e.self_device_time_total, e.count) for e in kernels], "cuda kernels"
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU and e.self_cpu_time_total > 0
           and not e.key.startswith("ProfilerStep")]  # the step's own span: its self time is host glue, not compute
    return [(e.key, e.self_cpu_time_total, e.count) for e in cpu], "cpu ops self time (no CUDA events)"


def summarize(prof, wall_ms: float) -> dict:
    """The profiled step's figures: busy and idle, launches, buckets, top kernels, top CPU ops."""
    events, source = device_events(prof)
    busy = sum(us for _, us, _ in events) / 1000
    buckets: dict[str, float] = {}
    for key, us, _ in events:
        buckets[bucket(key)] = buckets.get(bucket(key), 0.0) + us / 1000
    cpu = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU]
    host = {name: [round(sum(e.self_cpu_time_total for e in cpu if any(k in e.key.lower() for k in keys)) / 1000, 3),
                   sum(e.count for e in cpu if any(k in e.key.lower() for k in keys))] for name, keys in HOST.items()}
    return {"wall_ms": wall_ms, "busy_ms": busy, "busy_source": source, "gpu_idle_fraction": 1 - busy / wall_ms,
            "kernels": sum(n for _, _, n in events) if source == "cuda kernels" else 0,
            "buckets_ms": {k: round(v, 3) for k, v in sorted(buckets.items(), key=lambda kv: -kv[1])},
            "host_ms_calls": host,
            "top_kernels": [(k[:70], round(us / 1000, 3), n) for k, us, n in sorted(events, key=lambda x: -x[1])[:15]],
            "top_cpu_ops": [(e.key[:70], round(e.self_cpu_time_total / 1000, 3), e.count)
                            for e in sorted(cpu, key=lambda e: -e.self_cpu_time_total)[:10]]}


class StepHook:
    """Stands in for trainer.optimizer_step (Trainer.train_step calls it through the module global)
    while a run lasts: times every step to its end on the device, and profiles step `at`, the
    profiler started one step before as warm-up."""

    def __init__(self, at: int, device):
        self.at, self.device, self.ms, self.result, self.prof = at, device, {}, None, None

    def __enter__(self):
        self.original, trainer.optimizer_step = trainer.optimizer_step, self.step
        return self

    def __exit__(self, *exc):  # a run that raised gets the trainer's own function back too
        trainer.optimizer_step = self.original
        if self.prof is not None:
            self.prof.stop()

    def step(self, job, step, *rest):
        if step == self.at - 1:
            cuda = [ProfilerActivity.CUDA] if self.device.type == "cuda" else []
            self.prof = profile(activities=[ProfilerActivity.CPU, *cuda], schedule=schedule(wait=0, warmup=1, active=1, repeat=1),
                                on_trace_ready=lambda p: setattr(self, "result", summarize(p, self.ms[self.at])))
            self.prof.start()
        sync(self.device)
        t = time.perf_counter()
        out = self.original(job, step, *rest)
        sync(self.device)
        self.ms[step] = 1000 * (time.perf_counter() - t)
        if self.prof is not None:
            self.prof.step()  # after step `at`, on_trace_ready summarizes it (inside the trainer's timing of that step)
            if step == self.at:
                self.prof.stop()
                self.prof = None
        return out


def log_step_ms(run_dir: Path) -> list[float]:
    """Each logged step's ms as the trainer timed it (optimizer_step and the scheduler)."""
    path = run_dir / "log.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return [round(1000 * r["tokens"] / r["step"] / r["tokens_per_s"], 2) for r in records if r.get("tokens_per_s")]


def run_row(teacher, mode: str, batch: int, args, device) -> dict:
    """One distill() run of the 50% hybrid, as compile_speed.distill_rows makes it, with the hook on."""
    student = hybrid_of(teacher, 0.5)
    student.gm.float()
    config = DistillConfig(tokens=args.steps * args.seq_len * batch, seq_len=args.seq_len, global_batch=batch, warmup=0.0,
                           compile=mode == "compiled")
    row = {"bench": "distill_profile", "mode": mode, "batch": batch, "seq_len": args.seq_len, "steps": args.steps,
           "profile_step": args.profile_step, "gdn_backward": "fla" if fla_backward_supported() else "torch"}
    with tempfile.TemporaryDirectory() as folder, StepHook(args.profile_step, device) as hook:
        t = time.perf_counter()
        distill(student, [str(SAMPLE)], Path(folder) / "run", config, teacher=teacher, device=device, progress=False)
        row["seconds"] = round(time.perf_counter() - t, 2)
        row["steady_tokens_per_s"] = steady_tokens_per_s(Path(folder) / "run", skip=3)
        row["log_step_ms"] = log_step_ms(Path(folder) / "run")
    row["step_wall_ms"] = [round(hook.ms[s], 2) for s in sorted(hook.ms)]
    plain = [ms for s, ms in hook.ms.items() if s >= 3 and s not in (args.profile_step - 1, args.profile_step)]
    row["unprofiled_step_ms"] = statistics.median(plain) if plain else None
    row.update(hook.result or {"profile": "missing (the run ended before --profile-step)"})
    if hook.result and row["unprofiled_step_ms"]:
        row["idle_fraction_vs_unprofiled"] = 1 - row["busy_ms"] / row["unprofiled_step_ms"]
    torch._dynamo.reset()
    return row


def table(row: dict) -> str:
    """The run as one markdown table: headline figures, buckets, host calls, top kernels, top CPU ops."""
    lines = [f"\n### {row['mode']} batch {row['batch']} x {row['seq_len']} (step {row['profile_step']} profiled)",
             "| item | ms / value | count |", "|---|---|---|"]
    for key in ("steady_tokens_per_s", "unprofiled_step_ms", "wall_ms", "busy_ms", "busy_source", "gpu_idle_fraction",
                "idle_fraction_vs_unprofiled", "kernels"):
        if row.get(key) is not None:
            lines.append(f"| {key} | {row[key]:.4g} |  |" if isinstance(row[key], float) else f"| {key} | {row[key]} |  |")
    lines += [f"| bucket: {k} | {v:.3f} |  |" for k, v in row.get("buckets_ms", {}).items()]
    lines += [f"| host: {k} | {ms:.3f} | {n} |" for k, (ms, n) in row.get("host_ms_calls", {}).items()]
    lines += [f"| kernel: `{k}` | {ms:.3f} | {n} |" for k, ms, n in row.get("top_kernels", [])]
    lines += [f"| cpu: `{k}` | {ms:.3f} | {n} |" for k, ms, n in row.get("top_cpu_ops", [])]
    lines.append(f"| step ms (log) | {row.get('log_step_ms')} |  |")
    return "\n".join(lines)


def build_teacher(args, device):
    """The teacher as compile_speed.main builds it: SmolLM2-shaped random weights (stories260K's
    tokenizer reads the text) or a captured file, in bf16 on CUDA."""
    dtype = graph_dtype(device)
    source = smollm2_shaped().to(device=device, dtype=dtype).eval() if args.random else args.model
    teacher = capture(source, device=device, dtype=dtype, max_length=args.seq_len)
    if args.random:
        teacher.tokenizer = load_model(STORIES)[1]
    return teacher


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="teacher file (SmolLM2-135M's GGUF)")
    ap.add_argument("--random", action="store_true", help="SmolLM2-135M's shapes, random weights")
    ap.add_argument("--smoke", action="store_true", help="CPU, stories260K, tiny sizes, backend aot_eager")
    ap.add_argument("--batches", default="64,128", help="global batch = micro-batch, in sequences")
    ap.add_argument("--modes", default="eager,compiled")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--profile-step", type=int, default=6, help="0-based step profiled (after compiling and warm-up)")
    ap.add_argument("--budget-s", type=float, default=500, help="skip the runs left after this many seconds")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if args.smoke:
        compiled.BACKEND = "aot_eager"
        args.model, args.batches, args.seq_len, args.steps, args.profile_step = str(STORIES), "2", 64, 6, 3
    if not (args.random or args.model):
        ap.error("give --random, --model PATH or --smoke")
    if not 1 <= args.profile_step < args.steps:
        ap.error("--profile-step must lie in [1, --steps)")
    teacher = build_teacher(args, device)
    rows = Rows(args.json, args.budget_s)
    for batch in [int(b) for b in args.batches.split(",")]:
        for mode in args.modes.split(","):
            if rows.time_left(f"distill_profile {mode} x{batch}"):
                rows.add(run_row(teacher, mode, batch, args, device))
    for row in rows:
        if "mode" in row:
            print(table(row))


if __name__ == "__main__":
    main()
