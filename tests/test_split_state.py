"""tcal/split_state.py: the GDN chunk forward with its state pass cut into pieces along the sequence.

The index tensors against a plain construction and the piece-count model on any machine; fla's real
kernels through tcal.kernels.gated_delta_rule under Triton's CPU interpreter against the float64 PyTorch
recurrence (skipped where Triton is not installed); on CUDA, bf16 against float64 beside the unsplit
kernel, and a CUDA-graph capture against the eager call."""
from __future__ import annotations

import importlib.util
import math
import textwrap

import pytest
import torch
import torch.nn.functional as F

import tcal.split_state as split
from interpreted import run_interpreted
from tcal.kernels import fla_available, gated_delta_rule


@pytest.mark.parametrize("batch,seq_len,splits", [(1, 2048, 8), (2, 300, 3), (3, 1000, 4), (1, 640, 32), (2, 129, 2)])
def test_piece_layout_matches_a_plain_construction(batch, seq_len, splits):
    layout = split.piece_layout(batch, seq_len, splits, torch.device("cpu"))
    n_chunks = math.ceil(seq_len / 64)
    run = math.ceil(n_chunks / splits)
    bounds, offsets, indices = [0], [0], []
    for b in range(batch):
        for start in range(0, n_chunks, run):
            end = min(start + run, n_chunks)
            bounds.append(b * seq_len + min(end * 64, seq_len))
            offsets.append(offsets[-1] + end - start)
            indices += [[len(bounds) - 2, c - start] for c in range(start, end)]
    assert layout.pieces == len(range(0, n_chunks, run)) <= splits
    assert layout.cu_seqlens.tolist() == bounds
    assert layout.chunk_offsets.tolist() == offsets
    assert layout.chunk_indices.tolist() == indices
    assert layout.seq_offsets.tolist() == [b * layout.pieces for b in range(batch + 1)]
    assert layout.init_offsets.tolist() == [b * (layout.pieces - 1) for b in range(batch + 1)]
    assert layout.row_ids.tolist() == list(range(batch))


def test_piece_counts_follow_the_cost_model():
    assert split.state_splits(1, 9, split.MIN_CHUNKS - 1) == 1  # too short to pay
    assert split.state_splits(1, 9, 32) == 1  # 2k: the pre-scan and merge cost more than they save (measured)
    assert split.state_splits(2, 9, 512) == 1  # rows x heads past MAX_ROW_HEADS: the unsplit pass is busy enough
    assert split.state_splits(1, 9, 512) == 16  # 32k at batch 1: the measured best
    assert split.state_splits(1, 4, 512, head_dim=128) == 1  # head sizes the model was not fitted at
    for n_chunks in (256, 512, 4096):
        pieces = split.state_splits(1, 9, n_chunks)
        assert 1 < pieces <= split.MAX_SPLITS
        assert split.split_depth(n_chunks, pieces) <= split.MIN_GAIN * n_chunks
        assert all(split.split_depth(n_chunks, pieces) <= split.split_depth(n_chunks, s) for s in range(1, split.MAX_SPLITS + 1))


def test_kept_layouts_are_bounded():
    split._LAYOUTS.clear()
    for seq_len in range(64, 64 * (split.KEPT_LAYOUTS + 10), 64):
        split._layout(1, seq_len, 2, torch.device("cpu"))
    assert len(split._LAYOUTS) == split.KEPT_LAYOUTS and (1, 64, 2, "cpu") not in split._LAYOUTS
    split._LAYOUTS.clear()


def test_the_switch_forces_or_refuses(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv(split.SWITCH, "off")
    assert split.requested_splits(1, 9, 32768, cpu) == 1
    monkeypatch.setenv(split.SWITCH, "4")
    assert split.requested_splits(1, 9, 32768, cpu) == 4
    assert split.requested_splits(1, 9, 100, cpu) == 2  # never more pieces than chunks
    monkeypatch.setenv(split.SWITCH, "many")
    with pytest.raises(ValueError, match=split.SWITCH):
        split.requested_splits(1, 9, 32768, cpu)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None or importlib.util.find_spec("fla") is None,
                    reason="Triton is not installed (a CUDA-side extra)")
