"""A kept attention layer of a `--format kimi_linear` export: Kimi Linear's KimiLinearAttention is MLA
without RoPE, so a kept layer is written as one exactly when its site (surgery.sites.latent) says it is
that computation, read from the graph and never from model_type:

  q = q_proj(x), or q_b_proj(RMSNorm(q_a_proj(x)));  [latent | shared key] = kv_a_proj_with_mqa(x);
  [k_nope | v] per head = kv_b_proj(RMSNorm(latent));  k = [k_nope | shared key];  softmax(q k^T / sqrt(d)) v,
  o_proj; no RoPE, no biases, no q/k norms, no softcap, the latent norms' eps the class's own (1e-6).

`mla_form` gives the sizes (or the reason it is not that form), `mla_state` the tensors under
KimiLinearAttention's names: the teacher's own, unchanged."""
from __future__ import annotations

from dataclasses import dataclass

import numpy

from ..core.rewrite import nodes_by_name
from ..sites.ops import SHAPE_OPS, param_names, projection_parts
from ..sites.site import AttentionSite
from .qwen3_5_fit import Norm, is_op, match_rms, strip


@dataclass
class MlaForm:
    """KimiLinearConfig's MLA sizes and the parameters of one kept layer."""

    sizes: dict            # num_attention_heads, q_lora_rank, kv_lora_rank, qk_nope/qk_rope/v_head_dim
    weights: dict          # KimiLinearAttention's name -> the teacher's parameter
    norms: dict            # KimiLinearAttention's norm name -> Norm


def latent_norm(gm, proj_node: str, params: set[str]) -> Norm | None:
    """The RMSNorm a latent projection reads (kv_b_proj's kv_a_layernorm, q_b_proj's q_a_layernorm)."""
    parts = projection_parts(nodes_by_name(gm)[proj_node], params)
    x = strip(parts[0]) if parts else None
    while is_op(x, *SHAPE_OPS) and match_rms(x, params) is None:
        x = strip(x.args[0])  # the latent viewed as [B, 1, T, rank]
    return match_rms(x, params) if x is not None else None


def query_form(gm, site: AttentionSite, params: set[str]) -> tuple[dict, dict, dict] | str:
    """q_proj, or q_a_proj -> q_a_layernorm -> q_b_proj, with rows in head order."""
    q = site.q
    if q.more or q.transposed or q.rows() != list(range(site.num_heads * site.head_dim)):
        return "its query is not one projection with rows in head order"
    if q.via is None:
        return {"q_lora_rank": None}, {"q_proj": q.weight}, {}
    norm = latent_norm(gm, q.node, params)
    if norm is None or q.via["transposed"] or q.via["rows"] != list(range(len(q.via["rows"]))):
        return "its query's low rank is not q_a_proj -> RMSNorm -> q_b_proj"
    return ({"q_lora_rank": len(q.via["rows"])}, {"q_a_proj": q.via["weight"], "q_b_proj": q.weight}, {"q_a_layernorm": norm})


def key_value_form(gm, site: AttentionSite, params: dict) -> tuple[dict, dict, dict] | str:
    """kv_a_proj_with_mqa = [latent | shared key]; kv_b_proj(RMSNorm(latent)) = per head [k_nope | v]."""
    k, v, heads = site.k, site.v, site.num_heads
    if len(k.more) != 1 or k.via is not None or v.more or v.via is None or k.more[0]["weight"] != v.weight:
        return "its key and value are not kv_a_proj_with_mqa and kv_b_proj of one latent"
    latent = k.more[0]["via"]
    if latent is None or latent["weight"] != k.weight or v.via["rows"] != latent["rows"] or k.transposed or v.transposed:
        return "its key and value do not read one latent of kv_a_proj_with_mqa"
    rank, dv = len(latent["rows"]), site.v_head_dim or site.head_dim
    width_a, width_b = params[k.weight].shape[0], params[v.weight].shape[0]
    per_head = width_b // heads
    dn = per_head - dv
    dr = site.head_dim - dn
    expected_k = [[width_a + h * per_head + i for i in range(dn)] + [rank + j for j in range(dr)] for h in range(heads)]
    expected_v = [[h * per_head + dn + i for i in range(dv)] for h in range(heads)]
    if (latent["rows"] != list(range(rank)) or width_a != rank + dr or dn <= 0 or width_b != heads * per_head
            or k.heads != expected_k or v.heads != expected_v or site.kv_map != list(range(heads))):
        return "its key is not [k_nope | shared key] with kv_b_proj's rows per head [k_nope | v]"
    norm = latent_norm(gm, k.more[0]["node"], params)
    if norm is None:
        return "its latent is not RMSNorm-ed before kv_b_proj"
    sizes = {"kv_lora_rank": rank, "qk_nope_head_dim": dn, "qk_rope_head_dim": dr, "v_head_dim": dv}
    return sizes, {"kv_a_proj_with_mqa": k.weight, "kv_b_proj": v.weight}, {"kv_a_layernorm": norm}


def latent_eps() -> float:
    """The eps KimiLinearAttention builds its latent norms with (KimiLinearRMSNorm's own default, not
    the config's rms_norm_eps)."""
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearRMSNorm

    return KimiLinearRMSNorm(1).variance_epsilon


def mla_form(graph, site: AttentionSite) -> MlaForm | str:
    """The layer as KimiLinearAttention, or why it is not one (a clause for the export's refusal)."""
    if site.rope:
        return "it applies RoPE"
    if site.q_norm or site.k_norm or site.softcap:
        return "it has q/k norms or a softcap"
    projections = [site.q, site.k, site.v, site.o, *(p for q in (site.q, site.k, site.v) for p in q.more)]
    vias = [p.via for p in (site.q, site.k, site.v)] + [p["via"] for q in (site.q, site.k, site.v) for p in q.more]
    if any((p.bias if hasattr(p, "bias") else p["bias"]) for p in projections) or any(v and v["bias"] for v in vias):
        return "its projections have biases"
    gm, names = graph.gm, param_names(graph.gm)
    params = dict(gm.named_parameters(remove_duplicate=False))
    query, key_value = query_form(gm, site, names), key_value_form(gm, site, params)
    for found in (query, key_value):
        if isinstance(found, str):
            return found
    dv = site.v_head_dim or site.head_dim
    if site.o.transposed or site.o.rows() != list(range(site.num_heads * dv)):
        return "its output projection does not read the heads in order"
    if abs(site.scale - site.head_dim ** -0.5) > 1e-6 * site.head_dim ** -0.5:
        return f"its scale {site.scale:.6g} is not head_dim**-0.5"
    norms = {**query[2], **key_value[2]}
    if any(numpy.float32(n.eps) != numpy.float32(latent_eps()) for n in norms.values()):
        return f"its latent norms' eps {sorted({n.eps for n in norms.values()})} is not KimiLinearAttention's {latent_eps()}"
    sizes = {"num_attention_heads": site.num_heads, **query[0], **key_value[0]}
    return MlaForm(sizes, {**query[1], **key_value[1], "o_proj": site.o.weight}, norms)


def mla_state(params: dict, form: MlaForm) -> dict:
    """KimiLinearAttention's tensors (under self_attn.) of a kept layer: the teacher's, unchanged."""
    state = {f"{name}.weight": params[weight] for name, weight in form.weights.items()}
    return state | {f"{name}.weight": params[norm.weight] + norm.offset for name, norm in form.norms.items()}
