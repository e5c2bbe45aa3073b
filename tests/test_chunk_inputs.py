"""tcal/chunk_inputs.py: the recurrence's inputs formed in the intra kernel's launch, from a GatedDeltaNet's projections.

Which projections it takes (only when SURGERY_CHUNK_INPUTS=on); under Triton's CPU interpreter, bit-identical to
tcal.delta_inputs' kernel followed by tcal.chunk_intra's (float32 and float16, strided and transposed projections,
partial chunks), and through tcal.split_state's one-piece path; on CUDA a bf16 layer's output and state with it equal
to those without it (skipped where Triton is not installed or no GPU)."""
from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

import tcal.chunk_inputs as chunk_inputs
from interpreted import run_interpreted
from test_split_state import cuda_fla

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed (a CUDA-side extra)")


def projections(batch=1, length=100, heads=3, dim=64, dtype=torch.float32, seed=0):
    """q, k, v, a, b as slices of one wider projection (a GDN layer's fused input projection)."""
    gen = torch.Generator().manual_seed(seed)
    fused = torch.randn(batch, length, heads * (3 * dim + 2) + 5, generator=gen).to(dtype)
    parts = fused[..., :heads * (3 * dim + 2)].split([heads * dim] * 3 + [heads] * 2, dim=-1)
    return [p.unflatten(-1, (heads, dim)) for p in parts[:3]] + list(parts[3:])


@needs_triton
def test_takes_only_when_switched_on(monkeypatch):
    q, k, v, a, b = projections()
    monkeypatch.delenv(chunk_inputs.SWITCH, raising=False)
    assert not chunk_inputs.chunk_inputs_takes(q, k, v, a, b)  # not timed on a GPU yet: off by default
    monkeypatch.setenv(chunk_inputs.SWITCH, "on")
    assert chunk_inputs.chunk_inputs_takes(q, k, v, a, b)
    assert not chunk_inputs.chunk_inputs_takes(*projections(dim=128))  # a row wider than one column block
    assert not chunk_inputs.chunk_inputs_takes(q, k, v[..., :32], a, b)


@needs_triton
@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="fla is not installed (a CUDA-side extra)")
def test_kernel_in_the_interpreter():
    script = textwrap.dedent("""
        import os, sys, torch
        from tests.fla_interpreter import install
        install("fla.ops.gated_delta_rule", "fla.ops.common", "fla.ops.utils")
        sys.path.insert(0, "tests")  # the test module's own imports (interpreted, test_split_state)
        from test_chunk_inputs import projections
        from tcal.chunk_inputs import chunk_inputs_triton
        from tcal.chunk_intra import chunk_intra_triton
        from tcal.delta_inputs import Projections, delta_inputs_triton
        from tcal.kernels import gated_delta_rule
        from tcal.split_state import split_state_gated_delta_rule

        A_log, dt_bias = torch.randn(3), torch.randn(3) * 4
        for dtype in (torch.float32, torch.float16):
            for length, transposed in ((100, False), (130, True), (64, False)):
                parts = projections(2, length, 3, 64, dtype, seed=length)
                if transposed:  # a short convolution's output is a transposed view
                    parts = [x.transpose(1, 0).contiguous().transpose(1, 0) for x in parts]
                for v_silu in (True, False):
                    q, k, g_cum, w, u = chunk_inputs_triton(*parts, A_log, dt_bias, v_silu)
                    q2, k2, v2, g2, beta2 = delta_inputs_triton(*parts, A_log, dt_bias, v_silu)
                    want = (q2, k2, *chunk_intra_triton(k2, v2, g2, beta2))
                    for name, x, y in zip(("q", "k", "g_cum", "w", "u"), (q, k, g_cum, w, u), want):
                        assert x.dtype == y.dtype and x.is_contiguous() and torch.equal(x, y), (dtype, length, v_silu, name)

        # the one-piece path from the projections, against the same path on the prepared inputs
        parts = projections(1, 200, 3, 64, seed=3)
        p = Projections(*parts, A_log, dt_bias, True)
        state = 0.1 * torch.randn(1, 3, 64, 64)
        for states in ("off", "on"):
            os.environ["SURGERY_CHUNK_STATES"] = states
            folded = split_state_gated_delta_rule(None, None, None, None, None, 0.125, state, True, 1, (16, 4, 3), projections=p)
            prepared = split_state_gated_delta_rule(*p.prepared(), 0.125, state, True, 1, (16, 4, 3))
            assert torch.equal(folded[0], prepared[0]) and torch.equal(folded[1], prepared[1]), states
        want, want_state = gated_delta_rule(*(x.double() for x in p.prepared()), 0.125, state.double(), True, backend="torch")
        rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()
        assert rel(folded[0], want) < 1e-5 and rel(folded[1], want_state) < 1e-5
        print("ok")
    """)
    done = run_interpreted(script)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


@cuda_fla
@pytest.mark.parametrize("use_cache", [False, True])
def test_layer_equal_with_and_without(monkeypatch, use_cache):
    """A bf16 GatedDeltaNet of SmolLM2's GDN shapes at 2k x 1 (the one-piece path, with the walk of tcal.chunk_states):
    the output and the final state with the inputs formed in the intra kernel equal those with tcal.delta_inputs' launch."""
    from tcal.gdn import GDNCache, GatedDeltaNet

    torch.manual_seed(0)
    layer = GatedDeltaNet(576, 9, 64, backend="fla").cuda().bfloat16()
    x = torch.randn(1, 2048, 576, device="cuda").bfloat16()
    monkeypatch.setenv("SURGERY_STATE_SPLITS", "off")
    monkeypatch.setenv("SURGERY_CHUNK_STATES", "on")
    results = {}
    for setting in ("off", "on"):
        monkeypatch.setenv(chunk_inputs.SWITCH, setting)
        cache = GDNCache() if use_cache else None
        with torch.no_grad():
            results[setting] = layer(x, cache), (cache.recurrent if use_cache else None)
    assert torch.equal(results["on"][0], results["off"][0])
    assert not use_cache or torch.equal(results["on"][1], results["off"][1])
