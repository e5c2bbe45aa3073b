"""fla's chunked gated delta rule with its chunk-to-chunk state pass split along the sequence.

fla's state pass (`chunk_gated_delta_rule_fwd_kernel_h`) walks a row's chunks in order, one program per
head: at batch 1 that is 9 programs for SmolLM2's shapes, 32 chunks deep at 2k tokens and 512 at 32k,
while the rest of the GPU idles (0.81 ms of a 2k prefill's 3.92, bench/RESULTS.md). Here each row is cut
into S chunk-aligned pieces: fla's intra-card context-parallel kernels summarise every piece as an affine
map of the state entering it (h_out = M h_in + h_local), a merge composes the summaries into each piece's
entering state, and the usual state pass then runs all pieces at once from those states: NT chunk steps
become about 4 NT / S + 8 S (`split_depth`). That pays only for long rows: on an H200 the GDN op at 32k x 1
went from 0.617 to 0.450 ms (16 pieces), at 8k from 0.177 to 0.157, and at 2k it lost at every count.
Every other kernel is fla's own forward, unchanged, so the outputs differ from the unsplit kernel's only
by rounding (float32 states, TF32x3 merge).

Inference only (fla's intra-card kernels have no backward), CUDA only, fla 0.6.0 (pinned in pyproject).
The index tensors are built with device ops, so the whole call can be captured in a CUDA graph.
SURGERY_STATE_SPLITS: "auto" (the default, `state_splits` decides), "off", or a number of pieces.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .chunk_inputs import chunk_inputs_triton
from .chunk_intra import CHUNK, chunk_intra_takes, chunk_intra_triton
from .chunk_states import chunk_states_takes, chunk_states_triton
from .gated_norm import normed
from .state_pass import state_pass
from .switches import setting

SWITCH = "SURGERY_STATE_SPLITS"
MAX_SPLITS = 32  # fla's own cap on a merge chain, for its precision
MIN_CHUNKS = 8  # below this the pre-scan and merge cannot pay for themselves
# The cost model, in units of one chunk step of the unsplit state pass (~0.65 us on an H200 at 9 heads
# of 64), fitted to `python bench/speed.py --sections state_splits` (bench/RESULTS.md, thirty-first
# session): a piece's chunk costs about 4 steps (the pre-scan composes each chunk's [K, K] transition in
# TF32x3, then the replay), a merge step about 7.7 (~5 us: a dependent load and TF32x3 product per piece).
PIECE_STEP = 4.0
MERGE_STEP = 7.7
MIN_GAIN = 0.8  # taken only where the model says the pass gets 1.25x faster (rounding differs; the model is rough)
# Splitting pays only while the unsplit pass leaves the GPU nearly idle: at 9 heads x 2 rows of 8k it lost
# at every piece count (0.70-0.92x), at 9 x 1 it won from 8k (1.13x) and at 32k (1.37x).
MAX_ROW_HEADS = 16
# The model was fitted at head size 64 only; a larger head's pre-scan and merge work on [K, K] in TF32x3 and
# were neither timed nor run on a GPU yet, so they stay unsplit unless SURGERY_STATE_SPLITS forces a count.
MAX_HEAD_DIM = 64


def split_depth(n_chunks: int, splits: int) -> float:
    """The state pass's modelled cost in chunk steps: each piece pre-scanned and replayed, then the merge chain."""
    if splits <= 1:
        return float(n_chunks)
    return PIECE_STEP * math.ceil(n_chunks / splits) + MERGE_STEP * splits


