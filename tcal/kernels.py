"""The gated delta rule: per head, with state S [Dv, Dk],

    S_t = exp(g_t) * S_{t-1}
    S_t = S_t + beta_t * (v_t - S_t k_t) k_t^T
    o_t = S_t (scale * q_t)

Shapes: q, k [B, T, H, Dk]; v [B, T, H, Dv]; g (log-space decay, <= 0) and beta (in (0, 1))
[B, T, H]. States cross the API as [B, H, Dk, Dv] (S transposed), the layout of fla's kernels
and of its naive reference, so states can be handed between backends.

Two pure-PyTorch paths (a chunked WY form for long inputs, a token loop for short ones) run
anywhere and are differentiable; on CUDA, fla's Triton kernels are used when they can be.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import re

import torch
import torch.nn.functional as F

from .chunk_inputs import chunk_inputs_takes
from .delta_inputs import Projections
from .gated_norm import normed
from .split_state import requested_splits, split_state_gated_delta_rule
from .state_pass import state_pass_config

# At or below this length the token loop is cheaper than building chunk matrices.
RECURRENT_MAX_T = 16
# fla's fused recurrent kernel is its fast path for short inputs, but it has no backward.
FLA_RECURRENT_MAX_T = 64
# fla 0.6.0 refuses the gated chunk backward on Hopper with Triton in [3.4.0, 3.7.1).
FLA_BACKWARD_MIN_TRITON = (3, 7, 1)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64 (for reference checks); everything else runs in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _default_scale(scale: float | None, head_k_dim: int) -> float:
    return head_k_dim**-0.5 if scale is None else scale


def _heads_first(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, T, H, ...] -> [B, H, T, ...] in the compute dtype."""
    return x.transpose(1, 2).to(dtype)


def _initial_state(initial_state, batch, heads, dk, dv, like: torch.Tensor) -> torch.Tensor:
    if initial_state is None:
        return like.new_zeros(batch, heads, dk, dv)
    return initial_state.to(like.dtype)


def recurrent_gated_delta_rule_torch(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False
):
    """Token-by-token recurrence: exact, cheap for decoding and short prompts, slow for long ones."""
    out_dtype = v.dtype
    cdt = _compute_dtype(q.dtype)
    batch, _, heads, dk = k.shape
    dv = v.shape[-1]
    q = _heads_first(q, cdt) * _default_scale(scale, dk)
    k, v, g, beta = (_heads_first(x, cdt) for x in (k, v, g, beta))
    state = _initial_state(initial_state, batch, heads, dk, dv, like=q)

    outputs = []
    for t in range(q.shape[2]):
        state = state * g[:, :, t].exp()[..., None, None]
        k_t = k[:, :, t]
        predicted = torch.einsum("bhk,bhkv->bhv", k_t, state)
        delta = beta[:, :, t, None] * (v[:, :, t] - predicted)
        state = state + k_t[..., :, None] * delta[..., None, :]
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], state))

    o = torch.stack(outputs, dim=1).to(out_dtype)
    return o, (state if output_final_state else None)


def _chunks(x: torch.Tensor, pad: int, chunk_size: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, T, H, D] -> [B, H, N, C, D], contiguous (copied once here, so no matmul copies it again),
    zero-padded at the end of time.

    Zero padding is inert: g = 0 keeps the state, beta = 0 and k = 0 write nothing."""
    x = x.to(dtype)
    if pad:
        x = F.pad(x, (0, 0, 0, 0, 0, pad))
    b, t, h, d = x.shape
    return x.view(b, t // chunk_size, chunk_size, h, d).permute(0, 3, 1, 2, 4).contiguous()


@functools.lru_cache(maxsize=None)
def _above_diagonal(chunk_size: int, device: torch.device) -> torch.Tensor:
    """The entries j > i of a chunk's [C, C] pair matrix (built once per size and device, never written)."""
    return torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=device).triu(1)


def _masked_exp(x: torch.Tensor, drop: torch.Tensor) -> torch.Tensor:
    """exp(x), 0 where drop; dropped entries never reach exp, so they cannot overflow."""
    return x.masked_fill(drop, float("-inf")).exp()


