"""Where a decode step's time goes at a long context (issue 17's decode target: <= 1.0 ms a step
for the 75% GDN hybrid at 64k, batch 1). One H200, bf16, SmolLM2-135M's shapes, random weights:

    python bench/decode_profile.py --json decode_profile.json
    python bench/decode_profile.py --smoke          # CPU, stories260K, tiny sizes, aot_eager

Sections:
- token: tcal.token_step alone (the Triton kernel against its float32 reference: errors, CUDA-graph
  ms), at --step-batches.
- attention: one kept layer's one-token attention over a --context KV buffer, alone, as a CUDA
  graph (wall ms per replay) and under the profiler (the GPU's busy ms, kernels): the library's
  `attend` (SDPA with the position mask and enable_gqa) eager and compiled, and a split-K matmul
  form (each KV head's query heads as rows, scores over the whole buffer, P·V in --chunk-token
  pieces so the reduction over the context runs on many blocks).
- step: the teacher graph's and the hybrid's whole static step (sibling projections fused;
  --compare-fusion adds the hybrid's without), compiled, without a CUDA graph
  under the profiler (busy ms, kernels per step, the top kernels), and its CUDA-graph replay's wall
  ms (eager and compiled step). Busy ms far below the replay's wall ms would mean gaps between
  kernels; busy ms made of many small kernels means the kernel count is the limit, not bytes.
  "pipelined ms": greedy steps back to back, synchronised once (the host's own work overlaps
  the GPU's, as in generation). --compare-token-step adds the hybrid with its GDN layers composed
  from their pieces instead of tcal.token_step's one kernel; --teacher-batches limits the teacher's
  rows; --step-modes picks static (profiled) and/or cuda-graph.
Prints tables, writes JSON rows."""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import surgery.core.compiled as compiled  # noqa: E402
import tcal.gdn  # noqa: E402
from surgery import capture  # noqa: E402
from surgery.decode import Decoder  # noqa: E402
from surgery.decode.caches import attend  # noqa: E402
from bench._models import smollm2_shaped  # noqa: E402
from tcal.token_step import token_step_torch, token_step_triton  # noqa: E402
from bench.compile_probe import kernel_profile  # noqa: E402
from bench.compile_speed import Rows, hybrid_of, median_ms, sync  # noqa: E402

STORIES = Path(__file__).parent.parent / "tests/assets/stories260k/stories260K.gguf"


