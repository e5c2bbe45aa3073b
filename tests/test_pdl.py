"""tcal/pdl.py: programmatic dependent launch of the GDN prefill's Triton chain, off unless SURGERY_PDL=on.

Where it turns on (never off CUDA, never before sm_90); every kernel that takes it compiles for sm_90a with
its two griddepcontrol instructions (on the CPU machine: Triton's compiler and ptxas need no GPU); on
an sm_90 GPU, the chain's outputs with it are bit-identical to those without, eagerly and replayed."""
from __future__ import annotations

import importlib.util

import pytest
import torch

import tcal.pdl as pdl
from test_split_state import cuda_fla, gdn_inputs, replays_as_eager

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed (a CUDA-side extra)")


def test_off_by_default_and_off_the_gpu(monkeypatch):
    monkeypatch.delenv(pdl.SWITCH, raising=False)
    assert not pdl.pdl_on(torch.device("cpu")) and pdl.pdl_launch(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setenv(pdl.SWITCH, "on")
    assert not pdl.pdl_on(torch.device("cpu")) and pdl.pdl_launch(torch.device("cpu")) == {"PDL": False}  # no griddepcontrol off CUDA


@needs_triton
def test_kernels_compile_with_both_instructions():
    from bench.kernel_registers import compile_sm90, kernels

    for name, (kernel, signature, constexprs, warps) in kernels().items():
        ptx, report = compile_sm90(kernel, signature, constexprs, warps, pdl=True)
        assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx, name
        assert "Used" in report, report
        plain, _ = compile_sm90(kernel, signature, constexprs, warps, pdl=False)
        assert "griddepcontrol" not in plain, name


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
        assert replays_as_eager(chain), setting
        with torch.no_grad():
            results[setting] = chain()
    assert all(torch.equal(x, y) for x, y in zip(results["off"], results["on"]))
