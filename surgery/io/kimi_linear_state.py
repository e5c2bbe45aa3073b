"""The tensors and config.json of a `--format kimi_linear` export, under transformers' Kimi Linear
names, from a plan kimi_linear_export.plan made (its docstring says why each conversion is exact)."""
from __future__ import annotations

import torch

from .kimi_linear_mla import mla_state
from .qwen3_5_fit import Norm
from .qwen3_5_state import conv_taps, linear_tensor


def norm_tensor(params: dict, norm: Norm) -> torch.Tensor:
    """Kimi Linear's RMSNorm scales by w itself."""
    return params[norm.weight] + norm.offset


def kda_state(kda, conv_size: int) -> dict:
    """KimiLinearDeltaAttention's tensors from a tcal.mixers.kda layer built with kimi_form."""
    return {
        "q_proj.weight": kda.q_proj.weight, "k_proj.weight": kda.k_proj.weight, "v_proj.weight": kda.v_proj.weight,
        "conv1d.weight": conv_taps(kda, conv_size),
        "forget_gate.f_a_proj.weight": kda.f_proj[0].weight, "forget_gate.f_b_proj.weight": kda.f_proj[1].weight,
        "forget_gate.dt_bias": kda.dt_bias, "forget_gate.A_log": kda.A_log.view(1, 1, -1, 1),
        "b_proj.weight": kda.b_proj.weight, "g_a_proj.weight": kda.g_proj[0].weight, "g_b_proj.weight": kda.g_proj[1].weight,
        "o_norm.weight": kda.o_norm.weight, "o_proj.weight": kda.o_proj.weight,
    }


def kimi_linear_state(graph, plan) -> dict:
    """KimiLinearForCausalLM's state dict (lm_head always written: the class ties nothing)."""
    params = dict(graph.gm.named_parameters(remove_duplicate=False))
    layout = plan.layout
    with torch.no_grad():
        state = {"model.embed_tokens.weight": params[layout.embedding], "model.norm.weight": norm_tensor(params, layout.final_norm),
                 "lm_head.weight": linear_tensor(params, layout.lm_head).clone()}
        for block in layout.blocks:
            prefix = f"model.layers.{block.layer}."
            state |= {prefix + "input_layernorm.weight": norm_tensor(params, block.input_norm),
                      prefix + "post_attention_layernorm.weight": norm_tensor(params, block.post_norm),
                      **{prefix + f"mlp.{n}_proj.weight": linear_tensor(params, getattr(block, n)) for n in ("gate", "up", "down")}}
            if block.layer in plan.mla:
                mixer = mla_state(params, plan.mla[block.layer])
            else:
                mixer = kda_state(graph.gm.get_submodule(plan.kda[block.layer]["target"]), plan.conv_size)
            state |= {prefix + "self_attn." + k: v for k, v in mixer.items()}
    return state


def kimi_linear_config(graph, plan, dtype: torch.dtype) -> dict:
    """KimiLinearConfig's fields for the hybrid: sizes from the weights, the KDA layers' config and
    the kept MLA layers' sizes."""
    from transformers.models.kimi_linear import KimiLinearConfig

    params = dict(graph.gm.named_parameters(remove_duplicate=False))
    first = plan.layout.blocks[0]
    kda = next(iter(plan.kda.values()))["gdn_config"]
    teacher, layers = graph.config, len(plan.layout.blocks)
    mla = next(iter(plan.mla.values())).sizes if plan.mla else {"num_attention_heads": kda["num_heads"]}
    vocab, hidden = params[plan.layout.embedding].shape
    config = KimiLinearConfig(
        vocab_size=vocab, hidden_size=hidden,
        intermediate_size=params[first.gate.weight].shape[0 if not first.gate.transposed else 1],
        num_hidden_layers=layers, **mla, num_key_value_heads=mla["num_attention_heads"],
        hidden_act="silu", rms_norm_eps=plan.eps, tie_word_embeddings=False, use_cache=False,
        max_position_embeddings=getattr(teacher, "max_position_embeddings", graph.max_length),
        layer_types=["full_attention" if l in plan.mla else "linear_attention" for l in range(layers)],
        mlp_layer_types=["dense"] * layers, attention_bias=False,
        linear_num_heads=kda["num_heads"], linear_head_dim=kda["head_dim"], linear_conv_kernel_dim=plan.conv_size,
        pad_token_id=getattr(teacher, "pad_token_id", None), bos_token_id=getattr(teacher, "bos_token_id", None),
        eos_token_id=getattr(teacher, "eos_token_id", None),
    )
    written = config.to_dict()
    written.update(architectures=["KimiLinearForCausalLM"], dtype=str(dtype).removeprefix("torch."))
    return written