def split_k_attention(q, keys, values, allowed, scale: float, chunk: int):
    """Softmax attention of one query token per head over the whole buffer, as matmuls: q [B, H, 1, D],
    keys/values [B, Hc, S, D] (S a multiple of chunk), allowed [B or 1, S] bool."""
    b, heads, _, d = q.shape
    kv_heads, size = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    rows = q.reshape(b, kv_heads, group, d)
    scores = torch.matmul(rows, keys.transpose(-1, -2)).float() * scale                  # [B, Hc, G, S]
    scores = scores.masked_fill(~allowed.view(allowed.shape[0], 1, 1, size), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    pieces = size // chunk
    probs = probs.view(b, kv_heads, group, pieces, chunk).transpose(2, 3)                   # [B, Hc, P, G, C]
    partial = torch.matmul(probs, values.view(b, kv_heads, pieces, chunk, d))               # [B, Hc, P, G, D]
    return partial.float().sum(2).to(q.dtype).reshape(b, heads, 1, d)


def graph_ms(fn, device, repeats: int) -> float:
    """Wall ms of one replay of `fn` captured as a CUDA graph (the eager function's own ms on the CPU)."""
    if device.type != "cuda":
        return median_ms(fn, repeats, device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_ms(graph.replay, repeats, device)


def attention_rows(context, batch, chunk, device, dtype, repeats, out) -> None:
    torch.manual_seed(0)
    heads, kv_heads, d = 9, 3, 64
    q = torch.randn(batch, heads, 1, d, device=device, dtype=dtype)
    keys = torch.randn(batch, kv_heads, context, d, device=device, dtype=dtype)
    values = torch.randn(batch, kv_heads, context, d, device=device, dtype=dtype)
    index = torch.tensor([context - 7], device=device)
    slots = torch.arange(context, device=device)
    scale = d ** -0.5

    def library():
        return attend(q, keys, values, slots <= index[:, None], scale=scale, softcap=None, k_map=None, v_map=None)

    def split():
        return split_k_attention(q, keys, values, slots <= index[:, None], scale, chunk)

    want = split_k_attention(q.double(), keys.double(), values.double(), slots <= index[:, None], scale, chunk)
    variants = {"attend (SDPA, mask, gqa)": library, "split-K matmul": split}
    for name, fn in list(variants.items()):
        variants[f"{name}, compiled"] = torch.compile(fn, backend=compiled.BACKEND, fullgraph=True)
    kv_bytes = 2 * keys.numel() * keys.element_size()
    for name, fn in variants.items():
        with torch.no_grad():
            got = fn()
            ms = graph_ms(fn, device, repeats)
            prof = kernel_profile(fn, device)
        out({"bench": "attention", "variant": name, "context": context, "batch": batch, "chunk": chunk, "ms": ms,
             "busy_ms": prof["busy_ms"], "kernels": prof["kernels_per_call"], "top": prof["top"][:4],
             "GB_per_s": kv_bytes / ms / 1e6, "max_abs_err_vs_float64": (got.double() - want).abs().max().item()})


def token_rows(batches, device, repeats, out) -> None:
    """tcal.token_step alone at SmolLM2's GDN shapes (9 heads of 64): the Triton kernel (on CUDA)
    against the float32 reference on the same device, errors and CUDA-graph ms of each."""
    heads, d = 9, 64
    width = heads * d
    for batch in batches:
        g = torch.Generator(device="cpu").manual_seed(batch)
        proj = torch.randn(batch, 1, 4 * width + 2 * heads, generator=g).to(device, torch.bfloat16)
        parts = list(proj.split([width, width, width, heads, heads, width], dim=-1))
        params = [torch.randn(heads, generator=g).to(device), torch.randn(heads, generator=g).to(device),
                  (torch.rand(d, generator=g) + 0.5).to(device, torch.bfloat16)]
        state = (torch.randn(batch, heads, d, d, generator=g) * 0.1).to(device)
        ref_state, ker_state = state.clone(), state.clone()
        kernel = token_step_triton if device.type == "cuda" else token_step_torch
        want = token_step_torch(*parts, *params, ref_state, d ** -0.5, 1e-5, True)
        got = kernel(*parts, *params, ker_state, d ** -0.5, 1e-5, True)
        row = {"bench": "token_step", "batch": batch, "heads": heads, "head_dim": d,
               "max_abs_err_out": (got.float() - want.float()).abs().max().item(), "out_max": want.float().abs().max().item(),
               "max_abs_err_state": (ker_state - ref_state).abs().max().item()}
        row["reference ms"] = graph_ms(lambda: token_step_torch(*parts, *params, ref_state, d ** -0.5, 1e-5, True), device, repeats)
        row["kernel ms"] = graph_ms(lambda: kernel(*parts, *params, ker_state, d ** -0.5, 1e-5, True), device, repeats)
        out(row)


def pipelined_ms(dec, ids, steps: int, device) -> float:
    """Wall ms per token of `steps` greedy steps back to back, each fed the argmax of the last
    (on the device), synchronised once: how generation runs when the host keeps ahead of the GPU."""
    nxt = ids[:, :1]
    sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        nxt = dec.step(nxt).argmax(-1)
    sync(device)
    return (time.perf_counter() - t) * 1000 / steps


def step_rows(graphs, context, batch, device, repeats, out, fuse: bool, kernels: int, modes, variant: str = "") -> None:
    """One row per graph: per step mode its first (compiling) step, its median step, and for
    cuda-graph the replay alone and pipelined steps; for static the kernel profile."""
    for label, graph in graphs:
        ids = torch.randint(0, graph.config.vocab_size, (batch, context), device=device)
        row = {"bench": "step", "model": label + variant, "fused projections": fuse, "context": context, "batch": batch}
        for mode in modes:
            if mode == "cuda-graph" and device.type != "cuda":
                continue
            dec = Decoder(graph, verify=False, compile=True, step_mode=mode, fuse_projections=fuse).reset(batch, context + 8 * repeats + 64)
            with torch.no_grad():
                dec.prefill(ids)
                t = time.perf_counter()
                dec.step(ids[:, :1])
                sync(device)
                row[f"{mode} compiled first s"] = time.perf_counter() - t
                row[f"{mode} compiled ms"] = median_ms(lambda d=dec: d.step(ids[:, :1]), repeats, device)
                if mode == "cuda-graph" and dec._static.graph is not None:  # the GPU's own time: replays back to back
                    replay = dec._static.graph.replay
                    replay()
                    sync(device)
                    t = time.perf_counter()
                    for _ in range(50):
                        replay()
                    sync(device)
                    row["replay alone ms"] = (time.perf_counter() - t) * 1000 / 50
                    row["pipelined ms"] = pipelined_ms(dec, ids, 4 * repeats, device)
                if mode == "static":
                    prof = kernel_profile(lambda d=dec: d.step(ids[:, :1]), device, top=kernels)
                    row.update({"busy_ms": prof["busy_ms"], "kernels_per_step": prof["kernels_per_call"], "top": prof["top"]})
            del dec
            torch._dynamo.reset()
        out(row)


@contextlib.contextmanager
def composed_gdn_steps():
    """Decode steps as before tcal.token_step: each GDN layer composed from its pieces."""
    real = tcal.gdn.takes_token_step
    tcal.gdn.takes_token_step = lambda *a: False
    try:
        yield
    finally:
        tcal.gdn.takes_token_step = real


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="attention,step")
    ap.add_argument("--context", type=int, default=65536)
    ap.add_argument("--batches", default="1,16", help="attention section")
    ap.add_argument("--step-batches", default="1")
    ap.add_argument("--chunk", type=int, default=1024, help="split-K piece, tokens")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--compare-fusion", action="store_true", help="also the hybrid's step without fused projections")
    ap.add_argument("--compare-token-step", action="store_true",
                    help="also the hybrid's step with each GDN layer composed from its pieces (no tcal.token_step)")
    ap.add_argument("--step-modes", default="static,cuda-graph", help="static (profiled), cuda-graph (replayed)")
    ap.add_argument("--teacher-batches", default=None, help="step batches of the teacher row (default: --step-batches)")
    ap.add_argument("--kernels", type=int, default=12, help="kernels listed per profiled step")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if args.smoke:
        compiled.BACKEND = "aot_eager"
        args.context, args.batches, args.chunk, args.repeats = 256, "1", 64, 2
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batches = [int(b) for b in args.batches.split(",")]
    rows = Rows(args.json, budget_s=float("inf"))
    out = rows.add

    sections = set(args.sections.split(","))
    if "attention" in sections:
        for batch in batches:
            attention_rows(args.context, batch, args.chunk, device, dtype, args.repeats, out)
    if "token" in sections:
        token_rows([int(b) for b in args.step_batches.split(",")], device, args.repeats, out)
        for r in rows:
            if r["bench"] == "token_step":
                print(f"token step x{r['batch']}: kernel {r['kernel ms']:.4f} ms, reference {r['reference ms']:.4f} ms, "
                      f"err out {r['max_abs_err_out']:.2e} (of {r['out_max']:.2f}), state {r['max_abs_err_state']:.2e}")
    if "step" in sections:
        teacher = capture(str(STORIES) if args.smoke else smollm2_shaped(), device=device, dtype=dtype,
                          max_length=args.context + 8 * args.repeats + 64)
        hybrid = hybrid_of(teacher, 0.25)
        for gdn in hybrid.gdn_modules().values():
            gdn.to(dtype)
        modes = args.step_modes.split(",")
        teacher_batches = {int(b) for b in (args.teacher_batches or args.step_batches).split(",")}
        for batch in (int(b) for b in args.step_batches.split(",")):
            for fuse in (True, False) if args.compare_fusion else (True,):
                step_rows([("hybrid 75% GDN", hybrid)] + ([("teacher graph", teacher)] if fuse and batch in teacher_batches else []),
                          args.context, batch, device, args.repeats, out, fuse, args.kernels, modes)
            if args.compare_token_step:
                with composed_gdn_steps():
                    step_rows([("hybrid 75% GDN", hybrid)], args.context, batch, device, args.repeats, out, True,
                              args.kernels, modes, variant=" (composed)")
    print("\nattention | context x batch | CUDA-graph ms | busy ms | kernels | KV GB/s | err")
    for r in rows:
        if r["bench"] == "attention":
            print(f"{r['variant']} | {r['context']}x{r['batch']} | {r['ms']:.4f} | {r['busy_ms']:.4f} | {r['kernels']:.0f} | "
                  f"{r['GB_per_s']:.0f} | {r['max_abs_err_vs_float64']:.1e}")
    steps = [r for r in rows if r["bench"] == "step"]
    columns = list(dict.fromkeys(k for r in steps for k in r if k.endswith(" ms")))
    print("\nstep | context x batch | " + " | ".join(columns) + " | busy ms | kernels")
    for r in steps:
        print(f"{r['model']}{'' if r['fused projections'] else ' (unfused)'} | {r['context']}x{r['batch']} | "
              + " | ".join(f"{r[k]:.3f}" if k in r else "-" for k in columns)
              + f" | {r.get('busy_ms', 0):.3f} | {r.get('kernels_per_step', 0):.0f}")
        for name, ms, count in r.get("top", []):
            print(f"    {ms:.4f} ms x{count}  {name}")


if __name__ == "__main__":
    main()