class UnitLowerInverse(torch.autograd.Function):
    """(I + A)^-1 for A [..., C, C] of which only the strictly lower triangle is read (the diagonal and
    above may hold anything). One triangular solve against I forward; the backward is two batched
    matmuls (dA = -T^T dT T^T, strictly lower) instead of the solve's own backward, another solve."""

    @staticmethod
    def forward(ctx, a: torch.Tensor) -> torch.Tensor:
        eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device).expand_as(a)
        inverse = torch.linalg.solve_triangular(a, eye, upper=False, unitriangular=True)
        ctx.save_for_backward(inverse)
        return inverse

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (inverse,) = ctx.saved_tensors
        transposed = inverse.mT
        return (transposed @ grad.to(inverse.dtype) @ transposed).tril_(-1).neg_()


def _cross_chunk(u, w, k_end, chunk_decay, state):
    """The state entering each chunk, and what each chunk writes: per chunk n (a Python loop over
    chunks, every op batched over B*H) written_n = U_n - Wk_n S_n, S_(n+1) = e^(G_C) S_n + K_end_n^T
    written_n. Inputs are [B*H, N, ...] in the compute dtype; returns both stacked [B*H, N, ...] and
    the final state.

    Autocast is off: baddbmm is on its bf16 list, and the state and each chunk's decay must stay in
    the compute dtype, or slow-decay heads lose their decay (0.999 rounds to 1 in bf16)."""
    before, written = [], []
    with torch.autocast(u.device.type, enabled=False):
        for u_n, w_n, k_n, decay_n in zip(u.unbind(1), w.unbind(1), k_end.mT.unbind(1), chunk_decay.unbind(1)):
            before.append(state)
            new = torch.baddbmm(u_n, w_n, state, alpha=-1)
            written.append(new)
            state = torch.baddbmm(state * decay_n, k_n, new)
    return torch.stack(before, dim=1), torch.stack(written, dim=1), state


def chunked_gated_delta_rule_torch(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, chunk_size=64
):
    """Chunked form: closed-form intra-chunk work, a Python loop only over chunks.

    Within a chunk (local cumulative decay G_i = g_1 + ... + g_i) the values written to the state
    solve a unit lower-triangular system (the UT transform of the WY representation):
        (I + A) W = beta * V - beta * e^G * K S0,  A_ij = beta_i e^(G_i - G_j) k_i.k_j  (j < i),
    so W = U - Wk S0 with U, Wk from one inverse T = (I + A)^-1 that does not depend on S0. Every
    exponent is G_i - G_j (j <= i), G_i or G_C - G_j: all <= 0, so strong decay underflows to 0
    rather than overflowing. Memory is O(T * (C + D)) per head.
    """
    out_dtype = v.dtype
    cdt = _compute_dtype(q.dtype)
    batch, seq_len, heads, dk = k.shape
    dv = v.shape[-1]
    pad = (-seq_len) % chunk_size
    scale = _default_scale(scale, dk)

    q, k, v = (_chunks(x, pad, chunk_size, cdt) for x in (q, k, v))
    g, beta = (_chunks(x.unsqueeze(-1), pad, chunk_size, cdt).squeeze(-1) for x in (g, beta))

    cum = g.cumsum(-1)  # [B, H, N, C]
    drop = _above_diagonal(chunk_size, q.device)
    pair_decay = _masked_exp(cum[..., :, None] - cum[..., None, :], drop)  # e^(G_i - G_j), j <= i
    cum_decay = cum.exp()[..., None]

    # A's diagonal (beta_i k_i.k_i) is never read: the inverse sees only the strict lower triangle.
    inverse = UnitLowerInverse.apply(k @ k.mT * (beta[..., None] * pair_decay))
    inverse_beta = inverse * beta[..., None, :]  # T diag(beta)
    u = inverse_beta @ v
    w = inverse_beta @ (k * cum_decay)

    tail = cum[..., -1:]
    k_end = k * (tail - cum).exp()[..., None]
    chunk_decay = tail.exp()[..., None]  # [B, H, N, 1, 1]
    state = _initial_state(initial_state, batch, heads, dk, dv, like=q).flatten(0, 1)
    states, written, state = _cross_chunk(
        *(x.to(cdt).flatten(0, 1) for x in (u, w, k_end, chunk_decay)), state
    )
    # o = scale * (e^G q S_n + scores written_n), the scale folded into the small factor and the matmul.
    scores = (q @ k.mT) * pair_decay
    from_state = (q * (cum_decay * scale)).flatten(0, 2) @ states.flatten(0, 1)
    o = torch.baddbmm(from_state, scores.flatten(0, 2), written.flatten(0, 1), alpha=scale)
    state = state.view(batch, heads, dk, dv)

    o = o.view(batch, heads, -1, chunk_size, dv).permute(0, 2, 3, 1, 4).reshape(batch, -1, heads, dv)
    return o[:, :seq_len].to(out_dtype), (state if output_final_state else None)


