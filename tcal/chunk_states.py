"""The chunked gated delta rule's state pass with ONE product a chunk on its dependent path, and the output
kernel that goes with it, with their float64 reference beside them.

fla's state pass (the chunk-to-chunk walk that tcal.state_pass launches) does, per 64-token chunk c,

    v'  = u_c - w_c S                      (S rounded to k's dtype for the product)
    S   = 2^gL S + K~_c^T v'               (K~ = k * 2^(gL - g_i) per row, gL the chunk's last g)

two products in a row on the path from one chunk's state to the next: at 2k x 1 (9 heads of 64, 32 chunks
deep) its 22 launches took 0.49 ms of a hybrid's 3.14 ms of kernels on the H200, ~0.7 us a chunk (bench/
RESULTS.md, thirty-seventh session). Written as S' = 2^gL S + N_c - D_c S, with

    D_c = K~_c^T w_c   [K, K]   and   N_c = K~_c^T u_c   [K, V]

both computed for every chunk at once (`_transitions_kernel`, one program a chunk and head), the walk
(`_pass_kernel`) has one product a chunk, D_c S, whose operands' loads do not wait for S. The output kernel
(`_output_kernel`) then forms v' = u - w S_c from the stored states itself, as fla's output reads it
(o = scale (2^g q S_c + P v'), P the causal decayed q k^T), so the walk writes only the states. Rounding:
D_c and S are rounded to k's dtype for their product, where fla rounds S and v' (about the same error on
the increment); N_c and the state stay float32.

Inference only (no backward), rows of equal length, q/k heads equal to v heads, head sizes up to
MAX_HEAD_DIM. Slower than fla's state pass and output on one H200 (the hybrid's default forward 3.609 ms against
3.514 at 2k x 1, 13.22 against 11.35 at 8k x 1; bench/RESULTS.md, thirty-ninth session): off unless
SURGERY_CHUNK_STATES=on (tcal.split_state's one-piece path).
"""
from __future__ import annotations

import torch

from .chunk_intra import CHUNK
from .gated_norm import OutputNorm, kernel_takes as gated_norm_takes
from .pdl import pdl_launch
from .switches import enabled

try:  # Triton is a CUDA-side extra: CPU installs do not have it
    import triton
    import triton.language as tl
except Exception:  # a broken install raises more than ImportError
    triton = None

SWITCH = "SURGERY_CHUNK_STATES"  # "on": this module's three kernels replace fla's state pass and output
MAX_HEAD_DIM = 64  # as tcal.state_pass (the only size it launches); at 128 these kernels spill (sm_90a, ptxas)
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Launch (not timed yet): the walk takes tcal.state_pass's value block for the rows x heads; 4 warps as fla's state
# pass and output kernels, the fewest with which no kernel here spills for sm_90a at 9 heads of 64, bf16 (the output
# spilled at 2: `python bench/speed.py --sections registers`)
NUM_WARPS = 4
PASS_STAGES = 3


def chunk_states_torch(q, k, w, u, g, scale: float, initial_state=None):
    """The reference, in float64: (o [B, T, H, V], the state entering each chunk [B, NT, H, K, V], the final
    state [B, H, K, V]) from q, k [B, T, H, K], w [B, T, H, K], u [B, T, H, V] and the chunk-local cumulative
    log2 decay g [B, T, H] (what tcal.chunk_intra returns)."""
    q, k, w, u, g = (x.double() for x in (q, k, w, u, g))
    batch, length, heads, k_dim = k.shape
    v_dim = u.shape[-1]
    state = (torch.zeros(batch, heads, k_dim, v_dim, dtype=torch.float64, device=q.device) if initial_state is None
             else initial_state.double().clone())
    o, states = torch.empty_like(u), []
    for start in range(0, length, CHUNK):
        part = slice(start, min(start + CHUNK, length))
        qc, kc, wc, uc, gc = (x[:, part].transpose(1, 2) for x in (q, k, w, u, g))  # [B, H, C, .]
        states.append(state)
        written = uc - wc @ state
        size = gc.shape[-1]
        causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
        scores = (qc @ kc.mT) * torch.exp2(gc[..., :, None] - gc[..., None, :]).masked_fill(~causal, 0)
        o[:, part] = (scale * ((qc * torch.exp2(gc)[..., None]) @ state + scores @ written)).transpose(1, 2)
        last = gc[..., -1:]
        state = torch.exp2(last)[..., None] * state + (kc * torch.exp2(last - gc)[..., None]).mT @ written
    return o, torch.stack(states, 1), state


