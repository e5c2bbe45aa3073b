"""A decode step's elementwise producer and the linear that reads it, as one kernel (references beside it).

At one token per row a decode step is bound by its number of kernels, not its bytes (bench/RESULTS.md:
332 kernels of ~3 us in a 1.14 ms step of SmolLM2's 75% hybrid at 64k). Each layer runs a residual add
with its RMSNorm (surgery.decode.residual_norm), then the matmul of the normalised rows (q/k/v fused, a
GDN layer's input projections fused, gate/up fused), and the SwiGLU product (surgery.decode.swiglu), then
the down projection: each producer is a launch whose only reader is the next matmul. Here the matmul's
program computes its input itself while it loads it:

  norm_linear(a, b, norm_w, eps, W, bias)  -> (h = a + b, rms_norm(h) * norm_w @ W^T + bias)
  swiglu_linear(gate, up, W, bias)         -> silu(gate) * up @ W^T + bias

On CUDA, for at most ROWS rows in 16-bit dtypes (a decode step's), one Triton kernel: each program owns
BLOCK_N output columns of every row, recomputes the rows' norms (the activations are a few KB, read from
L2), rounds the producer's output to the model's dtype exactly where the two-kernel form rounds it, and
accumulates in float32 on tensor cores; program 0 also writes h. Anywhere else, the two calls themselves
(so the CPU and long prefills keep their numbers). `fuse_prologue_linears` rewrites a graph's pairs."""
from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from ..core.rewrite import call_in_place_of
from .fused_norms import is_call
from .residual_norm import add_rms_norm
from .swiglu import rows_of, silu_mul

try:  # Triton is a CUDA-side extra: CPU installs do not have it
    import triton
    import triton.language as tl
except Exception:  # a broken install raises more than ImportError
    triton = None

LINEAR = torch.ops.aten.linear.default
ROWS = 16  # one tensor-core tile of rows: a decode step's batch; more rows keep the two calls
BLOCK_K = 64
# The largest weight fused (bytes). A model's head (SmolLM2: 49,152 x 576, 57 MB) is a long bandwidth-bound
# GEMV that cuBLAS runs near its bytes, and one launch saved there is nothing next to it.
MAX_WEIGHT_BYTES = 16 << 20
DTYPES = (torch.bfloat16, torch.float16)


def norm_linear_reference(a, b, norm_weight, eps: float, weight, bias):
    """The two calls: (h, its RMSNorm) as add_rms_norm, then the linear."""
    h, normed = add_rms_norm(a, b, norm_weight, eps)
    return h, F.linear(normed, weight, bias)


def swiglu_linear_reference(gate, up, weight, bias):
    return F.linear(silu_mul(gate, up), weight, bias)


if triton is not None:

    @triton.jit
    def _prologue_linear_kernel(a, b, nw, w, bias, h_out, y, rows, n, k, stride_a, stride_b, stride_w, eps,
                                SWIGLU: tl.constexpr, HAS_NW: tl.constexpr, HAS_BIAS: tl.constexpr,
                                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """Program p: columns [p * BN, (p + 1) * BN) of y for every row. The norm: a first pass over the
        rows' h = a + b (rounded to the dtype, as the add is; program 0 stores it) for their mean squares,
        a second that normalises each BK slice as the matmul takes it."""
        pid = tl.program_id(0)
        r = tl.arange(0, BM)
        c = pid * BN + tl.arange(0, BN)
        row_in, col_in = r < rows, c < n
        rstd = tl.zeros([BM], dtype=tl.float32)
        if not SWIGLU:
            squares = tl.zeros([BM], dtype=tl.float32)
            for k0 in range(0, k, BK):
                d = k0 + tl.arange(0, BK)
                inside = row_in[:, None] & (d < k)[None, :]
                x = tl.load(a + r[:, None] * stride_a + d[None, :], mask=inside, other=0).to(tl.float32)
                x += tl.load(b + r[:, None] * stride_b + d[None, :], mask=inside, other=0).to(tl.float32)
                h = x.to(h_out.dtype.element_ty)
                if pid == 0:
                    tl.store(h_out + r[:, None] * k + d[None, :], h, mask=inside)
                hf = h.to(tl.float32)
                squares += tl.sum(hf * hf, 1)
            rstd = tl.rsqrt(squares / k + eps)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, k, BK):
            d = k0 + tl.arange(0, BK)
            inside = row_in[:, None] & (d < k)[None, :]
            x = tl.load(a + r[:, None] * stride_a + d[None, :], mask=inside, other=0).to(tl.float32)
            second = tl.load(b + r[:, None] * stride_b + d[None, :], mask=inside, other=0).to(tl.float32)
            if SWIGLU:
                x = x * tl.sigmoid(x) * second
            else:
                x = (x + second).to(h_out.dtype.element_ty).to(tl.float32) * rstd[:, None]
                if HAS_NW:
                    x = x * tl.load(nw + d, mask=d < k, other=0).to(tl.float32)[None, :]
            wt = tl.load(w + c[:, None] * stride_w + d[None, :], mask=col_in[:, None] & (d < k)[None, :], other=0)
            acc = tl.dot(x.to(wt.dtype), tl.trans(wt), acc)
        if HAS_BIAS:
            acc += tl.load(bias + c, mask=col_in, other=0).to(tl.float32)[None, :]
        tl.store(y + r[:, None] * n + c[None, :], acc.to(y.dtype.element_ty), mask=row_in[:, None] & col_in[None, :])


def _block_n(n: int) -> int:
    """Columns per program: enough programs to spread the weight's rows over the SMs (an H200 has 132)."""
    return 16 if n <= 2048 else 32 if n <= 8192 else 64


