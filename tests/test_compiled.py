"""Compiled (torch.compile, surgery.core.compiled) and eager runs of captured graphs agree on CPU.

Compiling on CPU is slow (C++ kernels built with gcc), so one test goes through inductor and the
others through "aot_eager": the same dynamo graph, the same custom GDN ops with their fake shapes,
the same AOTAutograd forward/backward split, run eagerly. Tolerance (float32), relative to the
largest eager value: 1e-5 for logits and states, 1e-4 for gradients (compiled, a GDN layer's six
input projections are six GEMMs, eagerly one fused GEMM: sums in another order, and a gradient
that is a small difference of large terms keeps less of its precision)."""
from __future__ import annotations

import copy
import dataclasses
import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from test_generate import hybrid

import surgery.core.compiled as compiled_module
from surgery.core.compiled import CompiledGraph, compile_default, resolve_compile
from surgery.core.run import graph_logits
from surgery.decode import Decoder
from surgery.eval.perplexity import perplexity
from tcal.kernels import gated_delta_rule_op

TOLERANCE = 1e-5
GRADIENT_TOLERANCE = 1e-4


def assert_close(eager: torch.Tensor, compiled: torch.Tensor, what: str, tolerance: float = TOLERANCE) -> None:
    scale = eager.abs().max().item() or 1.0
    diff = (eager - compiled).abs().max().item()
    assert diff <= tolerance * scale, f"{what}: max |diff| {diff:.3g} against max |eager| {scale:.3g}"


@pytest.fixture
def aot_eager(monkeypatch):
    monkeypatch.setattr(compiled_module, "BACKEND", "aot_eager")


