"""Does incremental decoding equal full recomputation on this machine? For the teacher graph and
50% / 75% GDN hybrids, in float32 and bf16: the Decoder's own construction-time self-check (max logit
difference on a 12-token probe), then greedy tokens of prefill + N steps against greedy tokens of
full recomputation on the growing sequence, and the largest logit difference along the way.

On the H200 (bf16) the hybrids' self-check refused with max logit differences of 1.44 and 2.69
(bench/RESULTS.md); this separates bf16 rounding (float32 agrees) from a CUDA-only discrepancy
(float32 disagrees too), and the attention side (teacher graph) from the GDN side (hybrids).

    python bench/decode_check.py --model /root/m/smol.gguf
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from surgery import PassManager, capture  # noqa: E402
from surgery.decode import DecodeError, Decoder  # noqa: E402


def compare(graph, prompt: torch.Tensor, steps: int) -> dict:
    row = {}
    try:
        decoder = Decoder(graph)
        row["self_check"] = "ok"
    except DecodeError as exc:
        row["self_check"] = exc.problem
        decoder = Decoder(graph, verify=False)
    seq = prompt.clone()
    decoder.reset(prompt.shape[0], prompt.shape[1] + steps)
    with torch.no_grad():
        inc = decoder.prefill(prompt)[:, -1]
        worst, agree = 0.0, 0
        for _ in range(steps):
            full = graph(seq)[:, -1]
            worst = max(worst, (inc.float() - full.float()).abs().max().item())
            agree += int(torch.equal(inc.argmax(-1), full.argmax(-1)))
            nxt = full.argmax(-1, keepdim=True)  # both continue the same sequence
            seq = torch.cat([seq, nxt], dim=1)
            inc = decoder.step(nxt)[:, -1]
    row |= {"max_logit_diff": worst, "greedy_agreement": agree / steps,
            "logit_scale": full.float().abs().max().item()}
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-length", type=int, default=300)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        teacher = capture(args.model, device=device, dtype=dtype, max_length=4096)
        prompt = torch.randint(0, teacher.config.vocab_size, (2, args.prompt_length),
                               generator=torch.Generator().manual_seed(0)).to(device)
        variants = [("teacher", teacher.branch())]
        for ratio in (0.5, 0.25):
            hybrid = teacher.branch()
            PassManager(["select", "replace"], {"select": {"keep_ratio": ratio}})(hybrid)
            variants.append((f"hybrid {100 - ratio * 100:.0f}% GDN", hybrid))
        for label, graph in variants:
            row = {"dtype": name, "variant": label, **compare(graph, prompt, args.steps)}
            rows.append(row)
            print(json.dumps(row), flush=True)
        del teacher, variants
    print("\n| dtype | variant | self-check | max logit diff | logit scale | greedy agreement |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dtype']} | {r['variant']} | {r['self_check'][:60]} | {r['max_logit_diff']:.3g} | "
              f"{r['logit_scale']:.3g} | {r['greedy_agreement']:.0%} |")


if __name__ == "__main__":
    main()