def prologue_linear_triton(a, b, norm_weight, eps: float, weight, bias, swiglu: bool, config: tuple | None = None):
    """The kernel: (h or None, y) for a, b [..., K] (row strides of their own, last stride 1) of at most
    ROWS rows, weight [N, K] (last stride 1), of one 16-bit dtype. config: (BLOCK_N, BLOCK_K, warps,
    stages) instead of the defaults (bench/speed.py's sweep)."""
    if triton is None:
        raise RuntimeError("prologue_linear_triton needs Triton; use the references.")
    width, n = a.shape[-1], weight.shape[0]
    ra, rb = rows_of(a), rows_of(b)
    y = torch.empty(*a.shape[:-1], n, dtype=a.dtype, device=a.device)
    h = None if swiglu else torch.empty(a.shape, dtype=a.dtype, device=a.device)
    if y.numel():
        block_n, block_k, warps, stages = config or (_block_n(n), BLOCK_K, 4, None)
        _prologue_linear_kernel[(triton.cdiv(n, block_n),)](
            ra, rb, norm_weight if norm_weight is not None else ra, weight, bias if bias is not None else weight,
            h if h is not None else y, y, ra.shape[0], n, width, ra.stride(0), rb.stride(0), weight.stride(0), float(eps),
            SWIGLU=swiglu, HAS_NW=norm_weight is not None, HAS_BIAS=bias is not None,
            BM=ROWS, BN=block_n, BK=block_k, num_warps=warps, **({} if stages is None else {"num_stages": stages}))
    return h, y


def kernel_takes(a, b, weight, bias, *others) -> bool:
    """Whether the kernel runs these (else the references do): CUDA and Triton, one 16-bit dtype, at most
    ROWS rows, a weight [N, K] of at most MAX_WEIGHT_BYTES with unit last stride."""
    tensors = [t for t in (a, b, weight, bias, *others) if t is not None]
    return (triton is not None and a.is_cuda and a.dtype in DTYPES and all(t.dtype == a.dtype for t in tensors)
            and a.shape == b.shape and a.dim() >= 1 and weight.dim() == 2 and weight.shape[1] == a.shape[-1]
            and weight.stride(1) == 1 and a.numel() // max(a.shape[-1], 1) <= ROWS
            and weight.numel() * weight.element_size() <= MAX_WEIGHT_BYTES
            and (bias is None or bias.shape == (weight.shape[0],)))


def norm_linear(a, b, norm_weight, eps: float, weight, bias):
    """(a + b, rms_norm(a + b) * norm_weight @ weight^T + bias): one kernel where kernel_takes, else the two calls."""
    if kernel_takes(a, b, weight, bias, norm_weight):
        return prologue_linear_triton(a, b, norm_weight, eps, weight, bias, swiglu=False)
    return norm_linear_reference(a, b, norm_weight, eps, weight, bias)


def swiglu_linear(gate, up, weight, bias):
    """silu(gate) * up @ weight^T + bias: one kernel where kernel_takes, else the two calls."""
    if kernel_takes(gate, up, weight, bias):
        return prologue_linear_triton(gate, up, None, 0.0, weight, bias, swiglu=True)[1]
    return swiglu_linear_reference(gate, up, weight, bias)


def _linear_over_attrs(node: Node):
    """(x, weight, bias) of an aten.linear whose weight and bias (if any) are module attributes, else None."""
    if not is_call(node, LINEAR):
        return None
    x, w = node.args[0], node.args[1]
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    if getattr(w, "op", None) != "get_attr" or (bias is not None and getattr(bias, "op", None) != "get_attr"):
        return None
    return x, w, bias


def _only_reader(x: Node, node: Node) -> bool:
    return isinstance(x, Node) and list(x.users) == [node]


def _attr_copy(graph, attr: Node | None) -> Node | None:
    return None if attr is None else graph.get_attr(attr.target)


def fuse_prologue_linears(gm: GraphModule) -> dict[str, int]:
    """Rewrite gm in place: each linear over module weights whose input is the normalised output of an
    add_rms_norm, or a silu_mul, read by nothing else, becomes norm_linear / swiglu_linear. Returns how
    many of each (the step keeps working where the kernel does not take a call: the references run)."""
    graph, counts = gm.graph, {"norm": 0, "swiglu": 0}
    for node in list(graph.nodes):
        found = _linear_over_attrs(node)
        if found is None:
            continue
        x, w, bias = found
        if _only_reader(x, node) and is_call(x, silu_mul) and len(x.args) == 2:
            call_in_place_of(node, swiglu_linear, (*x.args, w, bias))
            graph.erase_node(x)
            counts["swiglu"] += 1
        elif _only_reader(x, node) and is_call(x, operator.getitem) and x.args[1] == 1 and is_call(x.args[0], add_rms_norm):
            pair = x.args[0]
            with graph.inserting_after(pair):  # where the sum was: its readers may come before the linear
                weight, bias_copy = _attr_copy(graph, w), _attr_copy(graph, bias)
            with graph.inserting_after(bias_copy or weight):
                fused = graph.call_function(norm_linear, (*pair.args, weight, bias_copy))
            with graph.inserting_after(fused):
                y = graph.call_function(operator.getitem, (fused, 1))
            y.meta = dict(node.meta)
            node.replace_all_uses_with(y)
            graph.erase_node(node)
            graph.erase_node(x)
            for user in list(pair.users):  # the sum: getitem(pair, 0)
                user.args = (fused, *user.args[1:])
            graph.erase_node(pair)
            counts["norm"] += 1
    if any(counts.values()):
        graph.lint()
        gm.recompile()
    return counts
