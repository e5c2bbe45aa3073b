"""Incremental decoding of a captured or converted graph: a plan read from the sites (plan), KV
caches for kept attention (caches), recurrent state for GDN layers (gdn_state), positions continued
from the graph (positions), the Decoder that runs them (runtime), static and CUDA-graph steps
(static_step, with split-KV attention on CUDA: step_attention, and the position tables kept per
capacity: step_tables), sampling and generate (sampling); and the fast route every inference forward takes
(fast: the runner evaluation, passkey and a Decoder's prefill use)."""
from ..errors import DecodeError
from .fast import fast_logits, fast_runner
from .plan import DecodePlan, plan_decode
from .runtime import Decoder
from .sampling import check_sampling, generate, sample

__all__ = ["DecodeError", "DecodePlan", "Decoder", "check_sampling", "fast_logits", "fast_runner", "generate", "plan_decode", "sample"]
