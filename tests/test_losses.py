"""The chunked KL against the plain float64 formula: value, gradient, dtypes, and what it keeps for
backward."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from surgery.train.losses import kl_divergence


def plain_kl(student, teacher, temperature):
    t = F.log_softmax(teacher.double() / temperature, dim=-1)
    s = F.log_softmax(student.double() / temperature, dim=-1)
    return (t.exp() * (t - s)).sum(-1).mean() * temperature**2


def logits(*shape, seed, scale=3.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("chunk_rows", [None, 1, 3, 7])
def test_value_and_gradient_match_float64(temperature, chunk_rows):
    """2 x 5 rows in chunks that do not divide them (3, 7), one row at a time, or all at once."""
    student, teacher = logits(2, 5, 37, seed=0), logits(2, 5, 37, seed=1)
    mine = student.clone().requires_grad_(True)
    loss = kl_divergence(mine, teacher, temperature, chunk_rows=chunk_rows)
    loss.backward()
    ref_in = student.double().requires_grad_(True)
    ref = plain_kl(ref_in, teacher, temperature)
    ref.backward()
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(ref.item(), rel=1e-5)
    torch.testing.assert_close(mine.grad.double(), ref_in.grad, rtol=1e-5, atol=1e-8)


def test_gradient_matches_finite_differences():
    """Independent of autograd: central differences of the loss itself (forward sums in float32,
    hence the wide step)."""
    student = logits(3, 4, 11, seed=2, dtype=torch.float64).requires_grad_(True)
    teacher = logits(3, 4, 11, seed=3, dtype=torch.float64)
    kl_divergence(student, teacher, 1.5, chunk_rows=5).backward()
    eps, flat = 1e-2, student.detach().flatten()
    numeric = torch.empty_like(flat)
    for i in range(flat.numel()):
        step = torch.zeros_like(flat)
        step[i] = eps
        up = kl_divergence((flat + step).view_as(student), teacher, 1.5, chunk_rows=5)
        down = kl_divergence((flat - step).view_as(student), teacher, 1.5, chunk_rows=5)
        numeric[i] = (up.double() - down.double()) / (2 * eps)
    torch.testing.assert_close(numeric.view_as(student), student.grad, rtol=0, atol=2e-4)


def test_bf16_logits_get_a_bf16_gradient_close_to_float64():
    student, teacher = logits(4, 8, 64, seed=4, dtype=torch.bfloat16), logits(4, 8, 64, seed=5, dtype=torch.bfloat16)
    mine = student.clone().requires_grad_(True)
    loss = kl_divergence(mine, teacher, chunk_rows=6)
    loss.backward()
    ref_in = student.double().requires_grad_(True)
    ref = plain_kl(ref_in, teacher.double(), 1.0)
    ref.backward()
    assert mine.grad.dtype == torch.bfloat16 and loss.item() == pytest.approx(ref.item(), rel=1e-5)
    torch.testing.assert_close(mine.grad.double(), ref_in.grad, rtol=1e-2, atol=1e-5)
    assert teacher.grad is None


def test_autograd_keeps_no_float32_copies():
    """What autograd saves between forward and backward: nothing for the chunked loss (its one
    gradient buffer, in the logits' dtype, lives on the function's context), where the plain float32
    formula saves several float32 tensors of the logits' size."""
    student, teacher = logits(2, 16, 512, seed=6, dtype=torch.bfloat16), logits(2, 16, 512, seed=7, dtype=torch.bfloat16)

    def saved_bytes(fn) -> int:
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        s = student.clone().requires_grad_(True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(s)
        return total

    size = student.numel() * student.element_size()
    assert saved_bytes(lambda s: kl_divergence(s, teacher)) == 0
    assert saved_bytes(lambda s: plain_kl(s.float(), teacher.float(), 1.0).float()) >= 6 * size  # float32: 2x the bf16 bytes, 3+ tensors


def test_backward_runs_once():
    student = logits(2, 3, 7, seed=8).requires_grad_(True)
    loss = kl_divergence(student, logits(2, 3, 7, seed=9))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="runs once"):
        loss.backward()


def test_shapes_must_agree():
    with pytest.raises(ValueError, match="differ in shape"):
        kl_divergence(torch.zeros(2, 3, 5), torch.zeros(2, 3, 6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_chunks_give_the_eager_loss_and_gradient(dtype):
    """The chunk function as stage_kl runs it when training compiles (inductor, one graph per chunk
    shape: 3 rows, then the 1-row remainder), against the eager chunks and float64."""
    from surgery.core.compiled import CompiledGraph
    from surgery.train.losses import chunk_terms

    student, teacher = logits(2, 5, 37, seed=0, dtype=dtype), logits(2, 5, 37, seed=1, dtype=dtype)
    compiled = CompiledGraph(chunk_terms, backend="inductor", dynamic=False, report=None)
    results = []
    for terms in (chunk_terms, compiled):
        mine = student.clone().requires_grad_(True)
        loss = kl_divergence(mine, teacher, 2.0, chunk_rows=3, terms=terms)
        loss.backward()
        results.append((loss, mine.grad))
    assert compiled.failed is None
    assert results[1][1].dtype == dtype
    assert results[1][0].item() == pytest.approx(results[0][0].item(), rel=1e-5)
    torch.testing.assert_close(results[1][1].float(), results[0][1].float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-6)
    ref_in = student.double().requires_grad_(True)
    ref = plain_kl(ref_in, teacher.double(), 2.0)
    ref.backward()
    assert results[1][0].item() == pytest.approx(ref.item(), rel=1e-4)
