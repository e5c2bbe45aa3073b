"""Distillation's KL loss without full-size float32 copies of the logits.

KL(teacher || student) over a [batch, seq, vocab] pair of logits written the plain way (log-softmax
of both in float32, exp, subtract, multiply) holds several float32 tensors of the logits' size for
backward: at 32 x 1024 tokens and a 49,152-token vocabulary each is 6.4 GB, with Qwen's 151,936 20
GB. Here forward walks the rows in chunks, in float32, and writes the gradient with respect to the
student's logits in closed form, temperature * (softmax_s - softmax_t) / rows, into one tensor of
the logits' dtype (usually bf16); that tensor is all that is kept for backward, which only scales it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_ELEMENTS = 1 << 26  # float32 work per chunk: 256 MB per temporary


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """float32 logits / temperature (no division pass at the usual temperature of 1)."""
    x = logits.float()
    return x if temperature == 1.0 else x / temperature


def chunk_terms(student: torch.Tensor, teacher: torch.Tensor, temperature: float, scale: float):
    """One chunk of rows: (sum of KL(teacher || student) over its rows, float32; scale *
    (softmax_s - softmax_t) in the student's dtype). Eager, it is a dozen passes over a float32
    chunk; compiled (stage_kl passes a CompiledGraph of it when training compiles), inductor fuses
    it into a few reductions over the logits themselves, which at 128 x 512 tokens and a 49,152-token
    vocabulary saves most of the loss's ~80 ms a step (bench/RESULTS.md, twelfth session)."""
    t = F.log_softmax(_scaled(teacher, temperature), dim=-1)
    s = F.log_softmax(_scaled(student, temperature), dim=-1)
    p_t = t.exp()
    return (p_t * (t - s)).sum(), (s.exp_() - p_t).mul_(scale).to(student.dtype)


class _ChunkedKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student, teacher, temperature: float, chunk_rows: int | None, terms):
        vocab = student.shape[-1]
        s2, t2 = student.reshape(-1, vocab), teacher.reshape(-1, vocab)
        rows = s2.shape[0]
        step = chunk_rows or max(1, CHUNK_ELEMENTS // max(vocab, 1))
        total = torch.zeros((), dtype=torch.float32, device=student.device)
        grad = torch.empty_like(s2)
        for i in range(0, rows, step):
            kl, grad[i:i + step] = terms(s2[i:i + step], t2[i:i + step], temperature, temperature / rows)
            total += kl
        ctx.grad, ctx.shape = grad, student.shape  # an intermediate, not an input: kept on ctx, freed by backward
        return total / rows * temperature**2

    @staticmethod
    def backward(ctx, grad_output):
        grad = ctx.grad
        if grad is None:
            raise RuntimeError("kl_divergence's backward runs once per forward (its gradient buffer is reused); "
                               "recompute the loss instead of retain_graph=True.")
        ctx.grad = None
        return grad.mul_(grad_output.to(grad.dtype)).view(ctx.shape), None, None, None, None


def kl_divergence(student: torch.Tensor, teacher: torch.Tensor, temperature: float = 1.0, *,
                  chunk_rows: int | None = None, terms=chunk_terms) -> torch.Tensor:
    """temperature^2 * mean over tokens of KL(softmax(teacher / T) || softmax(student / T)), a float32
    scalar; differentiable in `student` only (the teacher is a target). chunk_rows: rows per chunk
    (default: as many as keep each float32 temporary at CHUNK_ELEMENTS); terms: chunk_terms or a
    compiled form of it."""
    if student.shape != teacher.shape:
        raise ValueError(f"student logits {tuple(student.shape)} and teacher logits {tuple(teacher.shape)} differ in shape")
    return _ChunkedKL.apply(student, teacher.detach(), float(temperature), chunk_rows, terms)
