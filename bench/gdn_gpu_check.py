"""Check our gated delta rule against fla's Triton kernels on a CUDA machine, and time both.

For each batch, length and input dtype it runs fla, our chunked PyTorch path, and (for
T <= 2048) a float64 token recurrence as ground truth, then checks GatedDeltaNet with
backend="fla" against backend="torch" in bf16. Exits 1 when an error exceeds its tolerance.

    python bench/gdn_gpu_check.py [--backward-only]

Where this Triton lets fla's backward run (>= 3.7.1 on Hopper), its gradients are checked against
the PyTorch path's too, and both are timed forward+backward.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import importlib.metadata  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tcal.gdn import GatedDeltaNet  # noqa: E402
from tcal.kernels import (  # noqa: E402
    chunked_gated_delta_rule_torch,
    fla_available,
    gated_delta_rule,
    recurrent_gated_delta_rule_torch,
)

BATCHES = (1, 2)
LENGTHS = (256, 2048, 8192)
DTYPES = (torch.bfloat16, torch.float32)
HEADS, HEAD_DIM = 9, 64
REFERENCE_MAX_T = 2048  # the float64 token loop is too slow beyond this
TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 5e-3}


def make_inputs(batch, seq_len, dtype, seed=0):
    """Inputs shaped like a GDN layer's: unit q and k, decays mostly mild with some strong ones."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    shape = (batch, seq_len, HEADS, HEAD_DIM)
    q = F.normalize(F.silu(randn(*shape)), dim=-1)
    k = F.normalize(F.silu(randn(*shape)), dim=-1)
    v = randn(*shape)
    g = F.logsigmoid(2 * randn(batch, seq_len, HEADS) + 2)
    beta = torch.sigmoid(randn(batch, seq_len, HEADS))
    return q.to(dtype), k.to(dtype), v.to(dtype), g, beta.to(dtype)


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def time_ms(fn, warmup=2, iters=5):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e3


def check_kernels():
    """One table row per case; returns the rows whose errors exceed the tolerance."""
    failures = []
    print(f"{'B':>2} {'T':>5} {'dtype':>8} | {'fla/ref':>9} {'torch/ref':>9} {'fla/torch':>9} |"
          f" {'fla ms':>8} {'torch ms':>8} {'f64 ms':>8}")
    for batch in BATCHES:
        for seq_len in LENGTHS:
            for dtype in DTYPES:
                inputs = make_inputs(batch, seq_len, dtype)
                with torch.no_grad():
                    o_fla, _ = gated_delta_rule(*inputs, backend="fla")
                    o_torch, _ = chunked_gated_delta_rule_torch(*inputs)
                    errors = {"fla/torch": rel_err(o_fla, o_torch)}
                    ms = {"fla": time_ms(lambda: gated_delta_rule(*inputs, backend="fla")),
                          "torch": time_ms(lambda: chunked_gated_delta_rule_torch(*inputs))}
                    if seq_len <= REFERENCE_MAX_T:
                        as64 = [x.double() for x in inputs]
                        start = time.perf_counter()
                        o_ref, _ = recurrent_gated_delta_rule_torch(*as64)
                        torch.cuda.synchronize()
                        ms["f64"] = (time.perf_counter() - start) * 1e3
                        errors["fla/ref"] = rel_err(o_fla, o_ref)
                        errors["torch/ref"] = rel_err(o_torch, o_ref)
                cells = [f"{errors[key]:9.2e}" if key in errors else f"{'-':>9}"
                         for key in ("fla/ref", "torch/ref", "fla/torch")]
                times = [f"{ms[key]:8.2f}" if key in ms else f"{'-':>8}" for key in ("fla", "torch", "f64")]
                name = str(dtype).removeprefix("torch.")
                print(f"{batch:>2} {seq_len:>5} {name:>8} | {' '.join(cells)} | {' '.join(times)}")
                if max(errors.values()) > TOLERANCE[dtype]:
                    failures.append((batch, seq_len, name, errors))
    return failures