def chunk_states_takes(q, k, w, u, g) -> bool:
    """SURGERY_CHUNK_STATES is "on", Triton imports; q, k, w [B, T, H, K] and u [B, T, H, V] contiguous, of
    one kernel dtype (q/k heads equal to v heads), K and V up to MAX_HEAD_DIM; g [B, T, H] contiguous float32."""
    if triton is None or not enabled(SWITCH, False):
        return False
    if any(x.dim() != 4 for x in (q, k, w, u)) or not q.shape == k.shape == w.shape or u.shape[:3] != q.shape[:3]:
        return False
    if q.dtype not in KERNEL_DTYPES or any(x.dtype != q.dtype for x in (k, w, u)) or max(q.shape[-1], u.shape[-1]) > MAX_HEAD_DIM:
        return False
    return (g.dtype == torch.float32 and tuple(g.shape) == tuple(q.shape[:3])
            and all(x.is_contiguous() for x in (q, k, w, u, g)))


if triton is not None:
    from .chunk_intra import dot_in
    from .pdl import release_dependents, wait_for_inputs

    @triton.jit
    def _tile(x, row, inside, D: tl.constexpr, BD: tl.constexpr):
        """Rows `row` [BT] of a [rows, D] matrix, columns [0, BD), zeros outside."""
        d = tl.arange(0, BD)
        return tl.load(x + row[:, None] * D + d[None, :], mask=inside[:, None] & (d < D)[None, :], other=0.0)

    @triton.jit
    def _chunk(length, H: tl.constexpr):
        """This program's 64-token chunk (axis 0) of one row x head (axis 1): (chunk, row, head, in-range mask of
        its positions, their indices into [B, T, H])."""
        i_t, i_bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
        i_b, i_h = i_bh // H, i_bh % H
        t = i_t * 64 + tl.arange(0, 64)
        return i_t, i_b, i_h, t < length, (i_b * length + t) * H + i_h

    @triton.jit
    def _transitions_kernel(k, w, u, g, trans_d, trans_n, length, H: tl.constexpr, K: tl.constexpr,
                            V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DOT: tl.constexpr,
                            PDL: tl.constexpr = False):
        """Program (chunk i_t, row x head i_bh): D = K~^T w [K, K] in k's dtype and N = K~^T u [K, V] float32,
        K~ = k * 2^(gL - g) rounded to k's dtype (zero past the row's end). trans_d [B, NT, H, K, K], trans_n
        [B, NT, H, K, V], contiguous."""
        wait_for_inputs(PDL)
        BT: tl.constexpr = 64
        i_t, i_b, i_h, inside, row = _chunk(length, H)
        last = (i_b * length + tl.minimum(i_t * BT + BT, length) - 1) * H + i_h
        g_last = tl.load(g + last)
        decay = tl.where(inside, tl.exp2(g_last - tl.load(g + row, mask=inside, other=0.0)), 0.0)
        kt = (_tile(k, row, inside, K, BK).to(tl.float32) * decay[:, None]).to(k.dtype.element_ty)
        d_part = dot_in(tl.trans(kt), _tile(w, row, inside, K, BK), DOT)
        n_part = dot_in(tl.trans(kt), _tile(u, row, inside, V, BV), DOT)
        chunk = (i_b * tl.cdiv(length, BT) + i_t) * H + i_h
        a, b, c = tl.arange(0, BK), tl.arange(0, BK), tl.arange(0, BV)
        tl.store(trans_d + chunk * K * K + a[:, None] * K + b[None, :], d_part.to(trans_d.dtype.element_ty),
                 mask=(a < K)[:, None] & (b < K)[None, :])
        tl.store(trans_n + chunk * K * V + a[:, None] * V + c[None, :], n_part, mask=(a < K)[:, None] & (c < V)[None, :])
        release_dependents(PDL)

    @triton.jit
    def _pass_kernel(trans_d, trans_n, g, h, h0, ht, length, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr, STORE_FINAL: tl.constexpr,
                     DOT: tl.constexpr, PDL: tl.constexpr = False):
        """Program (value block i_v, row x head i_bh): S = h0 (or 0); per chunk, h[chunk] = S in h's dtype,
        then S = 2^gL S + N - D S (D S with S rounded to D's dtype). h [B, NT, H, K, V]; h0, ht [B, H, K, V]
        float32."""
        wait_for_inputs(PDL)
        BT: tl.constexpr = 64
        i_v, i_bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
        i_b, i_h = i_bh // H, i_bh % H
        a, b, c = tl.arange(0, BK), tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
        kk = (a < K)[:, None] & (b < K)[None, :]
        kv = (a < K)[:, None] & (c < V)[None, :]
        at_kk, at_kv = a[:, None] * K + b[None, :], a[:, None] * V + c[None, :]
        state = tl.zeros([BK, BV], dtype=tl.float32)
        if HAS_H0:
            state += tl.load(h0 + i_bh * K * V + at_kv, mask=kv, other=0.0).to(tl.float32)
        chunks = tl.cdiv(length, BT)
        for i_t in range(chunks):
            chunk = (i_b * chunks + i_t) * H + i_h
            tl.store(h + chunk * K * V + at_kv, state.to(h.dtype.element_ty), mask=kv)
            d_c = tl.load(trans_d + chunk * K * K + at_kk, mask=kk, other=0.0)
            n_c = tl.load(trans_n + chunk * K * V + at_kv, mask=kv, other=0.0)
            g_last = tl.load(g + (i_b * length + tl.minimum(i_t * BT + BT, length) - 1) * H + i_h)
            state = state * tl.exp2(g_last) + n_c - dot_in(d_c, state.to(d_c.dtype), DOT)
        if STORE_FINAL:
            tl.store(ht + i_bh * K * V + at_kv, state, mask=kv)
        release_dependents(PDL)

    @triton.jit
    def _output_kernel(q, k, w, u, g, h, o, scale, length, gate, weight, eps, sg_b, sg_t, sg_h, sg_d,
                       H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       DOT: tl.constexpr, NORM: tl.constexpr = False, SIGMOID: tl.constexpr = False,
                       PDL: tl.constexpr = False):
        """Program (chunk i_t, row x head i_bh): v' = u - w S (rounded to u's dtype, as fla's pass stores it),
        o = scale (2^g q S + P v'), P = q k^T 2^(g_i - g_j) for j <= i (rounded to v''s dtype), S the state
        entering the chunk (h). o [B, T, H, V] in u's dtype; with NORM, RMSNorm(o) * weight * act(gate) of o
        rounded to its dtype first, as tcal.gated_norm computes it (gate [B, T, H, V] through its strides)."""
        wait_for_inputs(PDL)
        BT: tl.constexpr = 64
        i_t, i_b, i_h, inside, row = _chunk(length, H)
        rows = i_t * BT + tl.arange(0, BT)
        a, c = tl.arange(0, BK), tl.arange(0, BV)
        chunk = (i_b * tl.cdiv(length, BT) + i_t) * H + i_h
        s = tl.load(h + chunk * K * V + a[:, None] * V + c[None, :], mask=(a < K)[:, None] & (c < V)[None, :], other=0.0)
        qt, kt = _tile(q, row, inside, K, BK), _tile(k, row, inside, K, BK)
        written = (_tile(u, row, inside, V, BV).to(tl.float32) - dot_in(_tile(w, row, inside, K, BK), s, DOT))
        written = written.to(u.dtype.element_ty)
        gt = tl.load(g + row, mask=inside, other=0.0)
        from_state = dot_in(qt, s, DOT) * tl.exp2(gt)[:, None]
        causal = (rows[:, None] >= rows[None, :]) & inside[:, None] & inside[None, :]
        scores = tl.where(causal, dot_in(qt, tl.trans(kt), DOT) * tl.exp2(gt[:, None] - gt[None, :]), 0.0)
        out = (from_state + dot_in(scores.to(written.dtype), written, DOT)) * scale
        if NORM:  # the gated output norm of the rounded output, in float32 (tcal.gated_norm's math)
            out = out.to(o.dtype.element_ty).to(tl.float32)
            rstd = 1 / tl.sqrt(tl.sum(out * out, 1) / V + eps)
            gv = tl.load(gate + (i_b * sg_b + rows * sg_t + i_h * sg_h)[:, None] + c[None, :] * sg_d,
                         mask=inside[:, None] & (c < V)[None, :], other=0.0).to(tl.float32)
            act = tl.sigmoid(gv) if SIGMOID else gv * tl.sigmoid(gv)
            out = out * rstd[:, None] * tl.load(weight + c, mask=c < V, other=0.0).to(tl.float32)[None, :] * act
        tl.store(o + row[:, None] * V + c[None, :], out.to(o.dtype.element_ty), mask=inside[:, None] & (c < V)[None, :])
        release_dependents(PDL)


