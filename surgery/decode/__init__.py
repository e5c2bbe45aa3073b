"""Incremental decoding of a captured or converted graph: KV caches for kept attention, recurrent
state for GDN layers, positions continued from the graph, static and CUDA-graph steps, sampling."""
from ..errors import DecodeError
from .decoder import Decoder, check_sampling, generate, sample

__all__ = ["DecodeError", "Decoder", "check_sampling", "generate", "sample"]
