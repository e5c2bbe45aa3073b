"""One decoded token through a whole GDN decoder layer as ONE kernel on CUDA (the reference beside it).

A decode step is a chain of tiny kernels, each on a ~1.5-3 us latency floor inside a CUDA graph
(bench/RESULTS.md, thirtieth session: a matmul costs ~3.1 us whatever its size up to ~10 MB). A GDN
layer of a Llama-family hybrid is eight of them: the residual add and input norm, the fused input
projection, the token step (tcal.token_step), o_proj, the residual add and post norm, gate/up, the
SwiGLU product, down. Here they are five phases of one persistent kernel: each program owns tiles of
each phase's output and the programs meet at a counter in memory between phases (all programs are
resident: at most one per SM), so the step pays one launch and four waits instead of eight launches
(on the H200 at one row: 16.5 us a layer against 21.5, the four waits 4.6 of it; bench/RESULTS.md,
thirty-third session):

    1  h = a + b;  n = rms_norm(h) * w0;  proj = n @ W_in^T (+ bias)
    2  core = token_step(proj's q, k, v, a, b, g; the state, written in place)
    3  y = core @ W_o^T (+ bias)
    4  h2 = h + y;  n2 = rms_norm(h2) * w1;  m = silu(gate) * up, gate/up = n2 @ W_gu^T (+ bias)
    5  d = m @ W_d^T (+ bias)

and the layer's outputs are (h2, d), which the next layer's residual add reads. Every intermediate is
rounded to the model's dtype where the composed kernels round it, so the two differ only in the
order of float32 sums. `gdn_block_torch` is the composition itself (the kernels the graph ran).

Given an exchange buffer (as a Decoder's GDN layers are, surgery.decode.gdn_blocks) the phases do not
meet at all: each hands its output to the next as flagged words (surgery.decode.flagged_words), so a program waits only for the values it reads, and the read that finds
them there is the read of the data (on an H200: 15.3 us a layer in L2 against 16.6 with the four waits,
17.2 against 18.2 with the weights read from HBM; bench/RESULTS.md, fiftieth session). Phase 4 then
recomputes round(a + b) rather than reading phase 1's h. Each phase's tiles go to programs the phase before
left idle (surgery.decode.block_layout deals them and counts the programs), so they hold their weights
when the inputs arrive.

The programs' meeting (or waiting for each other's words) needs every program resident at once; under
Triton's CPU interpreter (which runs programs one after another) and with `phased=True` each phase is
its own launch instead, which is how the CPU tests check the phases' arithmetic."""
from __future__ import annotations

import torch

from .block_layout import BlockShape, exchange_words, shape_constants
from .flagged_words import HEADER_WORDS
from .residual_norm import add_rms_norm
from .row_linear import row_linear
from .swiglu import silu_mul

try:  # Triton is a CUDA-side extra: CPU installs do not have it
    import triton
    import triton.language as tl
except Exception:  # a broken install raises more than ImportError
    triton = None

# Rows a decode step sends through the kernel (each row is one more pass over a program's weight tiles): on the
# H200 one row took 16.5 us a layer against 21.5 for the composed kernels, 16 rows 120.7 against 22.4 (a row at a
# time, no tensor cores; bench/RESULTS.md, thirty-third session)
STEP_ROWS = 1
NUM_WARPS = 8
MAX_SPIN = 1 << 22   # polls of a phase counter before a program gives up (a non-resident grid): flags an error
SYNC_WORDS = 8       # per block, int64: four phase counters (words 0-3), the error flag (ERROR_WORD)
ERROR_WORD = 5


def gdn_block_torch(a, b, w0, eps0, gdn_state, w1, eps1, w_gu, b_gu, w_d, b_d, inter: int, gate_first: bool):
    """The reference: the layer's kernels as the step graph ran them, returning (h2, d)."""
    h, n = add_rms_norm(a, b, w0, eps0)
    h2, n2 = add_rms_norm(h, gdn_state(n), w1, eps1)
    return h2, swiglu_mlp(n2, w_gu, b_gu, w_d, b_d, inter, gate_first)


