"""One query token's attention over a static KV cache, split over the keys (flash-decoding).

A static decode step (surgery.decode.static_step) attends with one query token over the whole
max-length cache under a position mask. Through SDPA that is a bool mask [1, S] built every step and
turned into an additive one inside SDPA; a mask rules flash attention out, so CUDA takes the
memory-efficient kernel (where the installed torch lets it take GQA) or the math one (K/V repeated per
query head, the scores materialised). With batch 1 and one token there are only (batch x heads) rows
of work, and a kernel that does not split the keys leaves most of the GPU idle: the measured ~70 us
per 64k layer against ~12 us of bytes (bench/speed.py --sections step_attention prints which backends take the call).

`step_attention_triton` launches programs per (batch row, KV head, key split): each reads its split's
keys and values once for all the query heads that share that KV head (GQA), keeps a running max, sum
and weighted sum in float32 over the valid slots only (the valid length is read from the device
index tensor, so the step stays CUDA-graph safe: no host sync, the same launch at every offset), and a
second small kernel combines the splits' partial softmaxes. `step_attention_torch` is the same
split-and-combine in torch; `step_attention_reference` the plain softmax in float64. Softcapping
(tanh) is covered; sliding-window rings and arbitrary head maps are not (`kernel_takes` says no and
the layer keeps SDPA)."""
from __future__ import annotations

import math

import torch

try:  # Triton is a CUDA-side extra: CPU installs do not have it
    import triton
    import triton.language as tl
except Exception:  # a broken install raises more than ImportError
    triton = None

# From the H200 sweep (`bench/speed.py --sections step_attention --step-attention-sweep`, bench/RESULTS.md,
# twenty-first session): at 64k, batch 1, the broadcast form at its best took 0.115 ms against the
# tensor-core form's 0.0195 (and SDPA's 0.0293); at batch 16 1.73 ms against 0.202 (SDPA 0.202).
DOT = True               # the products on tensor cores (query heads padded to 16) where the inputs allow
TENSOR_CORE = (128, 4)   # (keys per inner iteration, warps) of the tensor-core form
BROADCAST = (64, 4)      # the same for broadcast sums (float32 inputs, or widths under 16)
PROGRAMS = 4             # aim for this many programs per streaming multiprocessor
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def step_attention_reference(q, keys, values, index, *, scale: float, softcap: float | None) -> torch.Tensor:
    """float64 softmax attention of q [B, H, 1, D] over slots 0..index of keys/values [B, Hc, S, D]
    (query head h reads KV head h * Hc // H), after tanh softcapping when softcap is set."""
    n = int(index.reshape(-1)[0]) + 1
    group = q.shape[1] // keys.shape[1]
    k = keys[:, :, :n].double().repeat_interleave(group, dim=1)
    v = values[:, :, :n].double().repeat_interleave(group, dim=1)
    scores = q.double() @ k.transpose(-1, -2) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    return torch.softmax(scores, dim=-1) @ v


def splits_for(batch: int, kv_heads: int, size: int, programs: int, block: int | None = None) -> tuple[int, int]:
    """(number of key splits, keys per split, a multiple of `block` (keys per inner iteration; None:
    the broadcast form's)) so that about `programs` programs cover the cache: more splits only add
    partials for the combine to read."""
    block = block or BROADCAST[0]
    blocks = max(1, math.ceil(size / block))
    wanted = max(1, min(blocks, math.ceil(programs / max(1, batch * kv_heads))))
    per = math.ceil(blocks / wanted) * block
    return math.ceil(size / per), per


def step_attention_torch(q, keys, values, index, *, scale: float, softcap: float | None, programs: int = 132 * PROGRAMS):
    """The kernel's arithmetic in torch: per (row, KV head, split) the max, sum and weighted sum of the
    valid slots' float32 scores, then the splits combined; output [B, H, 1, Dv] in q's dtype."""
    batch, heads, _, width = q.shape
    kv_heads, size = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    count, per = splits_for(batch, kv_heads, size, programs)
    pad = count * per - size
    k = torch.nn.functional.pad(keys.float(), (0, 0, 0, pad)).view(batch, kv_heads, 1, count, per, width)
    v = torch.nn.functional.pad(values.float(), (0, 0, 0, pad)).view(batch, kv_heads, 1, count, per, values.shape[-1])
    qg = q.float().view(batch, kv_heads, group, 1, 1, width)
    scores = (qg * k).sum(-1) * scale                       # [B, Hc, G, splits, per]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    valid = torch.arange(count * per, device=q.device).view(count, per) <= index.reshape(-1)[0]
    scores = scores.masked_fill(~valid, float("-inf"))
    top = scores.amax(-1)                                   # -inf for a split past the valid length
    safe = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    p = torch.exp(scores - safe[..., None])
    total, acc = p.sum(-1), (p[..., None] * v).sum(-2)      # [B, Hc, G, splits], [.., Dv]
    best = top.amax(-1, keepdim=True)
    weight = torch.exp(top - best)                          # 0 for the empty splits
    out = (weight[..., None] * acc).sum(-2) / (weight * total).sum(-1)[..., None]
    return out.reshape(batch, heads, 1, values.shape[-1]).to(q.dtype)