def state_splits(batch: int, heads: int, n_chunks: int, head_dim: int = 64) -> int:
    """How many pieces each row's state pass is cut into (1: not split): where few rows x heads leave the
    GPU idle and each row is many chunks deep, the count that minimises `split_depth`."""
    if n_chunks < MIN_CHUNKS or batch * heads > MAX_ROW_HEADS or head_dim > MAX_HEAD_DIM:
        return 1
    most = min(MAX_SPLITS, n_chunks // 2)
    best = min(range(1, most + 1), key=lambda s: (split_depth(n_chunks, s), s), default=1)
    return best if split_depth(n_chunks, best) <= MIN_GAIN * n_chunks else 1


def requested_splits(batch: int, heads: int, seq_len: int, device: torch.device, head_dim: int = 64) -> int:
    """The pieces for this call: SURGERY_STATE_SPLITS if it names a number, 1 if "off", else the model's choice."""
    value = setting(SWITCH, numeric=True)
    n_chunks = math.ceil(seq_len / CHUNK)
    if value == "off":
        return 1
    if isinstance(value, int):
        return max(1, min(value, n_chunks))
    if device.type != "cuda":  # fla's kernels off CUDA run only in Triton's interpreter (tests), never split unasked
        return 1
    return state_splits(batch, heads, n_chunks, head_dim)


class PieceLayout(NamedTuple):
    """Where each row's pieces lie in the flattened token order (see piece_layout)."""
    pieces: int  # per row
    cu_seqlens: torch.Tensor
    chunk_offsets: torch.Tensor
    chunk_indices: torch.Tensor
    seq_offsets: torch.Tensor
    init_offsets: torch.Tensor
    row_ids: torch.Tensor


def piece_layout(batch: int, seq_len: int, splits: int, device: torch.device) -> PieceLayout:
    """Index tensors of the rows' pieces in the flattened [1, batch * seq_len] token order fla's varlen
    kernels read: each row's chunks cut into `splits` runs of ceil(NT / splits) chunks (the last run shorter).

    cu_seqlens [P + 1] and chunk_offsets [P + 1] (P = batch x pieces), chunk_indices [batch x NT, 2]
    (piece, chunk within it), seq_offsets / init_offsets [batch + 1] (a row's first summary, its first
    merged state) and row_ids [batch]. Built from arange alone: no host copy, so it can be captured."""
    n_chunks = math.ceil(seq_len / CHUNK)
    run = math.ceil(n_chunks / splits)
    pieces = math.ceil(n_chunks / run)
    options = dict(device=device, dtype=torch.int32)
    rows = torch.arange(batch, **options)

    def bounds(per_row: int, per_piece: int) -> torch.Tensor:
        """Each piece's start in a row-major count of per_row units a row, then the total."""
        starts = rows[:, None] * per_row + torch.arange(pieces, **options)[None, :] * per_piece
        return torch.cat([starts.flatten(), torch.full((1,), batch * per_row, **options)])

    cu_seqlens, chunk_offsets = bounds(seq_len, run * CHUNK), bounds(n_chunks, run)
    chunk = torch.arange(n_chunks, **options)
    piece = rows[:, None] * pieces + (chunk // run)[None, :]
    within = (chunk % run)[None, :].expand(batch, n_chunks)
    row_marks = torch.arange(batch + 1, **options)
    return PieceLayout(pieces, cu_seqlens, chunk_offsets, torch.stack([piece.flatten(), within.flatten()], 1),
                       row_marks * pieces, row_marks * (pieces - 1), rows)


_LAYOUTS: dict[tuple, PieceLayout] = {}
KEPT_LAYOUTS = 64  # prompt lengths vary; the oldest shapes' few small tensors are dropped past this


def _layout(batch: int, seq_len: int, splits: int, device: torch.device) -> PieceLayout:
    """piece_layout, kept per shape; never kept from inside a CUDA-graph capture (its values exist only on replay)."""
    key = (batch, seq_len, splits, str(device))
    if key in _LAYOUTS:
        return _LAYOUTS[key]
    layout = piece_layout(batch, seq_len, splits, device)
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        _LAYOUTS[key] = layout
        while len(_LAYOUTS) > KEPT_LAYOUTS:
            _LAYOUTS.pop(next(iter(_LAYOUTS)))
    return layout


def split_state_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, splits, config=None,
                                 output_norm=None, projections=None):
    """fla's chunk forward (cumsum, intra-chunk WY, state pass, output) with the state pass split in pieces;
    with splits == 1, the whole rows' state pass launched with `config` (tcal.state_pass) instead, or
    tcal.chunk_states' walk and output where it takes the inputs (SURGERY_CHUNK_STATES=on). The
    cumsum and intra-chunk WY are tcal.chunk_intra's one kernel where it takes the inputs (fla's otherwise).

    Arguments as tcal.kernels.gated_delta_rule's fla path: q, k [B, T, H, K]; v [B, T, HV, V]; g, beta
    [B, T, HV]; states [B, HV, K, V]. Returns (o [B, T, HV, V] in q's dtype, final state float32 or None);
    with output_norm (tcal.gated_norm.OutputNorm) o normed, by tcal.chunk_states' output kernel where it runs. With
    projections (tcal.delta_inputs.Projections) instead of q, k, v, g, beta: the inputs formed by tcal.chunk_inputs."""
    if splits == 1 and config is None:
        raise ValueError("one piece runs the state pass with a tcal.state_pass launch config; pass config=")
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_fwd_o
    from fla.ops.cp.chunk_fwd import chunk_cp_fwd_h
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    if projections is not None:  # the inputs formed in the intra kernel's launch
        q, k, g, w, u = chunk_inputs_triton(*projections)
    else:
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        if chunk_intra_takes(k, v, g, beta):
            g, w, u = chunk_intra_triton(k, v, g, beta)
        else:
            g = chunk_local_cumsum(g, chunk_size=CHUNK, scale=RCP_LN2)  # log2 space, as fla's forward
            w, u, _ = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=g, beta=beta, chunk_size=CHUNK)
    batch, seq_len, _, dk = k.shape
    heads, dv = u.shape[2], u.shape[3]
    if splits == 1:  # fla's kernel reads the initial state as a contiguous [B, HV, K, V] block
        start = None if initial_state is None else initial_state.contiguous()
        if chunk_states_takes(q, k, w, u, g):  # SURGERY_CHUNK_STATES=on: one product a chunk on the walk
            o, final = chunk_states_triton(q, k, w, u, g, scale, start, output_final_state, config[0], output_norm=output_norm)
            return o.to(q.dtype), final
        h, v_new, final = state_pass(k, w, u, g, start, output_final_state, config)
        return normed(chunk_fwd_o(q=q, k=k, v=v_new, h=h, g=g, scale=scale, chunk_size=CHUNK).to(q.dtype), output_norm), final

    layout = _layout(batch, seq_len, splits, q.device)
    pieces = layout.pieces
    flat = [x.view(1, batch * seq_len, *x.shape[2:]) for x in (k, w, u, g)]

    summaries = k.new_empty(batch * pieces, heads, dk, dv + dk, dtype=torch.float32)
    chunk_cp_fwd_h(k=flat[0], w=flat[1], u=flat[2], hm=summaries, g=flat[3], cu_seqlens=layout.cu_seqlens,
                   chunk_size=CHUNK, multi_seqs=True)
    entering = _entering_states(summaries, layout, initial_state, batch, pieces, heads, dk, dv)

    h, v_new, final = chunk_gated_delta_rule_fwd_h(
        k=flat[0], w=flat[1], u=flat[2], g=flat[3], initial_state=entering, output_final_state=output_final_state,
        chunk_size=CHUNK, cu_seqlens=layout.cu_seqlens, chunk_indices=layout.chunk_indices,
        chunk_offsets=layout.chunk_offsets,
    )
    h = h.view(batch, -1, *h.shape[2:])
    o = chunk_fwd_o(q=q, k=k, v=v_new.view(batch, seq_len, heads, dv), h=h, g=g, scale=scale, chunk_size=CHUNK)
    if output_final_state:
        final = final.view(batch, pieces, heads, dk, dv)[:, -1].contiguous()
    return normed(o.to(q.dtype), output_norm), final


