"""The intra-chunk half of the chunked gated delta rule's inference forward as ONE kernel, with its
float64 reference beside it: from the per-token log decay g and beta, each 64-token chunk's

    g_cum = cumsum(g) / ln 2                     (chunk-local, log2 units, as fla's kernels read it)
    A_ij  = beta_i (k_i . k_j) 2^(g_cum_i - g_cum_j)   for j < i, else 0
    T     = (I + A)^-1
    w     = T diag(beta) (k * 2^g_cum),  u = T diag(beta) v

which fla's state pass and output kernels then read (tcal.split_state). fla computes these in four
launches (its cumsum, a zero fill of A, the fused kkt + triangular solve, the w/u recompute with A's
round trip through memory): 24.7 us of a 2k x 1 prefill's GDN layer on the H200 (bench/RESULTS.md,
thirty-third session), most of it the solve's 4 x 14 dependent row steps.

Here one program holds a chunk of one head as four sub-chunks of 16 rows, as fla's solve does, and
does all of it in one launch. What made fla's solve slow at batch 1 is latency: 288 programs at 2k x 1,
each inverting its four 16 x 16 diagonal blocks one after another by forward substitution, 56 dependent
row steps. Here the four blocks' row steps run interleaved in one loop (14 steps of four independent
chains), the blocks below the diagonal follow from T_ij = -T_ii sum_{j <= m < i} A_im T_mj (16 x 16
products in TF32x3, about float32's rounding, where fla's use TF32), and w and u are each row block's
sum of T_ij times the scaled keys or values (T_ij rounded to k's dtype first, as fla rounds T). On the
H200 at 2k x 1 (9 heads of 64) it takes 13.8 us against fla's 24.7 (1.6 + 23.1; bench/RESULTS.md,
thirty-fourth session), two warps a program. A first form, [64, 64] tiles with four warps (the diagonal
blocks by substitution together, then (I + N)^-1 as a product of (I + N^(2^s)) factors), took 45-104 us:
its row steps and products crossed warps.

Inference only (no backward), rows of equal length, q/k and v heads equal (fla also takes grouped v
heads: those keep fla's kernels), head sizes up to MAX_HEAD_DIM.
"""
from __future__ import annotations

import math

import torch

from .pdl import pdl_launch
from .switches import enabled

try:  # Triton is a CUDA-side extra: CPU installs do not have it
    import triton
    import triton.language as tl
except Exception:  # a broken install raises more than ImportError
    triton = None

SWITCH = "SURGERY_CHUNK_INTRA"  # "off": fla's four launches
CHUNK = 64  # fla's chunk size: its state pass and output kernels read chunks of it (tcal.split_state, tcal.state_pass)
BLOCKS = (16, 32, 64)  # key / value columns a step may hold (16: the narrowest tensor-core product)
# Launch: the best of 1, 2 and 4 warps x 16, 32 and 64 key / value columns a step at 2k x 1, 9 heads of 64 on the
# H200 (13.8 us against fla's 24.7 for its cumsum and intra launches; bench/RESULTS.md, thirty-fourth session)
NUM_WARPS = 2
BLOCK = 64
MAX_HEAD_DIM = 256
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
RCP_LN2 = 1 / math.log(2)


def chunk_intra_torch(k, v, g, beta, chunk: int = CHUNK):
    """The reference, in float64 whatever the inputs (tests compare against it): (g_cum, w, u) with
    g_cum [B, T, H] float64, w [B, T, H, K] and u [B, T, H, V] float64. A last partial chunk is as long
    as the rows' remainder."""
    k, v, g, beta = (x.double() for x in (k, v, g, beta))
    batch, length, heads, _ = k.shape
    g_cum, w, u = torch.empty_like(g), torch.empty_like(k), torch.empty_like(v)
    for start in range(0, length, chunk):
        part = slice(start, min(start + chunk, length))
        kc, vc, bc = k[:, part].transpose(1, 2), v[:, part].transpose(1, 2), beta[:, part].transpose(1, 2)  # [B, H, C, .]
        gc = g[:, part].transpose(1, 2).cumsum(-1) * RCP_LN2
        size = kc.shape[2]
        lower = torch.ones(size, size, dtype=torch.bool, device=k.device).tril(-1)
        a = (kc @ kc.mT) * torch.exp2(gc[..., :, None] - gc[..., None, :]).masked_fill(~lower, 0) * bc[..., :, None]
        eye = torch.eye(size, dtype=a.dtype, device=a.device).expand_as(a)
        t = torch.linalg.solve_triangular(eye + a, eye, upper=False, unitriangular=True)
        w[:, part] = (t @ (kc * (bc * torch.exp2(gc))[..., None])).transpose(1, 2)
        u[:, part] = (t @ (vc * bc[..., None])).transpose(1, 2)
        g_cum[:, part] = gc.transpose(1, 2)
    return g_cum, w, u


