"""Prefill and decode speed and cache memory: the teacher with transformers' own `generate` (KV cache)
against 50% and 75% GDN hybrids decoded incrementally with surgery.decode.Decoder (issue 6).

Weights do not change speed, so the hybrids are select + replace only. Prompts are random ids of
the context length; each run then produces --new-tokens tokens greedily.

* teacher (HF generate): prefill time = start of generate -> first logits processor call; decode
  tokens/s from the processor calls after it (one per generated token, synchronised); cache memory
  = bytes of the returned past_key_values.
* Decoder (teacher graph and hybrids): prefill in chunks whose logits fit in memory (the graph
  computes logits at every position), then one `step` per token; cache memory = Decoder.cache_bytes().
Peak memory is torch's max allocated during the run, above what the weights already held.

    python bench/decode.py --model /root/m/smol.gguf --contexts 4096,16384,65536 --batches 1,16
    python bench/decode.py --tiny                     # CPU smoke run on a 2-layer Llama
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from transformers import LogitsProcessor, LogitsProcessorList  # noqa: E402

from bench._models import qwen15b_shaped  # noqa: E402
from surgery import PassManager, capture  # noqa: E402
from surgery.decode import DecodeError, Decoder  # noqa: E402
from surgery.core.load import load_model  # noqa: E402

LOGITS_BUDGET = 4 << 30  # bytes of prefill logits per chunk


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class Stamps(LogitsProcessor):
    """Records the time of each generation step (synchronised), leaves the scores alone."""

    def __init__(self, device):
        self.device, self.times = device, []

    def __call__(self, input_ids, scores):
        sync(self.device)
        self.times.append(time.perf_counter())
        return scores


def cache_nbytes(cache) -> int:
    seen, total = set(), 0

    def walk(x):
        nonlocal total
        if isinstance(x, torch.Tensor):
            if x.data_ptr() not in seen:
                seen.add(x.data_ptr())
                total += x.numel() * x.element_size()
        elif isinstance(x, (list, tuple)):
            for y in x:
                walk(y)
        elif hasattr(x, "layers"):
            for layer in x.layers:
                walk([getattr(layer, "keys", None), getattr(layer, "values", None)])
        elif hasattr(x, "key_cache"):
            walk([x.key_cache, x.value_cache])

    walk(cache)
    return total


def peak_start(device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def peak_gib(device, base: int) -> float:
    return (torch.cuda.max_memory_allocated() - base) / 2**30 if device.type == "cuda" else 0.0


def run_hf(model, ids, new_tokens: int) -> dict:
    device = ids.device
    stamps = Stamps(device)
    base = peak_start(device)
    sync(device)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, use_cache=True, logits_processor=LogitsProcessorList([stamps]),
                         return_dict_in_generate=True, pad_token_id=0)
    sync(device)
    end = time.perf_counter()
    t = stamps.times
    prefill = t[0] - start
    decode = (end - t[0]) / max(len(t) - 1, 1) if len(t) > 1 else float("nan")  # steps after the first logits
    row = {"prefill_s": prefill, "decode_ms_per_step": decode * 1e3, "cache_gib": cache_nbytes(out.past_key_values) / 2**30,
           "peak_gib": peak_gib(device, base)}
    del out
    return row


def run_decoder(decoder: Decoder, ids, new_tokens: int, vocab: int) -> dict:
    device = ids.device
    b, length = ids.shape
    chunk = max(256, min(length, LOGITS_BUDGET // (b * vocab * 2)))
    base = peak_start(device)
    decoder.reset(b, length + new_tokens)
    sync(device)
    start = time.perf_counter()
    for s in range(0, length, chunk):
        logits = decoder.prefill(ids[:, s:s + chunk])[:, -1]
    nxt = logits.argmax(-1, keepdim=True)
    sync(device)
    mid = time.perf_counter()
    nxt = decoder.step(nxt)[:, -1].argmax(-1, keepdim=True)  # with cuda-graph steps: the capture
    sync(device)
    first = time.perf_counter()
    for _ in range(new_tokens - 2):
        nxt = decoder.step(nxt)[:, -1].argmax(-1, keepdim=True)
    sync(device)
    end = time.perf_counter()
    cache = decoder.cache_bytes()
    row = {"prefill_s": mid - start, "decode_ms_per_step": (end - first) / max(new_tokens - 2, 1) * 1e3,
           "first_step_ms": (first - mid) * 1e3, "step_mode": decoder.step_mode,
           "cache_gib": cache["total"] / 2**30, "cache_attention_gib": cache["attention"] / 2**30,
           "cache_gdn_gib": cache["gdn"] / 2**30, "peak_gib": peak_gib(device, base), "prefill_chunk": chunk}
    decoder.reset()
    return row


def build_decoder(graph, step_mode: str = "auto") -> Decoder:
    """A Decoder with its self-check; if the check refuses (bf16 rounding of a random-weight model can
    exceed its tolerance), say so and time the decoder anyway: speed does not depend on it."""
    try:
        return Decoder(graph, step_mode=step_mode)
    except DecodeError as exc:
        print(f"self-check refused ({exc.problem}); timing without it", flush=True)
        return Decoder(graph, verify=False, step_mode=step_mode)


def tiny_model(device, dtype):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=4096)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="teacher file or directory")
    ap.add_argument("--contexts", default="4096,16384,65536")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--keep-ratios", default="0.5,0.25")
    ap.add_argument("--graph-teacher", action="store_true", help="also decode the unconverted teacher graph with the Decoder")
    ap.add_argument("--step-modes", default="auto", help="Decoder step modes to time, e.g. auto,dynamic (auto: CUDA graphs on CUDA)")
    ap.add_argument("--qwen", default="", help="contexts:batches for the 1.5B-shaped model, e.g. 16384,65536:1 (empty: skip)")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    contexts = [int(x) for x in args.contexts.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    plans = []
    if args.tiny:
        plans.append(("tiny-llama", lambda: tiny_model(device, dtype), contexts, batches))
    if args.model:
        plans.append(("SmolLM2-135M", lambda: load_model(args.model, dtype=dtype)[0].to(device), contexts, batches))
    if args.qwen:
        ctx, _, bs = args.qwen.partition(":")
        qc = [int(x) for x in ctx.split(",")]
        plans.append(("Qwen2.5-1.5B-shaped", lambda: qwen15b_shaped(device, dtype, max(qc) + args.new_tokens), qc,
                      [int(x) for x in (bs or "1").split(",")]))
    rows = []

    def record(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)

    for name, make, ctxs, bss in plans:
        model = make()
        model.generation_config.max_length = None
        limit = max(ctxs) + args.new_tokens
        t = time.perf_counter()
        teacher = capture(model, device=device, dtype=dtype, max_length=limit)
        print(f"{name}: captured in {time.perf_counter() - t:.1f} s", flush=True)
        vocab = teacher.config.vocab_size
        variants = []
        modes = args.step_modes.split(",")
        tag = (lambda m: f", {m} steps") if len(modes) > 1 else (lambda m: "")
        graphs = [("teacher (Decoder)", teacher)] if args.graph_teacher else []
        for ratio in [float(r) for r in args.keep_ratios.split(",")]:
            hybrid = teacher.branch()
            PassManager(["select", "replace"], {"select": {"keep_ratio": ratio}})(hybrid)
            graphs.append((f"hybrid {100 - ratio * 100:.0f}% GDN", hybrid))
        for label, graph in graphs:
            for mode in modes:
                t = time.perf_counter()
                variants.append((label + tag(mode), build_decoder(graph, mode)))
                print(f"{name}: Decoder for {variants[-1][0]} built in {time.perf_counter() - t:.1f} s", flush=True)
        gen = torch.Generator().manual_seed(0)
        # warm-up: Triton compiles fla's kernels (chunked prefill, fused recurrent step, norms) on
        # first use, which the first timed row would otherwise carry (seen: 36 s "prefill" at 4k)
        for b in bss:
            ids = torch.randint(0, vocab, (b, min(512, limit - 8)), generator=gen).to(device)
            with torch.no_grad():
                run_hf(model, ids, 4)
            for _, decoder in variants:
                run_decoder(decoder, ids, 4, vocab)
                run_decoder(decoder, ids[:, : ids.shape[1] * 3 // 5], 4, vocab)  # a prefill that is not a multiple of the chunk
        for ctx in ctxs:
            for b in bss:
                ids = torch.randint(0, vocab, (b, ctx), generator=gen).to(device)
                with torch.no_grad():
                    base = run_hf(model, ids, args.new_tokens)
                record({"model": name, "variant": "teacher (HF generate)", "context": ctx, "batch": b, **base,
                        "decode_speedup": 1.0, "cache_ratio": 1.0})
                for label, decoder in variants:
                    row = run_decoder(decoder, ids, args.new_tokens, vocab)
                    record({"model": name, "variant": label, "context": ctx, "batch": b, **row,
                            "decode_speedup": base["decode_ms_per_step"] / row["decode_ms_per_step"],
                            "cache_ratio": row["cache_gib"] / base["cache_gib"] if base["cache_gib"] else float("nan")})
                del ids
        del variants, teacher, model
        if device.type == "cuda":
            torch.cuda.empty_cache()

    print()
    print("| model | variant | context | batch | prefill s | prefill tok/s | first step ms | decode ms/step | decode tok/s | decode speed-up | cache GiB | cache vs teacher | peak GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        first = f"{r['first_step_ms']:.1f}" if "first_step_ms" in r else "-"
        print(f"| {r['model']} | {r['variant']} | {r['context']} | {r['batch']} | {r['prefill_s']:.2f} | "
              f"{r['context'] * r['batch'] / r['prefill_s']:,.0f} | {first} | {r['decode_ms_per_step']:.2f} | "
              f"{r['batch'] * 1e3 / r['decode_ms_per_step']:,.0f} | {r['decode_speedup']:.2f}x | {r['cache_gib']:.3f} | "
              f"{r['cache_ratio']:.0%} | {r['peak_gib']:.2f} |")


if __name__ == "__main__":
    main()