@functools.lru_cache(maxsize=None)
def fla_available() -> bool:
    """Whether fla's Triton kernels import here (they need triton, so never on CPU-only installs)."""
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except Exception:  # triton missing or broken raises more than ImportError
        return False
    try:  # shipped autotune winners (tcal/kernel_configs.py); an export's copy of this file has none
        importlib.import_module(f"{__package__}.kernel_configs").pin_tuned_configs()
    except ModuleNotFoundError:
        pass
    return True


def version_tuple(version: str) -> tuple[int, ...]:
    """'3.9.0' -> (3, 9, 0), '2.11.0+cu130' -> (2, 11, 0): versions compared as numbers ('3.10' follows '3.9')."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


@functools.lru_cache(maxsize=None)
def fla_backward_supported() -> bool:
    try:
        return version_tuple(importlib.metadata.version("triton")) >= FLA_BACKWARD_MIN_TRITON
    except importlib.metadata.PackageNotFoundError:
        return False


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _inference_route(q, k, v) -> tuple[str, object]:
    """Where fla's inference forward of these shapes goes: ("recurrent", None) for short calls, ("split", pieces)
    (tcal.split_state), ("one piece", launch config) (tcal.state_pass) or ("chunk", None) (fla's own forward)."""
    if q.shape[1] <= FLA_RECURRENT_MAX_T:
        return "recurrent", None
    splits = requested_splits(q.shape[0], v.shape[2], q.shape[1], q.device, max(k.shape[-1], v.shape[-1]))
    if splits > 1:  # few rows, many chunks: the state pass cut along the sequence
        return "split", splits
    config = state_pass_config(q.shape[0] * v.shape[2], k.shape[-1], v.shape[-1], q.device)
    return ("one piece", config) if config is not None else ("chunk", None)  # one piece: few rows x heads


def _fla_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, output_norm=None):
    """fla's kernels with g and beta precomputed and q, k already normalised (the output through
    output_norm when given: folded into the last kernel where tcal.chunk_states runs)."""
    from fla.ops.gated_delta_rule import (
        chunk_gated_delta_rule,
        fused_recurrent_gated_delta_rule,
    )

    options = dict(
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=False,
    )
    route, setting = _inference_route(q, k, v) if not _needs_grad(q, k, v, g, beta, initial_state) else ("chunk", None)
    if route == "recurrent":  # gk and gv sit between g and beta in this signature: pass by keyword
        o, state = fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, **options)
        return normed(o, output_norm), state
    if route != "chunk":
        splits, config = (setting, None) if route == "split" else (1, setting)
        return split_state_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, splits, config,
                                            output_norm=output_norm)
    o, state = chunk_gated_delta_rule(q, k, v, g, beta, **options)
    return normed(o, output_norm), state


