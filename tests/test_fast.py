"""The fast route (surgery.decode.fast, surgery.core.compiled.ROUTES) on the CPU: with the route table
set as CUDA's is (the causal flags, compiled at once or after the eager calls paid for it, backend
aot_eager), the public runner and a Decoder's prefill give the eager numbers; the CPU default is the
captured graph itself; a compile that fails or disagrees falls back to eager with one warning."""
from __future__ import annotations

import copy
import dataclasses
import operator
import warnings

import pytest
import torch
from test_generate import full_greedy, hybrid, incremental_greedy

import surgery.core.compiled as compiled_module
import surgery.decode.agreement as agreement_module
from surgery.core.compiled import Route, inference_route
from surgery.decode import Decoder, generate
from surgery.decode.causal_flags import CausalFlags
from surgery.decode.fast import FastGraph, bucket, fast_graph, fast_logits, fast_runner, first_output
from surgery.decode.precision import float32_gaps, float32_twin
from surgery.decode.replay import Replays
from surgery.eval.passkey import passkey

TOLERANCE = 1e-5


@pytest.fixture
def aot_eager(monkeypatch):
    monkeypatch.setattr(compiled_module, "BACKEND", "aot_eager")


def cuda_routes_on_cpu(monkeypatch, compile_after):
    """The CPU takes the route the table gives CUDA, compiling after `compile_after` eager seconds."""
    route = Route(causal_flags=True, compile_after=compile_after)
    monkeypatch.setattr(compiled_module, "ROUTES", {("cpu", "eval"): route, ("cpu", "prefill"): route})


def fresh(stories):
    """A stories260K graph with a cache of its own (the session's branches share one, and a runner
    kept there would carry one test's backend into the next)."""
    return dataclasses.replace(stories(), cache={})


