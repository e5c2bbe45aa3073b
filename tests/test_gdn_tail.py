"""The tail of a GDN decoder layer's decoded token as one kernel (surgery.decode.gdn_tail): its reference
against the layer itself, the kernel against the reference under Triton's CPU interpreter, and on CUDA the
kernel at SmolLM2's widths (CUDA-graph replays included) and a decoder that takes it at batch 4."""

import importlib.util
import os
import textwrap

import pytest
import torch
import torch.nn.functional as F
from test_gdn_blocks import TokenStep, block_inputs, blocks, counted_launches, cuda_llama_hybrid, prompt
from interpreted import run_interpreted
from test_generate import hybrid

from surgery.decode.gdn_blocks import block_shape
from surgery.decode.gdn_tail import gdn_tail_torch
from surgery.decode.residual_norm import add_rms_norm_torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("bias", [False, True])
def test_the_reference_is_the_layers_token_then_the_post_norm(bias):
    """gdn_tail_torch from the fused projection's output = the layer's own one-token forward (input
    projections, token step, o_proj) followed by the residual add and norm; the state written alike."""
    layer, proj, a, b, w0, w1, *_, state = block_inputs(torch.float32, 3, bias, seed=5)
    shape = block_shape(layer, proj[0].shape[0], 56, True)
    mine = state.clone()
    with torch.no_grad():
        want = add_rms_norm_torch(b, TokenStep(layer, state, proj)(a), w1, 1e-5)
        got = gdn_tail_torch(F.linear(a, *proj), shape, layer, mine, b, w1, 1e-5)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    torch.testing.assert_close(mine, state, rtol=0, atol=0)
    assert not torch.equal(mine, block_inputs(torch.float32, 3, bias, seed=5)[-1])  # the step wrote it


def test_the_setting_is_on_unless_set_off_and_checked(monkeypatch):
    from surgery.decode.gdn_tail import tail_enabled

    monkeypatch.delenv("SURGERY_GDN_TAIL", raising=False)
    assert tail_enabled()
    monkeypatch.setenv("SURGERY_GDN_TAIL", "0")
    assert not tail_enabled()
    monkeypatch.setenv("SURGERY_GDN_TAIL", "fast")
    with pytest.raises(ValueError, match="SURGERY_GDN_TAIL=.fast"):
        tail_enabled()


def test_the_tail_takes_up_to_max_rows_unless_switched_off(monkeypatch):
    """1-8 rows by default (it lost to the composed kernels at 16 on an H100); none with the switch off."""
    from types import SimpleNamespace

    from surgery.decode.gdn_tail import MAX_ROWS, tail_takes

    shape = SimpleNamespace(hidden=576)
    monkeypatch.delenv("SURGERY_GDN_TAIL", raising=False)
    assert MAX_ROWS == 8 and tail_takes(1, shape) and tail_takes(MAX_ROWS, shape)
    assert not tail_takes(MAX_ROWS + 1, shape) and not tail_takes(16, shape)
    assert not tail_takes(2, SimpleNamespace(hidden=32768))  # a row of the output must fit one program
    monkeypatch.setenv("SURGERY_GDN_TAIL", "off")
    assert not tail_takes(2, shape)


def test_only_the_prefetching_form_is_capped_and_explicit_forms_are_kept():
    """SmolLM2's [576, 64] slice of o_proj is fetched before the token step and capped (two programs an SM); a
    2048-wide layer loops over its columns uncapped (the cap raised its 79 registers to 128, and 128-wide heads
    spill under it, compiled for sm_90a)."""
    from surgery.decode.gdn_tail import REGISTERS, launch_form

    assert launch_form(576, 64) == (True, REGISTERS)
    assert launch_form(2048, 64) == (False, None)
    assert launch_form(576, 128) == (False, None)
    assert launch_form(576, 64, prefetch=False) == (False, None)
    assert launch_form(576, 64, registers=None) == (True, None)
    assert launch_form(2048, 64, prefetch=True, registers=96) == (True, 96)