def chunk_states_triton(q, k, w, u, g, scale: float, initial_state=None, output_final_state: bool = False,
                        value_block: int | None = None, dot: str = "tf32x3", output_norm: OutputNorm | None = None):
    """The three kernels (inputs that chunk_states_takes, on CUDA; or CPU ones under TRITON_INTERPRET=1):
    (o like u, the final state [B, H, K, V] float32 or None). `value_block`: the walk's value columns a
    program (tcal.state_pass's choice for the rows x heads; the whole width when None). With `output_norm`
    the output is normed (in the output kernel where tcal.gated_norm's kernel would take it, else by its apply)."""
    if triton is None:
        raise RuntimeError("chunk_states_triton needs Triton; use chunk_states_torch.")
    batch, length, heads, k_dim = k.shape
    v_dim = u.shape[-1]
    bk, bv = max(16, triton.next_power_of_2(k_dim)), max(16, triton.next_power_of_2(v_dim))
    block = min(bv, max(16, value_block or bv))
    chunks = triton.cdiv(length, CHUNK)
    o = torch.empty_like(u)
    final = k.new_empty(batch, heads, k_dim, v_dim, dtype=torch.float32) if output_final_state else None
    if batch * length * heads == 0:  # nothing to walk: the final state is the initial one
        if final is not None and initial_state is not None:
            final.copy_(initial_state)
        elif final is not None:
            final.zero_()
        return o, final
    trans_d = k.new_empty(batch, chunks, heads, k_dim, k_dim)
    trans_n = k.new_empty(batch, chunks, heads, k_dim, v_dim, dtype=torch.float32)
    states = k.new_empty(batch, chunks, heads, k_dim, v_dim)
    start = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    pdl = pdl_launch(k.device)  # tcal.pdl: SURGERY_PDL=on on sm_90
    _transitions_kernel[(chunks, batch * heads)](k, w, u, g, trans_d, trans_n, length, H=heads, K=k_dim, V=v_dim,
                                                 BK=bk, BV=bv, DOT=dot, num_warps=NUM_WARPS, **pdl)
    _pass_kernel[(triton.cdiv(v_dim, block), batch * heads)](
        trans_d, trans_n, g, states, start, final, length, H=heads, K=k_dim, V=v_dim, BK=bk, BV=block,
        HAS_H0=start is not None, STORE_FINAL=final is not None, DOT=dot, num_warps=NUM_WARPS, num_stages=PASS_STAGES, **pdl)
    norm = output_norm
    folds = norm is not None and gated_norm_takes(o, norm.gate, norm.weight, norm.activation)
    gate, weight, eps, strides = (norm.gate, norm.weight, float(norm.eps), norm.gate.stride()) if folds else (o, o, 0.0, (0,) * 4)
    _output_kernel[(chunks, batch * heads)](q, k, w, u, g, states, o, float(scale), length, gate, weight, eps, *strides,
                                            H=heads, K=k_dim, V=v_dim, BK=bk, BV=bv, DOT=dot, NORM=folds,
                                            SIGMOID=folds and norm.activation == "sigmoid", num_warps=NUM_WARPS, **pdl)
    return (norm.apply(o) if norm is not None and not folds else o), final
