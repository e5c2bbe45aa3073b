"""The fast route's elementwise fusions, applied together: each RMSNorm as one kernel
(surgery.decode.fused_norms), then each residual add with the norm that reads it
(surgery.decode.residual_norm), each SwiGLU product (surgery.decode.swiglu) and each rotate-half RoPE
(surgery.decode.rope). Uncompiled routes and a Decoder's static steps take them; a compiled graph does
not need them (inductor fuses itself)."""
from __future__ import annotations

from torch.fx import GraphModule

from .fused_norms import fuse_rms_norms
from .residual_norm import fuse_residual_norms
from .rope import fuse_rope
from .swiglu import fuse_swiglu


def fuse_elementwise(gm: GraphModule, in_place: bool = False) -> tuple[GraphModule, dict[str, int]]:
    """A fork of `gm` (gm itself with in_place; gm itself when nothing matched) with every fusion, and
    how many of each."""
    fused, norms = fuse_rms_norms(gm, in_place)
    fused, residuals = fuse_residual_norms(fused, in_place=in_place or fused is not gm)
    fused, swiglus = fuse_swiglu(fused, in_place=in_place or fused is not gm)
    fused, ropes = fuse_rope(fused, in_place=in_place or fused is not gm)
    return fused, {"norms": norms, "residual norms": residuals, "swiglu": swiglus, "rope": ropes}
