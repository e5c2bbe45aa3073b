"""A GDN layer's decoded token from its input projections to the next norm as ONE kernel (reference beside it).

Past one row a static step composes a GDN decoder layer from its kernels (surgery.decode.gdn_block's
one-launch layer applies each weight tile a row at a time: at 16 rows it took 120.7 us against 22.4 for
the composed kernels on the H200). Three of them run back to back on the mixer's output: the token step
(tcal.token_step), o_proj (a cuBLAS GEMM at ~4 us whatever its size: too few output tiles to fill the
GPU) and the residual add with the post norm (surgery.decode.residual_norm). Here they are one launch:

    program (row n, head h):  core = token_step(...);  partial[n, h] = round(core) @ W_o[:, h]^T   (float32)
    the row's last program:   y = round(sum over heads of partial[n] in head order + bias)
                              h2 = round(h + y);  n2 = round(rms_norm(h2) * w1)

The programs of a row never wait for each other: each adds 1 to its row's counter after writing its
partial, and the one whose arrival completes the row (the counter only grows, H a launch, so
`old % H == H - 1` names it) sums them. Every intermediate is rounded where the composed kernels round
it, so the two differ only in the order of float32 sums. `gdn_tail_torch` is the composition itself."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tcal.switches import enabled
from tcal.token_step import token_step_torch

from .block_layout import BlockShape, pieces
from .residual_norm import add_rms_norm_torch

try:  # Triton is a CUDA-side extra: CPU installs do not have it
    import triton
    import triton.language as tl
except Exception:  # a broken install raises more than ImportError
    triton = None

ENV = "SURGERY_GDN_TAIL"
# Rows a step sends through the kernel: each (row, head) program reads its head's o_proj columns, so the
# bytes it moves grow with the rows where a GEMM's do not. On an H100 it won at 1-8 rows and lost at 16
# (bench/RESULTS.md, forty-third session)
MAX_ROWS = 8
MAX_HIDDEN = 16384   # the last program holds a row of the layer's output
PREFETCHED = 40960   # o_proj weights a program loads before its token step (more: a loop after it)
NUM_WARPS = 8
# Registers a thread may use: uncapped the default form took 157 (sm_90a), one program an SM, so 16 rows x 9 heads
# (144 programs) ran in two waves on an H100's 132 SMs (16.97 us a layer against 11.52 at 4 rows); at 128 (no
# spills) two programs fit an SM (14.66 us at 16 rows, the same at 1-8; forty-third session). Only that form holds
# o_proj's columns in registers: the loop form takes fewer uncapped (79 at 32 heads of 64), and its 128-wide
# heads spill under the cap
REGISTERS = 128


def tail_enabled() -> bool:
    """SURGERY_GDN_TAIL: on unless set off. On an H100 (forty-third session) projection + tail took 11.4-11.7 us a
    SmolLM2-shaped layer at 1-8 rows against 13.0-13.2 composed; at 16 rows 14.66 against 13.91 (MAX_ROWS)."""
    return enabled(ENV, True)


def gdn_tail_torch(proj, shape: BlockShape, layer, state, h, w1, eps1: float):
    """The reference, gdn_tail_triton's arguments: the token step on the projection's parts (state written),
    o_proj, the residual add and post norm, each as its own call; (h2, n2)."""
    rows, width = state.shape[0], shape.heads * shape.head_dim
    proj2 = proj.reshape(rows, -1)
    q, k, v, a, b, g = (proj2[:, start:start + (width if part in "qkvg" else shape.heads)]
                        for part, start in zip("qkvabg", shape.offsets))
    core = token_step_torch(q, k, v, a, b, g, layer.A_log, layer.dt_bias, layer.o_norm.weight, state,
                            shape.head_dim ** -0.5, layer.o_norm.eps, shape.v_silu)
    y = F.linear(core, layer.o_proj.weight, layer.o_proj.bias)
    return add_rms_norm_torch(h, y.reshape(h.shape), w1, eps1)


def new_arrivals(rows: int, device) -> torch.Tensor:
    """Each row's arrival counter (zeros; they only grow)."""
    return torch.zeros(rows, dtype=torch.int64, device=device)