def kernel_takes(q, keys, values, k_map=None, v_map=None) -> bool:
    """q [B, H, 1, D] and a grouped cache [B, Hc, S, D] (H a multiple of Hc, no head maps), one float
    dtype, unit last strides, head widths up to 256, on CUDA with Triton."""
    if triton is None or not q.is_cuda or k_map is not None or v_map is not None:
        return False
    if q.dim() != 4 or keys.dim() != 4 or values.dim() != 4 or q.shape[2] != 1:
        return False
    batch, heads, _, width = q.shape
    if keys.shape[:2] != values.shape[:2] or keys.shape[0] != batch or keys.shape[2] != values.shape[2]:
        return False
    if keys.shape[1] == 0 or heads % keys.shape[1] or keys.shape[3] != width or max(width, values.shape[3]) > 256:
        return False
    return q.dtype in DTYPES and keys.dtype == values.dtype == q.dtype and all(t.stride(-1) == 1 for t in (q, keys, values))


if triton is not None:

    @triton.jit
    def _split_kernel(q, k, v, index, m_out, l_out, acc_out, kv_heads, size, per, splits, scale, softcap,
                      sqb, sqh, skb, skh, skn, svb, svh, svn, GROUP: tl.constexpr, GP: tl.constexpr, DK: tl.constexpr,
                      DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BN: tl.constexpr, STEPS: tl.constexpr,
                      SOFTCAP: tl.constexpr, DOT: tl.constexpr):
        """Program (row b, KV head c, split s): the partial softmax of the GROUP query heads on KV head c
        over keys [s * per, (s + 1) * per) that are at or before the index; m, l, acc in float32. DOT:
        the two products on tensor cores (16-bit inputs, GP >= 16; the weights rounded to the input
        dtype as flash attention does), else as float32 broadcast sums."""
        bc, s = tl.program_id(0).to(tl.int64), tl.program_id(1)
        b, c = bc // kv_heads, bc % kv_heads
        g, dk, dv = tl.arange(0, GP), tl.arange(0, BK), tl.arange(0, BV)
        heads = c * GROUP + g
        qm = (g[:, None] < GROUP) & (dk[None, :] < DK)
        qraw = tl.load(q + b * sqb + heads[:, None] * sqh + dk[None, :], mask=qm, other=0)
        qv = qraw.to(tl.float32)
        valid = tl.minimum(tl.load(index).to(tl.int32) + 1, size)
        lo = s * per
        hi = tl.minimum(lo + per, valid)
        m = tl.full([GP], float("-inf"), tl.float32)
        l = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, BV], tl.float32)
        kb, vb = k + b * skb + c * skh, v + b * svb + c * svh
        for i in range(STEPS):  # a constant trip count, blocks past the valid length skipped
            start = lo + i * BN
            if start < hi:
                n = start + tl.arange(0, BN)
                inside = n < hi
                kt = tl.load(kb + n[:, None].to(tl.int64) * skn + dk[None, :], mask=inside[:, None] & (dk[None, :] < DK), other=0)
                if DOT:
                    sc = tl.dot(qraw, tl.trans(kt)) * scale   # [GP, BN], float32
                else:
                    sc = tl.sum(qv[:, None, :] * kt.to(tl.float32)[None, :, :], axis=2) * scale
                if SOFTCAP:
                    sc = softcap * (1.0 - 2.0 / (tl.exp(2.0 * sc / softcap) + 1.0))  # tanh, overflow-safe
                sc = tl.where(inside[None, :], sc, float("-inf"))
                new = tl.maximum(m, tl.max(sc, axis=1))
                alpha = tl.exp(m - new)
                p = tl.exp(sc - new[:, None])
                vt = tl.load(vb + n[:, None].to(tl.int64) * svn + dv[None, :], mask=inside[:, None] & (dv[None, :] < DV), other=0)
                if DOT:
                    acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
                else:
                    acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * vt.to(tl.float32)[None, :, :], axis=1)
                l = l * alpha + tl.sum(p, axis=1)
                m = new
        row = (b * kv_heads * GROUP + heads) * splits + s
        keep = g < GROUP
        tl.store(m_out + row, m, mask=keep)
        tl.store(l_out + row, l, mask=keep)
        tl.store(acc_out + row[:, None] * DV + dv[None, :], acc, mask=keep[:, None] & (dv[None, :] < DV))

    @triton.jit
    def _combine_kernel(m_in, l_in, acc_in, out, heads, splits, sob, soh, DV: tl.constexpr, BV: tl.constexpr,
                        BS: tl.constexpr):
        """Program (row b, head h): the splits' partial softmaxes combined (empty splits weigh 0)."""
        bh = tl.program_id(0).to(tl.int64)
        b, h = bh // heads, bh % heads
        s, dv = tl.arange(0, BS), tl.arange(0, BV)
        there = s < splits
        m = tl.load(m_in + bh * splits + s, mask=there, other=float("-inf"))
        l = tl.load(l_in + bh * splits + s, mask=there, other=0)
        best = tl.max(m, axis=0)
        w = tl.where(m > float("-inf"), tl.exp(m - best), 0.0)
        acc = tl.load(acc_in + (bh * splits + s)[:, None] * DV + dv[None, :], mask=there[:, None] & (dv[None, :] < DV), other=0)
        o = tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * l, axis=0)
        tl.store(out + b * sob + h * soh + dv, o.to(out.dtype.element_ty), mask=dv < DV)


