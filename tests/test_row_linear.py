"""A decode step's few-row linears as one Triton kernel (surgery.decode.row_linear): the kernel against F.linear
under Triton's CPU interpreter (masked widths, a bias, strided and 3-D inputs), the rule for when it runs, the
step graph's rewrite, and on CUDA the kernel at SmolLM2's shapes in bf16 with CUDA-graph replays."""

import importlib.util
import os
import textwrap

import pytest
import torch
import torch.nn.functional as F
from interpreted import run_interpreted

from surgery.decode import Decoder
from surgery.decode.row_linear import MAX_K, MAX_N, MAX_ROWS, fuse_row_linears, measured, row_linear

HAS_TRITON = importlib.util.find_spec("triton") is not None
TESTS = os.path.dirname(os.path.abspath(__file__))


def test_the_measured_envelope_bounds_rows_and_widths():
    assert measured(1, 576, 576) and measured(MAX_ROWS, MAX_N, MAX_K)
    assert not measured(MAX_ROWS + 1, 576, 576) and not measured(0, 576, 576)
    assert not measured(16, MAX_N + 1, 576) and not measured(16, 576, MAX_K + 1)


def test_off_cuda_it_is_f_linear_itself():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(3, 1, 40, generator=g), torch.randn(24, 40, generator=g), torch.randn(24, generator=g)
    assert torch.equal(row_linear(x, w, b), F.linear(x, w, b)) and torch.equal(row_linear(x, w), F.linear(x, w))


def test_the_step_graph_runs_its_linears_through_it_with_the_same_logits():
    """Every aten.linear of a tiny Llama's graph becomes a row_linear call, and on the CPU the rewritten graph
    gives the same logits bit for bit; a Decoder's static step graph has them."""
    from conftest import get_tiny

    from surgery.core.run import graph_logits

    graph = get_tiny("llama").graph
    linears = [n for n in graph.gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.linear.default]
    fused, count = fuse_row_linears(graph.gm)
    assert count == len(linears) > 0 and fused is not graph.gm
    assert not any(n.target is torch.ops.aten.linear.default for n in fused.graph.nodes if n.op == "call_function")
    ids = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(graph_logits(fused, ids), graph_logits(graph.gm, ids))
    step_gm = Decoder(graph, step_mode="static").step_gm
    assert any(n.target is row_linear for n in step_gm.graph.nodes if n.op == "call_function")


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (its CPU interpreter)")
def test_the_kernel_matches_f_linear_under_the_interpreter():
    script = textwrap.dedent("""
        import torch
        import torch.nn.functional as F
        from surgery.decode.row_linear import row_linear_triton
        g = torch.Generator().manual_seed(0)
        for dtype, tol in ((torch.float32, 1e-4), (torch.float16, 2e-2)):
            for rows, n, k, bias in ((1, 40, 200, False), (5, 96, 64, True), (16, 24, 1100, True), (16, 2050, 48, False)):
                x = torch.randn(rows, 1, k + 3, generator=g).to(dtype)[..., 3:]  # a strided view
                w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
                b = torch.randn(n, generator=g).to(dtype) if bias else None
                got, want = row_linear_triton(x, w, b), F.linear(x.float(), w.float(), None if b is None else b.float())
                assert got.shape == (rows, 1, n) and got.dtype == dtype, (got.shape, got.dtype)
                torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
        try:
            row_linear_triton(torch.zeros(17, 8), torch.zeros(4, 8))
        except ValueError as e:
            assert "at most 16 rows" in str(e)
        else:
            raise AssertionError("17 rows were taken")
        print("ok")
    """)
    done = run_interpreted(f"import sys; sys.path[:0] = [{TESTS!r}, {os.path.dirname(TESTS)!r}]\n" + script, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs CUDA and Triton")
@pytest.mark.parametrize("rows", [1, 16])
def test_the_kernel_matches_cublas_on_cuda(rows, monkeypatch):
    """SmolLM2's shapes in bf16 (one bias), eager and replayed from a CUDA graph: within one bf16 step of
    cuBLAS at each output's scale (the same float32 sums in another order); with the switch off, cuBLAS."""
    from surgery.decode.row_linear import kernel_takes

    g = torch.Generator(device="cuda").manual_seed(rows)
    for n, k in ((960, 576), (576, 576), (3072, 576), (576, 1536), (2368, 576)):
        x = torch.randn(rows, 1, k, device="cuda", generator=g).bfloat16()
        w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
        b = torch.randn(n, device="cuda", generator=g).bfloat16() if n == 960 else None
        assert kernel_takes(x, w, b)
        want = F.linear(x, w, b).float()
        graph = torch.cuda.CUDAGraph()
        row_linear(x, w, b)
        with torch.cuda.graph(graph):
            out = row_linear(x, w, b)
        for got in (row_linear(x, w, b), out):
            graph.replay()
            torch.testing.assert_close(got.float(), want, rtol=0, atol=2 ** -7 * want.abs().max().item())
    monkeypatch.setenv("SURGERY_ROW_LINEAR", "off")
    assert not kernel_takes(x, w, b) and torch.equal(row_linear(x, w, b), F.linear(x, w, b))