if triton is not None:
    from tcal.token_step import token_step_normed

    @triton.jit
    def _o_columns(w_o, hd, j0, HID: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                   BJ: tl.constexpr):
        """W_o[j0:j0 + BJ, head hd's columns], [BJ, BD] (zeros outside)."""
        j = j0 + tl.arange(0, BJ)
        d = tl.arange(0, BD)
        return tl.load(w_o + j[:, None] * (H * D) + hd * D + d[None, :], mask=(j[:, None] < HID) & (d[None, :] < D), other=0)

    @triton.jit
    def _store_part(out, w, x, j0, HID: tl.constexpr, BJ: tl.constexpr):
        """out[j0:j0 + BJ] = w @ x in float32."""
        j = j0 + tl.arange(0, BJ)
        tl.store(out + j, tl.sum(w.to(tl.float32) * x[None, :], 1), mask=j < HID)

    @triton.jit
    def _gdn_tail_kernel(proj, A_log, dt_bias, o_norm_w, state, w_o, bias_o, partial, arrivals, h, w1, h2, n2,
                         stride_proj, eps1, scale, norm_eps,
                         Q: tl.constexpr, K_: tl.constexpr, V: tl.constexpr, A: tl.constexpr, B: tl.constexpr,
                         G: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, HID: tl.constexpr,
                         BH: tl.constexpr, BJ: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr,
                         V_SILU: tl.constexpr, PREFETCH: tl.constexpr, HAS_BIAS_O: tl.constexpr, HAS_W1: tl.constexpr):
        """Program (row n, head hd): the head's token step and its share of o_proj; the row's last program
        to arrive finishes the row (module docstring). With PREFETCH the head's o_proj columns (in up to
        three pieces along the output) are loaded before the token step, which their latency then hides
        behind (a first version that loaded them after it, 64 rows at a time, was slower than the three
        kernels it replaced); wider layers loop over BJ rows of them after it."""
        pid = tl.program_id(0).to(tl.int64)
        n = pid // H
        hd = pid % H
        dt = h2.dtype.element_ty
        if PREFETCH:
            wa = _o_columns(w_o, hd, 0, HID, H, D, BD, P0)
            wb = wa
            wc = wa
            if P1 > 0:
                wb = _o_columns(w_o, hd, P0, HID, H, D, BD, P1)
            if P2 > 0:
                wc = _o_columns(w_o, hd, P0 + P1, HID, H, D, BD, P2)
        core = token_step_normed(proj + Q, proj + K_, proj + V, proj + A, proj + B, proj + G, A_log, dt_bias,
                                 o_norm_w, state, n, hd, stride_proj, stride_proj, stride_proj, stride_proj,
                                 stride_proj, stride_proj, scale, norm_eps, H, D, BD, V_SILU, False, "")
        x = core.to(dt).to(tl.float32)  # the core output as the composed step hands it to o_proj
        out = partial + (n * H + hd) * HID
        if PREFETCH:
            _store_part(out, wa, x, 0, HID, P0)
            if P1 > 0:
                _store_part(out, wb, x, P0, HID, P1)
            if P2 > 0:
                _store_part(out, wc, x, P0 + P1, HID, P2)
        else:
            for j0 in range(0, HID, BJ):
                _store_part(out, _o_columns(w_o, hd, j0, HID, H, D, BD, BJ), x, j0, HID, BJ)
        tl.debug_barrier()  # every thread's partial is written before the arrival
        old = tl.atomic_add(arrivals + n, 1, sem="acq_rel")
        if old % H == H - 1:  # the row's last arrival: every partial of the row is written
            tl.debug_barrier()
            j = tl.arange(0, BH)
            inside = j < HID
            acc = tl.zeros([BH], dtype=tl.float32)
            for g in tl.static_range(H):  # head order, whichever program arrived last
                acc += tl.load(partial + (n * H + g) * HID + j, mask=inside, other=0, cache_modifier=".cg")
            if HAS_BIAS_O:
                acc += tl.load(bias_o + j, mask=inside, other=0).to(tl.float32)
            y = acc.to(dt).to(tl.float32)  # o_proj's output
            s = (tl.load(h + n * HID + j, mask=inside, other=0).to(tl.float32) + y).to(dt)
            tl.store(h2 + n * HID + j, s, mask=inside)
            sf = s.to(tl.float32)
            normed = sf * tl.rsqrt(tl.sum(sf * sf) / HID + eps1)
            if HAS_W1:
                normed = normed * tl.load(w1 + j, mask=inside, other=0).to(tl.float32)
            tl.store(n2 + n * HID + j, normed.to(dt), mask=inside)


