"""Random-weight teachers the benchmarks share (speed, decoding, calibration time)."""
from __future__ import annotations

import torch

QWEN15B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2)
QWEN15B_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)


def qwen15b_shaped(device, dtype: torch.dtype, max_length: int, *, tiny: bool = False):
    """Shaped like Qwen2.5-1.5B (28 layers, hidden 1536, 12 heads, 2 KV heads, head_dim 128, vocab
    151,936, tied embeddings); tiny=True keeps the vocabulary and shrinks the rest for CPU smoke runs."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=151936, max_position_embeddings=max_length, tie_word_embeddings=True, rope_theta=1e6,
                         **(QWEN15B_TINY if tiny else QWEN15B))
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()


SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5, rope_theta=100000.0,
                     tie_word_embeddings=True, max_position_embeddings=8192)


def smollm2_shaped():
    """SmolLM2-135M's shapes with random weights: speed does not depend on the weights, and no
    98 MB teacher has to travel to the machine."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(**SMOLLM2_SHAPE), attn_implementation="sdpa").eval()
