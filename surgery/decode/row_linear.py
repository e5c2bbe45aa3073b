"""A linear over a decode step's few rows (1-16) as one Triton kernel, with F.linear beside it as the reference.

At one token per row a step's matmuls read each weight once and are bound by latency: cuBLAS's kernels
for 16 x 576 @ 576 x 3,072 and the like took 3.0-5.1 us each (weights from HBM, 50 in a CUDA graph),
and they are 120 of a SmolLM2 step's kernels. One program per BN output columns, the rows padded to 16
for tl.dot, the reduction in float32 and one rounding (as cuBLAS), took 0.35-0.83 us less a call on the
H200 at 1, 8 and 16 rows over every SmolLM2 shape (bench/RESULTS.md, forty-fourth session; the
constants below are that probe's best per shape). Outside the measured widths (K <= MAX_K, N <= MAX_N),
above MAX_ROWS rows, off CUDA or in another dtype, row_linear is F.linear itself. `fuse_row_linears`
routes a static decode step's aten.linear calls through it; SWITCH=off keeps cuBLAS."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from tcal.switches import enabled

from ..core.rewrite import call_in_place_of, rewrite_matches
from .fused_linears import LINEAR

try:  # Triton is a CUDA-side extra: CPU installs do not have it
    import triton
    import triton.language as tl
except Exception:  # a broken install raises more than ImportError
    triton = None

SWITCH = "SURGERY_ROW_LINEAR"  # "off": a decode step's linears stay cuBLAS's
MAX_ROWS = 16  # tl.dot's smallest tile: the rows are padded to it
MAX_K, MAX_N = 1536, 3072  # the widest input and output measured (SmolLM2's down and fused gate/up)


def launch_config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BN, BK, warps, stages) for an [n, k] weight: the probe's best (H200, 16 rows, us a call:
    960 x 576 2.96 vs cuBLAS 3.33, 576 x 576 2.68 vs 3.03, 3,072 x 576 3.62 vs 4.11, 2,368 x 576 3.48 vs
    3.90, 576 x 1,536 4.55 vs 5.06). A long reduction takes narrow column tiles (more programs to share it)."""
    if k > 1024:
        return 16, 256, 4, 4
    if n >= 2048:
        return 32, 64, 4, 6
    return 32, 128, 4, 4


if triton is not None:

    @triton.jit
    def _row_linear_kernel(x, w, bias, y, rows, n, stride_x, stride_w, K: tl.constexpr, HAS_BIAS: tl.constexpr,
                           BN: tl.constexpr, BK: tl.constexpr):
        """Program j: columns [j * BN, (j + 1) * BN) of y = x @ w.T (+ bias) for all (<= 16) rows."""
        r = tl.arange(0, 16)
        c = tl.program_id(0) * BN + tl.arange(0, BN)
        kk = tl.arange(0, BK)
        acc = tl.zeros((16, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            at = k0 + kk
            a = tl.load(x + r[:, None] * stride_x + at[None, :], mask=(r < rows)[:, None] & (at < K)[None, :], other=0)
            b = tl.load(w + c[None, :] * stride_w + at[:, None], mask=(c < n)[None, :] & (at < K)[:, None], other=0)
            acc += tl.dot(a, b)
        if HAS_BIAS:
            acc += tl.load(bias + c, mask=c < n, other=0).to(tl.float32)[None, :]
        tl.store(y + r[:, None] * n + c[None, :], acc.to(y.dtype.element_ty), mask=(r < rows)[:, None] & (c < n)[None, :])


def row_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton kernel: x [..., K] with at most MAX_ROWS rows, weight [N, K] with unit last stride."""
    if triton is None:
        raise RuntimeError("row_linear_triton needs Triton; use F.linear.")
    n, k = weight.shape
    flat = x.reshape(-1, k)
    flat = flat if flat.stride(-1) == 1 else flat.contiguous()
    if flat.shape[0] > MAX_ROWS or weight.stride(-1) != 1:
        raise ValueError(f"row_linear_triton takes at most {MAX_ROWS} rows and a weight with unit last stride; "
                         f"got {flat.shape[0]} rows, weight strides {weight.stride()}.")
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    if y.numel():
        bn, bk, warps, stages = launch_config(n, k)
        _row_linear_kernel[(triton.cdiv(n, bn),)](flat, weight, bias if bias is not None else weight, y, flat.shape[0], n,
                                                  flat.stride(0), weight.stride(0), K=k, HAS_BIAS=bias is not None, BN=bn,
                                                  BK=bk, num_warps=warps, num_stages=stages)
    return y


def kernel_takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the kernel runs this call: CUDA and Triton, fp16/bf16 throughout, at most MAX_ROWS rows, the
    weight within the measured widths with unit last stride, and the switch not off."""
    if triton is None or not x.is_cuda or x.dtype not in (torch.float16, torch.bfloat16) or weight.dim() != 2:
        return False
    n, k = weight.shape
    if weight.dtype != x.dtype or (bias is not None and (bias.dtype != x.dtype or bias.shape != (n,) or bias.stride(0) != 1)):
        return False
    if x.shape[-1] != k or weight.stride(-1) != 1 or not measured(x.numel() // max(k, 1), n, k):
        return False
    return enabled(SWITCH, True)


def measured(rows: int, n: int, k: int) -> bool:
    """Whether rows x [n, k] is within what the kernel was measured to win: 1-MAX_ROWS rows, K <= MAX_K, N <= MAX_N."""
    return 1 <= rows <= MAX_ROWS and 1 <= k <= MAX_K and 1 <= n <= MAX_N


def row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias): the kernel where kernel_takes says so, else F.linear itself."""
    if kernel_takes(x, weight, bias):
        return row_linear_triton(x, weight, bias)
    return F.linear(x, weight, bias)


def plain_linear(node: Node) -> tuple | None:
    """(x, weight, bias) where `node` is aten.linear, else None."""
    if node.op != "call_function" or node.target is not LINEAR or node.kwargs:
        return None
    return (node.args[0], node.args[1], node.args[2] if len(node.args) > 2 else None)


def fuse_row_linears(gm: GraphModule, in_place: bool = False) -> tuple[GraphModule, int]:
    """A fork of `gm` (gm itself with in_place) with every aten.linear as a row_linear call (which decides at
    each call), and how many; `gm` itself (and 0) when it has none."""
    return rewrite_matches(gm, plain_linear, lambda graph, node, args: call_in_place_of(node, row_linear, args), in_place)
