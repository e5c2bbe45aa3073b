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


# In this order: the residual fusion reads the fused norms.
FUSIONS = (("norms", fuse_rms_norms), ("residual norms", fuse_residual_norms), ("swiglu", fuse_swiglu), ("rope", fuse_rope))


def fuse_elementwise(gm: GraphModule, in_place: bool = False) -> tuple[GraphModule, dict[str, int]]:
    """A fork of `gm` (gm itself with in_place; gm itself when nothing matched) with every fusion, and
    how many of each (one fork at most: each rewrite after the first works on it in place)."""
    fused, counts = gm, {}
    for name, fuse in FUSIONS:
        fused, counts[name] = fuse(fused, in_place=in_place or fused is not gm)
    return fused, counts
