"""Tiny causal-decoder configs, one per transformers architecture, for the test suite.

Every config is built from scratch (no hub access): hidden 64, 2-3 layers, 4 query heads with 2 KV heads
where the architecture supports GQA (head_dim 16), vocab 128, max positions 128, intermediate 128, sliding
windows 8 (so they matter at the test lengths, e.g. 23). Models are float32, eval, and use
attn_implementation="sdpa" when the class supports it, else "eager" (see `attn_implementation`).

Each architecture in ARCHS and EXTRA_ARCHS was checked against the capture recipe

    ep = torch.export.export(model, (), {"input_ids": ids, "use_cache": False},
                             dynamic_shapes={"input_ids": {0: Dim("batch", 1, 64), 1: Dim("seq", 1, max_positions)},
                                             "use_cache": None}, strict=False)
    ep.module()(input_ids=other, use_cache=False).logits

with ids (2, 16): the export succeeds and the graph's logits equal the eager model's (max abs diff <= 1e-5,
in fact 0.0) at (1, 7) and (3, 23) (torch 2.13 CPU, transformers 5.24).

ARCHS        the default parametrisation: the required architectures plus the ones whose attention looks
             structurally different in the graph (fused QKV layouts, MQA, ALiBi, eager softmax, partial and
             interleaved rotary, NoPE layers, sliding windows, softcapping, q/k norms, an MoE router softmax).
             Each export takes about 1-4 s on 2 CPU cores.
EXTRA_ARCHS  more architectures that pass the same check, mostly Llama-like; opt-in (slow suites).
EXPECTED     name -> what an attention-site finder should discover (for ARCHS and EXTRA_ARCHS).
FAILING      name -> why the architecture does not capture with the recipe (or does not match).
SKIPPED      name -> architectures left out on purpose although they may capture (not one softmax-attention
             site per layer, hybrids, duplicates).
"""
from __future__ import annotations

from functools import partial
from typing import Callable

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

VOCAB = 128
HIDDEN = 64
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
INTERMEDIATE = 128
MAX_POSITIONS = 128
WINDOW = 8

