"""torch.compile against eager (issue 17): prefill, decode steps and distillation, with the compiled
graph's agreement with the eager one. One H200, bf16:

    python bench/compile_speed.py --model /root/m/smol.gguf --json compile_speed.json
    python bench/compile_speed.py --smoke        # CPU, stories260K, tiny sizes, backend aot_eager

Prefill ms (median of --repeats, batch 1 and 8): transformers' own forward, the captured teacher and
the 75% GDN hybrid, eager and compiled; compile seconds (first call); max |logits diff| compiled vs
eager per model in bf16, with emulate_precision_casts, and in float32; for the teacher the gap by
position (RoPE angles grow with it) and with TF32 matmuls on and off, to find the source of the 42.6
seen in the first probe. Decode step ms at --decode-context for the teacher and the 75% hybrid
(batch 1 and 16), eager CUDA-graph steps vs compiled ones. Distill tokens/s of the 50% hybrid (stage
kl, --distill-steps steps), eager vs compiled. Prints one table, writes JSON rows."""
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

import surgery.core.compiled as compiled  # noqa: E402
from surgery import PassManager, capture  # noqa: E402
from surgery.core.compiled import CompiledGraph  # noqa: E402
from surgery.core.load import load_model  # noqa: E402
from surgery.core.run import graph_logits  # noqa: E402
from surgery.decode import Decoder  # noqa: E402
from surgery.decode.causal_flags import causal_flags  # noqa: E402
from surgery.train import DistillConfig, distill  # noqa: E402
from bench._models import smollm2_shaped  # noqa: E402
from tcal.kernels import fla_backward_supported  # noqa: E402

STORIES = Path(__file__).parent.parent / "tests/assets/stories260k/stories260K.gguf"
H200_BF16_PEAK = 989e12  # dense bf16 FLOP/s of an H200 SXM (NVIDIA's data sheet; 1979e12 is with sparsity)
SAMPLE = Path(__file__).parent.parent / "surgery/data/calibration_sample.txt"


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_ms(fn, repeats: int, device) -> float:
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def hybrid_of(teacher, keep_ratio: float):
    graph = teacher.branch()
    PassManager(["select", "replace"], {"select": {"keep_ratio": keep_ratio}})(graph)
    return graph


def gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def agreement(graph, ids, device, full: bool) -> dict:
    """max |logits diff| compiled vs eager: bf16 as compiled by default and, when `full`, with emulated
    casts, by position quarter, with TF32 on/off (eager and compiled alike), and the float32 graph
    (each is a compile: the hybrid's took 133 s in the first probe, so only the teacher gets them all)."""
    out = {}
    with torch.no_grad():
        eager = graph.logits(ids)
        for name, precise in (("bf16", False), ("bf16_precise_casts", True))[: 2 if full else 1]:
            torch._dynamo.reset()
            got = graph_logits(CompiledGraph(graph.gm, label=name, precise_casts=precise), ids)
            out[name] = gap(got, eager)
            if not precise:
                quarters = (got.float() - eager.float()).abs().amax(-1).amax(0).chunk(4)
                out["bf16_by_quarter"] = [round(q.max().item(), 3) for q in quarters]
        if not full:
            torch._dynamo.reset()
            return out
        if device.type == "cuda":
            old = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = not old
            torch._dynamo.reset()
            out[f"bf16_tf32_{not old}"] = gap(graph_logits(CompiledGraph(graph.gm, label="tf32"), ids), graph.logits(ids))
            torch.backends.cuda.matmul.allow_tf32 = old
        graph.gm.float()
        torch._dynamo.reset()
        out["float32"] = gap(graph_logits(CompiledGraph(graph.gm, label="float32"), ids), graph.logits(ids))
        graph.gm.to(graph_dtype(device))
    torch._dynamo.reset()
    return out


