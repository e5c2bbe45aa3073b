"""The static decode step's kept-attention op alone, on CUDA: the split-KV kernels
(surgery.decode.step_attention) against the path they replace (SDPA under a bool position mask over
the max-length cache, as KVCacheAttention's static step calls it), each replayed as a CUDA graph;
and which SDPA backends take that call. SmolLM2-135M's attention shapes by default (9 query heads, 3 KV
heads, head width 64), bf16.

    python bench/speed.py --sections step_attention --decode-context 65536 --decode-batches 1,16 [--step-attention-sweep]
"""
from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

import surgery.decode.step_attention as step
from surgery.decode.replay import capture


def existing(q, k, v, allowed):
    """surgery.decode.caches.attend's call for a grouped one-token step without softcap."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=0.125, enable_gqa=k.shape[1] != q.shape[1])


def graph_ms(fn, replays: int = 200) -> float:
    """ms per replay of fn captured as a CUDA graph (after warm-up)."""
    graph = capture(fn, warmup=3)[0]
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def backends(q, k, v, allowed) -> str:
    """The SDPA backends that accept the existing path's call."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    took = []
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH):
        try:
            with sdpa_kernel([backend]):
                existing(q, k, v, allowed)
            took.append(backend.name)
        except RuntimeError:
            pass
    return ",".join(took)


def forms() -> None:
    """The compiled kernels on the forms the interpreter test covers (GQA, MHA, softcap, odd widths,
    q a transposed view, batch 2, the first and last slot; NaN past the index), against float64;
    with DOT off and on (on: 16-bit inputs with both widths >= 16 only)."""
    saved = step.DOT
    for dot in (False, True):
        step.DOT = dot
        print(f"forms with DOT={dot}:")
        forms_once()
    step.DOT = saved


def forms_once() -> None:
    g = torch.Generator("cuda").manual_seed(0)
    for b, h, hc, s, d, dv, idx, cap in ((1, 9, 3, 300, 64, 64, 130, None), (2, 4, 4, 70, 12, 20, 69, 50.0),
                                         (1, 2, 1, 5, 8, 8, 0, None), (3, 8, 2, 5000, 128, 128, 4095, 5.0)):
        for dtype in (torch.float32, torch.bfloat16):
            q = torch.randn(b, 1, h, d, device="cuda", generator=g).to(dtype).transpose(1, 2)
            k, v = torch.randn(b, hc, s, d, device="cuda", generator=g).to(dtype), torch.randn(b, hc, s, dv, device="cuda", generator=g).to(dtype)
            exact = step.step_attention_reference(q, k, v, torch.tensor([idx]), scale=0.3, softcap=cap)
            k[:, :, idx + 1:], v[:, :, idx + 1:] = float("nan"), float("nan")
            got = step.step_attention_triton(q, k, v, torch.tensor([idx], device="cuda"), scale=0.3, softcap=cap)
            err = float((got.double() - exact).abs().max())
            bound = 1e-5 if dtype == torch.float32 else 1 / 128
            print(f"form B={b} heads {h}/{hc} S={s} D={d}/{dv} index {idx} softcap {cap} {dtype}: max err {err:.2e} "
                  f"{'ok' if err <= bound else 'FAIL'}")


def sweep(context: int, batches: list, heads: int, kv_heads: int) -> None:
    """ms of the split-KV kernels at a full cache for each (DOT, keys per iteration, PROGRAMS per SM, warps);
    the module's constants are restored after each."""
    print("sweep: batch | DOT | BLOCK_N | programs/SM | warps | ms | K+V bytes / time")
    for batch in batches:
        g = torch.Generator("cuda").manual_seed(batch)
        q = torch.randn(batch, heads, 1, 64, device="cuda", generator=g).bfloat16()
        k, v = (torch.randn(batch, kv_heads, context, 64, device="cuda", generator=g).bfloat16() for _ in range(2))
        index = torch.tensor([context - 1], device="cuda")
        for dot, block, programs, warps in itertools.product((False, True), (32, 64, 128), (2, 4, 8, 16), (4, 8)):
            saved = step.DOT, step.PROGRAMS, step.TENSOR_CORE, step.BROADCAST
            step.DOT, step.PROGRAMS = dot, programs
            setattr(step, "TENSOR_CORE" if dot else "BROADCAST", (block, warps))
            ms = graph_ms(lambda: step.step_attention_triton(q, k, v, index, scale=0.125, softcap=None))
            step.DOT, step.PROGRAMS, step.TENSOR_CORE, step.BROADCAST = saved
            print(f"sweep: {batch} | {dot} | {block} | {programs} | {warps} | {ms:.4f} | {2 * k.numel() * 2 / (ms * 1e-3) / 1e9:.0f} GB/s")


def run(context: int = 65536, batches: str = "1,16", heads: int = 9, kv_heads: int = 3, sweep_constants: bool = False) -> None:
    """The forms against float64, then the old path against the split-KV kernels per batch and valid length;
    with sweep_constants also the kernels' constants (DOT, TENSOR_CORE / BROADCAST, PROGRAMS)."""
    args = argparse.Namespace(context=context, batches=batches, heads=heads, kv_heads=kv_heads, sweep=sweep_constants)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    forms()
    print("batch | valid | SDPA backends | SDPA path ms | split-KV ms | K+V bytes / split-KV time | max err vs float64 (split, SDPA)")
    for batch in (int(b) for b in args.batches.split(",")):
        g = torch.Generator("cuda").manual_seed(batch)
        q = torch.randn(batch, args.heads, 1, 64, device="cuda", generator=g).bfloat16()
        k, v = (torch.randn(batch, args.kv_heads, args.context, 64, device="cuda", generator=g).bfloat16() for _ in range(2))
        slots = torch.arange(args.context, device="cuda")
        for valid in (args.context, args.context // 16):
            index = torch.tensor([valid - 1], device="cuda")
            old = graph_ms(lambda: existing(q, k, v, slots <= index[:, None]))
            new = graph_ms(lambda: step.step_attention_triton(q, k, v, index, scale=0.125, softcap=None))
            gbs = 2 * k[:, :, :valid].numel() * 2 / (new * 1e-3) / 1e9
            exact = step.step_attention_reference(q, k, v, index, scale=0.125, softcap=None)
            errs = [float((got.double() - exact).abs().max()) for got in
                    (step.step_attention_triton(q, k, v, index, scale=0.125, softcap=None), existing(q, k, v, slots <= index[:, None]))]
            print(f"{batch} | {valid} | {backends(q, k, v, slots <= index[:, None])} | {old:.4f} | {new:.4f} | {gbs:.0f} GB/s"
                  f" | {errs[0]:.2e}, {errs[1]:.2e}{'' if step.kernel_takes(q, k, v) else ' (guard says no!)'}")
    if args.sweep:
        sweep(args.context, [int(b) for b in args.batches.split(",")], args.heads, args.kv_heads)