def gated_delta_rule_from_projections(projections: Projections, scale=None, initial_state=None, output_final_state=False,
                                      backend="auto", output_norm=None):
    """gated_delta_rule on a GatedDeltaNet's projections (tcal.delta_inputs.Projections: inference, its inputs kernel
    takes them): the inputs formed inside the intra kernel's launch (tcal.chunk_inputs) where fla's one-piece path
    runs and SURGERY_CHUNK_INPUTS=on, else by tcal.delta_inputs' kernel, then gated_delta_rule."""
    p = projections
    scale = _default_scale(scale, p.q.shape[-1])
    if backend != "torch" and p.q.is_cuda and fla_available() and not torch.compiler.is_compiling():
        route, config = _inference_route(p.q, p.k, p.v)
        if route == "one piece" and chunk_inputs_takes(p.q, p.k, p.v, p.a, p.b):
            return split_state_gated_delta_rule(None, None, None, None, None, scale, initial_state, output_final_state, 1,
                                                config, output_norm=output_norm, projections=p)
    return gated_delta_rule(*p.prepared(), scale, initial_state, output_final_state, backend, output_norm=output_norm)


def _use_fla(q, k, v, g, beta, initial_state) -> bool:
    if not (q.is_cuda and fla_available()):
        return False
    return not _needs_grad(q, k, v, g, beta, initial_state) or fla_backward_supported()


def gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    backend="auto",
    chunk_size=64,
    output_norm=None,
):
    """Run the gated delta rule; returns (o [B, T, H, Dv], final state [B, H, Dk, Dv] or None).

    backend: "torch" (chunked, or the token loop for T <= 16), "fla" (fla's Triton kernels,
    which use their own chunk size of 64), or "auto" (fla on CUDA when it imports and, if a
    gradient is needed, when its backward is trustworthy on this Triton; else torch).
    output_norm (tcal.gated_norm.OutputNorm): o comes back through it, inside the last kernel
    where that kernel can apply it (tcal.chunk_states), else by its apply."""
    scale = _default_scale(scale, q.shape[-1])
    if torch.compiler.is_compiling():  # one opaque op: dynamo neither traces fla nor breaks at its checks
        o, state = compiled_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, backend, chunk_size)
        return normed(o, output_norm), state
    if backend == "auto":
        backend = "fla" if _use_fla(q, k, v, g, beta, initial_state) else "torch"
    if backend == "fla":
        return _fla_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, output_norm)
    if backend != "torch":
        raise ValueError(f"unknown gated delta rule backend {backend!r}; use auto, torch or fla")
    if q.shape[1] <= RECURRENT_MAX_T:
        o, state = recurrent_gated_delta_rule_torch(q, k, v, g, beta, scale, initial_state, output_final_state)
    else:
        o, state = chunked_gated_delta_rule_torch(q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size)
    return normed(o, output_norm), state


def _resolved_backend(backend: str, q: torch.Tensor, training: bool) -> str:
    """The backend "auto" means for this call (the eager rule of _use_fla, with `training` known)."""
    if backend != "auto":
        return backend
    return "fla" if q.is_cuda and fla_available() and (not training or fla_backward_supported()) else "torch"


def _rule_outputs(q, k, v, g, beta, initial_state, scale, output_final_state, backend, chunk_size, training):
    """(o, final state or an empty tensor): a custom op returns tensors, never None, nor its inputs."""
    backend = _resolved_backend(backend, q, training)
    if backend == "fla" and training:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # the kernel whose backward is used

        o, state = chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                          output_final_state=output_final_state, use_qk_l2norm_in_kernel=False)
    else:
        o, state = gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, backend, chunk_size)
    if state is None or state is initial_state:
        state = q.new_empty(0, dtype=torch.float32) if state is None else state.clone()
    return o.contiguous(), state.contiguous()  # the strides the fake promises


# The dispatch key sets (included, excluded) outside any op, as this module is imported.
OUTSIDE_DISPATCH_KEYS = (torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set())


def _op_namespace() -> str:
    """The torch.library namespace of tcal's custom ops: "tcal" for the package, a name of its own
    for a copy (an exported model's modeling directory imports copies of these files). Freeing a
    custom op's definition deletes every registration under its name, so a copy that registered
    "tcal::..." again and was later garbage-collected took the package's ops with it (seen: opcheck
    failing after an export test had loaded a model)."""
    base = "tcal" if __package__ == "tcal" else "tcal_" + hashlib.sha1(str(__package__).encode()).hexdigest()[:12]
    namespace, n = base, 0
    while hasattr(getattr(torch.ops, namespace), "gated_delta_rule"):  # this very file executed again
        n += 1
        namespace = f"{base}_{n}"
    return namespace


