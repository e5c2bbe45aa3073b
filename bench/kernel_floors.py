"""What one kernel costs inside a CUDA graph on this GPU, at a decode step's shapes (bf16): an empty Triton
kernel, a small elementwise op, and the matmul of 1 or 16 rows over each of SmolLM2-135M's weight shapes
(q/k/v fused 960 x 576, o_proj 576 x 576, gate/up fused 3,072 x 576, down 576 x 1,536, a GDN layer's fused
input projection 2,368 x 576, the head 49,152 x 576): CALLS calls of one captured in one graph, the graph
replayed, the time per call (a graph of one call would add the graph's own launch to each). A decode step is
a chain of such kernels, so these floors bound it from below (bench/RESULTS.md, thirtieth session).

    python bench/speed.py --sections floors
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from bench.step_attention_bench import graph_ms
from surgery.decode.gdn_block import new_sync
from surgery.decode.residual_norm import add_rms_norm_triton
from surgery.decode.row_linear import row_linear

CALLS = 50

# (rows of the weight, its width): SmolLM2-135M's decode-step matmuls, then one larger and the head
WEIGHTS = ((576, 576), (960, 576), (1536, 576), (2368, 576), (3072, 576), (576, 1536), (8192, 576), (49152, 576))


def per_call_us(fn) -> float:
    """us per call of fn, CALLS of them captured in one CUDA graph."""
    return graph_ms(lambda: [fn() for _ in range(CALLS)], replays=40) * 1000 / CALLS


def empty_kernel_us() -> float:
    import triton

    @triton.jit
    def _empty(x):
        pass

    x = torch.zeros(1, device="cuda")
    return per_call_us(lambda: _empty[(1,)](x))


def run(rows) -> None:
    """Rows: us per kernel, and for the matmuls the weight's bytes over that time (GB/s)."""
    rows.add("empty Triton kernel", "CUDA graph", "kernel", empty_kernel_us(), "us")
    y = torch.randn(576, device="cuda", dtype=torch.bfloat16)
    z = torch.empty_like(y)
    rows.add("torch.add, 576 bf16", "CUDA graph", "kernel", per_call_us(lambda: torch.add(y, y, out=z)), "us")
    for m in (1, 16):  # the residual add with its RMSNorm, the only kernel between two of a layer's matmuls
        a, b = torch.randn(2, m, 576, device="cuda", dtype=torch.bfloat16)
        rows.add("add_rms_norm (surgery.decode.residual_norm)", f"{m} x 576", "kernel",
                 per_call_us(lambda: add_rms_norm_triton(a, b, y, 1e-5)), "us")
    for m in (1, 16):
        for n, k in WEIGHTS:
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            us = per_call_us(lambda: F.linear(a, w))
            config = f"{m} x {k} @ {k} x {n} ({n * k * 2 / 1e6:.2f} MB)"
            rows.add("F.linear (cuBLAS)", config, "kernel", us, "us")
            rows.add("F.linear (cuBLAS)", config, "weight read", n * k * 2 / us / 1e3, "GB/s")
    row_linear_rows(rows)
    gdn_layer_rows(rows)
    tail_rows(rows)


def row_linear_rows(rows) -> None:
    """surgery.decode.row_linear's kernel against cuBLAS at 1, 8 and 16 rows over the WEIGHTS it takes (its measured
    widths), each call with its own weight (CALLS of them, read from HBM as a step's layers are); us per call."""
    import itertools

    from surgery.decode.row_linear import measured, row_linear_triton

    for m in (1, 8, 16):
        for n, k in (w for w in WEIGHTS if measured(m, *w)):
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(CALLS)]
            config = f"{m} x {k} @ {k} x {n}, {CALLS} weights"
            base = per_call_us(lambda it=itertools.cycle(ws): F.linear(a, next(it)))
            rows.add("F.linear (cuBLAS), weights from HBM", config, "kernel", base, "us")
            rows.add("row_linear (surgery.decode.row_linear)", config, "kernel",
                     per_call_us(lambda it=itertools.cycle(ws): row_linear_triton(a, next(it))), "us", ("cuBLAS", base))


# the one-launch layer's forms timed: (name, flagged words); grid barriers, or flagged words handed over
LAYER_FORMS = (("", False), (", flagged words", True))


