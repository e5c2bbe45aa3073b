"""One decoded token of a GatedDeltaNet without a short convolution, from its input projections to
the gated-normed core output, with the recurrent state [B, H, Dk, Dv] (float32) updated in place:

    q, k = l2norm(silu(q_raw)), l2norm(silu(k_raw));  v = act(v_raw)
    beta = sigmoid(b_raw);  g = -exp(A_log) * softplus(a_raw + dt_bias)
    S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T (scale q)
    out = o * rsqrt(mean(o^2) + eps) * norm_weight * silu(gate)

The decay is one per head (GDN: a_raw [B, H], dt_bias [H]) or one per key channel (KDA's recurrence,
tcal.mixers.kda: a_raw [B, H*D], its low-rank gate already projected up, dt_bias [H*D]); the same
kernel takes both, so a KDA layer's token is one kernel too.

Why: a decode step is bound by kernel launches, not bytes. Composed from the layer's pieces and
compiled, a layer's token was seven kernels on the H200 (four fused elementwise ones, fla's
recurrent kernel, the state copy, the output norm); here it is one Triton kernel
(`token_step_triton`), one program per (row, head) holding the whole state tile, so the output norm
over the head sees the full value vector (a 75% hybrid's step: 418 kernels -> 286, bench/RESULTS.md,
twelfth session). `token_step_torch` is its reference: the same math in plain PyTorch, everywhere
(CPU, and CUDA with backend "torch"). Both compute in float32 throughout (the reference in the
state's dtype: float64 for checks); the layer's composition rounds q, k, v and o to the model's
dtype between its kernels, so in bf16 the two differ at that rounding.

Shapes: q, k, v, gate [B, 1, H*D] or [B, H*D]; b [B, 1, H] or [B, H]; a as b (or as q: a decay per
channel); each may be a slice of a wider projection output (last stride 1). The output has v's shape and dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .delta_inputs import L2NORM_EPS
from .kernels import OP_NAMESPACE

try:  # Triton is a CUDA-side extra: CPU installs do not have it
    import triton
    import triton.language as tl
except Exception:  # a broken install raises more than ImportError
    triton = None



def token_step_torch(q, k, v, a, b, gate, A_log, dt_bias, norm_weight, state, scale: float, norm_eps: float,
                     v_silu: bool) -> torch.Tensor:
    """The reference. `state` [B, H, D, D] (float32, or float64) is overwritten with the new state."""
    batch, heads = state.shape[:2]
    cdt = state.dtype  # float32 (float64 for reference checks)

    def per_head(x):
        return x.reshape(batch, heads, -1).to(cdt)

    q, k, vh, gate = (per_head(x) for x in (q, k, v, gate))
    q, k = F.silu(q), F.silu(k)
    q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + L2NORM_EPS)
    k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + L2NORM_EPS)
    vh = F.silu(vh) if v_silu else vh
    beta = b.reshape(batch, heads).to(cdt).sigmoid()
    if per_channel(a, state):
        g = -A_log.to(cdt).exp()[:, None] * F.softplus(per_head(a) + dt_bias.reshape(heads, -1).to(cdt))
        s = state * g.exp()[..., :, None]  # each key channel (the state's rows) its own decay
    else:
        g = -A_log.to(cdt).exp() * F.softplus(a.reshape(batch, heads).to(cdt) + dt_bias.to(cdt))
        s = state * g.exp()[..., None, None]
    delta = beta[..., None] * (vh - torch.einsum("bhk,bhkv->bhv", k, s))
    s = s + k[..., :, None] * delta[..., None, :]
    o = torch.einsum("bhk,bhkv->bhv", q * scale, s)
    state.copy_(s)
    normed = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + norm_eps) * norm_weight.to(cdt) * F.silu(gate)
    return normed.to(v.dtype).reshape(v.shape)


def per_channel(a: torch.Tensor, state: torch.Tensor) -> bool:
    """Whether `a` holds a decay input per key channel (KDA) rather than per head (GDN)."""
    batch, heads, dim = state.shape[:3]
    return dim > 1 and a.numel() == batch * heads * dim


if triton is not None:

    @triton.jit
    def token_step_normed(q, k, v, a, b, gate, A_log, dt_bias, norm_weight, state, n, h,
                          stride_q, stride_k, stride_v, stride_a, stride_b, stride_gate,
                          scale, norm_eps, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                          V_SILU: tl.constexpr, CHANNEL_DECAY: tl.constexpr, CACHE: tl.constexpr):
        """Row n, head h: its [D, D] state tile in registers, read once, written once; returns the
        gated-normed output, float32 [BD] (zeros past D), for the caller to store or use (inputs that
        other programs of the same launch wrote: CACHE ".cg" reads them from L2, past this SM's L1)."""
        held_s, bias, a_log, weight = token_step_held(A_log, dt_bias, norm_weight, state, n, h, H, D, BD, CHANNEL_DECAY)
        d = tl.arange(0, BD)
        inside = d < D
        vec = h * D + d
        b_q = tl.load(q + n * stride_q + vec, mask=inside, other=0, cache_modifier=CACHE).to(tl.float32)
        b_k = tl.load(k + n * stride_k + vec, mask=inside, other=0, cache_modifier=CACHE).to(tl.float32)
        b_v = tl.load(v + n * stride_v + vec, mask=inside, other=0, cache_modifier=CACHE).to(tl.float32)
        b_gate = tl.load(gate + n * stride_gate + vec, mask=inside, other=0, cache_modifier=CACHE).to(tl.float32)
        b_raw = tl.load(b + n * stride_b + h, cache_modifier=CACHE).to(tl.float32)
        if CHANNEL_DECAY:  # a decay per key channel: a [B, H*D], dt_bias [H*D]
            a_raw = tl.load(a + n * stride_a + vec, mask=inside, other=0, cache_modifier=CACHE).to(tl.float32)
        else:
            a_raw = tl.load(a + n * stride_a + h, cache_modifier=CACHE).to(tl.float32)
        return token_step_from_held(b_q, b_k, b_v, b_gate, b_raw, a_raw, held_s, bias, a_log, weight, state, n, h,
                                    scale, norm_eps, H, D, BD, V_SILU, CHANNEL_DECAY)

    @triton.jit
    def token_step_held(A_log, dt_bias, norm_weight, state, n, h, H: tl.constexpr, D: tl.constexpr,
                        BD: tl.constexpr, CHANNEL_DECAY: tl.constexpr):
        """What row n, head h's step reads besides its projections: the state tile [BD, BD], dt_bias (a scalar, or
        [BD] per channel), A_log and the output norm's weight [BD], float32. A caller that waits for the
        projections loads these first, so their latency (the state comes from HBM) passes during the wait."""
        d = tl.arange(0, BD)
        inside = d < D
        tile = state + (n * H + h) * D * D + d[:, None] * D + d[None, :]
        s = tl.load(tile, mask=inside[:, None] & inside[None, :], other=0)
        if CHANNEL_DECAY:
            bias = tl.load(dt_bias + h * D + d, mask=inside, other=0).to(tl.float32)
        else:
            bias = tl.load(dt_bias + h).to(tl.float32)
        a_log = tl.load(A_log + h).to(tl.float32)
        weight = tl.load(norm_weight + d, mask=inside, other=0).to(tl.float32)
        return s, bias, a_log, weight

    @triton.jit
    def token_step_from_held(b_q, b_k, b_v, b_gate, b_raw, a_raw, s, bias, a_log, weight, state, n, h, scale,
                             norm_eps, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, V_SILU: tl.constexpr,
                             CHANNEL_DECAY: tl.constexpr):
        """The step from its projections and token_step_held's values; the new state tile is stored in place."""
        d = tl.arange(0, BD)
        inside = d < D
        b_q = b_q * tl.sigmoid(b_q)
        b_k = b_k * tl.sigmoid(b_k)
        if V_SILU:
            b_v = b_v * tl.sigmoid(b_v)
        b_beta = tl.sigmoid(b_raw)
        x = a_raw + bias
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        decay = tl.exp(-tl.exp(a_log) * softplus)
        # Every reduction the output needs, at one level (they read only the loads): with the decayed state
        # S' = decay S, delta = beta (v - S'^T k) and o = (S' + k delta^T)^T q = S'^T q + (k.q) delta, so
        # the output waits for one round of sums, not three (S'^T k, then the update, then the new S'^T q);
        # q and k are normalised after the sums (scalars), as the reference normalises them before.
        rk = 1 / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
        rq = scale / tl.sqrt(tl.sum(b_q * b_q) + 1e-6)
        qk = tl.sum(b_q * b_k) * rq * rk
        k_decayed = b_k * decay
        q_decayed = b_q * decay
        delta = b_beta * (b_v - tl.sum(s * k_decayed[:, None], 0) * rk)
        o = tl.sum(s * q_decayed[:, None], 0) * rq + qk * delta
        if CHANNEL_DECAY:
            s = s * decay[:, None]
        else:
            s = s * decay
        s += (b_k * rk)[:, None] * delta[None, :]
        tl.store(state + (n * H + h) * D * D + d[:, None] * D + d[None, :], s, mask=inside[:, None] & inside[None, :])
        rms = tl.sqrt(tl.sum(o * o) / D + norm_eps)
        return o / rms * weight * (b_gate * tl.sigmoid(b_gate))

    @triton.jit
    def token_step_tile(q, k, v, a, b, gate, A_log, dt_bias, norm_weight, state, out, n, h,
                        stride_q, stride_k, stride_v, stride_a, stride_b, stride_gate, stride_out,
                        scale, norm_eps, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                        V_SILU: tl.constexpr, CHANNEL_DECAY: tl.constexpr, CACHE: tl.constexpr):
        """Row n, head h: token_step_normed, stored to out (this kernel's body, and one phase of
        surgery.decode.gdn_block's layer kernel)."""
        normed = token_step_normed(q, k, v, a, b, gate, A_log, dt_bias, norm_weight, state, n, h,
                                   stride_q, stride_k, stride_v, stride_a, stride_b, stride_gate,
                                   scale, norm_eps, H, D, BD, V_SILU, CHANNEL_DECAY, CACHE)
        d = tl.arange(0, BD)
        tl.store(out + n * stride_out + h * D + d, normed.to(out.dtype.element_ty), mask=d < D)

    @triton.jit
    def _token_step_kernel(q, k, v, a, b, gate, A_log, dt_bias, norm_weight, state, out,
                           stride_q, stride_k, stride_v, stride_a, stride_b, stride_gate, stride_out,
                           scale, norm_eps, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                           V_SILU: tl.constexpr, CHANNEL_DECAY: tl.constexpr):
        """Program (row n, head h): token_step_tile."""
        pid = tl.program_id(0).to(tl.int64)
        token_step_tile(q, k, v, a, b, gate, A_log, dt_bias, norm_weight, state, out, pid // H, pid % H,
                        stride_q, stride_k, stride_v, stride_a, stride_b, stride_gate, stride_out,
                        scale, norm_eps, H, D, BD, V_SILU, CHANNEL_DECAY, "")


def _rows(x: torch.Tensor, batch: int) -> torch.Tensor:
    """x as [B, N] with unit last stride (a slice of a projection output stays a view)."""
    x = x.reshape(batch, -1)
    return x if x.stride(-1) == 1 else x.contiguous()


def token_step_triton(q, k, v, a, b, gate, A_log, dt_bias, norm_weight, state, scale: float, norm_eps: float,
                      v_silu: bool) -> torch.Tensor:
    """The Triton kernel (CUDA tensors; or CPU ones under TRITON_INTERPRET=1, which is how the CPU
    tests check it). `state` must be float32 and contiguous: it is written in place."""
    if triton is None:
        raise RuntimeError("token_step_triton needs Triton; use token_step_torch.")
    batch, heads, dim = state.shape[:3]
    if state.dtype != torch.float32 or not state.is_contiguous() or state.shape[3] != dim:
        raise ValueError(f"the state must be a contiguous float32 [B, H, D, D] tensor, got {state.dtype} {tuple(state.shape)}")
    rows = [_rows(x, batch) for x in (q, k, v, a, b, gate)]
    out = torch.empty(batch, heads * dim, dtype=v.dtype, device=v.device)
    _token_step_kernel[(batch * heads,)](
        *rows, A_log, dt_bias, norm_weight, state, out, *(x.stride(0) for x in rows), out.stride(0),
        float(scale), float(norm_eps), H=heads, D=dim, BD=triton.next_power_of_2(dim), V_SILU=v_silu,
        CHANNEL_DECAY=per_channel(a, state), num_warps=4 if dim > 32 else 1,
    )
    return out.reshape(v.shape)


# The kernel holds a head's whole [D, D] float32 state in one program's registers: 128 x 128 is
# 64 KB over 4 warps. Gemma's 256-wide heads would be 256 KB, far past what a program can hold.
MAX_TRITON_HEAD_DIM = 128


def token_step_fits(head_dim: int, device_type: str, backend: str) -> bool:
    """Whether a layer's decoded token should take this step: everywhere the reference runs (CPU,
    or backend "torch"), and on CUDA where the Triton kernel can hold the state; else the layer
    composes its step from its pieces (fla's recurrent kernel among them) as before."""
    return device_type != "cuda" or backend == "torch" or _triton_runs(head_dim, device_type, backend)


def _triton_runs(head_dim: int, device_type: str, backend: str) -> bool:
    """Whether the Triton kernel (rather than the reference) runs this head: one rule for
    token_step_fits and gdn_token_step."""
    return device_type == "cuda" and backend != "torch" and triton is not None and head_dim <= MAX_TRITON_HEAD_DIM


def _dispatch(q, k, v, a, b, gate, A_log, dt_bias, norm_weight, state, scale, norm_eps, v_silu, use_triton):
    run = token_step_triton if use_triton else token_step_torch
    return run(q, k, v, a, b, gate, A_log, dt_bias, norm_weight, state, scale, norm_eps, v_silu)


# Any input layout will do (the launcher reads each row through its own stride): without this,
# inductor copied the four wide projection slices into fresh buffers at batch 16 on the H200
# (its GEMM output rows are padded there, so the slices' strides differ from the traced ones).
def _flexible_op(name: str, mutates_args):
    """torch.library.custom_op with the flexible_layout tag (where this torch takes tags)."""
    try:
        return torch.library.custom_op(name, mutates_args=mutates_args, tags=(torch.Tag.flexible_layout,))
    except (TypeError, AttributeError):
        return torch.library.custom_op(name, mutates_args=mutates_args)


@_flexible_op(f"{OP_NAMESPACE}::gdn_token_step", mutates_args=("state",))
def gdn_token_step_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      gate: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor,
                      state: torch.Tensor, scale: float, norm_eps: float, v_silu: bool, use_triton: bool) -> torch.Tensor:
    """The token step as one opaque op that writes `state` (what torch.compile sees, so a compiled
    decode step keeps the kernel and updates the state without a copy)."""
    return _dispatch(q, k, v, a, b, gate, A_log, dt_bias, norm_weight, state, scale, norm_eps, v_silu, use_triton)


@gdn_token_step_op.register_fake
def _(q, k, v, a, b, gate, A_log, dt_bias, norm_weight, state, scale, norm_eps, v_silu, use_triton):
    return v.new_empty(v.shape)


def gdn_token_step(q, k, v, a, b, gate, A_log, dt_bias, norm_weight, state, scale: float, norm_eps: float,
                   v_silu: bool, backend: str = "auto") -> torch.Tensor:
    """The token step. Backend "torch" is the reference; otherwise the Triton kernel runs on CUDA
    tensors with a float32 state and heads of at most MAX_TRITON_HEAD_DIM when Triton imports
    (otherwise: the reference). Under torch.compile, the custom op."""
    use_triton = state.dtype == torch.float32 and _triton_runs(state.shape[2], state.device.type, backend)
    if torch.compiler.is_compiling():
        return gdn_token_step_op(q, k, v, a, b, gate, A_log, dt_bias, norm_weight, state, float(scale),
                                 float(norm_eps), v_silu, use_triton)
    return _dispatch(q, k, v, a, b, gate, A_log, dt_bias, norm_weight, state, scale, norm_eps, v_silu, use_triton)
