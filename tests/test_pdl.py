"""tcal/pdl.py: programmatic dependent launch of the GDN prefill's Triton chain, off unless SURGERY_PDL=on.

Where it turns on (never off CUDA, never before sm_90); every kernel that takes it compiles for sm_90a with
its two griddepcontrol instructions (on the CPU machine: Triton's compiler and ptxas need no GPU); on
an sm_90 GPU, the chain's outputs with it are bit-identical to those without, eagerly and replayed."""
from __future__ import annotations

import importlib.util

import pytest
import torch

import tcal.pdl as pdl
from test_split_state import cuda_fla, gdn_inputs

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed (a CUDA-side extra)")


def test_off_by_default_and_off_the_gpu(monkeypatch):
    monkeypatch.delenv(pdl.SWITCH, raising=False)
    assert not pdl.pdl_on(torch.device("cpu")) and pdl.pdl_options(torch.device("cpu")) == {}
    monkeypatch.setenv(pdl.SWITCH, "on")
    assert not pdl.pdl_on(torch.device("cpu"))  # no griddepcontrol off CUDA, switched on or not


def sm90_ptx(kernel, signature: dict, constexprs: dict) -> str:
    """The kernel compiled for sm_90 (launch_pdl on, as tcal.pdl launches it): its PTX."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(fn=kernel, signature={**signature, **{name: "constexpr" for name in constexprs}}, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, launch_pdl=True)).asm["ptx"]


@needs_triton
def test_kernels_compile_with_both_instructions():
    import tcal.chunk_intra as ci
    import tcal.chunk_states as cs
    import tcal.delta_inputs as di
    import tcal.gated_norm as gn

    bf, f32, i32 = "*bf16", "*fp32", "i32"
    heads = dict(H=9, K=64, V=64, BK=64, BV=64, DOT="tf32x3", PDL=True)
    kernels = {
        "transitions": (cs._transitions_kernel, dict(k=bf, w=bf, u=bf, g=f32, trans_d=bf, trans_n=f32, length=i32), heads),
        "pass": (cs._pass_kernel, dict(trans_d=bf, trans_n=f32, g=f32, h=bf, h0=f32, ht=f32, length=i32),
                 {**heads, "BV": 16, "HAS_H0": True, "STORE_FINAL": True}),
        "output": (cs._output_kernel, dict(q=bf, k=bf, w=bf, u=bf, g=f32, h=bf, o=bf, scale="fp32", length=i32), heads),
        "intra": (ci._chunk_intra_kernel, dict(k=bf, v=bf, g=f32, beta=f32, g_out=f32, w=bf, u=bf, length=i32), heads),
        "delta_inputs": (di._delta_inputs_kernel, {**{n: bf for n in ("q", "k", "v", "a", "b")}, "A_log": f32, "dt_bias": f32,
                         **{n: bf for n in ("q_out", "k_out", "v_out")}, "g_out": f32, "beta_out": f32,
                         **{n: i32 for n in ("rows", "length", "heads")},
                         **{f"s{x}_{y}": i32 for x in "qkv" for y in "bthd"}, **{f"s{x}_{y}": i32 for x in "ab" for y in "bth"},
                         "eps": "fp32"}, dict(D=64, BD=64, BLOCK_T=32, V_SILU=True, PDL=True)),
        "gated_norm": (gn._gated_rms_norm_kernel, dict(x=bf, gate=bf, weight=bf, out=bf, rows=i32, length=i32, heads=i32,
                       **{f"s{x}_{y}": i32 for x in "xg" for y in "bthd"}, eps="fp32"),
                       dict(D=64, BD=64, BLOCK_R=32, SIGMOID=False, PDL=True)),
    }
    for name, (kernel, signature, constexprs) in kernels.items():
        ptx = sm90_ptx(kernel, signature, constexprs)
        assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx, name


@cuda_fla
def test_chain_with_pdl_is_bit_identical(monkeypatch):
    if torch.cuda.get_device_capability()[0] < pdl.MIN_CAPABILITY:
        pytest.skip("programmatic dependent launch needs sm_90")
    from tcal.delta_inputs import delta_inputs_triton
    from tcal.gated_norm import gated_rms_norm_triton
    from tcal.kernels import gated_delta_rule

    monkeypatch.setenv("SURGERY_CHUNK_STATES", "on")
    monkeypatch.setenv("SURGERY_STATE_SPLITS", "off")
    q, k, v, g, beta, state = gdn_inputs(1, 2048)
    a, b = torch.randn_like(g).bfloat16(), torch.randn_like(beta).bfloat16()
    A_log, dt_bias, weight = torch.rand(9, device="cuda"), torch.rand(9, device="cuda"), torch.rand(64, device="cuda").bfloat16()

    def chain():
        qq, kk, vv, gg, bb = delta_inputs_triton(q, k, v, a, b, A_log, dt_bias, True)
        o, s = gated_delta_rule(qq, kk, vv, gg, bb, None, state, True, backend="fla")
        return gated_rms_norm_triton(o, v, weight, 1e-5), s

    results = {}
    for setting in ("off", "on"):
        monkeypatch.setenv(pdl.SWITCH, setting)
        with torch.no_grad():
            eager = chain()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                replayed = chain()
            graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(x, y) for x, y in zip(eager, replayed)), setting
        results[setting] = eager
    assert all(torch.equal(x, y) for x, y in zip(results["off"], results["on"]))
