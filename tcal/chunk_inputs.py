"""tcal.chunk_intra's kernel fed by a GatedDeltaNet's projections: the recurrence's inputs (tcal.delta_inputs'
math) formed in the same launch as the intra-chunk solve.

At 2k x 1 the inputs kernel took 0.121 ms of the 75% hybrid's 3.14 ms of prefill kernels on the H200, 22 launches of
~5.5 us, and its outputs were read straight back by the intra kernel (bench/RESULTS.md, thirty-seventh session). Here
each program first forms its chunk's rows of one head, q, k = l2norm(silu(.)), v = silu(v) or v (rounded to the
projections' dtype and stored, as tcal.delta_inputs stores them: the state pass and output read q and k), g =
-exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b) (float32, through scratch rows), then, after a barrier that
makes its own stores visible to all its threads, runs the intra-chunk solve on them as tcal.chunk_intra's kernel does
(read back, the prologue's values are dead: held in registers across the solve they spilled for sm_90a)
(tcal.chunk_intra.intra_solve). The results are bit-identical to the two launches': the same float32 math and the
same roundings.

Inference only, rows of equal length, q/k heads equal to v heads, head sizes up to one column block (MAX_HEAD_DIM:
a row's norm needs the whole row in one tile). Slower on one H200 (with SURGERY_CHUNK_STATES=on, the hybrid's 2k x 1
forward 3.981 ms against 3.609 without it; bench/RESULTS.md, thirty-ninth session): off unless SURGERY_CHUNK_INPUTS=on.
"""
from __future__ import annotations

import torch

from .chunk_intra import BLOCK, CHUNK, NUM_WARPS
from .delta_inputs import L2NORM_EPS, kernel_takes as inputs_kernel_takes
from .pdl import pdl_launch
from .switches import enabled

try:  # Triton is a CUDA-side extra: CPU installs do not have it
    import triton
    import triton.language as tl
except Exception:  # a broken install raises more than ImportError
    triton = None

SWITCH = "SURGERY_CHUNK_INPUTS"  # "on": the inputs formed inside the intra kernel's launch
MAX_HEAD_DIM = BLOCK  # one column block holds a whole row


def chunk_inputs_takes(q, k, v, a, b) -> bool:
    """SURGERY_CHUNK_INPUTS is "on"; the projections are what tcal.delta_inputs' kernel takes (any strides), with
    heads up to MAX_HEAD_DIM."""
    if triton is None or not enabled(SWITCH, False):
        return False
    return inputs_kernel_takes(q, k, v, a, b) and q.shape[-1] <= MAX_HEAD_DIM