def test_a_cpu_step_keeps_the_layers_calls_with_the_tail_on(monkeypatch):
    """On the CPU a GDN block composes its calls whatever the setting says, and says why."""
    from conftest import get_tiny
    from test_generate import full_greedy, incremental_greedy

    monkeypatch.setenv("SURGERY_GDN_TAIL", "on")
    graph = hybrid(get_tiny("llama").graph.branch())
    from surgery.decode import Decoder

    decoder = Decoder(graph, step_mode="static")
    assert incremental_greedy(decoder, prompt(graph), 4)[0] == full_greedy(graph, prompt(graph), 4)[0]
    assert blocks(decoder) and all(m.declined == "not CUDA with Triton" for m in blocks(decoder))


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (a CUDA-side extra)")
def test_the_kernel_matches_the_reference_in_the_interpreter():
    """float32 and float16, 1, 3 and 16 rows, with and without biases, two steps on one state (at 3 rows o_proj's
    columns loaded after the token step, in pieces); the row counters count every program's arrival."""
    script = textwrap.dedent("""
        import torch
        import torch.nn.functional as F
        from surgery.decode.gdn_blocks import block_shape
        from surgery.decode.gdn_tail import gdn_tail_torch, gdn_tail_triton, new_arrivals
        import tests.test_gdn_blocks as t
        for dtype, tol in ((torch.float32, 1e-4), (torch.float16, 1e-2)):
            for rows, bias in ((1, False), (3, True), (16, True)):
                layer, proj, a, b, w0, w1, w_gu, b_gu, w_d, b_d, state = t.block_inputs(dtype, rows, bias, seed=rows)
                shape = block_shape(layer, proj[0].shape[0], 56, True)
                x, mine, arrivals = F.linear(a, *proj), state.clone(), new_arrivals(rows, "cpu")
                with torch.no_grad():
                    for _ in range(2):
                        want = gdn_tail_torch(x, shape, layer, state, b, w1, 1e-5)
                        got = gdn_tail_triton(x, shape, layer, mine, b, w1, 1e-5, arrivals, prefetch=rows != 3)
                        for u, v in zip(got, want):
                            torch.testing.assert_close(u.float(), v.float(), rtol=tol, atol=tol)
                        torch.testing.assert_close(mine, state, rtol=tol, atol=tol)
                assert arrivals.tolist() == [2 * shape.heads] * rows, arrivals
        print("ok")
    """)
    done = run_interpreted(f"import sys; sys.path[:0] = [{TESTS!r}, {os.path.dirname(TESTS)!r}]\n" + script, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


def near(got, want):
    """bf16 sums over 576 terms in another order: about one bf16 step at each output's scale."""
    for x, y in zip(got, want):
        torch.testing.assert_close(x.float(), y.float(), rtol=0, atol=2**-7 * y.float().abs().max().item())


@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs CUDA and Triton")
@pytest.mark.parametrize("rows", [1, 16])
def test_the_kernel_matches_the_reference_on_cuda(rows):
    """SmolLM2's widths in bf16: three calls, then three replays of a CUDA graph of one call (the row
    counters count on across launches and replays)."""
    from surgery.decode.gdn_tail import gdn_tail_triton, new_arrivals

    layer, proj, a, b, w0, w1, *_, state = block_inputs(torch.bfloat16, rows, False, hidden=576, heads=9, dim=64,
                                                        inter=1536, device="cuda")
    shape = block_shape(layer, proj[0].shape[0], 1536, True)
    x, mine, arrivals = F.linear(a, *proj), state.clone(), new_arrivals(rows, "cuda")
    with torch.no_grad():
        for _ in range(3):
            want = gdn_tail_torch(x, shape, layer, state, b, w1, 1e-5)
            near(gdn_tail_triton(x, shape, layer, mine, b, w1, 1e-5, arrivals), want)
            torch.testing.assert_close(mine, state, rtol=1e-3, atol=2e-3)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = gdn_tail_triton(x, shape, layer, mine, b, w1, 1e-5, arrivals)
        mine.copy_(state)
        for _ in range(3):
            want = gdn_tail_torch(x, shape, layer, state, b, w1, 1e-5)
            graph.replay()
            near(out, want)
            torch.testing.assert_close(mine, state, rtol=1e-3, atol=2e-3)
    assert arrivals.tolist() == [6 * shape.heads] * rows


@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs CUDA and Triton")
def test_a_cuda_decoder_at_batch_4_takes_the_tail_and_decodes_as_without(monkeypatch):
    """A tiny Llama hybrid in bf16 on CUDA, CUDA-graph steps of 4 rows: by default the tail runs, and each row's
    greedy tokens are those of SURGERY_GDN_TAIL=off (the composed kernels)."""
    from surgery.decode import Decoder

    graph = cuda_llama_hybrid()
    launches = counted_launches(monkeypatch, "gdn_tail_triton")
    ids = torch.tensor([prompt(graph, seed) for seed in range(4)], device="cuda")
    runs = {}
    for setting in ("auto", "off"):
        monkeypatch.setenv("SURGERY_GDN_TAIL", setting)
        decoder = Decoder(graph, verify=False)
        assert blocks(decoder)
        decoder.reset(4, ids.shape[1] + 8)
        last, tokens = decoder.prefill(ids)[:, -1], []
        for _ in range(8):
            tokens.append(last.argmax(-1))
            last = decoder.step(tokens[-1][:, None])[:, -1]
        runs[setting] = (torch.stack(tokens, 1), last)
        assert bool(launches) == (setting == "auto"), [m.declined for m in blocks(decoder)]
        launches.clear()
    assert torch.equal(runs["auto"][0], runs["off"][0])
    torch.testing.assert_close(runs["auto"][1].float(), runs["off"][1].float(), rtol=5e-2, atol=5e-2)
