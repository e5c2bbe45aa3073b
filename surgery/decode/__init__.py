"""Incremental decoding of a captured or converted graph: a plan read from the sites (plan), KV
caches for kept attention (caches), recurrent state for GDN layers (gdn_state), positions continued
from the graph (positions), the Decoder that runs them (runtime), static and CUDA-graph steps
(static_step), sampling and generate (sampling)."""
from ..errors import DecodeError
from .plan import DecodePlan, plan_decode
from .runtime import Decoder
from .sampling import check_sampling, generate, sample

__all__ = ["DecodeError", "DecodePlan", "Decoder", "check_sampling", "generate", "plan_decode", "sample"]