if triton is not None:
    from .chunk_intra import chunk_rows, intra_from_rows
    from .delta_inputs import decay_and_beta, unit_silu
    from .pdl import release_dependents, wait_for_inputs

    @triton.jit
    def _rows_in(q_raw, k_raw, v_raw, a, b, A_log_h, dt_bias_h, q_out, k_out, v_out, g_tmp, beta_tmp, inside, row, i_b, i_h,
                 length, H: tl.constexpr, sq_b, sq_t, sq_h, sq_d, sk_b, sk_t, sk_h, sk_d, sv_b, sv_t, sv_h, sv_d, sa_b, sa_t, sa_h,
                 sb_b, sb_t, sb_h, eps, J: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, V_SILU: tl.constexpr):
        """One 16-row block (chunk_rows' block J, `row` into [B, T, H]): q, k, v formed and stored ([B, T, H, D] contiguous), g and beta
        into g_tmp and beta_tmp ([B, T, H] float32)."""
        t = tl.program_id(0).to(tl.int64) * 64 + J * 16 + tl.arange(0, 16)  # the rows' positions (chunk_rows' block J)
        d = tl.arange(0, BD)
        tile = inside[:, None] & (d < D)[None, :]
        at = row[:, None] * D + d[None, :]
        q = unit_silu(q_raw, (i_b * sq_b + t * sq_t + i_h * sq_h)[:, None] + d[None, :] * sq_d, tile, eps)
        tl.store(q_out + at, q.to(q_out.dtype.element_ty), mask=tile)
        k = unit_silu(k_raw, (i_b * sk_b + t * sk_t + i_h * sk_h)[:, None] + d[None, :] * sk_d, tile, eps)
        tl.store(k_out + at, k.to(k_out.dtype.element_ty), mask=tile)
        v = tl.load(v_raw + (i_b * sv_b + t * sv_t + i_h * sv_h)[:, None] + d[None, :] * sv_d, mask=tile, other=0).to(tl.float32)
        if V_SILU:
            v = v * tl.sigmoid(v)
        tl.store(v_out + at, v.to(v_out.dtype.element_ty), mask=tile)
        g, beta = decay_and_beta(tl.load(a + i_b * sa_b + t * sa_t + i_h * sa_h, mask=inside, other=0),
                                 tl.load(b + i_b * sb_b + t * sb_t + i_h * sb_h, mask=inside, other=0), A_log_h, dt_bias_h)
        tl.store(g_tmp + row, g, mask=inside)
        tl.store(beta_tmp + row, beta, mask=inside)

    @triton.jit
    def _chunk_inputs_kernel(q_raw, k_raw, v_raw, a, b, A_log, dt_bias, q_out, k_out, v_out, g_tmp, beta_tmp, g_out, w, u,
                             length, sq_b, sq_t, sq_h, sq_d, sk_b, sk_t, sk_h, sk_d, sv_b, sv_t, sv_h, sv_d, sa_b, sa_t, sa_h,
                             sb_b, sb_t, sb_h, eps, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                             DOT: tl.constexpr, V_SILU: tl.constexpr, PDL: tl.constexpr = False):
        """Program (chunk i_t, row x head i_bh): the chunk's rows of one head formed from the projections (four
        16-row blocks; g and beta through g_tmp and beta_tmp), then tcal.chunk_intra's cumulative decay and solve
        on them, read back as that kernel reads its inputs (the prologue's values are dead across the solve)."""
        wait_for_inputs(PDL)
        m0, m1, m2, m3, r0, r1, r2, r3, i_b, i_h = chunk_rows(length, H)
        A_log_h, dt_bias_h = tl.load(A_log + i_h), tl.load(dt_bias + i_h)
        for j in tl.static_range(4):
            inside, row = (m0, r0) if j == 0 else (m1, r1) if j == 1 else (m2, r2) if j == 2 else (m3, r3)
            _rows_in(q_raw, k_raw, v_raw, a, b, A_log_h, dt_bias_h, q_out, k_out, v_out, g_tmp, beta_tmp, inside, row, i_b,
                     i_h, length, H, sq_b, sq_t, sq_h, sq_d, sk_b, sk_t, sk_h, sk_d, sv_b, sv_t, sv_h, sv_d, sa_b, sa_t, sa_h,
                     sb_b, sb_t, sb_h, eps, j, D, BD, V_SILU)
        tl.debug_barrier()  # the rows this program stored, visible to all its threads before it reads them back
        intra_from_rows(k_out, v_out, g_tmp, beta_tmp, g_out, w, u, m0, m1, m2, m3, r0, r1, r2, r3, D, D, BD, BD, DOT)
        release_dependents(PDL)


def chunk_inputs_triton(q, k, v, a, b, A_log, dt_bias, v_silu: bool, dot: str = "tf32x3"):
    """The kernel (inputs that chunk_inputs_takes, on CUDA; or CPU ones under TRITON_INTERPRET=1): (q, k
    [B, T, H, D] contiguous in the projections' dtype, g_cum float32 [B, T, H], w, u): what tcal.delta_inputs
    followed by tcal.chunk_intra return, from one launch."""
    if triton is None:
        raise RuntimeError("chunk_inputs_triton needs Triton; use tcal.delta_inputs and tcal.chunk_intra.")
    batch, length, heads, dim = q.shape
    out = q.new_empty(3, batch, length, heads, dim)  # q, k, v formed (v only for the solve to read back)
    g_cum, g_tmp, beta_tmp = q.new_empty(3, batch, length, heads, dtype=torch.float32)  # g, beta: the kernel's scratch
    w, u = torch.empty_like(out[1]), torch.empty_like(out[2])
    if batch * length * heads:
        _chunk_inputs_kernel[(triton.cdiv(length, CHUNK), batch * heads)](
            q, k, v, a, b, A_log, dt_bias, *out, g_tmp, beta_tmp, g_cum, w, u, length, *q.stride(), *k.stride(), *v.stride(), *a.stride(),
            *b.stride(), L2NORM_EPS, H=heads, D=dim, BD=max(16, triton.next_power_of_2(dim)), DOT=dot, V_SILU=v_silu,
            num_warps=NUM_WARPS, **pdl_launch(q.device))
    return out[0], out[1], g_cum, w, u