def ids_of(graph, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    vocab = graph.config.vocab_size
    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def logits_and_gdn_grads(run, graph, ids):
    """Logits and the gradients of a loss on them w.r.t. every GDN parameter."""
    for p in graph.gm.parameters():
        p.grad = None
    logits = graph_logits(run, ids)
    logits.float().square().mean().backward()
    grads = {f"{l}.{n}": p.grad.clone() for l, m in graph.gdn_modules().items() for n, p in m.named_parameters()}
    return logits.detach(), grads


def test_inductor_hybrid_logits_agree(tiny):
    """The real backend once (forward only: a backward doubles the C++ build, ~100 s here)."""
    graph = hybrid(tiny("llama").graph.branch(), use_short_conv=True)
    ids = ids_of(graph, 2, 20)
    run = CompiledGraph(graph.gm, backend="inductor", report=None)
    with torch.no_grad():
        assert_close(graph.logits(ids), graph_logits(run, ids), "logits")
    assert run.failed is None


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2", "gemma2"])
def test_hybrid_logits_and_gdn_gradients_agree(tiny, name):
    """A hybrid (half the layers GDN, short convolutions on): logits and GDN gradients, 20 tokens (the
    chunked kernel). qwen2: q/k/v biases; gemma2: softcap and sliding windows; gpt2: fused qkv,
    learned positions."""
    graph = hybrid(tiny(name).graph.branch(), use_short_conv=True)
    ids = ids_of(graph, 2, 20)
    eager, eager_grads = logits_and_gdn_grads(graph.gm, graph, ids)
    run = CompiledGraph(graph.gm, backend="aot_eager", report=None)
    logits, grads = logits_and_gdn_grads(run, graph, ids)
    assert run.failed is None and run.compile_seconds is not None
    assert_close(eager, logits, "logits")
    assert grads.keys() == eager_grads.keys()
    for key in grads:
        assert_close(eager_grads[key], grads[key], f"gradient of {key}", GRADIENT_TOLERANCE)


def decode(graph, ids, steps: int, compile: bool):
    decoder = Decoder(graph, step_mode="static", compile=compile).reset(ids.shape[0], ids.shape[1] + steps)
    logits, states = [decoder.prefill(ids)], []
    for t in range(steps):
        logits.append(decoder.step(ids[:, t:t + 1]))
        states.append({(l, "S"): m.cache.recurrent.clone() for l, m in decoder.gdn.items()}
                      | {(l, k): c.clone() for l, m in decoder.gdn.items() for k, c in m.cache.conv.items()})
    return logits, states, decoder


@pytest.mark.parametrize("name, use_short_conv", [("qwen2", True), ("qwen2", False), ("llama", False), ("gemma2", False)])
def test_decode_steps_and_gdn_states_agree(tiny, aot_eager, name, use_short_conv):
    """Static decode steps through the compiled step: logits and every GDN state (recurrent and
    convolution) after each of several steps, batch 2, against the eager decoder. Without short
    convolutions a step is the fused token step, compiled as a custom op that writes the state."""
    graph = hybrid(tiny(name).graph.branch(), use_short_conv=use_short_conv)
    ids = ids_of(graph, 2, 7)
    eager_logits, eager_states, _ = decode(graph, ids, 5, compile=False)
    logits, states, decoder = decode(graph, ids, 5, compile=True)
    assert decoder._static.runner.failed is None
    for step, (a, b) in enumerate(zip(eager_logits, logits)):
        assert_close(a, b, f"logits of call {step}")
    for step, (a, b) in enumerate(zip(eager_states, states)):
        assert a.keys() == b.keys()
        for key in a:
            assert_close(a[key], b[key], f"GDN state {key} after step {step}")


def test_two_more_lengths_compile_once_more(tiny):
    """Automatic dynamic shapes: the first length is compiled for itself, the second once with the
    length symbolic, and a third reuses that graph."""
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    graph = tiny("llama").graph.branch()
    run = CompiledGraph(graph.gm, backend=counting, report=None)
    with torch.no_grad():
        for length in (9, 13, 21):
            assert_close(graph.logits(ids_of(graph, 1, length)), graph_logits(run, ids_of(graph, 1, length)), f"{length} tokens")
    assert len(graphs) == 2


def test_compile_failure_falls_back_with_one_warning(tiny, monkeypatch):
    graph = tiny("llama").graph.branch()
    ids = ids_of(graph, 1, 8)
    with torch.no_grad():
        eager = graph.logits(ids)

        def broken(gm, example_inputs):
            raise RuntimeError("no compiler here\nand a long page below")

        run = CompiledGraph(graph.gm, backend=broken, report=None, label="test graph")
        with pytest.warns(UserWarning, match=r"Compiling the test graph failed \(.*no compiler here\); running it eagerly"):
            assert torch.equal(graph_logits(run, ids), eager)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert torch.equal(graph_logits(run, ids), eager)  # eager from now on, silently
        assert "long page" not in run.failed

        def refuse(*args, **kwargs):
            raise RuntimeError("torch.compile is not supported here")

        monkeypatch.setattr(torch, "compile", refuse)
        with pytest.warns(UserWarning, match="not supported here"):
            run = CompiledGraph(graph.gm, report=None)
        assert torch.equal(graph_logits(run, ids), eager)


def test_policy_and_perplexity(stories, aot_eager, monkeypatch):
    assert not any(compile_default("cpu", use) for use in compiled_module.USES)  # off where it was measured not to pay
    assert compile_default("cuda", "train") and not compile_default("cuda", "decode") and not compile_default("cuda", "eval")
    assert compile_default("cuda", "train", tokens=100_000_000) and not compile_default("cuda", "train", tokens=1_000_000)
    assert resolve_compile(True, "cuda", "train", tokens=1_000) is True  # asked for: compiled whatever the budget
    with pytest.raises(ValueError, match="unknown compile use"):
        compile_default("cuda", "sample")
    monkeypatch.setattr(compiled_module, "COMPILE_BY_DEFAULT", frozenset({("cuda", "eval")}))
    assert resolve_compile(None, "cuda", "eval") is True and resolve_compile(False, "cuda", "eval") is False
    assert resolve_compile(None, "cuda", "train") is False
    assert resolve_compile(None, "cpu", "eval") is False and resolve_compile(True, "cpu", "eval") is True
    graph = stories()
    ids = ids_of(graph, 1, 600)[0]
    eager = perplexity(graph, ids, chunk=128, batch_size=2, compile=False)
    compiled = perplexity(graph, ids, chunk=128, batch_size=2, compile=True)
    assert abs(compiled["nll"] - eager["nll"]) <= 1e-5 * eager["nll"]


def test_gated_delta_rule_op_passes_opcheck():
    """Schema, fake shapes and strides, the registered autograd, on CPU tensors with a state."""
    g = torch.Generator().manual_seed(0)
    b, t, h, d = 1, 20, 2, 8
    q, k = (F.normalize(torch.randn(b, t, h, d, generator=g), dim=-1).requires_grad_() for _ in range(2))
    v = torch.randn(b, t, h, d, generator=g).requires_grad_()
    decay, beta = (-torch.rand(b, t, h, generator=g)).requires_grad_(), torch.rand(b, t, h, generator=g).requires_grad_()
    state = torch.randn(b, h, d, d, generator=g).requires_grad_()
    torch.library.opcheck(gated_delta_rule_op, (q, k, v, decay, beta, state, d**-0.5, True, "torch", 64, True))


def test_compiled_distillation_logs_the_eager_losses(stories, aot_eager, tmp_path):
    """Stages l2 then kl through the compiled path (teacher and student with their causal masks
    turned into SDPA's is_causal flag, the student's rewrite sharing its parameters): the same
    losses step by step as eagerly, and the same trained weights."""
    from surgery.train import DistillConfig, distill

    text = tmp_path / "train.txt"
    text.write_text(" ".join(f"Once upon a time a cat named Tom {i} saw a dog." for i in range(60)))
    runs, teacher = {}, stories()
    for flag in (False, True):
        student = hybrid(teacher.branch())
        student = dataclasses.replace(student, gm=copy.deepcopy(student.gm))  # training it leaves `teacher` as it is
        config = DistillConfig(tokens=6 * 2 * 32, l2_tokens=2 * 2 * 32, stage="both", seq_len=32, global_batch=2,
                               warmup=0.0, schedule="constant", compile=flag)
        distill(student, [text], tmp_path / f"run{flag}", config, teacher=teacher, progress=False)
        log = (tmp_path / f"run{flag}" / "log.jsonl").read_text().splitlines()
        runs[flag] = ([r["loss"] for r in map(json.loads, log) if "loss" in r], dict(student.gm.named_parameters()))
    (eager, eager_weights), (compiled, compiled_weights) = runs[False], runs[True]
    assert len(eager) == 6 and all(abs(a - b) <= 1e-4 * abs(a) for a, b in zip(eager, compiled)), (eager, compiled)
    for name, p in eager_weights.items():
        assert_close(p.detach(), compiled_weights[name].detach(), name, GRADIENT_TOLERANCE)
