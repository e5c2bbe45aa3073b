"""fla's chunk-to-chunk GDN state pass, launched with a config chosen from the rows x heads it runs.

fla autotunes `chunk_gated_delta_rule_fwd_kernel_h_blockdim64` on a key of head counts and sizes only,
so one config serves a batch-1 prompt and a training batch alike, and the config shipped for
SmolLM2's GDN (tcal.kernel_configs: value blocks of 32) leaves a batch-1 prompt 18 programs of 132 SMs,
each walking every chunk in turn. Narrower value blocks give more programs the same depth. Timed on an
H200 at 9 heads of 64 (`python bench/speed.py --sections gdn_forward --gdn-forward-stages state`,
bench/RESULTS.md, thirty-third session), the pass took, in us:

    rows x heads   shipped (BV 32)   best                 chosen here
    9  (2k x 1)    28.8              22.6 (BV 16, 3 st.)  BV 16: 36 programs
    9  (8k x 1)    100.3             81.4 (BV 16)         BV 16
    36 (2k x 4)    28.5              28.5 (BV 32, 4 st.)  BV 32: 72 programs
    72 (2k x 8)    40.8              37.2 (BV 64, 4 st.)  BV 64: 72 programs

that is, the widest block that still gives about BUSY programs. Inference only (tcal.kernels' no-grad fla
path), head size 64 only (the size measured), up to MAX_ROW_HEADS rows x heads (past that fla's tuned
config, as in training). Every element of the state and output is computed as with any other block
width (a block splits the value columns only). SURGERY_STATE_PASS=off leaves fla's autotuned config.
"""
from __future__ import annotations

import functools

import torch

from .chunk_intra import CHUNK
from .switches import enabled

SWITCH = "SURGERY_STATE_PASS"
HEAD_DIM = 64        # the only head size timed
BUSY = 72            # programs the widest block must still give (the measured optimum at 36 and 72 rows x heads)
MAX_ROW_HEADS = 72   # measured up to here
# value block -> (warps, pipeline stages), the best of 2/4/8 warps x 2/3/4 stages at each block width
LAUNCH = {16: (4, 3), 32: (4, 4), 64: (4, 4)}


def state_pass_config(row_heads: int, k_dim: int, v_dim: int, device: torch.device) -> tuple[int, int, int] | None:
    """(value block, warps, stages) for a state pass over `row_heads` rows x heads, or None: fla's own."""
    if not enabled(SWITCH, True) or device.type != "cuda":
        return None
    if k_dim != HEAD_DIM or v_dim != HEAD_DIM or row_heads > MAX_ROW_HEADS:
        return None
    block = next((bv for bv in (64, 32) if row_heads * (v_dim // bv) >= BUSY), 16)
    return (block, *LAUNCH[block])


@functools.cache
def _kernel():
    """fla's state-pass kernel under its own heuristics, without its autotuner (the config is given)."""
    import triton
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_kernel_h_blockdim64 as tuned
    from triton.runtime.autotuner import Autotuner, Heuristics

    jit = tuned
    while isinstance(jit, (Heuristics, Autotuner)):
        jit = jit.fn
    return triton.heuristics(tuned.values)(jit)


def state_pass(k, w, u, g, initial_state, output_final_state: bool, config: tuple[int, int, int]):
    """fla's `chunk_gated_delta_rule_fwd_h` (equal-length rows) launched with `config`: returns the state
    entering each chunk [B, NT, HV, K, V], the corrected values v_new like u, and the final state
    (float32) or None. g is the chunk-local cumulative log2 decay, as fla's forward passes it."""
    import triton

    batch, seq_len, heads, k_dim = k.shape
    v_heads, v_dim = u.shape[2], u.shape[3]
    block, warps, stages = config
    h = k.new_empty(batch, triton.cdiv(seq_len, CHUNK), v_heads, k_dim, v_dim)
    v_new = torch.empty_like(u)
    final = k.new_empty(batch, v_heads, k_dim, v_dim, dtype=torch.float32) if output_final_state else None
    _kernel()[(triton.cdiv(v_dim, block) * batch * v_heads,)](
        k=k, v=u, w=w, v_new=v_new, g=g, gk=None, h=h, h0=initial_state, ht=final, cu_seqlens=None,
        chunk_offsets=None, T=seq_len, H=heads, HV=v_heads, K=k_dim, V=v_dim, BT=CHUNK, STATE_V_FIRST=False,
        BV=block, num_warps=warps, num_stages=stages)
    return h, v_new, final