def graph_dtype(device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


class Rows(list):
    """Rows written to --json as they come (a run cut short keeps what it measured), and a deadline
    (--budget-s) after which the remaining sections are skipped with a note."""

    def __init__(self, path, budget_s: float):
        super().__init__()
        self.path, self.end = path, time.perf_counter() + budget_s

    def add(self, row: dict) -> None:
        self.append(row)
        print(json.dumps(row), flush=True)
        if self.path:
            Path(self.path).write_text(json.dumps(self, indent=1))

    def time_left(self, section: str) -> bool:
        left = self.end - time.perf_counter()
        if left <= 0:
            self.add({"bench": section, "skipped": "out of --budget-s"})
        return left > 0


def prefill_rows(name, model, graphs, lengths, batches, args, device, out: Rows) -> None:
    vocab = graphs[0][1].config.vocab_size
    for length in lengths:
        for batch in batches:
            if not out.time_left(f"prefill {length}x{batch}"):
                return
            ids = torch.randint(0, vocab, (batch, length), device=device)
            with torch.no_grad():
                out.add({"bench": "prefill", "model": "transformers", "length": length, "batch": batch,
                         "ms": median_ms(lambda: model(input_ids=ids), args.repeats, device)})
                for label, graph in graphs:
                    if ("bench", graph.gm) not in graph.cache:  # one CompiledGraph per graph and mode, built once
                        # the compiled paths run SDPA with is_causal where the mask is provably causal
                        flagged, count = causal_flags(graph.gm, max(lengths)) if args.causal_flags else (graph.gm, 0)
                        graph.cache[("causal flags", graph.gm)] = count
                        graph.cache[("bench", graph.gm)] = CompiledGraph(flagged, label=label)
                        if device.type == "cuda":  # the compiled graph replayed as CUDA graphs (one per shape)
                            graph.cache[("bench cudagraphs", graph.gm)] = CompiledGraph(
                                flagged, label=f"{label} (CUDA graphs)", mode="reduce-overhead")
                    run = graph.cache[("bench", graph.gm)]
                    row = {"bench": "prefill", "model": label, "length": length, "batch": batch,
                           "causal_flags": graph.cache[("causal flags", graph.gm)],
                           "eager_ms": median_ms(lambda: graph.logits(ids), args.repeats, device),
                           "compiled_ms": median_ms(lambda: graph_logits(run, ids), args.repeats, device),
                           "compile_s": run.compile_seconds, "failed": run.failed}
                    if device.type == "cuda":
                        replay = graph.cache[("bench cudagraphs", graph.gm)]
                        row["cudagraphs_ms"] = median_ms(lambda: graph_logits(replay, ids), args.repeats, device)
                        row["cudagraphs_failed"] = replay.failed
                    out.add(row)


def decode_rows(graphs, context, batches, steps, device, out: Rows) -> None:
    for label, graph in graphs:
        for batch in batches:
            if not out.time_left(f"decode {label} x{batch}"):
                return
            ids = torch.randint(0, graph.config.vocab_size, (batch, context), device=device)
            row = {"bench": "decode", "model": label, "context": context, "batch": batch}
            for mode, flag in (("eager", False), ("compiled", True)):
                dec = Decoder(graph, verify=False, compile=flag).reset(batch, context + steps + 2)
                dec.prefill(ids)
                t = time.perf_counter()
                dec.step(ids[:, :1])  # capture (and compile)
                row[f"{mode}_first_step_s"] = time.perf_counter() - t
                row[f"{mode}_ms"] = median_ms(lambda d=dec: d.step(ids[:, :1]), steps, device)
                del dec  # its buffers (a 64k KV cache) go before the next mode's are allocated
            out.add(row)


def steady_tokens_per_s(run_dir: Path, skip: int) -> float | None:
    """Median tokens/s of the logged steps after the first `skip` (compiling and warm-up left out)."""
    records = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines() if line.strip()]
    rates = [r["tokens_per_s"] for r in records if r.get("tokens_per_s")][skip:]
    return statistics.median(rates) if rates else None


