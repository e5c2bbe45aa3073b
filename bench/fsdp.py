"""FSDP2 distillation against plain distillation in one process (issue 32): tokens/s and peak GPU
memory of `distill` on a random-weight teacher, per mode: plain (no sharding), fsdp (FSDP2, world
size 1: bf16 weights gathered per layer unit, float32 reduction), fsdp_offload (shards, gradients and
AdamW states in CPU memory, the optimizer step on the CPU). Each mode runs in a process of its own,
so its peak is its own and an out-of-memory mode leaves the others standing (the row says "oom").

    python bench/fsdp.py --shape smollm2 --modes plain,fsdp,fsdp_offload --batch 16 --seq-len 512 --steps 8 --json $OUT/fsdp_smollm2.json
    python bench/fsdp.py --shape llama8b --keep-ratio 0.25 --modes fsdp_offload,plain --batch 8,16 --micro 4 --seq-len 512 \\
        --steps 4 --lr-rest 0 --json $OUT/fsdp_llama8b.json
    python bench/fsdp.py --shape stories --modes plain,fsdp,fsdp_offload --batch 4 --seq-len 64 --steps 3   # CPU smoke

Stage kl (the whole student trained unless --lr-rest 0 freezes what is outside the GDN layers),
float32 master weights, bf16 autocast on CUDA, no compile (fsdp does not compile yet), no evaluation.
Checkpoints are not written (an 8B student's with its AdamW states is ~96 GB); throughput is the
median tokens/s of the steps after the first. --keep-ratio: the fraction of attention layers kept
(0.25: 24 of 32 converted). Memory: peak_alloc_gib / peak_reserved_gib from torch.cuda (the
teacher and the student's full weights included), resident_gib before training started, and the
process's peak RSS (CPU memory, where fsdp_offload keeps its states). --batch takes a list: a row
per mode and batch, to find the largest batch that fits. On the 1-GPU machine (128 GiB of CPU memory)
an 8B student with every parameter trained does not fit offloaded (float32 weights, gradients and
AdamW states: 16 bytes a parameter, 128 GB), hence --lr-rest 0 there (only the GDN layers train)."""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
STORIES = ROOT / "tests/assets/stories260k/stories260K.gguf"
SAMPLE = ROOT / "surgery/data/calibration_sample.txt"
SHAPES = {  # transformers LlamaConfig fields
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True),
    "llama8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False),
}


def teacher_graph(shape: str, device: torch.device, seq_len: int):
    from surgery import capture
    from surgery.core.load import load_model

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if shape == "stories":
        return capture(STORIES, device=device, dtype=dtype, max_length=seq_len)
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(LlamaConfig(max_position_embeddings=seq_len, **SHAPES[shape]), dtype=dtype,
                                                 attn_implementation="sdpa").eval()
    graph = capture(model, device=device, dtype=dtype, max_length=seq_len)
    graph.tokenizer = load_model(STORIES)[1]  # ids below 512: any vocabulary takes them
    return graph


def steady_rate(run: Path) -> float | None:
    rates = [r["tokens_per_s"] for r in map(json.loads, (run / "log.jsonl").read_text().splitlines()) if r.get("tokens_per_s")]
    return statistics.median(rates[1:]) if len(rates) > 1 else (rates[0] if rates else None)


def one(args) -> dict:
    """One mode in this process: build, distill, measure."""
    from surgery import PassManager
    from surgery.errors import SurgeryError
    from surgery.train import DistillConfig, distill
    from surgery.train.trainer import Trainer

    Trainer.save = lambda self, *a, **k: None  # measure training, not writing checkpoints
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    row = {"mode": args.one, "shape": args.shape, "keep_ratio": args.keep_ratio, "batch": args.batch, "micro": args.micro,
           "seq_len": args.seq_len, "steps": args.steps, "lr_rest": args.lr_rest, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    t = time.perf_counter()
    teacher = teacher_graph(args.shape, device, args.seq_len)
    student = teacher.branch()
    PassManager(["select", "replace"], {"select": {"keep_ratio": args.keep_ratio}})(student)
    student.gm.float()
    row["build_s"] = round(time.perf_counter() - t, 1)
    if device.type == "cuda":
        torch.cuda.synchronize()
        row["resident_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2)
        torch.cuda.reset_peak_memory_stats()
    config = DistillConfig(tokens=args.steps * args.batch * args.seq_len, stage="kl", seq_len=args.seq_len, global_batch=args.batch,
                           micro_batch=args.micro, warmup=0.0, compile=False, lr_kl_rest=args.lr_rest, grad_checkpoint=args.checkpoint,
                           fsdp=args.one != "plain", fsdp_offload=args.one == "fsdp_offload")
    with tempfile.TemporaryDirectory() as folder:
        t = time.perf_counter()
        try:
            result = distill(student, [str(SAMPLE)], Path(folder) / "run", config, teacher=teacher, device=device, progress=False)
            row.update(tokens_per_s=steady_rate(Path(folder) / "run"), tokens_per_s_all=result["tokens_per_s"], loss=result["loss"])
        except (SurgeryError, torch.OutOfMemoryError) as exc:
            row["oom" if "memory" in str(exc).lower() else "error"] = str(exc).splitlines()[0][:300]
        row["train_s"] = round(time.perf_counter() - t, 1)
    if device.type == "cuda":
        row["peak_alloc_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        row["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
    row["peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=["stories", *SHAPES], default="smollm2")
    ap.add_argument("--modes", default="plain,fsdp,fsdp_offload")
    ap.add_argument("--keep-ratio", type=float, default=0.5)
    ap.add_argument("--batch", default="16", help="global batch(es), e.g. 4,8,16: a row per mode and batch (the largest that fits)")
    ap.add_argument("--micro", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--lr-rest", type=float, default=7e-6)
    ap.add_argument("--checkpoint", action="store_true", help="per-layer activation checkpointing (--grad-checkpoint)")
    ap.add_argument("--timeout", type=float, default=560)
    ap.add_argument("--json")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        args.batch = int(args.batch)
        print(json.dumps(one(args)), flush=True)
        return
    rows = []
    for mode, batch in [(m, b) for m in args.modes.split(",") for b in args.batch.split(",")]:
        cmd = [sys.executable, __file__, *sys.argv[1:], "--one", mode, "--batch", batch]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
            row = json.loads(lines[-1]) if lines else {"mode": mode, "batch": batch, "error": f"exit {proc.returncode}: {proc.stderr.strip()[-600:]}"}
        except subprocess.TimeoutExpired:
            row = {"mode": mode, "batch": batch, "error": f"timed out after {args.timeout:g} s"}
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
