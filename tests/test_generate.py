"""Incremental decoding (surgery.decode) and `surgery generate`.

The reference for every decoded token and logit is full recomputation: graph.logits on the whole
growing sequence (the captured graph, which test_capture checks against transformers), and for
the teacher also transformers' own generate() on the eager model."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from typer.testing import CliRunner

import surgery
from surgery import PassManager
from surgery.decode import DecodeError, Decoder, generate
from surgery.decode.regimes import Regimes

from cli_checks import assert_clean_failure as assert_cli_failure, invoke as cli_invoke

ATOL = 1e-4  # float32: incremental and full logits differ by ~1e-6 on the tiny models
ARCHS = ["llama", "qwen2", "mistral", "gemma2", "phi3", "gpt2", "gpt_neox", "opt"]


def hybrid(graph, **replace):
    """select+replace keeping half the layers; short-conv weights randomised so their state matters."""
    PassManager(["select", "replace"], {"select": {"keep_ratio": 0.5}, "replace": replace})(graph)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in graph.gm.named_parameters():
            if "conv1d" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return graph


def full_greedy(graph, prompt: list, n: int):
    """Greedy tokens and last-position logits by recomputing the whole sequence each step."""
    seq, logits = list(prompt), []
    for _ in range(n):
        last = graph.logits(torch.tensor([seq]))[0, -1]
        logits.append(last)
        seq.append(int(last.argmax()))
    return seq[len(prompt):], torch.stack(logits)


def incremental_greedy(decoder, prompt: list, n: int):
    decoder.reset(1, len(prompt) + n)
    last = decoder.prefill(torch.tensor([prompt]))[0, -1]
    tokens, logits = [], []
    for i in range(n):
        logits.append(last)
        tokens.append(int(last.argmax()))
        if i < n - 1:
            last = decoder.step(torch.tensor([[tokens[-1]]]))[0, -1]
    return tokens, torch.stack(logits)


def prompt_of(length: int, vocab: int, seed: int = 0) -> list:
    return torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_matches_full(graph, prompt, n, modes=("dynamic", "static")):
    """Each step mode: "static" is the fixed-shape step a CUDA graph replays (full-capacity KV
    buffers under a position mask, positions picked by a device index, GDN state updated in place)."""
    want_tokens, want_logits = full_greedy(graph, prompt, n)
    for mode in modes:
        decoder = Decoder(graph, step_mode=mode)
        tokens, logits = incremental_greedy(decoder, prompt, n)
        assert tokens == want_tokens, mode
        torch.testing.assert_close(logits, want_logits, atol=ATOL, rtol=1e-4)
        assert generate(decoder, [prompt], n, eos_token_id=None) == [want_tokens]
    return decoder


# ------------------------------------------------------------------------------------------------
# (a) incremental == full recomputation


@pytest.mark.parametrize("name", ARCHS)
def test_incremental_equals_full_teacher_and_hybrid(tiny, name):
    """24 tokens: past the sliding window (8) of mistral and gemma2's odd layers."""
    graph = tiny(name).graph
    tiny(name).require_sites()
    prompt = prompt_of(7, 128)
    teacher = assert_matches_full(graph.branch(), prompt, 17)
    assert teacher.cache_bytes()["gdn"] == 0
    mixed = assert_matches_full(hybrid(graph.branch()), prompt, 17)
    assert mixed.gdn and mixed.attention and set(mixed.gdn) | set(mixed.attention) == set(range(graph.num_layers))


def test_softcap_that_bites():
    """The tiny gemma2's cap of 50 barely bends its small scores; a cap of 0.5 dominates them, so
    a decoder that dropped or misplaced the softcap would fail here."""
    from archs import attn_implementation, config
    from transformers import AutoModelForCausalLM

    cfg = config("gemma2")
    cfg.attn_logit_softcapping = 0.5
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation(cfg)).eval()
        with torch.no_grad():  # scores of order 1-10 (initialised weights give ~1e-3)
            for name, p in model.named_parameters():
                if name.endswith(("q_proj.weight", "k_proj.weight")):
                    p.mul_(40)
        graph = surgery.capture(model)
    assert graph.sites[0].softcap == pytest.approx(0.5)
    assert_matches_full(graph, prompt_of(7, 128), 17)


