"""What the graph says one attention layer is: its projections (which weight rows feed which head),
its heads, scale, softcap, RoPE and q/k norms, and the nodes where later steps read or cut it."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch


def linear_matrix(params: dict, weight: str, bias: str | None, transposed: bool):
    """A parameter linear map as nn.Linear holds it: ([out, in] weight, bias or None)."""
    w = params[weight]
    return (w.t() if transposed else w), (params[bias] if bias else None)


def through_low_rank(params: dict, w, b, via: dict | None):
    """(w, b) applied after `via`, folded into one map of the layer input: the input of w is
    scale * (A[rows] x + a[rows]) (MLA's latent: A a down projection, scale the fitted norm), so
    w' = w diag(scale) A[rows] and b' = w (scale * a[rows]) + b."""
    if via is None:
        return w, b
    a_w, a_b = linear_matrix(params, via["weight"], via["bias"], via["transposed"])
    index = torch.tensor(via["rows"], device=a_w.device)
    wide = torch.promote_types(w.dtype, torch.float32)  # a bf16 teacher's product summed in float32
    scale = torch.tensor(via["scale"], device=w.device, dtype=wide)
    folded = (w.to(wide) * scale) @ a_w.index_select(0, index).to(wide)
    if a_b is not None:
        shift = w.to(wide) @ (scale * a_b.index_select(0, index).to(wide))
        b = shift if b is None else b.to(wide) + shift
    return folded.to(w.dtype), (b.to(w.dtype) if b is not None else None)


@dataclass
class Projection:
    """Where a linear map lives: its parameters and, per head, the output rows (or input columns) it uses.
    A Q/K/V of multi-head latent attention (MLA) is not one matrix of the layer input: `via` is the
    down projection (and fitted norm scale) in front of this one, `more` further projections whose
    rows follow this one's in `heads` (the shared rope key), each a dict of weight, bias, transposed,
    node and via. Then heads index the rows of the stacked, folded maps (effective_matrix)."""

    weight: str
    bias: str | None
    transposed: bool          # stored [in, out] (GPT-2's Conv1D) rather than nn.Linear's [out, in]
    heads: list               # heads[h][d] = output row (for q/k/v) or input column (for o) of the weight
    node: str                 # the graph node that applies it
    via: dict | None = None   # {weight, bias, transposed, node, rows, scale}: the low-rank map before this one
    more: list = field(default_factory=list)

    @property
    def folded(self) -> bool:
        """Whether heads index a stacked or low-rank-folded map rather than the weight's own rows."""
        return self.via is not None or bool(self.more)

    def rows(self, heads: list[int] | None = None) -> list[int]:
        picked = self.heads if heads is None else [self.heads[h] for h in heads]
        return [r for head in picked for r in head]

    def effective_matrix(self, params: dict):
        """The [rows, in] map of the layer input whose rows `heads` index, and its bias."""
        parts = [dict(weight=self.weight, bias=self.bias, transposed=self.transposed, via=self.via), *self.more]
        maps = [through_low_rank(params, *linear_matrix(params, p["weight"], p["bias"], p["transposed"]), p["via"]) for p in parts]
        if len(maps) == 1:
            return maps[0]
        if all(b is None for _, b in maps):
            return torch.cat([w for w, _ in maps]), None
        return torch.cat([w for w, _ in maps]), torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in maps])

    def out_matrix(self, params: dict, heads: list[int] | None = None):
        """[len(rows), in] weight rows and the matching bias entries, for q/k/v projections."""
        w, bias = self.effective_matrix(params) if self.folded else linear_matrix(params, self.weight, self.bias, self.transposed)
        index = torch.tensor(self.rows(heads), device=w.device)
        return w.index_select(0, index), (bias.index_select(0, index) if bias is not None else None)

    def in_matrix(self, params: dict):
        """[out, H*D] weight columns ordered by (head, dim), and the bias, for the output projection."""
        w, bias = linear_matrix(params, self.weight, self.bias, self.transposed)
        index = torch.tensor(self.rows(), device=w.device)
        return w.index_select(1, index), bias

    def source_text(self) -> str:
        """The weights this projection reads, for the `src -> dst` copy log."""
        names = [self.weight + ("^T" if self.transposed else "")] + [p["weight"] for p in self.more]
        downs = [p["via"]["weight"] for p in [dict(via=self.via), *self.more] if p["via"]]
        return " + ".join(names) + (f" (folded through {', '.join(dict.fromkeys(downs))})" if downs else "")


@dataclass
class AttentionSite:
    """One softmax-attention layer as the graph shows it."""

    layer: int
    module_path: str
    kind: str                 # "sdpa" or "eager"
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    scale: float
    q: Projection
    k: Projection
    v: Projection
    o: Projection
    kv_map: list              # kv_map[h] = KV head that query head h reads
    rope: bool
    q_norm: list = field(default_factory=list)   # parameters applied to Q between projection and attention
    k_norm: list = field(default_factory=list)
    softcap: float | None = None
    causal: bool = True
    input_node: str = ""      # hidden states entering the Q/K/V projections [B, T, hidden]
    output_node: str = ""     # the output projection's result [B, T, hidden]
    attn_node: str = ""       # the attention op (SDPA, or the probabilities @ V matmul)
    q_node: str = ""          # Q, K, V as the attention op receives them [B, H, T, D]
    k_node: str = ""
    v_node: str = ""
    probs_node: str | None = None   # eager form: the softmax output [B, H, T, T]
    mask_node: str | None = None
    # what decoding reads, so that it never searches the graph for the attention op again
    op_scale: float | None = None   # the op's own factor on Q.K (SDPA's scale or d**-0.5; eager: the score path's times alpha)
    k_transposed: bool = False      # K arrives as K^T [B, H, D, T] (eager)
    scores_node: str | None = None  # eager form: the Q.K^T product
    scores_bias: bool = False       # that product is baddbmm(bias, Q, K^T): a bias on the scores (ALiBi-style)
    is_causal: bool = False         # SDPA's is_causal flag
    mask_mode: str | None = None    # how SDPA's attn_mask reads: "keep" (bool) or "additive" (float)
    logits_path: list = field(default_factory=list)  # eager form: the nodes from the scores to the softmax
    v_head_dim: int = 0             # V's (and the output's) width per head where it is not head_dim (MLA); 0: head_dim

    @property
    def mixer_head_dim(self) -> int:
        """The head width of a layer replacing this one: the wider of Q/K's and V's (MLA's differ;
        replace zero-pads the narrower)."""
        return max(self.head_dim, self.v_head_dim or self.head_dim)

    @property
    def fused_qkv(self) -> bool:
        return self.q.weight == self.k.weight or self.k.weight == self.v.weight

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "AttentionSite":
        d = dict(d)
        for key in ("q", "k", "v", "o"):
            d[key] = Projection(**d[key])
        return cls(**d)

    def summary(self) -> dict:
        """The row of `surgery inspect`."""
        return {
            "layer": self.layer, "path": self.module_path, "kind": self.kind, "heads": self.num_heads,
            "kv_heads": self.num_kv_heads, "head_dim": self.head_dim, "fused_qkv": self.fused_qkv,
            "qkv_bias": bool(self.q.bias or self.k.bias or self.v.bias), "rope": self.rope,
            "qk_norm": bool(self.q_norm or self.k_norm), "softcap": self.softcap, "scale": self.scale,
        }
