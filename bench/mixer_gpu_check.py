"""fla's kernels against the PyTorch references for the gla and kda mixers (tcal.mixers), on CUDA:
forward (chunked and short/recurrent lengths, with an initial state), and the gradients of a loss,
in float32 and bfloat16. Prints the largest relative error of each and exits 1 past the tolerance.

    python bench/mixer_gpu_check.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from tcal.mixers.gla_kernels import gla  # noqa: E402
from tcal.mixers.kda_kernels import kda  # noqa: E402

TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 3e-2}


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def case(mixer: str, t: int, dtype, seed: int = 0) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    b, h, d = 2, 9, 64

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    q, k, v = rand(b, t, h, d), torch.nn.functional.normalize(rand(b, t, h, d), dim=-1), rand(b, t, h, d)
    g = -torch.rand(b, t, h, d, generator=gen, device="cuda") * 0.5
    beta = torch.rand(b, t, h, generator=gen, device="cuda")
    s0 = rand(b, h, d, d) * 0.1
    inputs = [x.to(dtype) for x in (q, k, v)] + [g] + ([beta] if mixer == "kda" else [])
    run = gla if mixer == "gla" else kda
    out = {}
    for backend in ("fla", "torch"):
        leaves = [x.detach().clone().requires_grad_() for x in inputs]
        o, s = run(*leaves, initial_state=s0, output_final_state=True, backend=backend)
        (o.float().pow(2).mean() + s.float().pow(2).mean()).backward()
        out[backend] = (o, s, [x.grad for x in leaves])
    (o1, s1, g1), (o2, s2, g2) = out["fla"], out["torch"]
    return {"o": rel(o1, o2), "state": rel(s1, s2), "grads": max(rel(a, b) for a, b in zip(g1, g2))}


def main() -> None:
    worst = 0.0
    for mixer in ("gla", "kda"):
        for dtype in (torch.float32, torch.bfloat16):
            for t in (1, 40, 300):
                errors = case(mixer, t, dtype)
                bad = max(errors.values()) > TOLERANCE[dtype]
                worst = max(worst, max(errors.values()) / TOLERANCE[dtype])
                print(f"{mixer} {str(dtype).split('.')[-1]:>8} T={t:<4} " + " ".join(f"{k} {v:.2e}" for k, v in errors.items()) + ("  FAIL" if bad else ""))
    sys.exit(1 if worst > 1 else 0)


if __name__ == "__main__":
    main()