_COMMON = dict(
    vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, intermediate_size=INTERMEDIATE,
    max_position_embeddings=MAX_POSITIONS, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
# small MoE / MLA sizes, applied only where the config class has the field
_MOE = dict(
    num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=32, n_shared_experts=1, num_shared_experts=1,
    n_group=1, topk_group=1,
)
_MLA = dict(kv_lora_rank=16, q_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16,
            head_dim=8, num_key_value_heads=HEADS)


def _config(model_type: str, **overrides) -> PretrainedConfig:
    """AutoConfig.for_model(model_type) with the tiny sizes of _COMMON and _MOE (only the fields that this
    config class has, through its attribute_map too: GPT2's n_embd is set by hidden_size) and `overrides`."""
    default = AutoConfig.for_model(model_type)
    known = set(default.to_dict()) | set(getattr(default, "attribute_map", {}))
    kwargs = {k: v for k, v in {**_COMMON, **_MOE}.items() if k in known}
    kwargs.update(overrides)
    return AutoConfig.for_model(model_type, **kwargs)


_SLIDE3 = ["sliding_attention", "full_attention", "sliding_attention"]
_SLIDE2 = ["sliding_attention", "full_attention"]

ARCHS: dict[str, Callable[[], PretrainedConfig]] = {
    "llama": partial(_config, "llama"),
    "qwen2": partial(_config, "qwen2"),  # q/k/v biases are hard-wired in Qwen2Attention
    "qwen3": partial(_config, "qwen3"),  # per-head RMSNorm on q and k
    "mistral": partial(_config, "mistral", sliding_window=WINDOW),  # every layer sliding
    "gemma2": partial(_config, "gemma2", num_hidden_layers=3, query_pre_attn_scalar=32,
                      attn_logit_softcapping=50.0, final_logit_softcapping=30.0, sliding_window=WINDOW),
    "gemma3": partial(_config, "gemma3_text", num_hidden_layers=3, query_pre_attn_scalar=HEAD_DIM,
                      layer_types=_SLIDE3, sliding_window=WINDOW),
    "phi3": partial(_config, "phi3"),  # fused qkv_proj [q | k | v]
    "gpt2": partial(_config, "gpt2", n_inner=INTERMEDIATE),  # fused Conv1D c_attn
    "opt": partial(_config, "opt", ffn_dim=INTERMEDIATE, word_embed_proj_dim=HIDDEN,
                   pad_token_id=1, bos_token_id=2, eos_token_id=2),
    "gpt_neox": partial(_config, "gpt_neox"),  # fused per-head-interleaved qkv, partial rotary 0.25
    "falcon": partial(_config, "falcon", multi_query=True, new_decoder_architecture=False, num_kv_heads=1,
                      ffn_hidden_size=INTERMEDIATE),  # MQA, fused [q heads | k | v], parallel attn
    "falcon_new": partial(_config, "falcon", multi_query=False, new_decoder_architecture=True, num_kv_heads=KV_HEADS,
                          ffn_hidden_size=INTERMEDIATE),  # GQA, fused grouped per KV head
    "stablelm": partial(_config, "stablelm"),  # partial rotary 0.25, LayerNorm
    "olmo2": partial(_config, "olmo2"),  # RMSNorm over the whole q / k projection
    "phi": partial(_config, "phi"),  # partial rotary 0.5, biases, parallel block
    "cohere": partial(_config, "cohere"),  # interleaved rotary, parallel block, LayerNorm
    "cohere2": partial(_config, "cohere2", layer_types=_SLIDE2, sliding_window=WINDOW),  # rope on sliding layers only
    "granite": partial(_config, "granite", attention_multiplier=1.0 / HEAD_DIM, embedding_multiplier=4.0,
                       residual_multiplier=0.5, logits_scaling=2.0),
    "gptj": partial(_config, "gptj", rotary_dim=8, n_inner=INTERMEDIATE),  # interleaved partial rotary
    "codegen": partial(_config, "codegen", rotary_dim=8, n_inner=INTERMEDIATE, n_ctx=MAX_POSITIONS),  # fused, mp_num=4
    "bloom": partial(_config, "bloom"),  # ALiBi, eager only, fused per-head-interleaved qkv
    "mpt": partial(_config, "mpt"),  # ALiBi, eager, fused Wqkv; needs the DYNAMIC-dims export fallback
    "openai-gpt": partial(_config, "openai-gpt"),  # GPT-1: forward takes no use_cache
    "starcoder2": partial(_config, "starcoder2", sliding_window=WINDOW),  # biases incl. o_proj, LayerNorm
    "gpt_bigcode": partial(_config, "gpt_bigcode", n_inner=INTERMEDIATE),  # MQA, fused Linear c_attn
    "smollm3": partial(_config, "smollm3", no_rope_layer_interval=2),  # layer 1 has no rope (NoPE)
    "persimmon": partial(_config, "persimmon"),  # fused qkv, per-head LayerNorm q/k, partial rotary 0.5
    "qwen2_moe": partial(_config, "qwen2_moe"),  # MoE: a router softmax per layer besides the attention
}

EXTRA_ARCHS: dict[str, Callable[[], PretrainedConfig]] = {
    "gemma": partial(_config, "gemma"),
    "olmo": partial(_config, "olmo"),
    "olmo3": partial(_config, "olmo3", layer_types=_SLIDE2, sliding_window=WINDOW),
    "olmoe": partial(_config, "olmoe"),
    "falcon_mha": partial(_config, "falcon", multi_query=False, new_decoder_architecture=False, num_kv_heads=HEADS,
                          parallel_attn=False, bias=True, ffn_hidden_size=INTERMEDIATE),
    "falcon_alibi": partial(_config, "falcon", multi_query=True, alibi=True, num_kv_heads=1,
                            ffn_hidden_size=INTERMEDIATE),
    "exaone4": partial(_config, "exaone4", sliding_window=WINDOW, sliding_window_pattern=2),
    "helium": partial(_config, "helium"),
    "glm": partial(_config, "glm"),
    "glm4": partial(_config, "glm4"),
    "nemotron": partial(_config, "nemotron"),
    "qwen3_moe": partial(_config, "qwen3_moe"),
    "mixtral": partial(_config, "mixtral", sliding_window=None),
    "xglm": partial(_config, "xglm", ffn_dim=INTERMEDIATE),
    "biogpt": partial(_config, "biogpt"),
    "ctrl": partial(_config, "ctrl", dff=INTERMEDIATE),
    "gpt_neox_japanese": partial(_config, "gpt_neox_japanese", intermediate_multiple_size=2),
    "arcee": partial(_config, "arcee"),
    "apertus": partial(_config, "apertus"),
    "bitnet": partial(_config, "bitnet"),
    "seed_oss": partial(_config, "seed_oss"),
    "vaultgemma": partial(_config, "vaultgemma", num_hidden_layers=3, query_pre_attn_scalar=HEAD_DIM,
                          sliding_window=WINDOW),
    "ministral": partial(_config, "ministral", layer_types=_SLIDE2, sliding_window=WINDOW),
    "ministral3": partial(_config, "ministral3"),
    "ernie4_5": partial(_config, "ernie4_5"),
    "ernie4_5_moe": partial(_config, "ernie4_5_moe", moe_layer_start_index=1, moe_layer_end_index=1),
    "hunyuan_v1_dense": partial(_config, "hunyuan_v1_dense"),
    "hunyuan_v1_moe": partial(_config, "hunyuan_v1_moe"),
    "granite_swa": partial(_config, "granite_swa", sliding_window=WINDOW),
    "phimoe": partial(_config, "phimoe"),
    "dots1": partial(_config, "dots1"),
    "glm4_moe": partial(_config, "glm4_moe"),
    "gpt_oss": partial(_config, "gpt_oss", sliding_window=WINDOW),
    "llama4_text": partial(_config, "llama4_text"),
    "afmoe": partial(_config, "afmoe", layer_types=_SLIDE2, sliding_window=WINDOW),
    "cwm": partial(_config, "cwm", sliding_window=WINDOW),
    "flex_olmo": partial(_config, "flex_olmo"),
    "mellum": partial(_config, "mellum"),
    "nanochat": partial(_config, "nanochat"),
    "solar_open": partial(_config, "solar_open"),
    "jais2": partial(_config, "jais2"),
    "hyperclovax": partial(_config, "hyperclovax"),
    "laguna": partial(_config, "laguna"),
    "flint": partial(_config, "flint"),
    "kolibri1": partial(_config, "kolibri1", layer_types=_SLIDE2, sliding_window=WINDOW),
    "cohere2_moe": partial(_config, "cohere2_moe", layer_types=_SLIDE2, sliding_window=WINDOW),
    "apertus1p5_text": partial(_config, "apertus1p5_text"),
    "hy_v3": partial(_config, "hy_v3"),
    "minimax_m2": partial(_config, "minimax_m2"),
    "mimo_v2_flash": partial(_config, "mimo_v2_flash", sliding_window=WINDOW, v_head_dim=HEAD_DIM,
                             rope_parameters={t: {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
                                              for t in ("full_attention", "sliding_attention")}),
    "sarvam_moe": partial(_config, "sarvam_moe"),
    "exaone_moe": partial(_config, "exaone_moe", sliding_window=WINDOW, sliding_window_pattern=2),
    "modernbert_decoder": partial(_config, "modernbert-decoder", sliding_window=WINDOW),
    "gemma3n": partial(_config, "gemma3n_text", intermediate_size=[INTERMEDIATE] * LAYERS, num_kv_shared_layers=0,
                       vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8, laurel_rank=8,
                       activation_sparsity_pattern=[0.0] * LAYERS, layer_types=_SLIDE2, sliding_window=WINDOW),
    "gemma4": partial(_config, "gemma4_text", num_hidden_layers=3, vocab_size_per_layer_input=VOCAB,
                      hidden_size_per_layer_input=8, global_head_dim=HEAD_DIM, sliding_window=WINDOW,
                      layer_types=["sliding_attention", "full_attention", "full_attention"]),
    # multi-head latent attention (q/kv LoRA, split rope/nope head dims); MLA has no GQA: kv heads = heads
    "minicpm3": partial(_config, "minicpm3", **_MLA),
    "deepseek_v2": partial(_config, "deepseek_v2", **_MLA),
    "deepseek_v3": partial(_config, "deepseek_v3", **_MLA),
    "youtu": partial(_config, "youtu", **_MLA),
    "glm4_moe_lite": partial(_config, "glm4_moe_lite", **_MLA),
    "axk1": partial(_config, "axk1", **_MLA),
}

_ALL = {**ARCHS, **EXTRA_ARCHS}


def config(name: str) -> PretrainedConfig:
    return _ALL[name]()


def attn_implementation(cfg_or_name) -> str:
    """'sdpa' when the model class supports it, else 'eager' (Gemma2, Bloom, MPT, XGLM, GPT-OSS ... are eager)."""
    cfg = config(cfg_or_name) if isinstance(cfg_or_name, str) else cfg_or_name
    cls = AutoModelForCausalLM._model_mapping[type(cfg)]
    return "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"


def max_positions(cfg_or_name) -> int:
    """The longest sequence the config allows (Bloom has no position limit: MAX_POSITIONS)."""
    cfg = config(cfg_or_name) if isinstance(cfg_or_name, str) else cfg_or_name
    for key in ("max_position_embeddings", "n_positions", "max_seq_len"):
        value = getattr(cfg, key, None)
        if isinstance(value, int):
            return value
    return MAX_POSITIONS


def build(name: str, seed: int = 0) -> torch.nn.Module:
    """The float32 eval model for `name`, weights drawn from a fixed seed (the global RNG is left untouched)."""
    cfg = config(name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation(cfg))
    return model.to(torch.float32).eval()


# What an attention-site finder should discover. Per-layer lists where layers differ.
#   num_layers     attention sites (= decoder layers; all layers have attention)
#   heads          query heads;  kv_heads: K/V heads in the weights (before repeat_kv; 1 = MQA)
#   head_dim       q/k head dim
#   fused_qkv      one projection produces q, k and v
#   qkv_bias       the q/k/v projection(s) have a bias
#   qk_norm        a norm on q and k before attention; qk_norm_over: "head" (per-head, weight [head_dim]) or
#                  "proj" (over the whole projection, weight [heads*head_dim] / [kv_heads*head_dim])
#   rope           rotary embedding applied (per layer where it differs); rotary_dim: dims rotated per head
#   softcap        attention-logit softcapping value, or False
#   sliding_window window length, or None (full causal); a per-layer list where layers differ
#   scale          softmax scale on q.k (OPT folds it into q and passes scale=1.0 to SDPA)
#   attn_op        "sdpa": aten.scaled_dot_product_attention; "eager": matmul/baddbmm + aten._softmax
#   alibi          position bias added to the scores instead of rope
def _site(num_layers=LAYERS, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, fused_qkv=False, qkv_bias=False,
          qk_norm=False, qk_norm_over=None, rope=True, rotary_dim=HEAD_DIM, softcap=False, sliding_window=None,
          scale=HEAD_DIM ** -0.5, attn_op="sdpa", alibi=False, notes="", attention_adds_residual=False):
    return dict(attention_adds_residual=attention_adds_residual, num_layers=num_layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim, fused_qkv=fused_qkv,
                qkv_bias=qkv_bias, qk_norm=qk_norm, qk_norm_over=qk_norm_over, rope=rope, rotary_dim=rotary_dim,
                softcap=softcap, sliding_window=sliding_window, scale=scale, attn_op=attn_op, alibi=alibi,
                notes=notes)


_W2 = [WINDOW, None]
_W3 = [WINDOW, None, WINDOW]
_MLA_NOTE = ("MLA: q = q_b_proj(q_a_layernorm(q_a_proj(x))); kv_a_proj_with_mqa -> [latent 16 | shared rope key 8],"
             " kv_b_proj(kv_a_layernorm(latent)) -> per-head [k_nope 8 | v 16]; q/k = [nope 8 | rope 8]")

EXPECTED: dict[str, dict] = {
    # ---- ARCHS
    "llama": _site(),
    "qwen2": _site(qkv_bias=True),
    "qwen3": _site(qk_norm=True, qk_norm_over="head"),
    "mistral": _site(sliding_window=WINDOW),
    "gemma2": _site(num_layers=3, softcap=50.0, sliding_window=_W3, scale=32 ** -0.5, attn_op="eager",
                    notes="no SDPA support: eager; softcap tanh(s/50)*50 before the mask; final logit softcap 30"),
    "gemma3": _site(num_layers=3, qk_norm=True, qk_norm_over="head", sliding_window=_W3,
                    notes="sliding layers rope theta 1e4, full layer 1e6; two masks in the graph"),
    "phi3": _site(fused_qkv=True, notes="qkv_proj out = [q (64) | k (32) | v (32)]"),
    "gpt2": _site(kv_heads=HEADS, fused_qkv=True, qkv_bias=True, rope=False, rotary_dim=0,
                  notes="Conv1D c_attn (weight [in, 3*hidden]); learned absolute positions"),
    "opt": _site(kv_heads=HEADS, qkv_bias=True, rope=False, rotary_dim=0,
                 notes="q_proj output * 0.25 before SDPA, SDPA scale=1.0; learned positions"),
    "gpt_neox": _site(kv_heads=HEADS, fused_qkv=True, qkv_bias=True, rotary_dim=4,
                      notes="query_key_value out viewed [heads, 3*head_dim]: per head [q|k|v]"),
    "falcon": _site(kv_heads=1, fused_qkv=True,
                    notes="MQA; FalconLinear = numpy_T + matmul (no aten.linear); out viewed [heads + 2, head_dim]:"
                    " q = slice [:-2], k/v = aten.index with lifted constant index tensors [-2] / [-1];"
                    " SDPA gets the 1-head k/v unexpanded and no scale kwarg"),
    "falcon_new": _site(fused_qkv=True, notes="new_decoder_architecture: query_key_value out viewed"
                        " [kv_heads, heads/kv_heads + 2, head_dim]: per group [q q | k | v]; k/v broadcast_to +"
                        " flatten to all heads before SDPA (no scale kwarg)"),
    "stablelm": _site(rotary_dim=4),
    "olmo2": _site(qk_norm=True, qk_norm_over="proj", notes="q_norm weight [64], k_norm [32], before the head split"),
    "phi": _site(qkv_bias=True, rotary_dim=8),
    "cohere": _site(notes="interleaved (GPT-J style) rotary; parallel attn+mlp"),
    "cohere2": _site(rope=[True, False], rotary_dim=[HEAD_DIM, 0], sliding_window=_W2,
                     notes="rope only on the sliding layer (full layer is NoPE)"),
    "granite": _site(scale=1.0 / HEAD_DIM, notes="scale = attention_multiplier"),
    "gptj": _site(kv_heads=HEADS, rotary_dim=8, notes="interleaved partial rotary; no qkv bias"),
    "codegen": _site(kv_heads=HEADS, fused_qkv=True, rotary_dim=8,
                     notes="qkv_proj out viewed [mp_num=4 shards, 3*16]: per shard [q | v | k] (note the order);"
                     " with 4 heads each shard holds one head"),
    "mpt": _site(kv_heads=HEADS, fused_qkv=True, qkv_bias=False, rope=False, rotary_dim=0, attn_op="eager", alibi=True),
    "openai-gpt": _site(kv_heads=HEADS, fused_qkv=True, qkv_bias=True, rope=False, rotary_dim=0, attn_op="eager"),
    "bloom": _site(attention_adds_residual=True, kv_heads=HEADS, fused_qkv=True, qkv_bias=True, rope=False, rotary_dim=0, attn_op="eager",
                   alibi=True, notes="no SDPA support: eager baddbmm(alibi, q, k^T, beta=1, alpha=0.25);"
                   " query_key_value viewed [heads, 3, head_dim]"),
    "starcoder2": _site(qkv_bias=True, sliding_window=WINDOW, notes="o_proj has a bias too"),
    "gpt_bigcode": _site(kv_heads=1, fused_qkv=True, qkv_bias=True, rope=False, rotary_dim=0,
                         notes="MQA; Linear c_attn out = [q (64) | k (16) | v (16)]"),
    "smollm3": _site(rope=[True, False], rotary_dim=[HEAD_DIM, 0], notes="layer 1 is NoPE"),
    "persimmon": _site(kv_heads=HEADS, fused_qkv=True, qkv_bias=True, qk_norm=True, qk_norm_over="head",
                       rotary_dim=8, notes="query_key_value viewed [heads, 3*head_dim]; LayerNorm (with bias) q/k norms"),
    "qwen2_moe": _site(qkv_bias=True, notes="router softmax [tokens, experts] per layer, not attention"),
    # ---- EXTRA_ARCHS
    "gemma": _site(),
    "olmo": _site(),
    "olmo3": _site(qk_norm=True, qk_norm_over="proj", sliding_window=_W2),
    "olmoe": _site(qk_norm=True, qk_norm_over="proj", notes="router softmax per layer"),
    "falcon_mha": _site(kv_heads=HEADS, fused_qkv=True, qkv_bias=True,
                        notes="not new_decoder_architecture, not multi_query: query_key_value viewed"
                        " [heads, 3, head_dim]"),
    "falcon_alibi": _site(kv_heads=1, fused_qkv=True, rope=False, rotary_dim=0, alibi=True,
                          notes="MQA; alibi folded into the SDPA float mask"),
    "exaone4": _site(qk_norm=True, qk_norm_over="head", rope=[True, False], rotary_dim=[HEAD_DIM, 0],
                     sliding_window=_W2, notes="global layer is NoPE"),
    "helium": _site(),
    "glm": _site(qkv_bias=True, rotary_dim=8, notes="interleaved partial rotary"),
    "glm4": _site(qkv_bias=True, rotary_dim=8, notes="interleaved partial rotary; sandwich norms"),
    "nemotron": _site(rotary_dim=8),
    "qwen3_moe": _site(qk_norm=True, qk_norm_over="head", notes="router softmax per layer"),
    "mixtral": _site(notes="router softmax per layer"),
    "xglm": _site(kv_heads=HEADS, qkv_bias=True, rope=False, rotary_dim=0, attn_op="eager",
                  notes="no SDPA support; sinusoidal positions; scores bmm over [batch*heads]"),
    "biogpt": _site(kv_heads=HEADS, qkv_bias=True, rope=False, rotary_dim=0),
    "ctrl": _site(kv_heads=HEADS, qkv_bias=True, rope=False, rotary_dim=0, notes="Wq/Wk/Wv; sinusoidal positions"),
    "gpt_neox_japanese": _site(kv_heads=HEADS, fused_qkv=True, attn_op="eager", notes="no SDPA support"),
    "arcee": _site(),
    "apertus": _site(qk_norm=True, qk_norm_over="head", notes="llama3 rope scaling"),
    "bitnet": _site(notes="attn_sub_norm before o_proj"),
    "seed_oss": _site(qkv_bias=True),
    "vaultgemma": _site(num_layers=3, softcap=50.0, sliding_window=_W3, attn_op="eager"),
    "ministral": _site(sliding_window=_W2),
    "ministral3": _site(notes="yarn rope + llama4 attention scaling of q"),
    "ernie4_5": _site(notes="interleaved rotary"),
    "ernie4_5_moe": _site(notes="interleaved rotary; router softmax in layer 1 only"),
    "hunyuan_v1_dense": _site(qk_norm=True, qk_norm_over="head", notes="q/k norm after rope"),
    "hunyuan_v1_moe": _site(qk_norm=True, qk_norm_over="head", notes="q/k norm after rope; router softmax"),
    "granite_swa": _site(sliding_window=[None, WINDOW], scale=1.0, attn_op="eager", notes="no SDPA support"),
    "phimoe": _site(notes="router softmaxes per layer"),
    "dots1": _site(qk_norm=True, qk_norm_over="head"),
    "glm4_moe": _site(rotary_dim=8),
    "gpt_oss": _site(qkv_bias=True, sliding_window=_W2, attn_op="eager",
                     notes="no SDPA support; attention sinks: softmax over [scores | sink] (s+1 columns)"),
    "llama4_text": _site(qk_norm=True, qk_norm_over="head",
                         notes="weightless L2 q/k norm; chunked attention (chunk 8192 > max len); interleaved"
                         " (complex) rotary"),
    "afmoe": _site(qk_norm=True, qk_norm_over="head", sliding_window=_W2, notes="sigmoid output gate"),
    "cwm": _site(sliding_window=[None, WINDOW]),
    "flex_olmo": _site(qk_norm=True, qk_norm_over="proj", notes="router softmax per layer"),
    "mellum": _site(qk_norm=True, qk_norm_over="head", notes="router softmax per layer"),
    "nanochat": _site(qk_norm=True, qk_norm_over="head", notes="weightless q/k RMSNorm; final logit softcap 15"),
    "solar_open": _site(),
    "jais2": _site(qkv_bias=True),
    "hyperclovax": _site(),
    "laguna": _site(qk_norm=True, qk_norm_over="head", rotary_dim=8, notes="per-head output gate g_proj"),
    "flint": _site(qk_norm=True, qk_norm_over="head", attn_op="eager", notes="no SDPA support; attention sinks: softmax over s+1"),
    "kolibri1": _site(qk_norm=True, qk_norm_over="head", sliding_window=_W2),
    "cohere2_moe": _site(rope=[True, False], rotary_dim=[HEAD_DIM, 0], sliding_window=_W2),
    "apertus1p5_text": _site(qk_norm=True, qk_norm_over="head"),
    "hy_v3": _site(qk_norm=True, qk_norm_over="head"),
    "minimax_m2": _site(qk_norm=True, qk_norm_over="proj"),
    "mimo_v2_flash": _site(kv_heads=[KV_HEADS, 2 * KV_HEADS], rotary_dim=8, sliding_window=[None, WINDOW], attn_op="eager",
                           notes="no SDPA support; sliding layer: twice the kv heads + attention sinks (softmax over s+1);"
                           " v scaled by 0.707"),
    "sarvam_moe": _site(qk_norm=True, qk_norm_over="head", notes="loads as Glm4MoeForCausalLM"),
    "exaone_moe": _site(qk_norm=True, qk_norm_over="head", sliding_window=_W2),
    "modernbert_decoder": _site(kv_heads=HEADS, sliding_window=[None, WINDOW]),
    "gemma3n": _site(qk_norm=True, qk_norm_over="head", sliding_window=_W2, scale=1.0),
    "gemma4": _site(num_layers=3, qk_norm=True, qk_norm_over="head", rotary_dim=[HEAD_DIM, 4, 4],
                    sliding_window=[WINDOW, None, None], scale=1.0,
                    notes="weightless v_norm; full layers: proportional rope, partial_rotary_factor 0.25"),
    "minicpm3": _site(kv_heads=HEADS, rotary_dim=8, notes=_MLA_NOTE),
    "deepseek_v2": _site(kv_heads=HEADS, rotary_dim=8, notes=_MLA_NOTE),
    "deepseek_v3": _site(kv_heads=HEADS, rotary_dim=8, notes=_MLA_NOTE),
    "youtu": _site(kv_heads=HEADS, rotary_dim=8, notes=_MLA_NOTE),
    "glm4_moe_lite": _site(kv_heads=HEADS, rotary_dim=8, notes=_MLA_NOTE),
    "axk1": _site(kv_heads=HEADS, rotary_dim=8, notes=_MLA_NOTE),
}

FAILING: dict[str, str] = {
    "gpt_neo": "export guard seq != max_position_embeddings (causal-mask buffer slicing): Dim(seq, max=max_positions)"
               " is rejected; exports and matches (eager) with max=max_positions-1",
    "granitemoe": "forward has no use_cache parameter (only **kwargs): dynamic_shapes keyed 'use_cache' is rejected",
    "granitemoeshared": "forward has no use_cache parameter (only **kwargs): dynamic_shapes keyed 'use_cache' is rejected",
    "dbrx": "MoE expert loop guards on a data-dependent size (GuardOnDataDependentSymNode Eq(u0, 0)); also"
            " DbrxAttentionConfig needs rope_theta and clip_qkv set by hand to build at all",
    "longcat_flash": "MoE with zero-computation experts guards on a data-dependent size (GuardOnDataDependentSymNode)",
    "zaya": "hybrid (CCA) layers add the guard seq != 2, so Dim(seq) is rejected",
    "lara_mini": "hybrid Gated DeltaNet layers specialise seq to the capture length (16)",
}

SKIPPED: dict[str, str] = {
    # capture and match, but are not one softmax-attention site per decoder layer
    "diffllama": "differential attention: two SDPA calls per layer (4 for 2 layers), outputs subtracted",
    "doge": "dynamic-mask attention: the SDPA mask is computed from the values (dt_proj), not only causal",
    "jetmoe": "mixture-of-attention-heads: q and o projections are per-token MoE experts (router softmax inside attention)",
    "hrm_text": "hierarchical recurrent model: layers reused over cycles (10 SDPA calls for 2 layers), prefix-LM mask",
    "dory": "recurrent depth: the middle layers are looped (4 SDPA calls for 2 layers), mlp-only layers in between",
    # duplicates: AutoModelForCausalLM builds LlamaForCausalLM for these configs
    "internlm3": "builds LlamaForCausalLM (same graph as llama)",
    "exaone": "builds LlamaForCausalLM (same graph as llama)",
    "iquestcoder": "builds LlamaForCausalLM (same graph as llama)",
    "lfm3": "hybrid short-conv: with 2 layers the default layer_types are all 'conv' (no attention at all)",
    # hybrids / no softmax attention in most layers: not tried
    **{name: "hybrid: linear-attention / SSM / conv layers besides (or instead of) softmax attention; not tried"
       for name in ("lfm2", "lfm2_moe", "bamba", "jamba", "zamba", "zamba2", "falcon_h1", "granitemoehybrid",
                    "nemotron_h", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen4_exp_text", "kimi_linear",
                    "minimax", "olmo_hybrid", "bailing_hybrid", "recurrent_gemma")},
    **{name: "no attention (SSM / RNN)" for name in ("mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm")},
}
