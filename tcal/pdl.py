"""Programmatic dependent launch (PDL, sm_90 and later) for the GDN prefill's chain of Triton kernels.

At 2k x 1 a GDN layer's prefill is a chain of small launches (tcal.delta_inputs, tcal.chunk_intra, the
state pass and output, the gated norm), each a few microseconds, and inside a CUDA graph each still
waits for the one before to drain before its programs start (~1 us a kernel in a replayed step, bench/
RESULTS.md, thirtieth and thirty-third sessions). Launched as programmatic dependents, a kernel's
programs are scheduled while the previous kernel finishes: each waits (griddepcontrol.wait) before it
touches global memory, so it reads every input complete and writes nothing a previous kernel still reads,
and lets its own dependent launch (griddepcontrol.launch_dependents) after its last store.

On one H200 it took the chunk_states + chunk_inputs chain's 2k x 1 forward from 3.981 to 3.749 ms, still slower than
the default route (3.514; bench/RESULTS.md, thirty-ninth session): off unless SURGERY_PDL=on. The kernels take a
PDL constexpr; off, neither instruction is emitted (and the interpreter, which cannot run them, never sees them)."""
from __future__ import annotations

import torch

from .switches import enabled

try:  # Triton is a CUDA-side extra: CPU installs do not have it
    import triton
    import triton.language as tl
except Exception:  # a broken install raises more than ImportError
    triton = None

SWITCH = "SURGERY_PDL"
MIN_CAPABILITY = 9  # griddepcontrol is Hopper's


def pdl_on(device: torch.device) -> bool:
    """SURGERY_PDL=on and a CUDA device of compute capability 9.0 or later."""
    if triton is None or not enabled(SWITCH, False) or torch.device(device).type != "cuda":
        return False
    return torch.cuda.get_device_capability(device)[0] >= MIN_CAPABILITY


def pdl_launch(device: torch.device) -> dict:
    """Launch keywords for a kernel that takes the PDL constexpr: the constexpr and the launch attribute together
    ({"PDL": True, "launch_pdl": True} where pdl_on, else {"PDL": False})."""
    return {"PDL": True, "launch_pdl": True} if pdl_on(device) else {"PDL": False}


if triton is not None:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def wait_for_inputs(PDL: tl.constexpr):
        """A dependent launch's programs wait here, before their first global load or store."""
        if PDL:
            gdc_wait()

    @triton.jit
    def release_dependents(PDL: tl.constexpr):
        """After a program's last store: the next kernel's programs may be scheduled."""
        if PDL:
            gdc_launch_dependents()
