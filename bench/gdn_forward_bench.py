"""fla's inference forward of the gated delta rule, kernel by kernel, under each launch config of a
sweep: at batch-1 prefill its autotuner's key (head counts and sizes, not rows or length) shares one
config with training's batches, and the candidates it tries leave out narrow value blocks and one warp.
Each stage of the forward (the gate's cumsum; the intra-chunk kkt + solve and the w/u recompute; the
chunk-to-chunk state pass; the output) is timed alone, CALLS calls in one CUDA graph, with the shipped config, then
with each candidate put into its autotuner's cache, at SmolLM2-135M's GDN shapes (9 heads of 64, bf16), the
state pass as tcal.state_pass launches it for those rows x heads, and the cumsum and intra stages as
tcal.chunk_intra's one kernel at each of its launch candidates, and the state pass with the output as fla's
kernels and as tcal.chunk_states' three. What it found (bench/RESULTS.md, thirty-third
and thirty-fourth sessions) set tcal/state_pass.py's value blocks and tcal/chunk_intra.py's launch; fla's other
kernels' candidates gained nothing at 2k x 1.

    python bench/speed.py --sections gdn_forward --split-shapes 2048x1,2048x8 [--gdn-forward-stages state]
"""
from __future__ import annotations

import torch

from bench.state_splits_bench import DIM, HEADS, inputs
from bench.step_attention_bench import graph_ms

CHUNK = 64
CALLS = 20  # calls of a stage in one CUDA graph: a graph of one small kernel times the graph's own launch


def candidates() -> dict:
    """Autotuned kernel (qualified as tcal.kernel_configs names it) -> the configs to time."""
    import triton

    c = triton.Config
    return {
        "fla.ops.common.chunk_delta_h.chunk_gated_delta_rule_fwd_kernel_h_blockdim64":
            [c({"BV": bv}, num_warps=w, num_stages=s) for bv in (16, 32, 64) for w in (2, 4, 8) for s in (2, 3, 4)],
        "fla.ops.gated_delta_rule.chunk_fwd.chunk_gated_delta_rule_fwd_kkt_solve_kernel":
            [c({"BK": bk}, num_warps=w, num_stages=s) for bk in (32, 64) for w in (1, 2, 4, 8) for s in (1, 2)],
        "fla.ops.gated_delta_rule.wy_fast.recompute_w_u_fwd_kernel":
            [c({}, num_warps=w, num_stages=s) for w in (1, 2, 4, 8) for s in (1, 2, 3)],
        "fla.ops.common.chunk_o.chunk_fwd_kernel_o":
            # BK 32 (< K) made the kernel fault on the H200 (an illegal access poisons the process): not tried; nor
            # BV 32 at 4 warps (the first of them faulted on the H200 in the thirty-ninth session)
            [c({"BK": 64, "BV": bv}, num_warps=w, num_stages=s) for bv, w in ((64, 2), (64, 4), (32, 2)) for s in (2, 3)],
    }