def _entering_states(summaries, layout, initial_state, batch, pieces, heads, dk, dv) -> torch.Tensor:
    """[batch x pieces, HV, K, V] float32: each row's initial state (or zeros), then the merged states."""
    import triton
    from fla.ops.cp.chunk_merge import chunk_cp_fwd_bwd_kernel_merge

    first = (summaries.new_zeros(batch, 1, heads, dk, dv) if initial_state is None
             else initial_state.to(torch.float32).reshape(batch, 1, heads, dk, dv))
    if pieces == 1:
        return first.flatten(0, 1)
    merged = summaries.new_empty(batch * (pieces - 1), heads, dk, dv)
    h0 = None if initial_state is None else initial_state.contiguous()

    def grid(meta):
        return (triton.cdiv(dv, meta["BV"]), batch, heads)

    chunk_cp_fwd_bwd_kernel_merge[grid](
        h=merged, ag_hm=summaries, num_ranks=batch, rank=0, seq_offsets=layout.seq_offsets,
        init_offsets=layout.init_offsets, h0_seq_ids=layout.row_ids, h0=h0, h_seq_idx=None,
        HV=heads, K=dk, V=dv, BK=triton.next_power_of_2(dk), FORWARD=True, IS_INTRACARD=True, N=batch,
        STATE_V_FIRST=False,
    )
    return torch.cat([first, merged.view(batch, pieces - 1, heads, dk, dv)], 1).flatten(0, 1)
