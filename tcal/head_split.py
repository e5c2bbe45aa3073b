"""A head-split layer: some KV heads of an attention layer (with the query heads that share them under
GQA) stay softmax attention, the others become one GatedDeltaNet over the converted query heads.

Why at KV-head granularity: a KV head is what the cache stores, so keeping a KV head and its query
group is what costs (and converting it is what saves) KV bytes. Why before the output projection: the
two groups' per-head contexts are concatenated back in the teacher's head order and the teacher's own
o_proj reads them, so the kept heads are exactly the teacher's.

The layer holds no graph knowledge: it is called in parts (select_q/k/v on the Q, K, V the teacher's
attention op receives, `kept` on the slices, `gdn` on the block's normed input, `merge` on both), which
is how a decoder gives the kept heads a KV cache only as wide as they are and the GDN its state. Its
forward(x, o_weight) is the converted heads' share of the layer output: o_weight (the teacher's o_proj
columns of those heads, which the graph holds) times their context. Since the kept heads are exact,
Phase 2 aligning the layer output is aligning this share to the teacher's (`converted_target`)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .gdn import GatedDeltaNet
from .mixers.swa import SlidingWindowAttention
from .phase1 import Phase1Options, calibrate_layer, relative_error


class HeadSelect(nn.Module):
    """x[:, index] along the head dim (dim 1) of a [B, heads, ...] tensor."""

    def __init__(self, index: list[int]):
        super().__init__()
        self.register_buffer("index", torch.tensor(index, dtype=torch.long), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.index_select(1, self.index)


class HeadMerge(nn.Module):
    """[kept heads; converted heads] back in the teacher's head order: kept [B, Hk, T, D] and the GDN's
    flat context [B, T, Hc*D] -> [B, H, T, D] as the teacher's attention op returned it."""

    def __init__(self, kept: list[int], converted: list[int], head_dim: int):
        super().__init__()
        stacked = list(kept) + list(converted)
        self.head_dim = head_dim
        self.register_buffer("order", torch.tensor([stacked.index(h) for h in range(len(stacked))], dtype=torch.long), persistent=False)

    def forward(self, kept: torch.Tensor, converted: torch.Tensor) -> torch.Tensor:
        converted = converted.unflatten(-1, (-1, self.head_dim)).transpose(1, 2).to(kept.dtype)
        return torch.cat([kept, converted], dim=1).index_select(1, self.order)


class ContextGDN(GatedDeltaNet):
    """A GatedDeltaNet that returns its heads' context (after o_norm) [B, T, H*D]: its output projection
    is the identity, since the teacher's o_proj reads the merged heads. A method, not an nn.Identity
    module: a module without parameters is what graph pruning drops from a shared layer."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        del self.o_proj

    def o_proj(self, x: torch.Tensor) -> torch.Tensor:
        return x


class HeadSplitLayer(nn.Module):
    """kept_heads   the teacher's query heads that stay softmax attention (whole GQA groups)
    kv_index     the heads of the op's K/V tensor that hold their KV heads (what the cache keeps)
    kept_kv      the teacher's KV heads kept (for the record: inspect, diff)
    attention    the kept heads' SlidingWindowAttention config (a window >= the model's positions: causal)
    gdn          the converted heads' GatedDeltaNet config (a ContextGDN: the teacher's o_proj reads the
                 merged heads)"""

    DECODE = "split"

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, kept_heads: list[int], kv_index: list[int],
                 kept_kv: list[int], attention: dict, gdn: dict, layer_idx: int | None = None):
        arguments = dict(locals())
        super().__init__()
        self._config = {k: v for k, v in arguments.items() if k not in ("self", "__class__")}
        self.hidden_size, self.num_heads, self.head_dim, self.layer_idx = hidden_size, num_heads, head_dim, layer_idx
        self.kept_heads, self.kept_kv = list(kept_heads), list(kept_kv)
        self.converted_heads = [h for h in range(num_heads) if h not in set(kept_heads)]
        if not kept_heads or not self.converted_heads or len(kept_heads) % len(kv_index):
            raise ValueError(f"a head split keeps some but not all of {num_heads} heads, whole KV groups: kept {kept_heads}, KV {kv_index}")
        self.select_q, self.select_k, self.select_v = HeadSelect(kept_heads), HeadSelect(kv_index), HeadSelect(kv_index)
        self.kept = SlidingWindowAttention(**attention)
        self.gdn = ContextGDN(**gdn)
        self.merge = HeadMerge(self.kept_heads, self.converted_heads, head_dim)

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, kept={self.kept_heads} (KV {self.kept_kv}), converted={len(self.converted_heads)}, layer_idx={self.layer_idx}"

    @property
    def kept_kv_map(self) -> list[int]:
        """The kept-KV slot each kept query head reads (grouped: whole groups in order)."""
        group = len(self.kept_heads) // len(self.kept_kv)
        return [i // group for i in range(len(self.kept_heads))]

    def forward(self, hidden_states: torch.Tensor, o_weight: torch.Tensor) -> torch.Tensor:
        """The converted heads' share of the layer output (without the o_proj bias): o_weight [hidden, Hc*D]."""
        return F.linear(self.gdn(hidden_states), o_weight.to(hidden_states.dtype))

    def converted_target(self, ctx: torch.Tensor, o_weight: torch.Tensor) -> torch.Tensor:
        """That share in the teacher: the converted heads' context (of ctx [N, T, H, D]) times o_weight."""
        return F.linear(ctx[:, :, self.converted_heads].flatten(-2).to(o_weight.dtype), o_weight)

    def recomputed(self) -> nn.Module:
        """What gradient checkpointing recomputes: the GDN (a graph calls this layer in parts)."""
        return self.gdn

    def param_groups(self) -> dict:
        return {role: [(f"gdn.{n}", p) for n, p in items] for role, items in self.gdn.param_groups().items()}

    def copied_parameters(self) -> list:
        return [(f"gdn.{n}", p) for n, p in self.gdn.copied_parameters()]

    def new_cache(self):
        return self.gdn.new_cache()

    def gdn_config(self) -> dict:
        return dict(self._config, gdn=self.gdn.gdn_config(), attention=self.kept.gdn_config())

    @classmethod
    def from_gdn_config(cls, config: dict) -> "HeadSplitLayer":
        return cls(**config)


def head_stats(stats: dict, heads: list[int]) -> dict:
    """The per-head statistics (tcal.stats.AttentionStats.result) of `heads` only."""
    n = len(stats["distance"])
    return {k: v[heads] if torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == n else v for k, v in stats.items()}


@torch.no_grad()
def calibrate_split(layer: HeadSplitLayer, x: torch.Tensor, ctx: torch.Tensor, stats: dict, opts: Phase1Options, o_weight: torch.Tensor) -> dict:
    """Phase 1 of the converted heads from their own statistics and context (tcal.phase1 on the GDN);
    the report's errors are of the converted heads' share of the layer output (o_weight: see forward)."""
    target = layer.converted_target(ctx, o_weight)
    before = relative_error(layer(x, o_weight), target)
    heads_ctx = ctx[:, :, layer.converted_heads]
    report = calibrate_layer(layer.gdn, x, heads_ctx, heads_ctx.flatten(-2), head_stats(stats, layer.converted_heads), opts)
    report.update(rel_error_before=before, rel_error_after=relative_error(layer(x, o_weight), target),
                  kept_heads=layer.kept_heads, converted_heads=layer.converted_heads)
    return report