def chunk_intra_takes(k, v, g, beta) -> bool:
    """Triton imports; k [B, T, H, K] and v [B, T, H, V] contiguous, of one kernel dtype, K and V up to
    MAX_HEAD_DIM; g and beta [B, T, H] contiguous float32; SURGERY_CHUNK_INTRA is not "off"."""
    if triton is None or not enabled(SWITCH, True):
        return False
    if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3] or k.dtype not in KERNEL_DTYPES or v.dtype != k.dtype:
        return False
    if max(k.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:
        return False
    return (all(x.is_contiguous() for x in (k, v, g, beta)) and all(x.dtype == torch.float32 for x in (g, beta))
            and all(tuple(x.shape) == tuple(k.shape[:3]) for x in (g, beta)))


if triton is not None:
    from .pdl import release_dependents, wait_for_inputs

    RCP_LN2_ = tl.constexpr(RCP_LN2)

    @triton.jit
    def dot_in(a, b, DOT: tl.constexpr):
        """a @ b, float32 operands in DOT precision (16-bit ones are multiplied exactly either way)."""
        if a.dtype == tl.float32:
            return tl.dot(a, b, input_precision=DOT)
        return tl.dot(a, b)

    @triton.jit
    def _rows(x, row, inside, D: tl.constexpr, BD: tl.constexpr, d0):
        """Rows `row` [BC] of a [rows, D] matrix, columns [d0, d0 + BD), zeros outside."""
        d = d0 + tl.arange(0, BD)
        return tl.load(x + row[:, None] * D + d[None, :], mask=inside[:, None] & (d < D)[None, :], other=0.0)

    @triton.jit
    def _scaled_rows(x, row, inside, scale, D: tl.constexpr, BD: tl.constexpr, d0):
        """_rows times scale [BC] per row, rounded back to x's dtype (as fla's w/u recompute rounds them)."""
        return (_rows(x, row, inside, D, BD, d0).to(tl.float32) * scale[:, None]).to(x.dtype.element_ty)

    @triton.jit
    def _store_rows(x, value, row, inside, D: tl.constexpr, BD: tl.constexpr, d0):
        d = d0 + tl.arange(0, BD)
        tl.store(x + row[:, None] * D + d[None, :], value.to(x.dtype.element_ty), mask=inside[:, None] & (d < D)[None, :])

    @triton.jit
    def _gated(a, gi, gj, bi, DIAGONAL: tl.constexpr, o):
        """beta_i (k_i . k_j) 2^(g_i - g_j) of a [BC, BC] block, strictly lower on the diagonal. g never
        grows along a chunk, so off the diagonal (and below it) the exponent is <= 0."""
        if DIAGONAL:
            return tl.where(o[:, None] > o[None, :], a * tl.exp2(gi[:, None] - gj[None, :]), 0.0) * bi[:, None]
        return a * tl.exp2(gi[:, None] - gj[None, :]) * bi[:, None]

    @triton.jit
    def _solve_row(neg, inv, o, r):
        """Row r of (I + D)^-1 - I from rows < r: -(row r of D) - sum_j D_rj (row j of (I + D)^-1 - I)."""
        picked = (o == r)[:, None]
        x = tl.sum(tl.where(picked, neg, 0.0), 0)
        x = x + tl.sum(x[:, None] * inv, 0)
        return tl.where(picked, x[None, :], inv)

    @triton.jit
    def _row_block(t0, t1, t2, t3, x0, x1, x2, x3, N: tl.constexpr, DOT: tl.constexpr):
        """sum_{j < N} t_j @ x_j, float32 (t_j [BC, BC] in x's dtype, x_j [BC, BD])."""
        acc = dot_in(t0.to(x0.dtype), x0, DOT)
        if N > 1:
            acc += dot_in(t1.to(x1.dtype), x1, DOT)
        if N > 2:
            acc += dot_in(t2.to(x2.dtype), x2, DOT)
        if N > 3:
            acc += dot_in(t3.to(x3.dtype), x3, DOT)
        return acc

    @triton.jit
    def _apply_t(x, out, r0, r1, r2, r3, m0, m1, m2, m3, s0, s1, s2, s3, i0, i1, i2, i3, t10, t20, t21, t30, t31, t32,
                 D: tl.constexpr, BD: tl.constexpr, DOT: tl.constexpr):
        """out = T diag(s) x for the chunk's four row blocks (T's blocks i_c on the diagonal, t_ij below it)."""
        for d0 in tl.static_range(0, D, BD):
            x0 = _scaled_rows(x, r0, m0, s0, D, BD, d0)
            x1 = _scaled_rows(x, r1, m1, s1, D, BD, d0)
            x2 = _scaled_rows(x, r2, m2, s2, D, BD, d0)
            x3 = _scaled_rows(x, r3, m3, s3, D, BD, d0)
            _store_rows(out, _row_block(i0, i0, i0, i0, x0, x0, x0, x0, 1, DOT), r0, m0, D, BD, d0)
            _store_rows(out, _row_block(t10, i1, i1, i1, x0, x1, x1, x1, 2, DOT), r1, m1, D, BD, d0)
            _store_rows(out, _row_block(t20, t21, i2, i2, x0, x1, x2, x2, 3, DOT), r2, m2, D, BD, d0)
            _store_rows(out, _row_block(t30, t31, t32, i3, x0, x1, x2, x3, 4, DOT), r3, m3, D, BD, d0)

    @triton.jit
    def log2_cumsum(g0, g1, g2, g3):
        """The chunk-local cumulative decay of four 16-row blocks, in log2 units (rows past the end hold 0)."""
        s0 = tl.sum(g0, 0)
        s1 = s0 + tl.sum(g1, 0)
        s2 = s1 + tl.sum(g2, 0)
        return (tl.cumsum(g0, 0) * RCP_LN2_, (tl.cumsum(g1, 0) + s0) * RCP_LN2_, (tl.cumsum(g2, 0) + s1) * RCP_LN2_,
                (tl.cumsum(g3, 0) + s2) * RCP_LN2_)

    @triton.jit
    def intra_solve(k, v, w, u, r0, r1, r2, r3, m0, m1, m2, m3, c0, c1, c2, c3, b0, b1, b2, b3,
                    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DOT: tl.constexpr):
        """From a chunk's rows r_j of k and v ([B, T, H, D] contiguous), their cumulative log2 decay c_j and beta b_j
        (four 16-row blocks): w = T diag(beta) (k * 2^g) and u = T diag(beta) v, T = (I + A)^-1 (module docstring)."""
        BC: tl.constexpr = 16
        o = tl.arange(0, BC)
        # A's ten lower blocks: k_i . k_j over the key columns, then gated
        z = tl.zeros([BC, BC], dtype=tl.float32)
        a00, a11, a22, a33, a10, a20, a21, a30, a31, a32 = z, z, z, z, z, z, z, z, z, z
        for d0 in tl.static_range(0, K, BK):
            k0 = _rows(k, r0, m0, K, BK, d0)
            k1 = _rows(k, r1, m1, K, BK, d0)
            k2 = _rows(k, r2, m2, K, BK, d0)
            k3 = _rows(k, r3, m3, K, BK, d0)
            a00 += dot_in(k0, tl.trans(k0), DOT)
            a11 += dot_in(k1, tl.trans(k1), DOT)
            a22 += dot_in(k2, tl.trans(k2), DOT)
            a33 += dot_in(k3, tl.trans(k3), DOT)
            a10 += dot_in(k1, tl.trans(k0), DOT)
            a20 += dot_in(k2, tl.trans(k0), DOT)
            a21 += dot_in(k2, tl.trans(k1), DOT)
            a30 += dot_in(k3, tl.trans(k0), DOT)
            a31 += dot_in(k3, tl.trans(k1), DOT)
            a32 += dot_in(k3, tl.trans(k2), DOT)
        a00 = _gated(a00, c0, c0, b0, True, o)
        a11 = _gated(a11, c1, c1, b1, True, o)
        a22 = _gated(a22, c2, c2, b2, True, o)
        a33 = _gated(a33, c3, c3, b3, True, o)
        a10 = _gated(a10, c1, c0, b1, False, o)
        a20 = _gated(a20, c2, c0, b2, False, o)
        a21 = _gated(a21, c2, c1, b2, False, o)
        a30 = _gated(a30, c3, c0, b3, False, o)
        a31 = _gated(a31, c3, c1, b3, False, o)
        a32 = _gated(a32, c3, c2, b3, False, o)

        # the four diagonal blocks' inverses, their row steps interleaved (four independent chains)
        n0, n1, n2, n3 = -a00, -a11, -a22, -a33
        i0, i1, i2, i3 = n0, n1, n2, n3
        for r in range(2, BC):
            i0 = _solve_row(n0, i0, o, r)
            i1 = _solve_row(n1, i1, o, r)
            i2 = _solve_row(n2, i2, o, r)
            i3 = _solve_row(n3, i3, o, r)
        eye = tl.where(o[:, None] == o[None, :], 1.0, 0.0)
        i0, i1, i2, i3 = i0 + eye, i1 + eye, i2 + eye, i3 + eye

        # the blocks below the diagonal: T_ij = -T_ii sum_{j <= m < i} A_im T_mj
        t10 = -dot_in(i1, dot_in(a10, i0, DOT), DOT)
        t21 = -dot_in(i2, dot_in(a21, i1, DOT), DOT)
        t32 = -dot_in(i3, dot_in(a32, i2, DOT), DOT)
        t20 = -dot_in(i2, dot_in(a20, i0, DOT) + dot_in(a21, t10, DOT), DOT)
        t31 = -dot_in(i3, dot_in(a31, i1, DOT) + dot_in(a32, t21, DOT), DOT)
        t30 = -dot_in(i3, dot_in(a30, i0, DOT) + dot_in(a31, t10, DOT) + dot_in(a32, t20, DOT), DOT)

        # w = T diag(beta) (k * 2^g), u = T diag(beta) v, a row block at a time
        e0, e1, e2, e3 = b0 * tl.exp2(c0), b1 * tl.exp2(c1), b2 * tl.exp2(c2), b3 * tl.exp2(c3)
        _apply_t(k, w, r0, r1, r2, r3, m0, m1, m2, m3, e0, e1, e2, e3, i0, i1, i2, i3, t10, t20, t21, t30, t31, t32,
                 K, BK, DOT)
        _apply_t(v, u, r0, r1, r2, r3, m0, m1, m2, m3, b0, b1, b2, b3, i0, i1, i2, i3, t10, t20, t21, t30, t31, t32,
                 V, BV, DOT)

    @triton.jit
    def chunk_rows(length, H: tl.constexpr):
        """This program's chunk (axis 0) of one row x head (axis 1) as four 16-row blocks: their positions t_j,
        in-range masks m_j and indices r_j into [B, T, H]; then the row and head."""
        BC: tl.constexpr = 16
        i_t, i_bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
        i_b, i_h = i_bh // H, i_bh % H
        t0 = i_t * 4 * BC + tl.arange(0, BC)
        t1, t2, t3 = t0 + BC, t0 + 2 * BC, t0 + 3 * BC
        r0 = (i_b * length + t0) * H + i_h
        r1 = (i_b * length + t1) * H + i_h
        r2 = (i_b * length + t2) * H + i_h
        r3 = (i_b * length + t3) * H + i_h
        return t0 < length, t1 < length, t2 < length, t3 < length, r0, r1, r2, r3, i_b, i_h

    @triton.jit
    def intra_from_rows(k, v, g, beta, g_out, w, u, m0, m1, m2, m3, r0, r1, r2, r3, K: tl.constexpr, V: tl.constexpr,
                        BK: tl.constexpr, BV: tl.constexpr, DOT: tl.constexpr):
        """A chunk's rows (chunk_rows) of g and beta [B, T, H] float32: their cumulative log2 decay into g_out, then
        intra_solve's w and u."""
        c0, c1, c2, c3 = log2_cumsum(tl.load(g + r0, mask=m0, other=0.0), tl.load(g + r1, mask=m1, other=0.0),
                                     tl.load(g + r2, mask=m2, other=0.0), tl.load(g + r3, mask=m3, other=0.0))
        tl.store(g_out + r0, c0, mask=m0)
        tl.store(g_out + r1, c1, mask=m1)
        tl.store(g_out + r2, c2, mask=m2)
        tl.store(g_out + r3, c3, mask=m3)
        b0 = tl.load(beta + r0, mask=m0, other=0.0)
        b1 = tl.load(beta + r1, mask=m1, other=0.0)
        b2 = tl.load(beta + r2, mask=m2, other=0.0)
        b3 = tl.load(beta + r3, mask=m3, other=0.0)
        intra_solve(k, v, w, u, r0, r1, r2, r3, m0, m1, m2, m3, c0, c1, c2, c3, b0, b1, b2, b3, K, V, BK, BV, DOT)

    @triton.jit
    def _chunk_intra_kernel(k, v, g, beta, g_out, w, u, length, H: tl.constexpr, K: tl.constexpr,
                            V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DOT: tl.constexpr,
                            PDL: tl.constexpr = False):
        """Program (chunk i_t, row x head i_bh): the chunk's 64 rows of one head as four sub-chunks of
        BC = 16 rows (module docstring). k, v, w, u are [B, T, H, D] contiguous; g, beta, g_out [B, T, H]
        float32."""
        wait_for_inputs(PDL)
        m0, m1, m2, m3, r0, r1, r2, r3, _, _ = chunk_rows(length, H)
        intra_from_rows(k, v, g, beta, g_out, w, u, m0, m1, m2, m3, r0, r1, r2, r3, K, V, BK, BV, DOT)
        release_dependents(PDL)


def chunk_intra_triton(k, v, g, beta, num_warps: int | None = None, block: int | None = None, dot: str = "tf32x3"):
    """The kernel (inputs that chunk_intra_takes, on CUDA; or CPU ones under TRITON_INTERPRET=1): (g_cum
    float32 [B, T, H], w like k, u like v). `block`: the key and value columns a step holds; NUM_WARPS
    and BLOCK unless given (bench/gdn_forward_bench.py times others)."""
    num_warps, block = num_warps or NUM_WARPS, block or BLOCK
    if triton is None:
        raise RuntimeError("chunk_intra_triton needs Triton; use chunk_intra_torch.")
    if block not in BLOCKS:
        raise ValueError(f"chunk_intra_triton's column block is one of {BLOCKS}, got {block}")
    batch, length, heads, k_dim = k.shape
    v_dim = v.shape[-1]
    g_cum, w, u = torch.empty_like(g), torch.empty_like(k), torch.empty_like(v)
    if batch * length * heads:
        _chunk_intra_kernel[(triton.cdiv(length, CHUNK), batch * heads)](
            k, v, g, beta, g_cum, w, u, length, H=heads, K=k_dim, V=v_dim, BK=min(block, max(16, triton.next_power_of_2(k_dim))),
            BV=min(block, max(16, triton.next_power_of_2(v_dim))), DOT=dot, num_warps=num_warps,
            **pdl_launch(k.device),
        )
    return g_cum, w, u