def test_incremental_equals_full_with_short_conv_and_chunked_prefill(tiny):
    """GDN conv streams carry their last inputs; a 20-token prefill takes the chunked kernel path
    (T > 16) and must hand its final state to the token loop."""
    graph = hybrid(tiny("llama").graph.branch(), use_short_conv=True)
    assert_matches_full(graph, prompt_of(20, 128, seed=1), 9)


def test_incremental_equals_full_on_stories(stories):
    """The real tiny Llama (5 layers, GQA) as teacher and as a hybrid, from a GGUF."""
    prompt = prompt_of(9, 512, seed=2)
    assert_matches_full(stories(), prompt, 14)
    assert_matches_full(hybrid(stories()), prompt, 14)


def test_chunked_continuation_matches_full(tiny):
    """prefill may be called again to continue a sequence with several tokens at once."""
    graph = hybrid(tiny("mistral").graph.branch())
    ids = torch.tensor([prompt_of(26, 128, seed=3)])
    decoder = Decoder(graph).reset(1)
    got = torch.cat([decoder.prefill(ids[:, :5]), decoder.prefill(ids[:, 5:17]), decoder.step(ids[:, 17]), decoder.prefill(ids[:, 18:])], dim=1)
    torch.testing.assert_close(got, graph.logits(ids), atol=ATOL, rtol=1e-4)


# ------------------------------------------------------------------------------------------------
# refused forms


@pytest.mark.parametrize("name, words", [("bloom", "ALiBi"), ("mpt", "position bias")])
def test_position_bias_is_refused(tiny, name, words):
    """ALiBi cannot be reproduced from cached K/V without the bias: refuse with the fix."""
    with pytest.raises(DecodeError, match=words) as info:
        Decoder(tiny(name).graph)
    assert "full recomputation" in info.value.fix


def test_self_check_refuses_what_it_cannot_continue(tiny, monkeypatch):
    """Without the position rewrite, RoPE would see position 0 at every step: the construction-time
    comparison with full recomputation must catch it rather than decode wrongly."""
    from surgery.decode import runtime as decode

    monkeypatch.setattr(decode, "rewrite_positions", lambda *args: Regimes())
    with pytest.raises(DecodeError, match="disagrees with full recomputation"):
        Decoder(tiny("llama").graph)


def test_self_check_in_bf16_accepts_rounding_and_refuses_wrong_positions(stories_path, monkeypatch):
    """In bf16 incremental and full logits differ by rounding (more through GDN layers); the check
    must pass a correct decoder of a bf16 hybrid and still refuse one that keeps positions at 0."""
    from surgery import PassManager, capture
    from surgery.decode import runtime as decode

    graph = capture(stories_path, dtype=torch.bfloat16)
    PassManager(["select", "replace"], {"select": {"keep_ratio": 0.5}})(graph)
    Decoder(graph)  # passes its self-check
    monkeypatch.setattr(decode, "rewrite_positions", lambda *args: Regimes())
    with pytest.raises(DecodeError, match="relative logit error"):
        Decoder(graph)


def test_self_check_past_the_bf16_tolerance_asks_float32(stories_path, monkeypatch):
    """A bf16 disagreement past the tolerance is rechecked on a float32 copy: a correct decoder (rounding
    only; here every bf16 difference counts as too large) decodes with one warning and the bf16 logits,
    while one that keeps positions at 0 is refused with both figures."""
    from surgery import PassManager, capture
    from surgery.decode import agreement
    from surgery.decode import runtime as decode

    graph = capture(stories_path, dtype=torch.bfloat16)
    PassManager(["select", "replace"], {"select": {"keep_ratio": 0.5}})(graph)
    monkeypatch.setattr(agreement, "LOW_PRECISION_REL_ERROR", -1.0)
    with pytest.warns(UserWarning, match="float32 copy of the weights agrees") as caught:
        decoder = Decoder(graph)
    assert len([w for w in caught if "float32 copy" in str(w.message)]) == 1
    prompt = prompt_of(6, 512, seed=3)
    tokens, logits = incremental_greedy(decoder, prompt, 4)
    assert logits.dtype == torch.bfloat16 and len(tokens) == 4
    monkeypatch.setattr(decode, "rewrite_positions", lambda *args: Regimes())
    with pytest.raises(DecodeError, match=r"relative logit error .* float32 copy disagrees too \(max logit difference"):
        Decoder(graph)


