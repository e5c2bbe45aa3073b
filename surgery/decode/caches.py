"""The modules that live in a decode graph and carry state between calls: the shared position
offset (DecodeState) and the KV cache of each kept softmax-attention core (KVCacheAttention, with
`attend`, the attention it computes; CachePrep, how K/V become cache rows). The GDN layers' state
is surgery.decode.gdn_state; surgery.decode.plan finds where they all go in the graph."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import DecodeError
from .step_attention import kernel_takes, step_attention_triton


class DecodeState(nn.Module):
    """How many tokens the caches hold. The graph calls it two ways: on the input's length (an int)
    it returns the cache+new length; on a position tensor with `dim` it keeps the entries of the new
    tokens (the last length-offset along dim).

    Static steps (one token per row, every shape fixed, as a CUDA graph needs): `static_length` is
    the caches' capacity, every length-derived table is built at that length, and the new token's
    row is picked with `index`, a device tensor holding the offset, so nothing the step launches
    depends on a Python number that changes from step to step."""

    def __init__(self):
        super().__init__()
        self.offset = 0
        self.static_length: int | None = None
        self.index: torch.Tensor | None = None

    @property
    def static(self) -> bool:
        return self.static_length is not None

    def forward(self, x, dim: int | None = None):
        if dim is None:
            return x + self.offset if self.static_length is None else self.static_length
        if self.static_length is not None:
            return x.index_select(dim, self.index)
        return x.narrow(dim, self.offset, x.shape[dim] - self.offset)

    def extra_repr(self) -> str:
        return f"offset={self.offset}"


_INDEX_TENSORS: dict = {}


def _index_tensor(items: tuple, device) -> torch.Tensor:
    """A device tensor of head indices, made once: indexing with a Python list copies it to the
    device on every call, which a CUDA graph capture does not allow."""
    key = (items, str(device))
    if key not in _INDEX_TENSORS:
        _INDEX_TENSORS[key] = torch.tensor(items, dtype=torch.long, device=device)
    return _INDEX_TENSORS[key]


def attend(q, keys, values, allowed, *, scale: float, softcap: float | None, k_map, v_map, causal: bool = False):
    """Softmax attention of q [B, H, T, D] over keys/values [B, Hc, S, D] as cached.

    allowed [T, S] bool (None: every key); causal=True (T == S, a first prefill) means the plain
    causal mask, which SDPA's flash kernel applies without materialising it (a 64k-token prefill
    would otherwise build a 4 G-entry mask). k_map/v_map: the cache head each query head reads, None
    for the grouped layout h -> h*Hc//H that SDPA's enable_gqa does without materialising copies;
    with several query tokens K/V are expanded instead, since the kernels that take a mask or a
    causal flag do not all take enable_gqa (the fallback would build the whole score matrix)."""
    heads = q.shape[1]
    grouped = k_map is None and v_map is None and keys.shape[1] == values.shape[1]
    if softcap is None and grouped and q.shape[2] == 1:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, scale=scale, enable_gqa=keys.shape[1] != heads)
    keys, values = _expand(keys, k_map, heads), _expand(values, v_map, heads)
    if softcap is None:
        if causal:
            return F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, scale=scale)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if causal:
        allowed = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
    return torch.matmul(probs, values)


def _expand(x, head_map, heads: int):
    if head_map is None:
        return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)
    return x.index_select(1, _index_tensor(tuple(head_map), x.device))


@dataclass
class CachePrep:
    """How the K (or V) tensor reaching the attention call becomes cache rows [B, Hc, T, D]."""

    transposed: bool = False         # it arrives as [B, H, D, T] (eager K^T)
    select: tuple | None = None      # keep only these heads (copies of one KV head dropped)

    def __call__(self, x):
        if self.transposed:
            x = x.transpose(-1, -2)
        if self.select is not None:
            x = x.index_select(1, _index_tensor(tuple(self.select), x.device))
        return x


class KVCacheAttention(nn.Module):
    """One kept softmax-attention core with its KV cache.

    Full-attention layers keep a linear buffer [B, Hc, C, D] filled up to the offset (C = the capacity
    given to reset, doubled when exceeded: no per-step concatenation of the whole cache). Sliding-
    window layers keep a ring of at most `window` positions. The cache is as wide as the layer's KV
    heads (Hc), not its query heads."""

    def __init__(self, state: DecodeState, layer: int, *, k_prep: CachePrep, v_prep: CachePrep, k_map, v_map,
                 scale: float, softcap: float | None, window: int | None, out_dtype: torch.dtype, limit: int):
        super().__init__()
        self._state = (state,)  # shared with the graph's DecodeState; a tuple keeps it out of the module tree
        self.layer, self.k_prep, self.v_prep, self.k_map, self.v_map = layer, k_prep, v_prep, k_map, v_map
        self.scale, self.softcap, self.window, self.out_dtype, self.limit = scale, softcap, window, out_dtype, limit
        self.reset()

    def extra_repr(self) -> str:
        return f"layer={self.layer}, scale={self.scale:.4g}, softcap={self.softcap}, window={self.window}"

    def reset(self, batch: int | None = None, capacity: int | None = None) -> None:
        self.k_cache = self.v_cache = self.pos = None
        self.batch, self.capacity = batch, capacity
        self.__dict__.pop("_slot_ids", None)  # a compiled step would otherwise recompile for the old size

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k_cache, self.v_cache, self.pos) if t is not None)

    def forward(self, q, k, v):
        state = self._state[0]
        off = state.offset
        k, v = self.k_prep(k), self.v_prep(v)
        if self.batch is not None and k.shape[0] != self.batch:
            raise DecodeError(f"The decoder was reset for batch {self.batch} but got {k.shape[0]} rows.", "Call reset(batch_size) first.")
        if state.static:
            return self._static_step(q, k, v, state.index)
        if self.window is None:
            keys, values, allowed = self._linear(k, v, off)
        else:
            keys, values, allowed = self._ring(k, v, off)
        causal = off == 0 and self.window is None and k.shape[2] > 1  # a first prefill: plain causal
        out = attend(q, keys, values, None if causal else allowed, scale=self.scale, softcap=self.softcap,
                     k_map=self.k_map, v_map=self.v_map, causal=causal)
        return out.to(self.out_dtype)

    def fill(self, k, v) -> None:
        """A first prefill's K and V (as they reach the attention call, batch checked by the Decoder)
        written as forward writes them at offset 0, without the attention (surgery.decode.prefill)."""
        (self._linear if self.window is None else self._ring)(self.k_prep(k), self.v_prep(v), 0)

    def _static_step(self, q, k, v, index):
        """One token per row written at its slot through a device index and attention over the whole
        buffer under a position mask: the same kernels and shapes at every offset. The buffer was
        allocated at full capacity by the prefill (linear) or holds the ring (sliding window); a linear
        buffer on CUDA: split-KV kernels reading the valid length from the index, no mask (step_attention)."""
        size = self.k_cache.shape[2]
        slot = index if self.window is None else index.remainder(size)
        self.k_cache.index_copy_(2, slot, k)
        self.v_cache.index_copy_(2, slot, v)
        if self.window is None and kernel_takes(q, self.k_cache, self.v_cache, self.k_map, self.v_map):
            return step_attention_triton(q, self.k_cache, self.v_cache, index, scale=self.scale, softcap=self.softcap).to(self.out_dtype)
        if self.window is None:
            allowed = self._slots(size, index.device) <= index[:, None]
        else:
            self.pos.index_copy_(0, slot, index)
            allowed = (self.pos >= 0) & (self.pos <= index[:, None]) & (index[:, None] - self.pos < self.window)
        out = attend(q, self.k_cache, self.v_cache, allowed, scale=self.scale, softcap=self.softcap, k_map=self.k_map, v_map=self.v_map)
        return out.to(self.out_dtype)

    def static_ready(self, capacity: int) -> bool:
        """Whether the buffers can take static steps up to `capacity` tokens without growing."""
        if self.k_cache is None:
            return False
        if self.window is None:
            return self.k_cache.shape[2] >= capacity
        return self.pos is not None and self.k_cache.shape[2] == min(self.window, capacity)

    def _slots(self, size: int, device) -> torch.Tensor:
        cached = self.__dict__.get("_slot_ids")
        if cached is None or cached.shape[0] != size or cached.device != device:
            cached = torch.arange(size, device=device)
            self.__dict__["_slot_ids"] = cached
        return cached

    def _alloc(self, like_k, like_v, size: int):
        """Zeroed buffers: static steps attend over every slot under a mask, and a masked slot's
        weight of 0 times a NaN left in uninitialised memory would still be NaN."""
        b, h, _, d = like_k.shape
        k = like_k.new_zeros(b, h, size, d)
        v = like_v.new_zeros(b, like_v.shape[1], size, like_v.shape[3])
        return k, v

    def _linear(self, k, v, off: int):
        t = k.shape[2]
        need = off + t
        if self.k_cache is None or need > self.k_cache.shape[2]:
            size = max(need, self.capacity or 0) if self.k_cache is None else max(need, min(2 * self.k_cache.shape[2], self.limit))
            kc, vc = self._alloc(k, v, size)
            if self.k_cache is not None:
                kc[:, :, :off] = self.k_cache[:, :, :off]
                vc[:, :, :off] = self.v_cache[:, :, :off]
            self.k_cache, self.v_cache = kc, vc
        self.k_cache[:, :, off:need] = k
        self.v_cache[:, :, off:need] = v
        allowed = None
        if t > 1 and off > 0:  # (a first prefill is plain causal: attend's causal flag)
            q_pos = torch.arange(off, need, device=k.device)
            allowed = torch.arange(need, device=k.device)[None, :] <= q_pos[:, None]
        return self.k_cache[:, :, :need], self.v_cache[:, :, :need], allowed

    def _resize_ring(self, size: int, like_k, like_v) -> None:
        """A ring of `size` slots holding the last `size` positions seen (position p lives at p % size)."""
        kc, vc = self._alloc(like_k, like_v, size)
        pos = torch.full((size,), -1, dtype=torch.long, device=like_k.device)
        if self.k_cache is not None:
            valid = (self.pos >= 0).nonzero().squeeze(1)
            valid = valid[self.pos[valid].argsort()][-size:]
            slots = self.pos[valid] % size
            kc[:, :, slots] = self.k_cache[:, :, valid]
            vc[:, :, slots] = self.v_cache[:, :, valid]
            pos[slots] = self.pos[valid]
        self.k_cache, self.v_cache, self.pos = kc, vc, pos

    def _ring(self, k, v, off: int):
        w, t = self.window, k.shape[2]
        need = off + t
        size = self.k_cache.shape[2] if self.k_cache is not None else 0
        if size < min(w, need):
            grown = max(need, self.capacity or 0) if self.k_cache is None else max(need, 2 * size)
            self._resize_ring(min(w, grown), k, v)
            size = self.k_cache.shape[2]
        if t == 1:
            slot = off % size
            self.k_cache[:, :, slot] = k[:, :, 0]
            self.v_cache[:, :, slot] = v[:, :, 0]
            self.pos[slot] = off
            if need < size:  # not wrapped yet: positions 0..off sit in slots 0..off
                return self.k_cache[:, :, :need], self.v_cache[:, :, :need], None
            return self.k_cache, self.v_cache, None  # exactly the last `window` positions
        valid = (self.pos >= 0).nonzero().squeeze(1)
        keys = torch.cat([self.k_cache[:, :, valid], k], dim=2)  # a prefill: the ring, not the history
        values = torch.cat([self.v_cache[:, :, valid], v], dim=2)
        q_pos = torch.arange(off, need, device=k.device)
        k_pos = torch.cat([self.pos[valid], q_pos])
        allowed = (k_pos[None, :] <= q_pos[:, None]) & (q_pos[:, None] - k_pos[None, :] < w)
        n = min(t, size)
        slots = q_pos[-n:] % size
        self.k_cache[:, :, slots] = k[:, :, -n:]
        self.v_cache[:, :, slots] = v[:, :, -n:]
        self.pos[slots] = q_pos[-n:]
        return keys, values, allowed
