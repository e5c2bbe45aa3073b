"""Attention sites: what the graph says each attention layer is (AttentionSite), found from the
graph alone (finder), with the op sets it recognises (ops), the index probe (probe) and the
attention op of each layer (attention_op)."""
from .finder import find_sites, vocab_size
from .site import AttentionSite, Projection

__all__ = ["AttentionSite", "Projection", "find_sites", "vocab_size"]