def test_position_limit(tiny):
    graph = tiny("llama").graph
    decoder = Decoder(graph)
    with pytest.raises(DecodeError, match="position limit"):
        generate(decoder, [[5, 6, 7]], graph.max_length)
    decoder.reset(1)
    decoder.prefill(torch.zeros(1, graph.max_length, dtype=torch.long))
    with pytest.raises(DecodeError, match="position limit"):
        decoder.step(torch.tensor([[1]]))


# ------------------------------------------------------------------------------------------------
# (b) the teacher against transformers' own generate


@pytest.mark.parametrize("name", ["llama", "mistral", "gpt2", "gemma2"])
def test_teacher_greedy_equals_transformers_generate(tiny, name):
    entry = tiny(name)
    prompt = prompt_of(6, 128, seed=4)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        want = entry.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20,
                                    eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert generate(entry.graph, [prompt], 20, eos_token_id=None) == [want]


# ------------------------------------------------------------------------------------------------
# (c) state sizes


def test_gdn_state_does_not_grow_and_kv_cache_is_kv_heads_wide(tiny):
    graph = hybrid(tiny("llama").graph.branch(), use_short_conv=True)
    site = graph.sites[0]
    assert graph.layer_kinds == ["attention", "gdn"] and site.num_kv_heads < site.num_heads
    decoder = Decoder(graph).reset(1)  # no capacity: the KV cache grows, the GDN state must not
    decoder.prefill(torch.tensor([prompt_of(5, 128)]))
    gdn_after_prefill, att_after_prefill = decoder.cache_bytes()["gdn"], decoder.cache_bytes()["attention"]
    for t in range(40):
        decoder.step(torch.tensor([[t + 3]]))
    sizes = decoder.cache_bytes()
    assert sizes["gdn"] == gdn_after_prefill > 0
    assert sizes["attention"] > att_after_prefill
    # recurrent [B, H, Dk, Dv] float32 + three conv streams of conv_size-1 inputs
    h, d = site.num_heads, site.head_dim
    assert sizes["gdn"] == h * d * d * 4 + 3 * 3 * h * d * 4
    decoder.reset(1, capacity=45)
    decoder.prefill(torch.tensor([prompt_of(5, 128)]))
    assert decoder.cache_bytes(per_layer=True)[0] == 2 * site.num_kv_heads * 45 * d * 4  # K and V, KV heads only


def test_sliding_window_cache_is_bounded(tiny):
    graph = tiny("mistral").graph  # every layer has a window of 8
    decoder = Decoder(graph).reset(1, capacity=60)
    decoder.prefill(torch.tensor([prompt_of(10, 128)]))
    first = decoder.cache_bytes()["attention"]
    for t in range(40):
        decoder.step(torch.tensor([[t + 3]]))
    assert decoder.cache_bytes()["attention"] == first
    assert first < 2 * graph.num_layers * 2 * 9 * 16 * 4 + 1024  # about a window, not 60 positions


# ------------------------------------------------------------------------------------------------
# (d) batches


@pytest.mark.parametrize("name", ["qwen2", "gemma2"])
def test_batched_prompts_of_different_lengths(tiny, name):
    graph = hybrid(tiny(name).graph.branch())
    prompts = [prompt_of(n, 128, seed=n) for n in (4, 9, 4, 13)]
    batched = generate(graph, prompts, 12, eos_token_id=None)
    assert batched == [full_greedy(graph, p, 12)[0] for p in prompts]
    assert generate(Decoder(graph, step_mode="static"), prompts, 12, eos_token_id=None) == batched


def test_static_steps_fall_back_without_capacity_and_modes_are_checked(tiny):
    """Static steps need buffers at a known capacity; without one the decoder grows its caches
    (dynamic steps) and still matches. A CUDA graph on a CPU graph is a clear error."""
    graph = hybrid(tiny("llama").graph.branch())
    ids = torch.tensor([prompt_of(12, 128, seed=4)])
    decoder = Decoder(graph, step_mode="static").reset(1)
    got = torch.cat([decoder.prefill(ids[:, :6])] + [decoder.step(ids[:, t]) for t in range(6, 12)], dim=1)
    torch.testing.assert_close(got, graph.logits(ids), atol=ATOL, rtol=1e-4)
    with pytest.raises(DecodeError, match="step_mode"):
        Decoder(graph, step_mode="fast")
    with pytest.raises(DecodeError, match="CUDA"):
        Decoder(graph, step_mode="cuda-graph")


