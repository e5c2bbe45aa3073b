"""The tensors and config.json of a `--format qwen3_5` export, under transformers' Qwen3.5 names,
from a plan qwen3_5_export.plan made (its docstring says why each conversion is exact)."""
from __future__ import annotations

import torch

from .qwen3_5_fit import Linear, Norm


def norm_tensor(params: dict, norm: Norm) -> torch.Tensor:
    """Qwen3.5's RMSNorm scales by (1 + w)."""
    return (params[norm.weight] + norm.offset) - 1.0


def linear_tensor(params: dict, linear: Linear) -> torch.Tensor:
    w = params[linear.weight]
    return w.t() if linear.transposed else w


def attention_state(site, params: dict, order: list[int], norm_weights: tuple) -> dict:
    """q_proj rows per head: the head's query, then its output gate (zeros: sigmoid(0) = 0.5);
    o_proj times 2 undoes that half exactly."""
    q, _ = site.q.out_matrix(params, order)
    q = q.view(site.num_heads, site.head_dim, -1)
    o, _ = site.o.in_matrix(params)
    o = o.view(o.shape[0], site.num_heads, site.head_dim)[:, order].reshape(o.shape[0], -1)
    return {
        "q_proj.weight": torch.cat([q, torch.zeros_like(q)], dim=1).reshape(-1, q.shape[-1]),
        "k_proj.weight": site.k.out_matrix(params)[0], "v_proj.weight": site.v.out_matrix(params)[0],
        "o_proj.weight": o * 2, "q_norm.weight": norm_weights[0], "k_norm.weight": norm_weights[1],
    }


def conv_taps(gdn, conv_size: int) -> torch.Tensor:
    """[3 * inner, 1, conv_size]: the q, k, v convolutions stacked, left-padded with zero taps for
    older tokens; the identity (current token's tap 1) for a GDN without short convolutions."""
    inner = gdn.num_heads * gdn.head_dim
    if not gdn.use_short_conv:
        taps = gdn.o_proj.weight.new_zeros(3 * inner, 1, conv_size)
        taps[:, 0, -1] = 1.0
        return taps
    taps = torch.cat([gdn.q_conv1d.weight, gdn.k_conv1d.weight, gdn.v_conv1d.weight])
    return torch.nn.functional.pad(taps, (conv_size - taps.shape[-1], 0))


def gdn_state(gdn, conv_size: int) -> dict:
    return {
        "in_proj_qkv.weight": torch.cat([gdn.q_proj.weight, gdn.k_proj.weight, gdn.v_proj.weight]),
        "in_proj_z.weight": gdn.g_proj.weight, "in_proj_b.weight": gdn.b_proj.weight, "in_proj_a.weight": gdn.a_proj.weight,
        "conv1d.weight": conv_taps(gdn, conv_size), "A_log": gdn.A_log, "dt_bias": gdn.dt_bias,
        "norm.weight": gdn.o_norm.weight, "out_proj.weight": gdn.o_proj.weight,
    }


def qwen3_5_state(graph, plan) -> dict:
    """Qwen3_5ForCausalLM's state dict (lm_head left out when tied to the embedding)."""
    params = dict(graph.gm.named_parameters(remove_duplicate=False))
    layout = plan.layout
    with torch.no_grad():
        state = {"model.embed_tokens.weight": params[layout.embedding], "model.norm.weight": norm_tensor(params, layout.final_norm)}
        if not tied(params, layout):
            state["lm_head.weight"] = linear_tensor(params, layout.lm_head)
        for block in layout.blocks:
            prefix = f"model.layers.{block.layer}."
            state |= {prefix + "input_layernorm.weight": norm_tensor(params, block.input_norm),
                      prefix + "post_attention_layernorm.weight": norm_tensor(params, block.post_norm),
                      **{prefix + f"mlp.{n}_proj.weight": linear_tensor(params, getattr(block, n)) for n in ("gate", "up", "down")}}
            if block.layer in plan.gdn:
                gdn = graph.gm.get_submodule(plan.gdn[block.layer]["target"])
                state |= {prefix + "linear_attn." + k: v for k, v in gdn_state(gdn, plan.conv_size).items()}
            else:
                site = graph.sites[block.layer]
                norms = tuple(norm_tensor(params, n) for n in plan.q_k_norms[block.layer])
                state |= {prefix + "self_attn." + k: v for k, v in attention_state(site, params, plan.head_order[block.layer], norms).items()}
    return state


def tied(params: dict, layout) -> bool:
    return layout.lm_head.weight == layout.embedding or params[layout.lm_head.weight] is params[layout.embedding]


def qwen3_5_config(graph, plan, dtype: torch.dtype) -> dict:
    """Qwen3_5TextConfig's fields for the hybrid: sizes from the sites and the weights."""
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    params = dict(graph.gm.named_parameters(remove_duplicate=False))
    kept = [l for l, kind in enumerate(plan.kinds) if kind == "attention"]
    site = graph.sites[kept[0] if kept else 0]
    gdn = next(iter(plan.gdn.values()))["gdn_config"]
    _, theta, partial = plan.rope
    teacher = graph.config
    config = Qwen3_5TextConfig(
        vocab_size=params[plan.layout.embedding].shape[0], hidden_size=site.hidden_size,
        intermediate_size=params[plan.layout.blocks[0].gate.weight].shape[0 if not plan.layout.blocks[0].gate.transposed else 1],
        num_hidden_layers=len(plan.kinds), num_attention_heads=site.num_heads, num_key_value_heads=site.num_kv_heads,
        head_dim=site.head_dim, hidden_act="silu", rms_norm_eps=plan.eps, tie_word_embeddings=tied(params, plan.layout),
        max_position_embeddings=getattr(teacher, "max_position_embeddings", graph.max_length),
        rope_parameters={"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": partial},
        attention_bias=False, attention_dropout=0.0, linear_conv_kernel_dim=plan.conv_size,
        linear_num_key_heads=gdn["num_heads"], linear_num_value_heads=gdn["num_heads"],
        linear_key_head_dim=gdn["head_dim"], linear_value_head_dim=gdn["head_dim"],
        layer_types=["linear_attention" if k == "gdn" else "full_attention" for k in plan.kinds],
        pad_token_id=getattr(teacher, "pad_token_id", None), bos_token_id=getattr(teacher, "bos_token_id", None),
        eos_token_id=getattr(teacher, "eos_token_id", None),
    )
    written = config.to_dict()
    written.update(architectures=["Qwen3_5ForCausalLM"], dtype=str(dtype).removeprefix("torch."), partial_rotary_factor=partial)
    return written