def ids_of(graph, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, graph.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def assert_close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    diff = (a.float() - b.float()).abs().max().item()
    assert diff <= TOLERANCE * max(1.0, b.abs().max().item()), f"{what}: max |diff| {diff:.3g}"


def test_the_table():
    """CUDA: the flags, CUDA-graph replay and the elementwise fusions, no compile by itself (compiled.ROUTES); the CPU: nothing;
    the user's flag: compiled at once, or never (the flags and replay kept where the table has them)."""
    assert inference_route(None, "cpu", "eval") == Route() and inference_route(None, "cpu", "prefill") == Route()
    assert inference_route(None, "cuda", "prefill") == Route(True, None, True, True) == inference_route(None, "cuda", "eval")
    assert inference_route(True, "cpu", "eval") == Route(True, 0.0)
    assert inference_route(False, "cuda", "eval") == Route(True, None, True, True)
    assert inference_route(False, "cpu", "eval") == Route(False, None)
    with pytest.raises(ValueError, match="unknown compile use"):
        inference_route(None, "cuda", "sample")
    assert [bucket(n, 8192) for n in (1, 2048, 2049, 5000, 9000)] == [2048, 2048, 4096, 8192, 8192]


def test_cpu_default_is_the_captured_graph(stories):
    graph = fresh(stories)
    ids = ids_of(graph, 2, 40)
    with torch.no_grad():
        assert torch.equal(fast_logits(graph, ids), graph.logits(ids))  # bit for bit: the CPU's numbers stay
    fast = fast_graph(graph)
    assert fast.graphs == {None: graph.gm} and not fast.compiled


def test_fast_route_after_the_break_even(stories, aot_eager, monkeypatch):
    """Eager with the flags until the eager calls cost compile_after seconds, then compiled (one
    graph per length bucket); the logits agree throughout."""
    cuda_routes_on_cpu(monkeypatch, compile_after=1e-9)
    graph = fresh(stories)
    ids = ids_of(graph, 2, 40)
    with torch.no_grad():
        eager = graph.logits(ids)
        run = fast_runner(graph)
        first = run(ids)  # eager, a shape's first call: not counted (one-off kernel tuning)
        fast = fast_graph(graph)
        assert not fast.compiled and fast.eager_seconds == 0
        assert_close(first, eager, "eager call with the flags")
        assert_close(run(ids), eager, "eager again, counted")
        assert not fast.compiled and fast.eager_seconds > 0
        assert_close(run(ids), eager, "compiled call")
    key = bucket(40, graph.max_length)
    assert list(fast.compiled) == [key] and fast.compiled[key].failed is None and fast.failed is None
    assert fast.graphs[key] is not graph.gm  # the flags' rewrite, not the captured graph


def test_compile_that_fails_warns_once_and_stays_eager(stories, monkeypatch):
    cuda_routes_on_cpu(monkeypatch, compile_after=0.0)

    def broken(gm, example_inputs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(compiled_module, "BACKEND", broken)
    graph = fresh(stories)
    ids = ids_of(graph, 1, 30)
    with torch.no_grad():
        eager = graph.logits(ids)
        with pytest.warns(UserWarning, match="no compiler here"):
            assert_close(fast_logits(graph, ids), eager, "fallback")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert_close(fast_logits(graph, ids), eager, "eager from now on, silently")


def test_compile_that_disagrees_warns_once_and_stays_eager(stories, monkeypatch):
    """A backend whose graph computes something else: caught by the first call's check."""
    cuda_routes_on_cpu(monkeypatch, compile_after=0.0)

    def wrong(gm, example_inputs):
        return lambda *args: [x * -1.0 if torch.is_tensor(x) and x.is_floating_point() else x for x in gm(*args)]

    monkeypatch.setattr(compiled_module, "BACKEND", wrong)
    graph = fresh(stories)
    ids = ids_of(graph, 1, 30)
    with torch.no_grad():
        eager = graph.logits(ids)
        with pytest.warns(UserWarning, match="disagrees with the eager one"):
            assert_close(fast_logits(graph, ids), eager, "the eager logits returned")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert_close(fast_logits(graph, ids), eager, "eager from now on")
    assert "disagree" in fast_graph(graph).failed


def test_decoder_prefill_on_the_fused_route(tiny, monkeypatch):
    """CUDA's default route (the flags, the fusions, sibling projections as one matmul; eager here, the CPU
    has no CUDA graphs): the prefill's taps still fill the caches, so greedy steps equal full recomputation."""
    graph = hybrid(tiny("llama").graph.branch(), use_short_conv=True)
    prompt = ids_of(graph, 1, 11)[0].tolist()
    reference, _ = full_greedy(graph, prompt, 6)
    route = Route(causal_flags=True, fused=True)
    monkeypatch.setattr(compiled_module, "ROUTES", {("cpu", "eval"): route, ("cpu", "prefill"): route})
    fast = Decoder(graph)
    assert fast.fast_prefill.on
    tokens, _ = incremental_greedy(fast, prompt, 6)
    assert tokens == reference
    ids = torch.tensor([prompt])
    with torch.no_grad():  # the runs of all positions' logits and of the last one's
        assert_close(fast.reset(1, 20).prefill(ids), graph.logits(ids), "all logits")
        assert_close(fast.reset(1, 20).prefill(ids, last_only=True), graph.logits(ids)[:, -1:], "the last position's")
    copies = [w for run in fast.fast_prefill.runs.values() for weights in run.fused.values() for w in weights]
    assert copies and len({id(w) for w in copies}) == len(fast.fast_prefill.runs[False].copies) < len(copies)  # one copy, both runs
    sdpa = [n for run in fast.fast_prefill.runs.values() for gm in run.graphs.values() for n in gm.graph.nodes
            if n.target is torch.ops.aten.scaled_dot_product_attention.default]
    assert sdpa and all(n.kwargs.get("enable_gqa") for n in sdpa)  # the kept GQA layer on its own heads (surgery.decode.gqa)


@pytest.mark.parametrize("name, use_short_conv", [("llama", True), ("gemma2", False), ("qwen2", None)])
def test_decoder_prefill_through_the_fast_route(tiny, aot_eager, monkeypatch, name, use_short_conv):
    """The prefill graph's taps fill the caches as the eager prefill does: the prefill's logits and
    the greedy steps after it equal the eager Decoder's and full recomputation's. gemma2: sliding
    windows (a ring cache) and softcap; llama with short convolutions (conv states); qwen2: the
    teacher itself (no GDN)."""
    graph = tiny(name).graph.branch()
    graph = graph if use_short_conv is None else hybrid(graph, use_short_conv=use_short_conv)
    prompt = ids_of(graph, 1, 11)[0].tolist()
    reference, _ = full_greedy(graph, prompt, 6)
    eager = Decoder(graph)
    assert not eager.fast_prefill.on  # the CPU default: the decode graph
    cuda_routes_on_cpu(monkeypatch, compile_after=0.0)
    fast = Decoder(graph)  # its self-check ran the prefill taps eagerly
    assert fast.fast_prefill.on
    ids = torch.tensor([prompt])
    with torch.no_grad():
        assert_close(fast.reset(1, 20).prefill(ids), eager.reset(1, 20).prefill(ids), "prefill logits")
        for layer, m in eager.gdn.items():
            assert_close(fast.gdn[layer].cache.recurrent, m.cache.recurrent, f"GDN {layer} state")
        for layer, m in eager.attention.items():
            assert_close(fast.attention[layer].k_cache, m.k_cache, f"K cache {layer}")
    assert list(fast.fast_prefill.runs[False].compiled) and fast.fast_prefill.runs[False].failed is None
    with torch.no_grad():  # generate's prefill: the head computes the last position only
        last = fast.reset(1, 20).prefill(ids, last_only=True)
        assert last.shape[1] == 1
        assert_close(last, eager.reset(1, 20).prefill(ids)[:, -1:], "last position's logits")
    run = fast.fast_prefill.runs[True]
    head = next(n for n in reversed(run.graphs[run.key(11)].graph.nodes) if n.target == torch.ops.aten.linear.default)
    assert head.args[0].target is operator.getitem  # sliced before the head, not after
    tokens, _ = incremental_greedy(fast, prompt, 6)
    assert tokens == reference


def test_passkey_takes_the_runner(stories, aot_eager, monkeypatch, tmp_path):
    """passkey scores through the fast runner: the same accuracy on both routes."""
    graph = fresh(stories)
    text = tmp_path / "filler.txt"
    text.write_text(" ".join(f"The grass is green and the sky is blue {i}." for i in range(200)))
    options = dict(filler_files=[text], lengths=(200,), depths=2, trials_per_depth=1)
    plain = passkey(graph, **options)
    cuda_routes_on_cpu(monkeypatch, compile_after=0.0)
    fast = passkey(graph, **options)
    assert fast == plain
    assert fast_graph(graph).compiled


def test_flags_bucket_refuses_nothing_it_serves(stories):
    """A length past one bucket moves to the next: the rewrite of each bucket covers its inputs."""
    graph = fresh(stories)
    fast = FastGraph(graph.gm, "cpu", "eval", False, limit=graph.max_length)
    fast.route = Route(causal_flags=True)
    for length in (5, graph.max_length):
        key = fast.key(length)
        assert key >= length and isinstance(fast.graph(key), torch.fx.GraphModule)
    assert CausalFlags(graph.max_length) == CausalFlags(graph.max_length)  # hashable, one rewrite per bucket


def test_float32_gaps_of_a_bf16_graph(stories_path, stories, aot_eager):
    """stories260K captured in bf16: its float32 twin rewrites the traced casts (it matches a float32
    capture of the same weights far better than the bf16 graph does), and the report compares eager
    and compiled bf16 with it."""
    import surgery

    low = surgery.capture(stories_path, dtype=torch.bfloat16, find=False)
    high = fresh(stories)
    high = dataclasses.replace(high, gm=copy.deepcopy(high.gm))  # the session's teacher stays as it is
    ids = ids_of(high, 1, 48)
    with torch.no_grad():
        for name, p in high.gm.named_parameters():  # the same (bf16-rounded) weights
            p.copy_(low.gm.get_parameter(name).float())
        twin = float32_twin(low.gm)
        assert all(p.dtype == torch.float32 for p in twin.parameters())
        exact = high.logits(ids)
        twin_gap = (twin(input_ids=ids, **twin.meta["extra_inputs"]).logits - exact).abs().max().item()
        assert twin_gap < 1e-3 * exact.abs().max().item() < (low.logits(ids).float() - exact).abs().max().item()
    report = float32_gaps(low, ids, report=None)
    assert report["compiled_vs_eager"]["max_rel"] < 1e-2 and report["eager"]["mean_rel"] > 0
    assert report == {**report, "compiled_no_farther": report["compiled"]["max_rel"] <= report["eager"]["max_rel"]
                      and report["compiled"]["mean_rel"] <= report["eager"]["mean_rel"]}
    with_reference = float32_gaps(low, ids, reference=high, report=None)
    assert abs(with_reference["eager"]["mean_rel"] - report["eager"]["mean_rel"]) < 1e-2


def test_decoder_prefill_that_fails_to_compile_warns_once(tiny, monkeypatch):
    """The Decoder's compiled prefill falls back as the runner does: one warning, then the eager
    prefill graph, the same tokens."""
    graph = hybrid(tiny("llama").graph.branch())
    prompt = ids_of(graph, 1, 9)[0].tolist()
    reference, _ = full_greedy(graph, prompt, 4)
    cuda_routes_on_cpu(monkeypatch, compile_after=0.0)

    def broken(gm, example_inputs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(compiled_module, "BACKEND", broken)
    decoder = Decoder(graph)
    with pytest.warns(UserWarning, match="Compiling the prefill graph failed"):
        assert generate(decoder, [prompt], 4, eos_token_id=None)[0] == reference
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert generate(decoder, [prompt], 4, eos_token_id=None)[0] == reference
    assert decoder.fast_prefill.runs[True].failed


def test_the_runtime_guard_measures_distributions():
    """compiled_agrees: rounding-sized noise and a common offset pass; another model's logits, a
    permuted vocabulary and NaN do not."""
    g = torch.Generator().manual_seed(0)
    eager = 4 * torch.randn(2, 50, 300, generator=g)
    assert agreement_module.compiled_agrees(eager + 0.05 * torch.randn(eager.shape, generator=g), eager)[0]
    assert agreement_module.compiled_agrees(eager + 7.0, eager)[0]  # softmax ignores a shift
    assert not agreement_module.compiled_agrees(4 * torch.randn(eager.shape, generator=g), eager)[0]
    assert not agreement_module.compiled_agrees(eager.flip(-1), eager)[0]
    nan = eager.clone()
    nan[0, 3, 7] = float("nan")
    assert agreement_module.compiled_agrees(nan, eager) == (False, "non-finite logits")


class FakeGraph:
    """A stand-in for a captured CUDA graph on the CPU: replay() reruns the captured function and writes
    its logits into the captured output, as a replay writes into the graph's memory."""

    def __init__(self, run, out, corrupt: bool = False, frozen: bool = False):
        self.run, self.out, self.corrupt, self.frozen, self.replays = run, out, corrupt, frozen, 0

    def replay(self):
        self.replays += 1
        if self.frozen:  # what a CUDA graph that read copies of the weights made at capture would give
            return
        logits = self.run().logits
        self.out.logits.copy_(logits.flip(-1) if self.corrupt else logits)


def replaying_on_cpu(monkeypatch, fast: FastGraph, corrupt: bool = False, fail: bool = False, frozen: bool = False) -> list:
    """Turn `fast`'s replay on for CPU inputs with FakeGraph captures; returns the list of captures."""
    captured = []

    def capture(run):
        if fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        warm, out = run(), run()
        captured.append(FakeGraph(run, out, corrupt, frozen))
        return captured[-1], out, warm

    fast.route = Route(causal_flags=True, replay=True)
    fast.replays = Replays(keep=2, devices=("cpu",))  # the FastGraph watches the weights and drops its graphs
    monkeypatch.setattr(fast.replays, "capture", capture)
    return captured


def test_replay_from_a_shapes_second_call(stories, monkeypatch):
    """A shape's first call runs eagerly, its second captures and replays, later ones replay; outputs
    are borrowed (the graph's memory) and equal eager's; the `keep` most recent shapes stay captured."""
    graph = fresh(stories)
    fast = FastGraph(graph.gm, "cpu", "eval", None, limit=graph.max_length)
    captured = replaying_on_cpu(monkeypatch, fast)
    ids = ids_of(graph, 1, 30)
    with torch.no_grad():
        reference = graph.logits(ids)
        first = fast(input_ids=ids).logits
        assert not captured and not fast.borrowed
        assert_close(first, reference, "eager call")
        second = fast(input_ids=ids).logits.clone()
        assert len(captured) == 1 and fast.borrowed and captured[0].replays == 1
        assert_close(second, reference, "replayed call")
        other = ids_of(graph, 1, 30, seed=1)  # same shape, other tokens: the same graph, new input copied in
        assert_close(fast(input_ids=other).logits, graph.logits(other), "replay on new ids")
        assert len(captured) == 1 and captured[0].replays == 2
        for length in (31, 32, 31, 32):  # two more shapes: the first shape's graph is dropped (keep=2)
            fast(input_ids=ids_of(graph, 1, length))
        assert len(captured) == 3 and (1, 30) not in {slot[0] for slot in fast.replays.graphs}


@pytest.mark.parametrize("problem", ["fail", "corrupt"])
def test_replay_that_fails_or_disagrees_warns_once(stories, monkeypatch, problem):
    """A capture that raises, or a graph whose output disagrees with its eager warm-up: one warning,
    the eager numbers, and eager for good."""
    graph = fresh(stories)
    fast = FastGraph(graph.gm, "cpu", "eval", None, limit=graph.max_length, label="test graph")
    replaying_on_cpu(monkeypatch, fast, corrupt=problem == "corrupt", fail=problem == "fail")
    ids = ids_of(graph, 1, 30)
    with torch.no_grad():
        reference = graph.logits(ids)
        fast(input_ids=ids)
        with pytest.warns(UserWarning, match="Replaying the test graph") as caught:
            out = fast(input_ids=ids).logits
        assert len(caught) == 1 and not fast.borrowed and fast.replays.failed
        assert_close(out, reference, "fallback")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert_close(fast(input_ids=ids).logits, reference, "after the fallback")


def test_replay_under_autocast_captures_without_the_weight_cast_cache(stories, monkeypatch):
    """A distillation evaluates under autocast with float32 weights that train. With autocast's cast
    cache on, a weight updated in place is not seen inside the context (the cache's copy is), and a CUDA
    graph captured there reads that copy, freed when the context exits: the H200's mid-run evaluations
    were NaN. So a capture runs with the cache off, and a graph captured under autocast serves only
    calls under the same autocast."""
    lin, x = torch.nn.Linear(8, 8), torch.randn(2, 8)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # the hazard, in torch itself
        before = lin(x)
        lin.weight.add_(1.0)
        assert torch.equal(lin(x), before)
    graph = fresh(stories)
    fast = FastGraph(graph.gm, "cpu", "eval", None, limit=graph.max_length)
    captured = replaying_on_cpu(monkeypatch, fast)
    cache_at_capture = []
    inner = fast.replays.capture
    monkeypatch.setattr(fast.replays, "capture", lambda run: (cache_at_capture.append(torch.is_autocast_cache_enabled()), inner(run))[1])
    ids = ids_of(graph, 1, 30)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            fast(input_ids=ids), fast(input_ids=ids)
            assert cache_at_capture == [False] and torch.is_autocast_cache_enabled()
        plain = fast(input_ids=ids).logits  # not under autocast: a graph of its own, first eager
        assert len(captured) == 1 and not fast.borrowed and plain.dtype == torch.float32
        fast(input_ids=ids)
        assert len(captured) == 2  # (outside autocast the cache flag means nothing)


def test_weights_that_change_are_captured_again(stories, monkeypatch):
    """A captured graph keeps what it read at capture (a GDN layer's concatenated projections among it):
    after an in-place weight update (an optimizer step between a distillation's evaluations) every
    graph is captured again, so a replay gives the new weights' logits, not the old ones."""
    graph = fresh(stories)
    graph = dataclasses.replace(graph, gm=copy.deepcopy(graph.gm))  # its weights are edited below
    fast = FastGraph(graph.gm, "cpu", "eval", None, limit=graph.max_length)
    captured = replaying_on_cpu(monkeypatch, fast, frozen=True)
    ids = ids_of(graph, 1, 30)
    with torch.no_grad():
        fast(input_ids=ids), fast(input_ids=ids)
        before = fast(input_ids=ids).logits.clone()
        assert len(captured) == 1 and captured[0].replays == 2
        weight = dict(graph.gm.named_parameters())[next(n for n, _ in graph.gm.named_parameters() if "norm" in n)]
        weight.mul_(1.5)
        after = fast(input_ids=ids).logits
        assert len(captured) == 2
        assert_close(after, graph.logits(ids), "replay after the update")
        assert (after - before).abs().max() > 1e-3


def test_long_inputs_run_eagerly(stories, monkeypatch):
    """Inputs of more than REPLAY_MAX_TOKENS tokens are never captured (their host cost is small next to
    the memory a kept graph holds)."""
    import surgery.decode.replay as replay_module

    graph = fresh(stories)
    fast = FastGraph(graph.gm, "cpu", "eval", None, limit=graph.max_length)
    captured = replaying_on_cpu(monkeypatch, fast)
    monkeypatch.setattr(replay_module, "REPLAY_MAX_TOKENS", 40)
    with torch.no_grad():
        for _ in range(3):
            fast(input_ids=ids_of(graph, 2, 21))  # 42 tokens
        assert not captured and not fast.borrowed
        for _ in range(2):
            fast(input_ids=ids_of(graph, 2, 20))
        assert len(captured) == 1 and fast.borrowed


def linear_count(gm) -> int:
    return sum(n.op == "call_function" and n.target is torch.ops.aten.linear.default for n in gm.graph.nodes)


def test_sibling_projections_are_one_matmul_on_the_fused_route(stories, monkeypatch):
    """The fused route (CUDA's) runs q/k/v and gate/up as one matmul each over copies of their weights: the
    logits are the captured graph's, an in-place edit of a weight reaches the next call (the copies are
    refreshed), and neither the switch's off nor a device too small for the copies fuses them."""
    import surgery.decode.fused_linears as fused_linears

    monkeypatch.setattr(compiled_module, "ROUTES", {("cpu", "eval"): Route(causal_flags=True, fused=True)})
    graph = fresh(stories)
    ids = ids_of(graph, 2, 40)
    key = bucket(40, graph.max_length)
    layers = graph.config.num_hidden_layers
    up = next(p for name, p in graph.gm.named_parameters() if "up_proj" in name)
    with torch.no_grad():
        assert_close(fast_logits(graph, ids), graph.logits(ids), "fused")
        fast = fast_graph(graph)
        assert linear_count(fast.graphs[key]) == linear_count(graph.gm) - 3 * layers  # q/k/v 3 -> 1, gate/up 2 -> 1
        assert len(fast.fused[key]) == 2 * layers
        before, kept = fast_logits(graph, ids).clone(), up.clone()  # the session's graphs share these weights
        up.mul_(1.5)
        try:
            edited = fast_logits(graph, ids)
            assert_close(edited, graph.logits(ids), "after an in-place edit")
            assert (edited - before).abs().max().item() > 1e-3
            up.mul_(2 / 3)  # the public eager call (a Decoder's self-check probes) sees an edit too
            assert_close(first_output(fast.eager(ids)), graph.logits(ids), "eager after an in-place edit")
        finally:
            up.copy_(kept)
    twin = dataclasses.replace(graph, gm=copy.deepcopy(graph.gm), cache={})  # a model cast after its first call
    with torch.no_grad():
        fast_logits(twin, ids)
        twin.gm.double()
        assert_close(fast_logits(twin, ids.clone()), graph.logits(ids), "after a cast to float64")
        assert first_output(fast_graph(twin).eager(ids)).dtype == torch.float64
    for off in ("switch", "memory"):
        with monkeypatch.context() as m:
            if off == "switch":
                m.setenv(fused_linears.SWITCH, "off")
            else:
                m.setattr(fused_linears, "MEMORY_SHARE", 0.0)
            graph = fresh(stories)
            with torch.no_grad():
                assert_close(fast_logits(graph, ids), graph.logits(ids), f"{off} off")
            fast = fast_graph(graph)
            assert linear_count(fast.graphs[key]) == linear_count(graph.gm) and not fast.fused[key]