def swiglu_mlp(n2, w_gu, b_gu, w_d, b_d, inter: int, gate_first: bool) -> torch.Tensor:
    """The layer's MLP as the step graph runs it: gate/up as one matmul, the SwiGLU product, down."""
    gate, up = row_linear(n2, w_gu, b_gu).split_with_sizes([inter, inter], -1)
    return row_linear(silu_mul(gate, up) if gate_first else silu_mul(up, gate), w_d, b_d)


if triton is not None:
    from tcal.token_step import token_step_from_held, token_step_held, token_step_tile

    from .flagged_words import flag_store, flagged_head, flagged_row3, launch_number

    SPIN_LIMIT = tl.constexpr(MAX_SPIN)
    ERROR_WORD_ = tl.constexpr(ERROR_WORD)
    HEADER = tl.constexpr(HEADER_WORDS)

    @triton.jit
    def grid_wait(sync, k, nprog):
        """Arrive at counter k, then wait until all `nprog` programs of this launch have (a grid barrier).
        The counters only grow: a launch adds nprog to each counter it meets at, so the arrival's own count
        names the launch, the last to arrive never polls, and nothing is reset on the way out (the reset it
        replaced, a chain of atomics on the last program's way out, cost about 3.2 us a launch on the H200:
        four waits alone took 7.8 us, now 4.6; bench/RESULTS.md, thirty-third session). The count is polled
        with acquiring atomics (volatile loads, or acquiring loads after a reduction, measured no faster)."""
        tl.debug_barrier()  # every thread's stores of this phase are issued before the arrival
        old = tl.atomic_add(sync + k, 1, sem="acq_rel")
        goal = (old // nprog + 1) * nprog
        seen = old + 1
        spins = 0
        while (seen < goal) & (spins < SPIN_LIMIT):
            seen = tl.atomic_add(sync + k, 0, sem="acquire")
            spins += 1
        if seen < goal:
            tl.atomic_xchg(sync + ERROR_WORD_, 1)
        tl.debug_barrier()
        # 0, but only known once the wait is over: added to the next phase's input pointers, it keeps the
        # compiler from moving their loads above the wait
        return (seen >= goal).to(tl.int32) - 1

    @triton.jit
    def _w_piece(W, n0, N, k0, P: tl.constexpr, K: tl.constexpr, BN: tl.constexpr):
        n = n0 + tl.arange(0, BN)
        c = k0 + tl.arange(0, P)
        return tl.load(W + n[:, None] * K + c[None, :], mask=(n[:, None] < N) & (c[None, :] < K), other=0)

    @triton.jit
    def _fetch(W, n0, N, K: tl.constexpr, BN: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr):
        """Rows [n0, n0 + BN) of W [N, K] in up to three pieces along K, every load issued at once (a
        piece that is not there repeats the first)."""
        w0 = _w_piece(W, n0, N, 0, P0, K, BN)
        w1 = w0
        w2 = w0
        if P1 > 0:
            w1 = _w_piece(W, n0, N, P0, P1, K, BN)
        if P2 > 0:
            w2 = _w_piece(W, n0, N, P0 + P1, P2, K, BN)
        return w0, w1, w2

    @triton.jit
    def _row_piece(x, r, k0, P: tl.constexpr, K: tl.constexpr):
        """x[r, k0:k0 + P] of a [rows, K] tensor another program may have written, float32, zeros outside."""
        c = k0 + tl.arange(0, P)
        return tl.load(x + r * K + c, mask=c < K, other=0, cache_modifier=".cg").to(tl.float32)

    @triton.jit
    def _row3(x, r, K: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr):
        x0 = _row_piece(x, r, 0, P0, K)
        x1 = x0
        x2 = x0
        if P1 > 0:
            x1 = _row_piece(x, r, P0, P1, K)
        if P2 > 0:
            x2 = _row_piece(x, r, P0 + P1, P2, K)
        return x0, x1, x2

    @triton.jit
    def _mv3(x0, x1, x2, w0, w1, w2, P1: tl.constexpr, P2: tl.constexpr):
        """W x over the pieces, float32 [BN] (a row at a time: no tensor-core layouts, so the weight
        tile stays in the registers it was loaded into and serves every row)."""
        acc = tl.sum(w0.to(tl.float32) * x0[None, :], 1)
        if P1 > 0:
            acc += tl.sum(w1.to(tl.float32) * x1[None, :], 1)
        if P2 > 0:
            acc += tl.sum(w2.to(tl.float32) * x2[None, :], 1)
        return acc

    @triton.jit
    def _sum_piece(a, b, out, store, r, k0, P: tl.constexpr, K: tl.constexpr):
        """round(a + b) on row r, columns [k0, k0 + P), float32; written to out where `store` (a scalar
        condition, compared as a block: Triton 3.9's interpreter makes a program-id comparison int32, which a
        store's mask refuses)."""
        return _put_piece(_row_piece(a, r, k0, P, K) + _row_piece(b, r, k0, P, K), out, store, r, k0, P, K)

    @triton.jit
    def _weight_piece(w, k0, P: tl.constexpr, K: tl.constexpr, HAS_W: tl.constexpr):
        c = k0 + tl.arange(0, P)
        if HAS_W:
            return tl.load(w + c, mask=c < K, other=0).to(tl.float32)
        return tl.full([P], 1.0, tl.float32)

    @triton.jit
    def _weight3(w, K: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, HAS_W: tl.constexpr):
        """A norm's weight in pieces, float32 (ones where the norm has none): loaded before a phase waits, as its
        matmul's tile is, since no phase writes it."""
        v0 = _weight_piece(w, 0, P0, K, HAS_W)
        v1 = v0
        v2 = v0
        if P1 > 0:
            v1 = _weight_piece(w, P0, P1, K, HAS_W)
        if P2 > 0:
            v2 = _weight_piece(w, P0 + P1, P2, K, HAS_W)
        return v0, v1, v2

    @triton.jit
    def _normed_row3(a, b, v0, v1, v2, out, store, r, eps, K: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr,
                     P2: tl.constexpr):
        """Row r of rms_norm(h) * w in pieces (w as _weight3's pieces v; rounded to the model's dtype), h =
        round(a + b) written to out where `store`: the residual add and the norm as the add_rms_norm kernel
        computes them."""
        s0 = _sum_piece(a, b, out, store, r, 0, P0, K)
        s1 = s0
        s2 = s0
        if P1 > 0:
            s1 = _sum_piece(a, b, out, store, r, P0, P1, K)
        if P2 > 0:
            s2 = _sum_piece(a, b, out, store, r, P0 + P1, P2, K)
        return _norm3(s0, s1, s2, v0, v1, v2, eps, K, P1, P2, out.dtype.element_ty)

    @triton.jit
    def _norm3(s0, s1, s2, v0, v1, v2, eps, K: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, dtype: tl.constexpr):
        """rms_norm(s) * w of a row in pieces (w as _weight3's pieces v), each rounded to `dtype`."""
        total = tl.sum(s0 * s0, 0)
        if P1 > 0:
            total += tl.sum(s1 * s1, 0)
        if P2 > 0:
            total += tl.sum(s2 * s2, 0)
        rstd = tl.rsqrt(total / K + eps)
        x0 = (s0 * rstd * v0).to(dtype).to(tl.float32)
        x1 = x0
        x2 = x0
        if P1 > 0:
            x1 = (s1 * rstd * v1).to(dtype).to(tl.float32)
        if P2 > 0:
            x2 = (s2 * rstd * v2).to(dtype).to(tl.float32)
        return x0, x1, x2

    @triton.jit
    def _residual_piece(a, b, y, out, store, r, k0, P: tl.constexpr, K: tl.constexpr):
        """round(round(a + b) + y) on row r's piece from its pieces already read, written to out where `store`."""
        return _put_piece((a + b).to(out.dtype.element_ty).to(tl.float32) + y, out, store, r, k0, P, K)

    @triton.jit
    def _residual3(a0, a1, a2, b0, b1, b2, y0, y1, y2, out, store, r, K: tl.constexpr, P0: tl.constexpr,
                   P1: tl.constexpr, P2: tl.constexpr):
        """Row r of round(round(a + b) + y) in pieces (a, b as _row3 read them before the wait for y; y float32,
        already rounded), written to out where `store`: the layer's second residual add with its first one
        recomputed (the flagged form's phase 4)."""
        s0 = _residual_piece(a0, b0, y0, out, store, r, 0, P0, K)
        s1 = s0
        s2 = s0
        if P1 > 0:
            s1 = _residual_piece(a1, b1, y1, out, store, r, P0, P1, K)
        if P2 > 0:
            s2 = _residual_piece(a2, b2, y2, out, store, r, P0 + P1, P2, K)
        return s0, s1, s2

    @triton.jit
    def _put_piece(x, out, store, r, k0, P: tl.constexpr, K: tl.constexpr):
        """round(x) on row r, columns [k0, k0 + P), written to out where `store`; float32."""
        c = k0 + tl.arange(0, P)
        s = x.to(out.dtype.element_ty)
        tl.store(out + r * K + c, s, mask=(c < K) & ((c * 0 + store) != 0))
        return s.to(tl.float32)

    @triton.jit
    def _write_row(out, acc, bias, r, n0, N, number, dtype: tl.constexpr, BN: tl.constexpr, HAS_BIAS: tl.constexpr,
                   FLAGGED: tl.constexpr):
        """Row r, columns [n0, n0 + BN) of a [rows, N] output = round(acc + bias): stored, or (FLAGGED) written to a
        flagged region with this launch's number."""
        n = n0 + tl.arange(0, BN)
        if HAS_BIAS:
            acc += tl.load(bias + n, mask=n < N, other=0).to(tl.float32)
        if FLAGGED:
            flag_store(out, r * N + n, acc.to(dtype), n < N, number)
        else:
            tl.store(out + r * N + n, acc.to(dtype), mask=n < N)

    @triton.jit
    def _swiglu(gate, up, gate_bias, up_bias, n0, N, dtype: tl.constexpr, BN: tl.constexpr, HAS_BIAS: tl.constexpr):
        """silu(gate) * up from the two matmuls' float32 rows, each rounded first as the linear's output is."""
        n = n0 + tl.arange(0, BN)
        if HAS_BIAS:
            gate += tl.load(gate_bias + n, mask=n < N, other=0).to(tl.float32)
            up += tl.load(up_bias + n, mask=n < N, other=0).to(tl.float32)
        gate = gate.to(dtype).to(tl.float32)
        up = up.to(dtype).to(tl.float32)
        return gate * tl.sigmoid(gate) * up

    @triton.jit
    def _gdn_block_kernel(a, b, w0, w_in, bias_in, proj, h,
                          A_log, dt_bias, o_norm_w, state, core,
                          w_o, bias_o, y,
                          w1, w_gu, bias_gu, h2, m,
                          w_d, bias_d, d_out, sync, ex,
                          eps0, eps1, scale, norm_eps,
                          HID: tl.constexpr, N_IN: tl.constexpr, Q: tl.constexpr, K_: tl.constexpr, V: tl.constexpr,
                          A: tl.constexpr, B: tl.constexpr, G: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
                          BD: tl.constexpr, V_SILU: tl.constexpr, INTER: tl.constexpr, GATE_FIRST: tl.constexpr,
                          BN_IN: tl.constexpr, BN_O: tl.constexpr, BN_GU: tl.constexpr, BN_D: tl.constexpr,
                          HP0: tl.constexpr, HP1: tl.constexpr, HP2: tl.constexpr,
                          IP0: tl.constexpr, IP1: tl.constexpr, IP2: tl.constexpr,
                          XP0: tl.constexpr, XP1: tl.constexpr, XP2: tl.constexpr,
                          HAS_W0: tl.constexpr, HAS_W1: tl.constexpr, HAS_BIAS_IN: tl.constexpr,
                          HAS_BIAS_O: tl.constexpr, HAS_BIAS_GU: tl.constexpr, HAS_BIAS_D: tl.constexpr,
                          FIRST: tl.constexpr, LAST: tl.constexpr, ROWS: tl.constexpr,
                          nprog: tl.constexpr, IT_TS: tl.constexpr, FLAGS: tl.constexpr,
                          OFF_PAST: tl.constexpr, OFF_GU: tl.constexpr):
        """Phases FIRST..LAST of the layer (module docstring), the programs meeting between phases.
        Each program owns at most one output tile of each matmul phase (the launcher sizes tiles so that every
        tile has a program), loads its weight tile once and applies it to every row, and loads the next
        phase's tile (and what else no phase writes: a norm's weight, the state tile, the layer's inputs)
        before it waits. The phases' tiles are dealt out from different programs (OFF_PAST, OFF_GU:
        block_layout.shape_constants): the input projection, o_proj and down start past the token step's
        programs and gate/up past o_proj's (block_layout.block_programs launches enough programs for that
        where the SMs allow), so a phase's programs were idle in the phase before and hold their weights when
        its inputs arrive, rather than fetching them only after finishing that phase's work. FLAGS: the phases hand proj, core, y and m over as flagged
        words in `ex` (surgery.decode.flagged_words) and never meet; phase 4 recomputes the first residual
        add instead of reading it."""
        pid = tl.program_id(0)
        dt = proj.dtype.element_ty
        number = 0
        if FLAGS:
            number = launch_number(ex, nprog, FIRST == 1)
        ex_proj = ex + HEADER
        ex_core = ex_proj + ROWS * N_IN
        ex_y = ex_core + ROWS * H * D
        ex_m = ex_y + ROWS * HID
        error = sync + ERROR_WORD_
        # each matmul phase's tile of this program (block_layout.shape_constants' offsets)
        t_past = (pid + nprog - OFF_PAST) % nprog  # the input projection's, o_proj's and down's tile
        t_gu = (pid + nprog - OFF_GU) % nprog
        if FIRST <= 1 and LAST >= 1:  # the residual add, the input norm and the fused input projection
            wi0, wi1, wi2 = _fetch(w_in, t_past * BN_IN, N_IN, HID, BN_IN, HP0, HP1, HP2)
            v0, v1, v2 = _weight3(w0, HID, HP0, HP1, HP2, HAS_W0)
            keeper = t_past == 0  # the program that stores h (the flagged form's phase 4 recomputes it instead)
            if FLAGS:
                keeper = pid < 0
            if t_past * BN_IN < N_IN:
                for r in tl.static_range(ROWS):
                    x0, x1, x2 = _normed_row3(a, b, v0, v1, v2, h, keeper, r, eps0, HID, HP0, HP1, HP2)
                    acc = _mv3(x0, x1, x2, wi0, wi1, wi2, HP1, HP2)
                    _write_row(ex_proj if FLAGS else proj, acc, bias_in, r, t_past * BN_IN, N_IN, number, dt, BN_IN,
                               HAS_BIAS_IN, FLAGS)
            if LAST > 1 and not FLAGS:
                proj += grid_wait(sync, 0, nprog)
        if FIRST <= 2 and LAST >= 2:  # the token step, one (row, head) at a time
            for i in tl.static_range(IT_TS):
                item = pid + i * nprog
                if item < ROWS * H:
                    if FLAGS:
                        row = item // H
                        hd = item % H
                        # the state tile and the head's constants are read before the wait for the projections
                        held, bias, a_log, weight = token_step_held(A_log, dt_bias, o_norm_w, state, row, hd, H, D, BD,
                                                                    False)
                        vq, vk, vv, vg, va, vb = flagged_head(ex_proj, row, hd, number, error, N_IN, Q, K_, V, A, B, G,
                                                              D, BD)
                        normed = token_step_from_held(vq, vk, vv, vg, vb, va, held, bias, a_log, weight, state, row, hd,
                                                      scale, norm_eps, H, D, BD, V_SILU, False)
                        dd = tl.arange(0, BD)
                        flag_store(ex_core, row * H * D + hd * D + dd, normed.to(dt), dd < D, number)
                    else:
                        token_step_tile(proj + Q, proj + K_, proj + V, proj + A, proj + B, proj + G, A_log, dt_bias,
                                        o_norm_w, state, core, item // H, item % H, N_IN, N_IN, N_IN, N_IN, N_IN,
                                        N_IN, H * D, scale, norm_eps, H, D, BD, V_SILU, False, ".cg")
            if LAST > 2:
                wo0, wo1, wo2 = _fetch(w_o, t_past * BN_O, HID, H * D, BN_O, IP0, IP1, IP2)
                if not FLAGS:
                    core += grid_wait(sync, 1, nprog)
        if FIRST <= 3 and LAST >= 3:  # o_proj
            if FIRST == 3:
                wo0, wo1, wo2 = _fetch(w_o, t_past * BN_O, HID, H * D, BN_O, IP0, IP1, IP2)
            if t_past * BN_O < HID:
                for r in tl.static_range(ROWS):
                    if FLAGS:
                        x0, x1, x2 = flagged_row3(ex_core, r, number, error, H * D, IP0, IP1, IP2)
                    else:
                        x0, x1, x2 = _row3(core, r, H * D, IP0, IP1, IP2)
                    _write_row(ex_y if FLAGS else y, _mv3(x0, x1, x2, wo0, wo1, wo2, IP1, IP2), bias_o, r, t_past * BN_O,
                               HID, number, dt, BN_O, HAS_BIAS_O, FLAGS)
            if LAST > 3:
                g0, g1, g2 = _fetch(w_gu, t_gu * BN_GU, INTER, HID, BN_GU, HP0, HP1, HP2)
                u0, u1, u2 = _fetch(w_gu + INTER * HID, t_gu * BN_GU, INTER, HID, BN_GU, HP0, HP1, HP2)
                if not FLAGS:
                    after = grid_wait(sync, 2, nprog)
                    h += after
                    y += after
        if FIRST <= 4 and LAST >= 4:  # the residual add, the post norm, gate/up and the SwiGLU product
            if FIRST == 4:
                g0, g1, g2 = _fetch(w_gu, t_gu * BN_GU, INTER, HID, BN_GU, HP0, HP1, HP2)
                u0, u1, u2 = _fetch(w_gu + INTER * HID, t_gu * BN_GU, INTER, HID, BN_GU, HP0, HP1, HP2)
            v0, v1, v2 = _weight3(w1, HID, HP0, HP1, HP2, HAS_W1)
            if t_gu * BN_GU < INTER:
                for r in tl.static_range(ROWS):
                    if FLAGS:
                        a0, a1, a2 = _row3(a, r, HID, HP0, HP1, HP2)  # the layer's inputs: read before the wait for y
                        b0, b1, b2 = _row3(b, r, HID, HP0, HP1, HP2)
                        y0, y1, y2 = flagged_row3(ex_y, r, number, error, HID, HP0, HP1, HP2)
                        s0, s1, s2 = _residual3(a0, a1, a2, b0, b1, b2, y0, y1, y2, h2, t_gu == 0, r, HID, HP0, HP1, HP2)
                        x0, x1, x2 = _norm3(s0, s1, s2, v0, v1, v2, eps1, HID, HP1, HP2, dt)
                    else:
                        x0, x1, x2 = _normed_row3(h, y, v0, v1, v2, h2, t_gu == 0, r, eps1, HID, HP0, HP1, HP2)
                    first = _mv3(x0, x1, x2, g0, g1, g2, HP1, HP2)
                    second = _mv3(x0, x1, x2, u0, u1, u2, HP1, HP2)
                    if GATE_FIRST:
                        prod = _swiglu(first, second, bias_gu, bias_gu + INTER, t_gu * BN_GU, INTER, dt, BN_GU,
                                       HAS_BIAS_GU)
                    else:
                        prod = _swiglu(second, first, bias_gu + INTER, bias_gu, t_gu * BN_GU, INTER, dt, BN_GU,
                                       HAS_BIAS_GU)
                    _write_row(ex_m if FLAGS else m, prod, bias_gu, r, t_gu * BN_GU, INTER, number, dt, BN_GU, False,
                               FLAGS)
            if LAST > 4:
                d0, d1, d2 = _fetch(w_d, t_past * BN_D, HID, INTER, BN_D, XP0, XP1, XP2)
                if not FLAGS:
                    m += grid_wait(sync, 3, nprog)
        if FIRST <= 5 and LAST >= 5:  # down
            if FIRST == 5:
                d0, d1, d2 = _fetch(w_d, t_past * BN_D, HID, INTER, BN_D, XP0, XP1, XP2)
            if t_past * BN_D < HID:
                for r in tl.static_range(ROWS):
                    if FLAGS:
                        x0, x1, x2 = flagged_row3(ex_m, r, number, error, INTER, XP0, XP1, XP2)
                    else:
                        x0, x1, x2 = _row3(m, r, INTER, XP0, XP1, XP2)
                    _write_row(d_out, _mv3(x0, x1, x2, d0, d1, d2, XP1, XP2), bias_d, r, t_past * BN_D, HID, number, dt,
                               BN_D, HAS_BIAS_D, False)


def new_sync(device) -> torch.Tensor:
    """A block's meeting counters (zeros): one buffer per program count, since a launch's arrival counts
    name it by multiples of nprog."""
    return torch.zeros(SYNC_WORDS, dtype=torch.int64, device=device)


def sync_failed(sync: torch.Tensor) -> bool:
    """Whether a wait of some launch on `sync` timed out (its programs were not all resident)."""
    return bool(sync[ERROR_WORD].item())


def gdn_block_triton(a, b, w0, eps0, layer, state, w_in, bias_in, w1, eps1, w_gu, b_gu, w_d, b_d,
                     shape: BlockShape, sync: torch.Tensor, limit: int, phased: bool = False, last: int = 5,
                     exchange: torch.Tensor | None = None):
    """The kernel: (h2, d) of rows [B, 1, hidden] (or [B, hidden]); `state` written in place. At most
    `limit` programs, all resident at once unless `phased` (block_tiles(shape, limit) must not be None).
    `last` < 5 runs phases 1..last only (bench/kernel_floors.py times the phases that way). With `exchange`
    (new_exchange(exchange_words(shape, rows), device), the block's own), the phases hand their outputs over
    as flagged words instead of meeting at grid barriers."""
    if triton is None:
        raise RuntimeError("gdn_block_triton needs Triton; use gdn_block_torch.")
    rows = a.shape[0]
    if exchange is not None and (exchange.dtype != torch.int64 or exchange.numel() < HEADER_WORDS
                                 + exchange_words(shape, rows)):
        raise ValueError(f"the exchange buffer holds {exchange.numel()} {exchange.dtype} words; this layer needs "
                         f"new_exchange(exchange_words(shape, {rows}), device).")
    a2, b2 = (x.reshape(rows, shape.hidden).contiguous() for x in (a, b))
    dev, dt = a.device, a.dtype

    def scratch(width):
        return torch.empty(rows, width, dtype=dt, device=dev)

    h2, d = scratch(shape.hidden), scratch(shape.hidden)
    if exchange is None:  # what the phases hand over through memory (the flagged form writes it to `exchange`)
        proj, h, core, y, m = (scratch(w) for w in (shape.proj, shape.hidden, shape.heads * shape.head_dim, shape.hidden,
                                                    shape.inter))
    else:
        proj = h = core = y = m = a2  # never written (phase 1's h stays unstored), their dtype the rows'
    o = layer.o_proj
    args = (a2, b2, w0 if w0 is not None else a2, w_in, bias_in if bias_in is not None else w_in, proj, h,
            layer.A_log, layer.dt_bias, layer.o_norm.weight, state, core,
            o.weight, o.bias if o.bias is not None else o.weight, y,
            w1 if w1 is not None else a2, w_gu, b_gu if b_gu is not None else w_gu, h2, m,
            w_d, b_d if b_d is not None else w_d, d, sync, exchange if exchange is not None else sync,
            float(eps0), float(eps1), float(layer.head_dim ** -0.5), float(layer.o_norm.eps))
    consts = dict(shape_constants(shape, rows, limit), num_warps=NUM_WARPS,
                  HAS_W0=w0 is not None, HAS_W1=w1 is not None, HAS_BIAS_IN=bias_in is not None,
                  HAS_BIAS_O=o.bias is not None, HAS_BIAS_GU=b_gu is not None, HAS_BIAS_D=b_d is not None,
                  FLAGS=exchange is not None)
    for first, upto in ([(p, p) for p in range(1, last + 1)] if phased else [(1, last)]):
        _gdn_block_kernel[(consts["nprog"],)](*args, FIRST=first, LAST=upto, **consts)
    return h2.reshape(a.shape), d.reshape(a.shape)