def test_fla_kernels_split_in_the_interpreter():
    """fla's kernels run by Triton's CPU interpreter (float32) through gated_delta_rule's fla path with the
    state pass forced into pieces, and whole at each value block tcal.state_pass can launch (with and
    without a final state): rows of 300 and 260 tokens (a partial last chunk), with and without an initial
    state, against the float64 token recurrence."""
    script = textwrap.dedent("""
        import os, torch
        from tests.fla_interpreter import install
        install("fla.ops.gated_delta_rule", "fla.ops.cp", "fla.ops.common")
        import fla.ops.cp.chunk_fwd
        fla.ops.cp.chunk_fwd._check_cp_device = lambda device: None  # the interpreter's tensors live on the CPU
        from tcal.kernels import gated_delta_rule
        from tcal.split_state import split_state_gated_delta_rule
        from tcal.state_pass import LAUNCH

        rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()
        for batch, seq_len, pieces, with_state in ((1, 300, 3, False), (2, 260, 2, True)):
            gen = torch.Generator().manual_seed(0)
            r = lambda *s: torch.randn(*s, generator=gen)
            q, k = r(batch, seq_len, 2, 64), torch.nn.functional.normalize(r(batch, seq_len, 2, 64), dim=-1)
            v, g = r(batch, seq_len, 2, 64), -0.1 * torch.rand(batch, seq_len, 2, generator=gen)
            beta, state = torch.rand(batch, seq_len, 2, generator=gen), 0.1 * r(batch, 2, 64, 64)
            state = state if with_state else None
            want, want_state = gated_delta_rule(*[x.double() for x in (q, k, v, g, beta)], None,
                                                None if state is None else state.double(), True, backend="torch")
            os.environ["SURGERY_STATE_SPLITS"] = str(pieces)
            with torch.no_grad():
                o, s = gated_delta_rule(q, k, v, g, beta, None, state, True, backend="fla")
            errors = rel(o, want), rel(s, want_state)
            assert max(errors) < 1e-5, (batch, seq_len, pieces, errors)
            for block, (warps, stages) in LAUNCH.items():  # one piece, the state pass at each tcal.state_pass width
                with torch.no_grad():
                    o, s = split_state_gated_delta_rule(q, k, v, g, beta, 64 ** -0.5, state, True, 1, (block, warps, stages))
                    o2, none = split_state_gated_delta_rule(q, k, v, g, beta, 64 ** -0.5, state, False, 1, (block, warps, stages))
                errors = rel(o, want), rel(s, want_state)
                assert max(errors) < 1e-5 and none is None and torch.equal(o, o2), (batch, seq_len, block, errors)
                if state is not None:  # the same state as a strided view
                    strided = state.transpose(-1, -2).contiguous().transpose(-1, -2)
                    with torch.no_grad():
                        o3, s3 = split_state_gated_delta_rule(q, k, v, g, beta, 64 ** -0.5, strided, True, 1, (block, warps, stages))
                    assert torch.equal(o3, o) and torch.equal(s3, s), block
        print("ok")
    """)
    done = run_interpreted(script)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


cuda_fla = pytest.mark.skipif(not (torch.cuda.is_available() and fla_available()), reason="needs CUDA and fla")


def gdn_inputs(batch, seq_len, heads=9, dim=64):
    gen = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")
    q, k = (F.normalize(r(batch, seq_len, heads, dim), dim=-1).bfloat16() for _ in range(2))
    v = r(batch, seq_len, heads, dim).bfloat16()
    g, beta = -0.3 * torch.rand(batch, seq_len, heads, generator=gen, device="cuda"), torch.rand(batch, seq_len, heads, generator=gen, device="cuda")
    return q, k, v, g, beta, 0.1 * r(batch, heads, dim, dim)


@cuda_fla
@pytest.mark.parametrize("batch,seq_len,heads,dim", [(1, 2048, 9, 64), (2, 3000, 9, 64), (1, 2048, 4, 128), (1, 1500, 2, 256)])
def test_split_is_as_close_to_float64_as_unsplit(monkeypatch, batch, seq_len, heads, dim):
    errors = errors_by_setting(monkeypatch, split.SWITCH, ("off", "8"), gdn_inputs(batch, seq_len, heads, dim))
    assert errors["8"][0] <= 1.5 * errors["off"][0] + 1e-4, errors
    assert errors["8"][1] <= 1.5 * errors["off"][1] + 1e-4, errors


def replays_as_eager(call) -> bool:
    """call() eagerly, then captured in a CUDA graph and replayed: whether every output came back bit-identical."""
    with torch.no_grad():
        eager = call()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = call()
        graph.replay()
    torch.cuda.synchronize()
    return all(torch.equal(a, b) for a, b in zip(eager, replayed))


def errors_by_setting(monkeypatch, switch: str, settings, inputs) -> dict:
    """setting of `switch` -> the fla path's (output, final state) relative errors against float64 on `inputs`."""
    q, k, v, g, beta, state = inputs
    want, want_state = gated_delta_rule(*(x.double() for x in (q, k, v, g, beta)), None, state.double(), True, backend="torch")
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
    errors = {}
    for setting in settings:
        monkeypatch.setenv(switch, setting)
        with torch.no_grad():
            o, s = gated_delta_rule(q, k, v, g, beta, None, state, True, backend="fla")
        errors[setting] = rel(o, want), rel(s, want_state)
    return errors


@cuda_fla
def test_split_replays_from_a_cuda_graph(monkeypatch):
    """A capture builds its own index tensors (their values exist only on replay) and keeps none of them."""
    monkeypatch.setenv(split.SWITCH, "8")
    q, k, v, g, beta, state = gdn_inputs(1, 2048)
    with torch.no_grad():
        eager, eager_state = gated_delta_rule(q, k, v, g, beta, None, state, True, backend="fla")  # compiles, tunes
        split._LAYOUTS.clear()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o, s = gated_delta_rule(q, k, v, g, beta, None, state, True, backend="fla")
        assert not split._LAYOUTS
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o, eager) and torch.equal(s, eager_state)