def gdn_layer_rows(rows) -> None:
    """A SmolLM2-shaped GDN decoder layer's decoded token (hidden 576, 9 heads of 64, intermediate 1,536):
    the composed kernels a static step ran (add_rms_norm, the fused input projection, the token step,
    o_proj, add_rms_norm, gate/up, silu_mul, down) against surgery.decode.gdn_block's one kernel, at each
    program count; us per layer, CALLS layers in one graph."""
    from surgery.decode.flagged_words import new_exchange
    from surgery.decode.block_layout import block_programs, exchange_words
    from surgery.decode.gdn_block import gdn_block_torch, gdn_block_triton
    from surgery.decode.gdn_blocks import block_shape
    from surgery.decode.fused_linears import FusedWeight
    from tcal.gdn import GatedDeltaNet, GDNCache

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for m in (1, 16):
        torch.manual_seed(0)
        layer = GatedDeltaNet(576, 9, 64).to("cuda", torch.bfloat16).eval()
        parts = [layer.get_submodule(n) for n in layer.INPUT_PROJECTIONS]
        w_in, b_in = FusedWeight([p.weight for p in parts], [p.bias for p in parts], align_rows=True).pair()  # as a Decoder's
        a, b = torch.randn(2, m, 1, 576, device="cuda", dtype=torch.bfloat16)
        w0, w1 = torch.ones(2, 576, device="cuda", dtype=torch.bfloat16)
        w_gu = torch.randn(3072, 576, device="cuda", dtype=torch.bfloat16) * 0.04
        w_d = torch.randn(576, 1536, device="cuda", dtype=torch.bfloat16) * 0.03
        cache = GDNCache(in_place=True)
        cache.recurrent = torch.zeros(m, 9, 64, 64, device="cuda")

        def composed():
            return gdn_block_torch(a, b, w0, 1e-5, static_step(layer, cache, w_in, b_in), w1, 1e-5, w_gu, None, w_d, None,
                                   1536, True)

        with torch.no_grad():
            base = per_call_us(composed)
            rows.add("GDN layer, composed kernels", f"{m} x 576", "layer", base, "us")
            shape = block_shape(layer, w_in.shape[0], 1536, True)
            sync = new_sync("cuda")
            programs = block_programs(shape, sms, m)
            exchange = new_exchange(exchange_words(shape, m), "cuda")
            for form, flagged in LAYER_FORMS:
                ex = exchange if flagged else None
                for last in range(1, 6):  # phases 1..last in one launch: what each phase (and its hand-over) adds
                    us = per_call_us(lambda: gdn_block_triton(a, b, w0, 1e-5, layer, cache.recurrent, w_in, b_in, w1,
                                                              1e-5, w_gu, None, w_d, None, shape, sync, sms, last=last,
                                                              exchange=ex))
                    rows.add(f"GDN layer, one kernel{form}, phases 1-{last} ({programs} programs)", f"{m} x 576", "layer",
                             us, "us", ("composed", base))
            hbm_rows(rows, layer, w_in, b_in, a, b, w0, w1, w_gu, w_d, cache, shape, sync, sms,
                     [(form, exchange if flagged else None) for form, flagged in LAYER_FORMS])
    barrier_rows(rows, sorted({16, 32, programs, sms}))


# the tail kernel's launch forms timed: (o_proj's columns fetched before the token step, warps, a thread's register
# cap); the first is the default
TAIL_FORMS = ((True, 8, 128), (True, 8, None), (False, 8, None))


def tail_rows(rows, device: str = "cuda") -> None:
    """A SmolLM2-shaped GDN mixer's decoded token and the post norm after it (the input projection, the token
    step, o_proj, add_rms_norm: what surgery.decode.gdn_tail takes at 2-8 rows) composed against the input
    projection and the tail kernel (the linears through row_linear, as a Decoder's static step runs them); us per
    layer, CALLS layers in one graph, each with its own copy of the weights (read from HBM, as a step's layers are)."""
    import copy

    from surgery.decode.fused_linears import FusedWeight
    from surgery.decode.gdn_blocks import block_shape
    from surgery.decode.gdn_tail import gdn_tail_triton, new_arrivals
    from tcal.gdn import GatedDeltaNet, GDNCache

    torch.manual_seed(0)
    layer = GatedDeltaNet(576, 9, 64).to(device, torch.bfloat16).eval()
    twins = [copy.deepcopy(layer) for _ in range(CALLS)]
    fused = [FusedWeight([t.get_submodule(n).weight for n in t.INPUT_PROJECTIONS],
                         [t.get_submodule(n).bias for n in t.INPUT_PROJECTIONS], align_rows=True).pair() for t in twins]
    w1 = torch.ones(576, device=device, dtype=torch.bfloat16)
    shape = block_shape(layer, fused[0][0].shape[0], 1536, True)
    for m in (1, 2, 4, 8, 16):
        n, h = torch.randn(2, m, 1, 576, device=device, dtype=torch.bfloat16)
        cache = GDNCache(in_place=True)
        cache.recurrent = torch.zeros(m, 9, 64, 64, device=device)
        arrivals = new_arrivals(m, device)

        def composed():
            for twin, proj in zip(twins, fused):
                add_rms_norm_triton(h, static_step(twin, cache, *proj)(n), w1, 1e-5)

        def tail(**form):
            for twin, proj in zip(twins, fused):
                gdn_tail_triton(row_linear(n, *proj), shape, twin, cache.recurrent, h, w1, 1e-5, arrivals, **form)

        with torch.no_grad():
            base = graph_ms(composed, replays=40) * 1000 / CALLS
            rows.add("GDN mixer + post norm, composed (projection, token step, o_proj, add_rms_norm)", f"{m} x 576", "layer", base, "us")
            for prefetch, warps, registers in TAIL_FORMS:
                form = (f"o_proj columns {'before' if prefetch else 'after'} the token step, {warps} warps, "
                        f"{registers or 'uncapped'} registers")
                rows.add(f"GDN mixer + post norm, projection + tail kernel ({form})", f"{m} x 576", "layer",
                         graph_ms(lambda: tail(prefetch=prefetch, warps=warps, registers=registers), replays=40)
                         * 1000 / CALLS, "us",
                         ("composed", base))