def stages(batch: int, seq_len: int) -> dict:
    """Stage name -> (a closure running it on fixed inputs, the kernels whose configs it reads)."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_fwd_o
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    from tcal.chunk_intra import chunk_intra_triton
    from tcal.chunk_states import chunk_states_triton
    from tcal.state_pass import state_pass, state_pass_config

    q, k, v, g, beta, _ = inputs(batch, seq_len)
    chosen = state_pass_config(batch * HEADS, DIM, DIM, q.device)
    gc = chunk_local_cumsum(g, chunk_size=CHUNK, scale=RCP_LN2)
    w, u, _ = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=gc, beta=beta, chunk_size=CHUNK)
    h, v_new, _ = chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, g=gc, output_final_state=True, chunk_size=CHUNK)
    names = list(candidates())

    def fla_output(states, v_new):
        return chunk_fwd_o(q=q, k=k, v=v_new, h=states, g=gc, scale=DIM ** -0.5, chunk_size=CHUNK)

    return {  # stage -> (closure, autotuned kernels it launches)
        "cumsum": (lambda: chunk_local_cumsum(g, chunk_size=CHUNK, scale=RCP_LN2), []),
        "intra": (lambda: chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=gc, beta=beta,
                                                                                     chunk_size=CHUNK), names[1:3]),
        **{f"cumsum + intra, tcal.chunk_intra {warps} warps, block {block}": (
            lambda block=block, warps=warps: chunk_intra_triton(k, v, g, beta, warps, block), [])
           for warps, block in INTRA_CANDIDATES},
        "state": (lambda: chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, g=gc, output_final_state=True,
                                                            chunk_size=CHUNK), names[:1]),
        "state, tcal.state_pass's launch": (
            (lambda: state_pass(k, w, u, gc, None, True, chosen)) if chosen else None, []),
        "output": (lambda: chunk_fwd_o(q=q, k=k, v=v_new, h=h, g=gc, scale=DIM ** -0.5, chunk_size=CHUNK), names[3:]),
        "state + output, tcal.state_pass's launch and fla's output": (
            (lambda: fla_output(*state_pass(k, w, u, gc, None, True, chosen)[:2])) if chosen else None, []),
        "state + output, tcal.chunk_states (transitions, one-product walk, output)": (
            lambda: chunk_states_triton(q, k, w, u, gc, DIM ** -0.5, None, True, chosen[0] if chosen else None), []),
        "state + output, tcal.chunk_states launched as programmatic dependents (SURGERY_PDL=on)": (
            lambda: with_pdl(lambda: chunk_states_triton(q, k, w, u, gc, DIM ** -0.5, None, True, chosen[0] if chosen else None)), []),
    }


def with_pdl(call):
    """call() with SURGERY_PDL=on (read at each launch, so a CUDA graph captures the dependent launches)."""
    from bench.harness import env_setting
    from tcal.pdl import SWITCH

    with env_setting(SWITCH, "on"):
        return call()


# tcal.chunk_intra's one kernel (the cumsum and intra stages in one launch), per warp count and column block
INTRA_CANDIDATES = [(warps, block) for warps in (1, 2, 4) for block in (64, 32)]
# intra: zeros, fused kkt + solve, the w/u recompute; state: the chunk-to-chunk pass (fla's tuned launch, then the
# launch tcal.state_pass chooses for these rows x heads, where it chooses one)
STAGES = ("cumsum", "intra", "state", "output")


def run(rows, shapes: str, only: str = ",".join(STAGES), sweep: bool = True) -> None:
    """Rows: us per stage with the shipped configs, then (with `sweep`) per candidate of each kernel the stage
    reads (the other kernels at their shipped configs), and the best candidate per kernel."""
    from triton.runtime.errors import OutOfResources

    from tcal.kernel_configs import autotuners

    tried = candidates() if sweep else {}
    for shape in shapes.split(","):
        seq_len, batch = (int(x) for x in shape.split("x"))
        config = f"{seq_len} x {batch}, {HEADS} heads of {DIM}"
        with torch.no_grad():
            built = stages(batch, seq_len)
            tuners = dict(autotuners())  # fla's modules are imported by now
            for stage, (once, kernels) in built.items():
                if not set(stage.split(",")[0].split(" + ")) <= set(only.split(",")) or once is None:
                    continue
                call = lambda once=once: [once() for _ in range(CALLS)]  # noqa: E731
                shipped = graph_ms(call, replays=20) * 1000 / CALLS
                rows.add(f"GDN forward: {stage}", config, "shipped configs", shipped, "us")
                for name in kernels if tried else []:
                    tuner = tuners[name]
                    keys = list(tuner.cache)
                    kept = {key: tuner.cache[key] for key in keys}
                    best = None
                    try:
                        for candidate in tried[name]:
                            for key in keys:
                                tuner.cache[key] = candidate
                            try:
                                us = graph_ms(call, replays=20) * 1000 / CALLS
                            except OutOfResources as exc:  # a config this GPU cannot hold: noted, skipped (a fault
                                # would leave the process's CUDA context unusable, so anything else propagates)
                                rows.add(f"GDN forward: {stage}", config, f"{name.rsplit('.', 1)[1]} {describe(candidate)}: "
                                         f"failed ({type(exc).__name__})", float("nan"), "us")
                                continue
                            rows.add(f"GDN forward: {stage}", config, f"{name.rsplit('.', 1)[1]} {describe(candidate)}", us,
                                     "us", ("shipped", shipped))
                            best = min(best or (us, candidate), (us, candidate), key=lambda x: x[0])
                    finally:
                        tuner.cache.update(kept)
                    if best:
                        rows.add(f"GDN forward: {stage}", config, f"{name.rsplit('.', 1)[1]} best {describe(best[1])} "
                                 f"(shipped {', '.join(describe(c) for c in kept.values())})", best[0], "us", ("shipped", shipped))


def describe(config) -> str:
    kw = " ".join(f"{k}={v}" for k, v in config.kwargs.items())
    return f"[{kw} w={config.num_warps} s={config.num_stages}]".replace("[ ", "[")