def check_state_handoff(batch=2, prefill=300, decode=8):
    """Prefill with fla's chunk kernel, decode with its fused recurrent kernel from that state:
    states and outputs must agree with the torch paths (same [B, H, Dk, Dv] state layout)."""
    inputs = make_inputs(batch, prefill + decode, torch.float32, seed=1)
    head = [x[:, :prefill] for x in inputs]
    tail = [x[:, prefill:] for x in inputs]
    results = {}
    with torch.no_grad():
        for backend in ("fla", "torch"):
            _, state = gated_delta_rule(*head, output_final_state=True, backend=backend)
            results[backend] = gated_delta_rule(*tail, initial_state=state, output_final_state=True, backend=backend)
    o_err = rel_err(results["fla"][0], results["torch"][0])
    s_err = rel_err(results["fla"][1], results["torch"][1])
    print(f"state handoff fp32 (prefill {prefill}, decode {decode}): fla vs torch output {o_err:.2e}, "
          f"final state {s_err:.2e}")
    return [("state handoff", o_err, s_err)] if max(o_err, s_err) > TOLERANCE[torch.float32] else []


def check_layer(batch=2, seq_len=2048):
    """The whole layer in bf16, fla against torch, forward only."""
    torch.manual_seed(0)
    layer = GatedDeltaNet(HEADS * HEAD_DIM, HEADS, HEAD_DIM, q_bias=True, k_bias=True, v_bias=True)
    layer = layer.to("cuda", torch.bfloat16)
    x = torch.randn(batch, seq_len, HEADS * HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        layer.backend = "fla"
        out_fla = layer(x)
        layer.backend = "torch"
        out_torch = layer(x)
    error = rel_err(out_fla, out_torch)
    print(f"GatedDeltaNet bf16 B={batch} T={seq_len}: fla vs torch rel err {error:.2e}")
    return [("layer", batch, seq_len, error)] if error > TOLERANCE[torch.bfloat16] else []


def check_auto_backward(batch=1, seq_len=512):
    """backend="auto" must train: it falls back to torch where fla's backward is refused."""
    torch.manual_seed(0)
    layer = GatedDeltaNet(HEADS * HEAD_DIM, HEADS, HEAD_DIM).to("cuda", torch.bfloat16)
    x = torch.randn(batch, seq_len, HEADS * HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    layer(x).float().square().mean().backward()
    finite = all(torch.isfinite(p.grad).all() for p in layer.parameters())
    print(f"GatedDeltaNet backend=auto backward: {'finite gradients' if finite else 'NON-FINITE gradients'}")
    return [] if finite else [("auto backward", batch, seq_len)]


def check_backward(shapes=((2, 1024), (32, 1024))):
    """fla's backward (when this Triton allows it) against our chunked PyTorch path in float32:
    gradients of every input, and the forward+backward time of both (the training cost per layer)."""
    from tcal.kernels import fla_backward_supported

    if not fla_backward_supported():
        print(f"fla backward: refused on triton {importlib.metadata.version('triton')} (training uses the torch path)")
        return []
    failures = []
    print(f"{'B':>3} {'T':>5} | " + " ".join(f"{'d' + n + ' err':>9}" for n in ("q", "k", "v", "g", "beta"))
          + f" | {'fla fwd+bwd ms':>14} {'torch fwd+bwd ms':>16}")
    for batch, seq_len in shapes:
        inputs = [x.requires_grad_(True) for x in make_inputs(batch, seq_len, torch.float32, seed=2)]
        weight = torch.randn(batch, seq_len, HEADS, HEAD_DIM, device="cuda")

        def run(backend):
            for x in inputs:
                x.grad = None
            o, _ = gated_delta_rule(*inputs, backend=backend)
            (o * weight).sum().backward()
            return [x.grad.clone() for x in inputs]

        grads = {backend: run(backend) for backend in ("fla", "torch")}
        errors = [rel_err(a, b) for a, b in zip(grads["fla"], grads["torch"])]
        ms = {backend: time_ms(lambda b=backend: run(b)) for backend in ("fla", "torch")}
        print(f"{batch:>3} {seq_len:>5} | " + " ".join(f"{e:9.2e}" for e in errors)
              + f" | {ms['fla']:14.2f} {ms['torch']:16.2f}")
        if max(errors) > 2e-2:
            failures.append(("backward", batch, seq_len, errors))
    return failures


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    if not fla_available():
        print("fla does not import here")
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{importlib.metadata.version('triton')}, fla {importlib.metadata.version('fla-core')}")
    full = "--backward-only" not in sys.argv  # --backward-only: the quick check before a training run
    failures = check_backward() + (check_kernels() + check_state_handoff() + check_layer() if full else []) + check_auto_backward()
    for failure in failures:
        print("FAIL", failure)
    print("FAILED" if failures else "OK")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