OP_NAMESPACE = _op_namespace()


@torch.library.custom_op(f"{OP_NAMESPACE}::gated_delta_rule", mutates_args=())
def gated_delta_rule_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        initial_state: torch.Tensor | None, scale: float, output_final_state: bool, backend: str,
                        chunk_size: int, training: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """gated_delta_rule as one opaque op (what torch.compile sees): the eager kernels run inside it."""
    return _rule_outputs(q, k, v, g, beta, initial_state, scale, output_final_state, backend, chunk_size, training)


def _state_like(q: torch.Tensor, v: torch.Tensor, output_final_state: bool) -> torch.Tensor:
    if not output_final_state:
        return q.new_empty(0, dtype=torch.float32)
    b, _, h, dk = q.shape
    return q.new_empty(b, h, dk, v.shape[-1], dtype=_compute_dtype(q.dtype))


@gated_delta_rule_op.register_fake
def _(q, k, v, g, beta, initial_state, scale, output_final_state, backend, chunk_size, training):
    return v.new_empty(*q.shape[:3], v.shape[-1]), _state_like(q, v, output_final_state)


@torch.library.custom_op(f"{OP_NAMESPACE}::gated_delta_rule_backward", mutates_args=())
def gated_delta_rule_backward_op(grad_o: torch.Tensor, grad_state: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                                 v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, initial_state: torch.Tensor | None,
                                 scale: float, output_final_state: bool, backend: str, chunk_size: int) -> list[torch.Tensor]:
    """Gradients w.r.t. q, k, v, g, beta and the initial state (empty when there is none): the forward
    is recomputed with autograd on (the torch kernels, or fla's chunk kernel and its backward)."""
    inputs = [t.detach().requires_grad_() for t in (q, k, v, g, beta)]
    state_in = None if initial_state is None else initial_state.detach().requires_grad_()
    # An op's kernel runs below autograd (its dispatch keys excluded); the recomputation needs it back.
    with torch._C._ForceDispatchKeyGuard(*OUTSIDE_DISPATCH_KEYS), torch.enable_grad():
        o, state = _rule_outputs(*inputs, state_in, scale, output_final_state, backend, chunk_size, True)
        outputs, grads = [o], [grad_o]
        if grad_state.numel():
            outputs.append(state)
            grads.append(grad_state)
        wrt = inputs + ([state_in] if state_in is not None else [])
        found = torch.autograd.grad(outputs, wrt, grads, allow_unused=True)
    found = [torch.zeros_like(t, memory_format=torch.contiguous_format) if d is None else d.contiguous()
             for t, d in zip(wrt, found)]
    return found if state_in is not None else found + [q.new_empty(0)]


@gated_delta_rule_backward_op.register_fake
def _(grad_o, grad_state, q, k, v, g, beta, initial_state, scale, output_final_state, backend, chunk_size):
    like = [q, k, v, g, beta] + ([] if initial_state is None else [initial_state])
    grads = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in like]
    return grads if initial_state is not None else grads + [q.new_empty(0)]


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, initial_state, scale, output_final_state, backend, chunk_size, _ = inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state)
    ctx.options = (scale, output_final_state, backend, chunk_size)


def _backward(ctx, grad_o, grad_state):
    q, k, v, g, beta, initial_state = ctx.saved_tensors
    if grad_state is None:
        grad_state = q.new_empty(0)
    grads = gated_delta_rule_backward_op(grad_o, grad_state, q, k, v, g, beta, initial_state, *ctx.options)
    d_state = grads[5] if initial_state is not None else None
    return (*grads[:5], d_state, None, None, None, None, None)


gated_delta_rule_op.register_autograd(_backward, setup_context=_setup_context)


def compiled_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, backend, chunk_size):
    """gated_delta_rule under torch.compile: the custom op, its None state restored."""
    training = _needs_grad(q, k, v, g, beta, initial_state)
    o, state = gated_delta_rule_op(q, k, v, g, beta, initial_state, float(scale), output_final_state, backend,
                                   chunk_size, training)
    return o, (state if output_final_state else None)
