"""tcal/chunk_intra.py: the gated delta rule's intra-chunk forward (cumsum, (I + A)^-1, w, u) as one kernel.

Which inputs it takes, on any machine; the kernel under Triton's CPU interpreter (float32) against the
float64 reference at every column block it takes, with partial chunks and unequal head sizes, and beside
fla's own four launches (skipped where Triton is not installed); on CUDA, bf16 no farther from float64 than
fla's, through gated_delta_rule too, and in a CUDA graph."""
from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

import tcal.chunk_intra as ci
from interpreted import run_interpreted
from test_split_state import cuda_fla, errors_by_setting, gdn_inputs

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed (a CUDA-side extra)")


def intra_inputs(batch=1, length=100, heads=2, k_dim=64, v_dim=64, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    k = torch.nn.functional.normalize(torch.randn(batch, length, heads, k_dim, generator=gen), dim=-1).to(dtype)
    v = torch.randn(batch, length, heads, v_dim, generator=gen).to(dtype)
    return k, v, -0.3 * torch.rand(batch, length, heads, generator=gen), torch.rand(batch, length, heads, generator=gen)


@needs_triton
def test_takes_what_the_kernel_handles(monkeypatch):
    monkeypatch.delenv(ci.SWITCH, raising=False)
    k, v, g, beta = intra_inputs()
    assert ci.chunk_intra_takes(k, v, g, beta)
    assert ci.chunk_intra_takes(*intra_inputs(dtype=torch.bfloat16)[:2], g, beta)
    assert not ci.chunk_intra_takes(k, v[:, :, :1].contiguous(), g, beta)  # grouped v heads: fla's kernels
    assert not ci.chunk_intra_takes(k, v, g.bfloat16(), beta)
    assert not ci.chunk_intra_takes(k.transpose(1, 2).contiguous().transpose(1, 2), v, g, beta)
    assert not ci.chunk_intra_takes(*intra_inputs(k_dim=512)[:2], g, beta)
    assert not ci.chunk_intra_takes(k.double(), v.double(), g, beta)
    monkeypatch.setenv(ci.SWITCH, "off")
    assert not ci.chunk_intra_takes(k, v, g, beta)


def test_reference_solves_the_chunk_system():
    """w and u satisfy (I + A) w = diag(beta) (k * 2^g_cum) and (I + A) u = diag(beta) v chunk by chunk."""
    k, v, g, beta = intra_inputs(length=70)
    g_cum, w, u = ci.chunk_intra_torch(k, v, g, beta)
    for start in (0, 64):
        part = slice(start, min(start + 64, 70))
        kc, gc, bc = k[0, part, 0].double(), g_cum[0, part, 0], beta[0, part, 0].double()
        assert torch.allclose(gc, g[0, part, 0].double().cumsum(0) / torch.log(torch.tensor(2.0, dtype=torch.float64)))
        a = (kc @ kc.T * torch.exp2(gc[:, None] - gc[None, :]) * bc[:, None]).tril(-1)
        eye = torch.eye(len(gc), dtype=torch.float64)
        assert torch.allclose((eye + a) @ w[0, part, 0], kc * (bc * torch.exp2(gc))[:, None], atol=1e-12)
        assert torch.allclose((eye + a) @ u[0, part, 0], v[0, part, 0].double() * bc[:, None], atol=1e-12)


@needs_triton
@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="fla is not installed (a CUDA-side extra)")
def test_kernel_in_the_interpreter():
    script = textwrap.dedent("""
        import torch
        from tests.fla_interpreter import install
        install("fla.ops.gated_delta_rule", "fla.ops.common", "fla.ops.utils")
        from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
        from fla.ops.utils import chunk_local_cumsum
        from fla.ops.utils.constant import RCP_LN2
        from tcal.chunk_intra import BLOCKS, chunk_intra_torch, chunk_intra_triton

        def intra_inputs(batch, length, heads, k_dim, v_dim):
            gen = torch.Generator().manual_seed(0)
            k = torch.nn.functional.normalize(torch.randn(batch, length, heads, k_dim, generator=gen), dim=-1)
            v = torch.randn(batch, length, heads, v_dim, generator=gen)
            return k, v, -0.3 * torch.rand(batch, length, heads, generator=gen), torch.rand(batch, length, heads, generator=gen)

        rel = lambda a, b: ((a.double() - b.double()).norm() / b.double().norm()).item()
        for shape in ((1, 300, 2, 64, 64), (2, 130, 3, 64, 128), (1, 64, 1, 32, 48)):
            k, v, g, beta = intra_inputs(*shape)
            want = chunk_intra_torch(k, v, g, beta)
            for block in BLOCKS:
                got = chunk_intra_triton(k, v, g, beta, block=block)
                errors = [rel(a, b) for a, b in zip(got, want)]
                assert max(errors) < 1e-6 and all(x.dtype == y.dtype for x, y in zip(got[1:], (k, v))), (shape, block, errors)
            gc = chunk_local_cumsum(g, chunk_size=64, scale=RCP_LN2)
            w, u, _ = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=gc, beta=beta, chunk_size=64)
            assert max(rel(gc, want[0]), rel(w, want[1]), rel(u, want[2])) < 1e-5, shape  # fla's launches agree
        try:
            chunk_intra_triton(k, v, g, beta, block=8)
        except ValueError as e:
            assert "column block" in str(e)
        else:
            raise AssertionError("a column block below 16 was taken")
        print("ok")
    """)
    done = run_interpreted(script)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


@cuda_fla
@pytest.mark.parametrize("batch,seq_len,heads,dim", [(1, 2048, 9, 64), (2, 1000, 9, 64), (1, 1500, 4, 128)])
def test_as_close_to_float64_as_fla(monkeypatch, batch, seq_len, heads, dim):
    """bf16: w and u no farther from float64 than fla's intra launches', and the whole rule's output and state
    no farther than with fla's (SURGERY_CHUNK_INTRA=off); a CUDA-graph replay gives the eager call's."""
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    monkeypatch.setenv("SURGERY_STATE_SPLITS", "off")
    inputs = gdn_inputs(batch, seq_len, heads, dim)
    _, k, v, g, beta, _ = inputs
    want = ci.chunk_intra_torch(k, v, g, beta)
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
    with torch.no_grad():
        ours = ci.chunk_intra_triton(k, v, g, beta)
        gc = chunk_local_cumsum(g, chunk_size=64, scale=RCP_LN2)
        w, u, _ = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=gc, beta=beta, chunk_size=64)
    theirs = (gc, w, u)
    for mine, fla_out, reference in zip(ours, theirs, want):
        assert rel(mine, reference) <= 1.5 * rel(fla_out, reference) + 1e-6
    errors = errors_by_setting(monkeypatch, ci.SWITCH, ("off", "auto"), inputs)
    assert errors["auto"][0] <= 1.5 * errors["off"][0] + 1e-4, errors
    assert errors["auto"][1] <= 1.5 * errors["off"][1] + 1e-4, errors
    with torch.no_grad():
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = ci.chunk_intra_triton(k, v, g, beta)
        graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(replayed, ours))