def static_step(layer, cache, w_in, b_in):
    """GDNState's call in a static step: the layer's token step on `cache`, its input projection and o_proj through
    row_linear (as a Decoder's static step runs them)."""
    return lambda n: layer(n, cache=cache, projection=(w_in, b_in), linear=row_linear)


def hbm_rows(rows, layer, w_in, b_in, a, b, w0, w1, w_gu, w_d, cache, shape, sync, sms, forms) -> None:
    """The layer again with a different copy of every weight and its own state for each of the CALLS layers (as
    a step's layers: read from HBM, where the rows above read one L2-resident set), composed against the kernel
    (one row) in each of `forms` (name, exchange: grid barriers, or flagged words handed over)."""
    import copy

    from surgery.decode.gdn_block import gdn_block_torch, gdn_block_triton
    from tcal.gdn import GDNCache

    sets = []
    for i in range(CALLS):
        twin = copy.deepcopy(layer)
        own = GDNCache(in_place=True)
        own.recurrent = cache.recurrent.clone()
        sets.append((twin, w_in.clone(), w_gu.clone(), w_d.clone(), own))

    def composed():
        for twin, wi, wgu, wd, own in sets:
            gdn_block_torch(a, b, w0, 1e-5, static_step(twin, own, wi, b_in), w1, 1e-5, wgu, None, wd, None, 1536, True)

    def kernel(ex):
        for twin, wi, wgu, wd, own in sets:
            gdn_block_triton(a, b, w0, 1e-5, twin, own.recurrent, wi, b_in, w1, 1e-5, wgu, None, wd, None, shape, sync, sms,
                             exchange=ex)

    config = f"{a.shape[0]} x 576"
    base = graph_ms(composed, replays=40) * 1000 / CALLS
    rows.add("GDN layer, composed kernels, weights and state from HBM (a copy per layer)", config, "layer", base, "us")
    if a.shape[0] == 1:
        for form, ex in forms:
            one = graph_ms(lambda: kernel(ex), replays=40) * 1000 / CALLS
            rows.add(f"GDN layer, one kernel{form}, weights and state from HBM (a copy per layer)", config, "layer", one,
                     "us", ("composed", base))


def barrier_rows(rows, counts) -> None:
    """Grid barriers and nothing else, per program count (the layer kernel's among them): the shipped waits
    (counters that only grow), one of them alone, and the thirty-second session's (counters reset by the
    last program out)."""
    for programs in counts:
        for name, kernel in BARRIER_KINDS.items():
            sync = new_sync("cuda")  # a buffer per program count (the growing counters' launches are multiples of it)
            rows.add(f"grid barrier, {name}", f"{programs} programs", "kernel",
                     per_call_us(lambda: kernel[(programs,)](sync, programs)), "us")


try:
    import triton
    import triton.language as tl

    from surgery.decode.gdn_block import grid_wait

    @triton.jit
    def _barriers(sync, nprog: tl.constexpr):
        for k in tl.static_range(4):
            grid_wait(sync, k, nprog)

    @triton.jit
    def _barrier_once(sync, nprog: tl.constexpr):
        grid_wait(sync, 0, nprog)

    @triton.jit
    def _wait_then_reset(sync, k, target):
        """The thirty-second session's wait: counters zero between launches (see _reset_on_exit)."""
        tl.debug_barrier()
        tl.atomic_add(sync + k, 1, sem="release")
        seen = tl.atomic_add(sync + k, 0, sem="acquire")
        while seen < target:
            seen = tl.atomic_add(sync + k, 0, sem="acquire")
        tl.debug_barrier()

    @triton.jit
    def _reset_on_exit(sync, nprog):
        tl.debug_barrier()
        if tl.atomic_add(sync + 4, 1, sem="acq_rel") == nprog - 1:
            for k in tl.static_range(0, 5):
                tl.atomic_xchg(sync + k, 0)

    @triton.jit
    def _barriers_reset(sync, nprog: tl.constexpr):
        for k in tl.static_range(4):
            _wait_then_reset(sync, k, nprog)
        _reset_on_exit(sync, nprog)

    BARRIER_KINDS = {"x4, growing counters (shipped)": _barriers,
                     "x1, growing counters": _barrier_once,
                     "x4, counters reset on exit (thirty-second session)": _barriers_reset}
except Exception:  # no Triton (a CPU install): the section is CUDA-only anyway
    triton = None