def tail_takes(rows: int, shape: BlockShape) -> bool:
    """Whether a step of `rows` rows through a layer of `shape` (one the token step already takes, on CUDA
    with Triton) runs the kernel: switched on, at most MAX_ROWS rows, a row of the output in one program."""
    return rows <= MAX_ROWS and shape.hidden <= MAX_HIDDEN and tail_enabled()


def launch_form(hidden: int, head_dim: int, prefetch: bool | None = None,
                registers: int | str | None = "auto") -> tuple[bool, int | None]:
    """(prefetch, register cap) of a launch: o_proj's columns fetched before the token step where the head's
    slice is at most PREFETCHED weights, and only that form capped at REGISTERS; explicit values are kept."""
    if prefetch is None:
        prefetch = sum(pieces(hidden)) * (1 << (head_dim - 1).bit_length()) <= PREFETCHED  # the padded head
    if registers == "auto":
        registers = REGISTERS if prefetch else None
    return prefetch, registers


def gdn_tail_triton(proj, shape: BlockShape, layer, state, h, w1, eps1: float, arrivals: torch.Tensor,
                    prefetch: bool | None = None, warps: int = NUM_WARPS, registers: int | str | None = "auto"):
    """The kernel: (h2, n2) shaped like h ([B, 1, hidden] or [B, hidden]) from the fused input projection's
    output `proj` (q, k, v, a, b, g at shape.offsets, one decay input per head), the layer's parameters and its
    float32 state [B, H, D, D] (written in place). `arrivals`: new_arrivals(B or more), kept between calls.
    `prefetch` (None: where the slice is at most PREFETCHED weights), `warps` and `registers` (a thread's cap;
    None: the compiler's choice; "auto": REGISTERS where the columns are prefetched): the launch's form, which
    bench/kernel_floors.py times side by side."""
    if triton is None:
        raise RuntimeError("gdn_tail_triton needs Triton; use gdn_tail_torch.")
    rows, heads, dim = state.shape[:3]
    hidden = h.shape[-1]
    proj2 = proj.reshape(rows, -1)
    h_rows = h.reshape(rows, hidden).contiguous()
    h2, n2 = torch.empty_like(h_rows), torch.empty_like(h_rows)
    partial = torch.empty(rows, heads, hidden, dtype=torch.float32, device=h.device)
    o = layer.o_proj
    q, k, v, a, b, g = shape.offsets
    bd = triton.next_power_of_2(dim)
    parts = pieces(hidden)
    prefetch, registers = launch_form(hidden, dim, prefetch, registers)
    _gdn_tail_kernel[(rows * heads,)](
        proj2, layer.A_log, layer.dt_bias, layer.o_norm.weight, state, o.weight,
        o.bias if o.bias is not None else o.weight, partial, arrivals, h_rows, w1 if w1 is not None else h_rows, h2, n2,
        proj2.stride(0), float(eps1), float(dim ** -0.5), float(layer.o_norm.eps),
        Q=q, K_=k, V=v, A=a, B=b, G=g, H=heads, D=dim, BD=bd, HID=hidden, BH=triton.next_power_of_2(hidden),
        BJ=max(16, 4096 // bd), **dict(zip(("P0", "P1", "P2"), parts)), V_SILU=shape.v_silu,
        PREFETCH=prefetch,
        HAS_BIAS_O=o.bias is not None, HAS_W1=w1 is not None, num_warps=warps, maxnreg=registers,
    )
    return h2.reshape(h.shape), n2.reshape(h.shape)