def device_programs(device) -> int:
    """How many programs to aim for: PROGRAMS per streaming multiprocessor (132 SMs off CUDA)."""
    if device.type == "cuda":
        return PROGRAMS * torch.cuda.get_device_properties(device).multi_processor_count
    return PROGRAMS * 132


def step_attention_triton(q, keys, values, index, *, scale: float, softcap: float | None) -> torch.Tensor:
    """The two Triton kernels (inputs that kernel_takes, index a one-entry long tensor on q's
    device); output [B, H, 1, Dv] in q's dtype. Under torch.compile, the custom op around them."""
    if triton is None:
        raise RuntimeError("step_attention_triton needs Triton; use step_attention_torch.")
    if torch.compiler.is_compiling():
        return split_kv_attention_op(q, keys, values, index, float(scale), softcap)
    return launch(q, keys, values, index, scale, softcap)


def launch(q, keys, values, index, scale: float, softcap: float | None) -> torch.Tensor:
    """The split kernel over (row x KV head, split), then the combine over (row x head)."""
    batch, heads, _, width = q.shape
    kv_heads, size, dv = keys.shape[1], keys.shape[2], values.shape[3]
    group = heads // kv_heads
    dot = DOT and q.dtype != torch.float32 and min(width, dv) >= 16
    block, warps = TENSOR_CORE if dot else BROADCAST
    splits, per = splits_for(batch, kv_heads, size, device_programs(q.device), block)
    m = torch.empty(batch * heads * splits, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty(batch * heads * splits * dv, dtype=torch.float32, device=q.device)
    out = torch.empty(batch, heads, 1, dv, dtype=q.dtype, device=q.device)
    _split_kernel[(batch * kv_heads, splits)](
        q, keys, values, index, m, l, acc, kv_heads, size, per, splits, float(scale), float(softcap or 1.0),
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1),
        values.stride(2), GROUP=group, GP=max(16 if dot else 1, triton.next_power_of_2(group)), DK=width, DV=dv, BK=triton.next_power_of_2(width),
        BV=triton.next_power_of_2(dv), BN=block, STEPS=per // block, SOFTCAP=softcap is not None, DOT=dot, num_warps=warps)
    _combine_kernel[(batch * heads,)](m, l, acc, out, heads, splits, out.stride(0), out.stride(1), DV=dv,
                                      BV=triton.next_power_of_2(dv), BS=triton.next_power_of_2(splits), num_warps=4)
    return out


@torch.library.custom_op("surgery::split_kv_attention", mutates_args=())
def split_kv_attention_op(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, index: torch.Tensor, scale: float,
                          softcap: float | None) -> torch.Tensor:
    """The kernels as one opaque op (what torch.compile sees: a compiled static step keeps them)."""
    return launch(q, keys, values, index, scale, softcap)


@split_kv_attention_op.register_fake
def _(q, keys, values, index, scale, softcap):
    return q.new_empty(q.shape[0], q.shape[1], 1, values.shape[3])