def test_static_steps_keep_the_gdn_state_memory(tiny):
    """A captured step reads and writes fixed addresses: a decoder that can take static steps keeps
    each GDN state in the tensors the prefill made, a dynamic one may replace them (no copies)."""
    graph = hybrid(tiny("llama").graph.branch())
    ids = torch.tensor([prompt_of(9, 128, seed=7)])

    def addresses(decoder):
        return [t.data_ptr() for m in decoder.gdn.values() for t in m._tensors()]

    for mode, kept in (("static", True), ("dynamic", False)):
        decoder = Decoder(graph, step_mode=mode).reset(1, capacity=16)
        decoder.prefill(ids[:, :6])
        before = addresses(decoder)
        held = [t for m in decoder.gdn.values() for t in m._tensors()]  # alive, so a new state cannot reuse their memory
        got = [decoder.step(ids[:, t]) for t in range(6, 9)]
        assert (addresses(decoder) == before) is kept, mode
        del held
        torch.testing.assert_close(torch.cat(got, dim=1), graph.logits(ids)[:, 6:], atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma2"])
def test_static_steps_fuse_sibling_projections_and_follow_weight_changes(tiny, name):
    """Static steps run linears that share an input as one matmul (q/k/v, gate/up: fewer kernels per
    step) and each GDN layer's six input projections as one; after weights change in place the
    fused copies follow, so steps still equal full recomputation with the new weights."""
    shared = tiny(name).graph.branch()  # a private copy: the weights are scaled and cast below
    graph = hybrid(dataclasses.replace(shared, gm=copy.deepcopy(shared.gm), meta=copy.deepcopy(shared.meta)))
    decoder = Decoder(graph, step_mode="static")
    linears = [sum(n.target is torch.ops.aten.linear.default for n in gm.graph.nodes) for gm in (decoder.gm, decoder.step_gm)]
    assert linears[1] < linears[0] and len(decoder.fused) > len(decoder.gdn) > 0
    assert not any("_fused_linear" in k for k in graph.gm.state_dict()) and not any("_fused" in k for k in decoder.step_gm.state_dict())
    ids = torch.tensor([prompt_of(9, 128, seed=3)])
    with torch.no_grad():
        for p in graph.gm.parameters():
            if p.dim() == 2:
                p.mul_(1.05)
    decoder.reset(1, capacity=16)
    decoder.prefill(ids[:, :6])
    got = torch.cat([decoder.step(ids[:, t]) for t in range(6, 9)], dim=1)
    torch.testing.assert_close(got, graph.logits(ids)[:, 6:], atol=ATOL, rtol=1e-4)
    plain = Decoder(graph, step_mode="static", fuse_projections=False)
    assert plain.step_gm is plain.gm and plain.fused == []
    graph.gm.double()  # a cast the fused copies cannot follow in place: said, not silently stale
    with pytest.raises(DecodeError, match="changed dtype or device"):
        decoder.reset(1, capacity=16)


def test_gdn_projections_padded_to_aligned_rows_decode_the_same(tiny, monkeypatch):
    """On CUDA a GDN layer's fused input projection gets zero rows up to an aligned count (cuBLAS takes
    slow kernels for 2,322 rows); forced here on the CPU, steps still equal full recomputation, and a
    weight change is copied into the rows before the padding, which stays zero."""
    import surgery.decode.fused_linears as fused_linears
    from tcal.gdn import CUDA_ROW_ALIGN

    def padded(weight, bias):
        pad = -weight.shape[0] % CUDA_ROW_ALIGN or CUDA_ROW_ALIGN  # always some rows, even where aligned
        return torch.nn.functional.pad(weight, (0, 0, 0, pad)), None if bias is None else torch.nn.functional.pad(bias, (0, pad))

    monkeypatch.setattr(fused_linears, "row_aligned", padded)
    shared = tiny("llama").graph.branch()
    graph = hybrid(dataclasses.replace(shared, gm=copy.deepcopy(shared.gm), meta=copy.deepcopy(shared.meta)))
    decoder = Decoder(graph, step_mode="static")
    projections = [m.projection for m in decoder.gdn.values()]
    assert projections and all(p.weight.shape[0] % CUDA_ROW_ALIGN == 0 and p.weight.shape[0] > sum(p.sizes) for p in projections)
    ids = torch.tensor([prompt_of(9, 128, seed=4)])
    for scale in (1.0, 1.05):
        with torch.no_grad():
            for p in graph.gm.parameters():
                if p.dim() == 2:
                    p.mul_(scale)
        decoder.reset(1, capacity=16)
        decoder.prefill(ids[:, :6])
        got = torch.cat([decoder.step(ids[:, t]) for t in range(6, 9)], dim=1)
        torch.testing.assert_close(got, graph.logits(ids)[:, 6:], atol=ATOL, rtol=1e-4)
    assert all(not p.weight[sum(p.sizes):].any() for p in projections)


def test_eos_stops_and_sampling_is_seeded(tiny):
    graph = tiny("llama").graph
    decoder = Decoder(graph)
    prompt = prompt_of(5, 128, seed=5)
    greedy = generate(decoder, [prompt], 10, eos_token_id=None)[0]
    stopped = generate(decoder, [prompt, prompt_of(5, 128, seed=6)], 10, eos_token_id=greedy[3])
    assert stopped[0] == greedy[: greedy.index(greedy[3]) + 1]  # the eos token is kept, nothing after it
    streamed = []
    generate(decoder, [prompt], 10, eos_token_id=None, stream=lambda i, t: streamed.append((i, t)))
    assert streamed == [(0, t) for t in greedy]
    a = generate(decoder, [prompt], 10, temperature=1.0, seed=7, eos_token_id=None)
    assert a == generate(decoder, [prompt], 10, temperature=1.0, seed=7, eos_token_id=None)
    assert a != generate(decoder, [prompt], 10, temperature=5.0, seed=8, eos_token_id=None)
    # a nucleus or a top-k of one token leaves only the argmax
    assert generate(decoder, [prompt], 10, temperature=1.0, top_k=1, seed=9, eos_token_id=None)[0] == greedy
    assert generate(decoder, [prompt], 10, temperature=1.0, top_p=1e-6, seed=9, eos_token_id=None)[0] == greedy


# ------------------------------------------------------------------------------------------------
# (e) the command line


@pytest.fixture(scope="module")
def runner():
    return CliRunner()


def invoke(runner, *args):
    return cli_invoke(runner, "generate", *args)


def assert_clean_failure(result, *words):
    """Also: nothing on stdout, which a pipe would read as a continuation."""
    assert_cli_failure(result, *words)
    assert result.stdout == ""


def test_text_stream_prints_the_whole_decode_with_short_decodes(stories):
    """Streaming token by token prints what decoding the whole continuation gives (leading spaces,
    multi-byte characters split over byte tokens), and no decode grows with the continuation."""
    from surgery.cli.generate import CONTEXT_TOKENS, TextStream

    tok = stories().tokenizer
    prompt = tok("Once upon a time")["input_ids"]
    new = tok(" there was a naïve café owner — «Ünïcode» ☃ — who said: 你好, world!\n" * 6, add_special_tokens=False)["input_ids"]
    assert len(new) > 10 * CONTEXT_TOKENS
    lengths = []

    class Counting(TextStream):
        def _decode(self, ids):
            lengths.append(len(ids))
            return super()._decode(ids)

    written = []
    stream = Counting(tok, prompt, written.append)
    for t in new:
        stream.push(t)
    stream.close()
    context = prompt[-CONTEXT_TOKENS:]
    full = tok.decode(context + new, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    base = tok.decode(context, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert "".join(written) == full[len(base):] + "\n"
    assert max(lengths) <= 4 * CONTEXT_TOKENS, max(lengths)


def test_cli_prints_only_the_continuations(runner, stories_path, stories, tmp_path):
    prompts = ["Once upon a time", "Lily saw a"]
    (tmp_path / "prompts.txt").write_text(prompts[1] + "\n\n")
    result = invoke(runner, "--model", stories_path, "--prompt", prompts[0], "--prompt-file", tmp_path / "prompts.txt",
                    "--max-new-tokens", 24, "--device", "cpu")
    assert result.exit_code == 0, result.output
    graph = stories()
    tok = graph.tokenizer
    want = ""
    for text in prompts:
        ids = tok(text)["input_ids"]
        new, _ = full_greedy(graph, ids, 24)
        new = new[: new.index(tok.eos_token_id) + 1] if tok.eos_token_id in new else new
        whole, head = tok.decode(ids + new, skip_special_tokens=True), tok.decode(ids, skip_special_tokens=True)
        assert whole.startswith(head)
        want += whole[len(head):] + "\n"
    assert result.stdout == want
    assert "loading" in result.stderr


def test_cli_errors(runner, stories_path, tiny, tmp_path):
    assert_clean_failure(invoke(runner, "--model", stories_path, "--prompt", "  "), "empty")
    assert_clean_failure(invoke(runner, "--model", stories_path), "No prompt")
    too_many = 10_000
    assert_clean_failure(invoke(runner, "--model", stories_path, "--prompt", "Once", "--max-new-tokens", too_many, "--device", "cpu"),
                         "position limit")
    saved = tmp_path / "hybrid"
    surgery.save(hybrid(tiny("llama").graph.branch()), saved)  # a model built from a config: no tokenizer
    assert_clean_failure(invoke(runner, "--model", saved, "--prompt", "hello", "--device", "cpu"), "tokenizer")


def test_cuda_graph_capture_logic_with_a_stand_in_graph(tiny, monkeypatch):
    """The capture path of surgery.decode.static_step on the CPU, with torch.cuda's stream and graph API
    replaced by stand-ins whose replay reruns the static step on the captured input buffer: the
    warm-up steps must not advance the GDN states (they are restored), and each replay must read
    the ids copied into that buffer and the offset set before it."""
    import contextlib

    from surgery.decode import static_step

    graph = hybrid(tiny("llama").graph.branch(), use_short_conv=True)
    decoder = Decoder(graph, step_mode="static")
    step = decoder._static
    replays = []

    class StandInGraph:
        def replay(self):
            replays.append(decoder.state.offset)
            step.logits.copy_(step._run(step.ids))

    fake_cuda = type("cuda", (), {
        "current_stream": staticmethod(lambda device=None: type("S", (), {"wait_stream": lambda self, other: None})()),
        "Stream": staticmethod(lambda device=None: type("S", (), {"wait_stream": lambda self, other: None})()),
        "stream": staticmethod(lambda s: contextlib.nullcontext()),
        "CUDAGraph": StandInGraph,
        "graph": staticmethod(lambda g: contextlib.nullcontext()),
    })
    monkeypatch.setattr(static_step.torch, "cuda", fake_cuda)
    step.cuda_graph = True
    ids = torch.tensor([prompt_of(14, 128, seed=8)])
    decoder.reset(1, 14)
    got = [decoder.prefill(ids[:, :6])] + [decoder.step(ids[:, t]) for t in range(6, 14)]
    torch.testing.assert_close(torch.cat(got, dim=1), graph.logits(ids), atol=ATOL, rtol=1e-4)
    assert isinstance(step.graph, StandInGraph) and replays == list(range(6, 14))


def test_sampling_options_are_checked_and_unseeded_sampling_varies(tiny):
    graph = tiny("llama").graph
    decoder = Decoder(graph)
    prompt = prompt_of(5, 128, seed=5)
    for bad in ({"temperature": -1.0}, {"temperature": 1.0, "top_p": 0.0}, {"temperature": 1.0, "top_k": 0}):
        with pytest.raises(DecodeError, match="Sampling options"):
            generate(decoder, [prompt], 4, **bad)
    draws = {tuple(generate(decoder, [prompt], 12, temperature=5.0, eos_token_id=None)[0]) for _ in range(4)}
    assert len(draws) > 1  # no seed: not the same draw every call


def test_a_one_dimensional_prompt_is_one_row(tiny):
    graph = tiny("llama").graph
    ids = torch.tensor(prompt_of(6, 128, seed=3))
    got = Decoder(graph).reset(1, 8).prefill(ids)
    torch.testing.assert_close(got, graph.logits(ids[None]), atol=ATOL, rtol=1e-4)


# ------------------------------------------------------------------------------------------------
# positions whose tables change with the sequence's length (LongRoPE's switch)

SWITCH = 16  # original_max_position_embeddings: short factors up to 16 tokens, long ones past it


@pytest.fixture(scope="module")
def longrope():
    """phi3 (unconverted) with LongRoPE: every position's rotation changes when the sequence passes SWITCH."""
    from transformers import AutoConfig, AutoModelForCausalLM

    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
            "long_factor": [1.0 + 0.5 * i for i in range(8)], "original_max_position_embeddings": SWITCH}
    config = AutoConfig.for_model("phi3", vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64,
                                  original_max_position_embeddings=SWITCH, rope_parameters=rope, pad_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        return surgery.capture(model)


@pytest.fixture(scope="module")
def longrope_prompts(longrope):
    """8 prompts of 14 tokens and full recomputation's 10 greedy tokens and logits for each."""
    prompts = [prompt_of(14, 128, seed=s) for s in range(8)]
    return prompts, [full_greedy(longrope, p, 10) for p in prompts]


@pytest.mark.parametrize("step_mode", ["dynamic", "static"])
def test_longrope_decoding_past_its_switch_equals_full_recomputation(longrope, longrope_prompts, step_mode):
    """14 + 10 tokens cross the switch: the decoder recomputes its caches there (as transformers'
    Phi3 does), so every token and logit is full recomputation's."""
    decoder = Decoder(longrope, step_mode=step_mode)
    assert decoder.regimes.switches == [SWITCH + 1]
    prompts, full = longrope_prompts
    for prompt, (want_tokens, want_logits) in zip(prompts, full):
        tokens, logits = incremental_greedy(decoder, prompt, 10)
        assert tokens == want_tokens
        torch.testing.assert_close(logits, want_logits, atol=ATOL, rtol=1e-4)
    assert generate(decoder, prompts, 10, eos_token_id=None) == [tokens for tokens, _ in full]


def test_longrope_below_its_switch_and_chunked_prefills_across_it(longrope):
    decoder = Decoder(longrope)
    prompt = prompt_of(6, 128, seed=9)
    tokens, logits = incremental_greedy(decoder, prompt, 8)  # 14 tokens: short factors throughout
    want_tokens, want_logits = full_greedy(longrope, prompt, 8)
    assert tokens == want_tokens
    torch.testing.assert_close(logits, want_logits, atol=ATOL, rtol=1e-4)
    ids = torch.tensor([prompt_of(30, 128, seed=4)])
    decoder.reset(1, 30)
    got = torch.cat([decoder.prefill(ids[:, :10]), decoder.prefill(ids[:, 10:20])[:, -1:], decoder.prefill(ids[:, 20:])[:, -1:]], dim=1)
    want = torch.cat([longrope.logits(ids[:, :10]), longrope.logits(ids[:, :20])[:, -1:], longrope.logits(ids)[:, -1:]], dim=1)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)


def test_self_check_catches_a_decoder_that_keeps_its_caches_across_the_switch(longrope, monkeypatch):
    from surgery.decode.regimes import Regimes as RegimesClass

    monkeypatch.setattr(RegimesClass, "crosses", lambda self, offset, new: False)
    with pytest.raises(DecodeError, match="disagrees with full recomputation on a 19-token probe"):
        Decoder(longrope)


class StubTables:
    """find_regimes' view of a graph: the tables at two lengths agree when `regime` maps them alike."""

    def __init__(self, regime):
        self.regime, self.calls = regime, 0

    def prefix(self, short: int, long: int) -> bool:
        self.calls += 1
        return self.regime(short) == self.regime(long)


def test_switches_are_located_and_tables_that_change_at_every_length_are_refused_past_a_few():
    from surgery.decode.regimes import MAX_SWITCHES, find_regimes

    one = find_regimes(StubTables(lambda n: n > 4096), 131072)
    assert one.switches == [4097] and one.limit is None
    assert not one.crosses(10, 100) and one.crosses(4096, 1) and one.crosses(4000, 200) and not one.crosses(0, 5000)
    assert find_regimes(StubTables(lambda n: 0), 131072).switches == []
    every = find_regimes(StubTables(lambda n: n if n > 10 else 0), 64)  # as dynamic NTK scaling would be
    assert every.switches == list(range(11, 11 + MAX_SWITCHES)) and every.limit == 10 + MAX_SWITCHES
    every.check(every.limit)
    with pytest.raises(DecodeError, match="change with the sequence length at more than"):
        every.check(every.limit + 1)