def distill_rows(teacher, steps, seq_len, batch, device, out: Rows, modes=("eager", "compiled")) -> None:
    row = {"bench": "distill", "model": "hybrid 50% GDN", "steps": steps, "seq_len": seq_len, "batch": batch,
           "gdn_backward": "fla" if fla_backward_supported() else "torch"}
    for mode, flag in (("eager", False), ("compiled", True)):
        if mode not in modes or not out.time_left(f"distill {mode} x{batch}"):
            continue
        student = hybrid_of(teacher, 0.5)
        student.gm.float()
        config = DistillConfig(tokens=steps * seq_len * batch, seq_len=seq_len, global_batch=batch, warmup=0.0, compile=flag)
        with tempfile.TemporaryDirectory() as folder:
            t = time.perf_counter()
            result = distill(student, [str(SAMPLE)], Path(folder) / "run", config, teacher=teacher, device=device, progress=False)
            row[f"{mode}_seconds"] = time.perf_counter() - t
            row[f"{mode}_tokens_per_s_all"] = result["tokens_per_s"]
            row[f"{mode}_tokens_per_s"] = steady_tokens_per_s(Path(folder) / "run", skip=3)
            # model FLOPs per token from the run's own count (flops_per_s / tokens_per_s), at the steady rate
            per_token = (result.get("flops_per_s") or 0) / result["tokens_per_s"] if result.get("tokens_per_s") else 0
            steady = row[f"{mode}_tokens_per_s"] or 0
            row[f"{mode}_model_flops_per_s"] = steady * per_token
            row[f"{mode}_of_h200_peak"] = steady * per_token / H200_BF16_PEAK
        torch._dynamo.reset()
    out.add(row)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="teacher file (SmolLM2-135M's GGUF)")
    ap.add_argument("--random", action="store_true", help="SmolLM2-135M's shapes, random weights (speed only; "
                    "stories260K's tokenizer reads the distillation text)")
    ap.add_argument("--lengths", default="2048,4096,8192,32768")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--decode-context", type=int, default=65536)
    ap.add_argument("--decode-batches", default="1,16")
    ap.add_argument("--distill-steps", type=int, default=20)
    ap.add_argument("--distill-batches", default="8", help="micro-batch = global batch, 512 tokens each")
    ap.add_argument("--distill-modes", default="eager,compiled")
    ap.add_argument("--no-causal-flags", dest="causal_flags", action="store_false",
                    help="compiled prefill keeps the traced masks (as before the causal-flag rewrite)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="CPU, stories260K, tiny sizes, backend aot_eager")
    ap.add_argument("--budget-s", type=float, default=330, help="skip what is left after this many seconds")
    ap.add_argument("--sections", default="agreement,prefill,decode,distill")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if args.smoke:
        compiled.BACKEND = "aot_eager"
        args.model, args.lengths, args.batches, args.decode_context, args.decode_batches = str(STORIES), "64", "1,2", 200, "1"
        args.distill_steps, args.repeats = 2, 2
    lengths = [int(x) for x in args.lengths.split(",")]
    dtype = graph_dtype(device)
    model = smollm2_shaped() if args.random else load_model(args.model, dtype=torch.float32)[0]
    model = model.to(device=device, dtype=dtype).eval()
    t = time.perf_counter()
    teacher = capture(model if args.random else args.model, device=device, dtype=dtype,
                      max_length=max(max(lengths), args.decode_context + 64))
    if args.random:
        teacher.tokenizer = load_model(STORIES)[1]
    print(f"captured in {time.perf_counter() - t:.1f} s", flush=True)
    graphs = [("teacher graph", teacher), ("hybrid 75% GDN", hybrid_of(teacher, 0.25))]
    sections = set(args.sections.split(","))
    rows = Rows(args.json, args.budget_s)
    if "agreement" in sections:
        for index, (label, graph) in enumerate(graphs):
            if rows.time_left(f"agreement {label}"):
                ids = torch.randint(0, teacher.config.vocab_size, (1, min(lengths)), device=device)
                rows.add({"bench": "agreement", "model": label, "length": min(lengths), **agreement(graph, ids, device, full=index == 0)})
    if "prefill" in sections:
        prefill_rows("transformers", model, graphs, lengths, [int(b) for b in args.batches.split(",")], args, device, rows)
    if "decode" in sections:
        decode_rows(graphs[::-1], args.decode_context, [int(b) for b in args.decode_batches.split(",")], max(8, args.repeats), device, rows)
    if "distill" in sections:
        for batch in ([int(b) for b in args.distill_batches.split(",")] if not args.smoke else [2]):
            distill_rows(teacher, args.distill_steps, 512 if not args.smoke else 64, batch, device, rows,
                         tuple(args.distill_modes.split(",")))
    for row in rows:
        print(" | ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
