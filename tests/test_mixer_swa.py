"""replace.mixer: the registry, and swa (sliding-window softmax attention in place of the attention op).

References: a float64 loop over each query's window (the module), the receptive field of a stack of
windowed layers (the graph: a token outside it cannot change a logit), full recomputation (decoding),
the teacher's own attention block output on held-out text (Phase 1), the saved weights (save/load)."""
from __future__ import annotations

import json

import pytest
import torch

import surgery
from surgery import PassManager
from surgery.decode import Decoder
from surgery.errors import CheckpointError, ExportError, PassConfigError
from tcal import maps
from tcal.mixers import MIXERS, get_mixer
from tcal.mixers.swa import SlidingWindowAttention
from tcal.stats import AttentionStats

from test_calibrate import HELD_OUT

SIX = ["llama", "qwen2", "gemma2", "gpt2", "gpt_neox", "phi3"]  # sdpa, GQA, biases, eager + softcap, fused QKV layouts


def convert(graph, mixer="swa", layers=None, **replace):
    select = {"policy": "convert", "layers": layers} if layers is not None else {"keep_ratio": 0.5}
    PassManager(["select", "replace"], {"select": select, "replace": {"mixer": mixer, **replace}})(graph)
    return graph


def matches_full(graph, ids: torch.Tensor, first: int) -> None:
    """Prefill `first` tokens then step one at a time, in both step modes: the logits of full recomputation."""
    full = graph.logits(ids)
    for mode in ("dynamic", "static"):
        decoder = Decoder(graph, step_mode=mode).reset(1, ids.shape[1])
        got = [decoder.prefill(ids[:, :first])] + [decoder.step(ids[:, t:t + 1]) for t in range(first, ids.shape[1])]
        torch.testing.assert_close(torch.cat(got, dim=1), full, atol=1e-4, rtol=1e-4, msg=mode)


def naive_window_attention(q, k, v, window: int, scale: float, softcap=None) -> torch.Tensor:
    """float64, one query at a time over its last `window` keys; K/V heads repeated for GQA."""
    q, k, v = (x.double() for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=torch.float64)
    for h in range(q.shape[1]):
        for t in range(q.shape[2]):
            lo = max(0, t - window + 1)
            s = (k[:, h // group, lo:t + 1] @ q[:, h, t, :, None]).squeeze(-1) * scale
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            out[:, h, t] = (s.softmax(-1)[..., None] * v[:, h // group, lo:t + 1]).sum(1)
    return out


# ------------------------------------------------------------------------------------------------
# the registry


def test_registry_lists_the_mixers_and_names_the_choices():
    assert "gdn" in MIXERS and "swa" in MIXERS
    assert get_mixer("swa").module is SlidingWindowAttention
    with pytest.raises(ValueError, match="choose one of gdn, swa"):
        get_mixer("mamba")


def test_unknown_mixer_is_refused_before_any_work(stories):
    graph = stories()
    with pytest.raises(PassConfigError, match="mixer 'mamba' is not one of gdn, swa"):
        convert(graph, mixer="mamba")
    assert graph.history == [] and "replace" not in graph.meta


def test_default_mixer_is_gdn_and_recorded(stories):
    graph = convert(stories(), mixer="gdn", layers=[1])
    assert graph.meta["replace"]["modules"]["1"]["mixer"] == "gdn" and graph.layer_kinds[1] == "gdn"
    assert get_mixer(graph.history[-1]["config"]["mixer"]).name == "gdn"


# ------------------------------------------------------------------------------------------------
# swa: the module and its Phase 1 map


@pytest.mark.parametrize("softcap, transposed", [(None, False), (2.0, True)])
def test_module_matches_a_float64_loop(softcap, transposed):
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 11, 8, generator=g), torch.randn(2, 2, 11, 8, generator=g), torch.randn(2, 2, 11, 8, generator=g)
    module = SlidingWindowAttention(4, 8, window=3, scale=0.4, softcap=softcap, k_transposed=transposed)
    got = module(q, k.transpose(-1, -2) if transposed else k, v)
    torch.testing.assert_close(got.double(), naive_window_attention(q, k, v, 3, 0.4, softcap), atol=1e-5, rtol=1e-5)


def test_the_module_traces_into_one_graph():
    """The window is a buffer (Phase 1 sets it, checkpoints keep it): reading it as a Python int broke a
    compiled graph at the kept heads of every head-split layer (forty-second session)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 7, 8, generator=g) for _ in range(3))
    module = SlidingWindowAttention(2, 8, window=3, scale=0.4)
    explained = torch._dynamo.explain(module)(q, k, v)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    torch.testing.assert_close(module(q, k, v).double(), naive_window_attention(q, k, v, 3, 0.4, None), atol=1e-5, rtol=1e-5)


def test_window_from_mass_keeps_the_quantile():
    mass = torch.tensor([[0.5, 0.3, 0.1, 0.1], [0.05, 0.05, 0.1, 0.8]])  # per head, by distance 0, 1, 2, 3
    assert maps.window_from_mass(mass, 0.8).tolist() == [2, 4]
    assert maps.window_from_mass(mass, 0.45).tolist() == [1, 4]
    assert maps.window_from_mass(mass, 1.0).tolist() == [4, 4]


def test_stats_mass_by_distance_sums_to_one_per_row_and_matches_the_mean_distance():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 3, 9, 4, generator=g), torch.randn(2, 3, 9, 4, generator=g)
    stats = AttentionStats(3)
    stats.update_from_qk(q, k, scale=0.5, query_chunk=4)
    out = stats.result()
    torch.testing.assert_close(out["distance_mass"].sum(-1), torch.ones(3, dtype=torch.float64))
    d = torch.arange(out["distance_mass"].shape[1], dtype=torch.float64).clamp_min(0.5)
    torch.testing.assert_close((out["distance_mass"] * d).sum(-1), out["distance"])


# ------------------------------------------------------------------------------------------------
# swa in graphs


def test_stories_swa_decodes_exactly_and_is_windowed(stories):
    graph = convert(stories(), layers=[1, 3], window=3)
    assert graph.layer_kinds == ["attention", "swa", "attention", "swa", "attention"]
    ids = torch.randint(3, 512, (1, 19), generator=torch.Generator().manual_seed(0))
    assert (graph.logits(ids) - stories().logits(ids)).abs().max() > 1e-3  # the window bites at 19 tokens
    matches_full(graph, ids, 7)
    sizes = Decoder(graph).reset(1, 19)
    sizes.prefill(ids)
    assert sizes.attention[1].k_cache.shape[2] == 3 and sizes.attention[0].k_cache.shape[2] == 19  # a ring of 3 positions
    assert sizes.cache_bytes()["gdn"] == 0


def test_swa_decodes_on_the_cuda_route(stories, monkeypatch):
    """The route CUDA takes (causal flags, fusions; its prefill through the fast runner), on the CPU:
    the decode graph drops the window layer's call and pruned the module, which the prefill graph
    shares, so the prefill lost its window buffer (the H200 speed run, seventeenth session)."""
    import surgery.core.compiled as compiled_module
    from surgery.core.compiled import Route

    route = Route(causal_flags=True, fused=True)
    monkeypatch.setattr(compiled_module, "ROUTES", {("cpu", "eval"): route, ("cpu", "prefill"): route})
    graph = convert(stories(), layers=[1, 3], window=3)
    matches_full(graph, torch.randint(3, 512, (1, 15), generator=torch.Generator().manual_seed(2)), 5)


@pytest.mark.parametrize("name", SIX)
def test_tiny_archs_convert_window_and_decode_exactly(tiny, name):
    """Every layer swa with window 2: a token can reach a logit only through L * (2 - 1) positions, so
    changing token 0 leaves every logit from position L + 1 on unchanged (and changes position 0's)."""
    entry = tiny(name)
    entry.require_sites()
    layers = list(range(entry.graph.num_layers))
    graph = convert(entry.graph.branch(), layers=layers, window=2)
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    other = ids.clone()
    other[0, 0] = 3 + (int(ids[0, 0]) - 2) % 125
    a, b = graph.logits(ids), graph.logits(other)
    reach = len(layers) + 1
    torch.testing.assert_close(a[:, reach:], b[:, reach:], atol=1e-5, rtol=1e-5)
    assert (a[:, 0] - b[:, 0]).abs().max() > 1e-4
    matches_full(convert(entry.graph.branch(), window=3), torch.randint(3, 128, (1, 13), generator=torch.Generator().manual_seed(1)), 5)


def test_swa_refuses_alibi_by_layer(tiny):
    entry = tiny("bloom")
    entry.require_sites()
    graph = entry.graph.branch()
    with pytest.raises(PassConfigError, match="mixer 'swa' cannot stand in .* layer 0: its scores carry a position bias"):
        convert(graph, layers=[0])
    assert "replace" not in graph.meta


@pytest.fixture(scope="module")
def held_out(stories_teacher):
    from surgery.data.text import tokenize

    return tokenize(stories_teacher.tokenizer, HELD_OUT).flatten()[:512].reshape(2, 256)


def block_output(graph, layer: int) -> str:
    """The node holding a converted layer's attention block output: its output projection (a mixer
    that replaced only the op), else the call of the module that replaced the whole block."""
    entry = graph.meta["replace"]["modules"][str(layer)]
    if get_mixer(entry["mixer"]).replaces == "op":
        return graph.sites[layer].output_node
    return next(n.name for n in graph.gm.graph.nodes if n.op == "call_module" and n.target == entry["target"])


def block_error(graph, teacher, ids, layers, record) -> float:
    """Relative squared error of the converted layers' attention block outputs against the teacher's."""
    got = record(graph.gm, ids, [block_output(graph, l) for l in layers])
    want = record(teacher.gm, ids, [graph.sites[l].output_node for l in layers])
    pairs = [(got[block_output(graph, l)], want[graph.sites[l].output_node]) for l in layers]
    return sum(float((a - b).pow(2).sum() / b.pow(2).sum()) for a, b in pairs) / len(pairs)


def test_phase1_window_beats_the_copy_only_window_on_held_out_text(stories, stories_teacher, held_out, record, tmp_path):
    """The copy-only baseline keeps replace's window (4); Phase 1 reads each layer's from the
    teacher's attention mass (calibration text), and the block outputs on held-out stories come
    closer to the teacher's. Save/load keeps the calibrated windows exactly; the qwen3_5 export refuses by name."""
    baseline = convert(stories(), layers=[1, 3], window=4)
    calibrated = convert(stories(), layers=[1, 3], window=4)
    PassManager(["calibrate", "align"], {"calibrate": {"samples": 4, "length": 256}})(calibrated)
    windows = {l: int(m.window) for l, m in calibrated.gdn_modules().items()}
    assert all(w > 4 for w in windows.values()), windows
    assert calibrated.meta["align"]["steps"] == 0  # nothing to train
    before = block_error(baseline, stories_teacher, held_out, [1, 3], record)
    after = block_error(calibrated, stories_teacher, held_out, [1, 3], record)
    assert after < 0.5 * before, (before, after)

    surgery.save(calibrated, tmp_path / "h")
    loaded = surgery.load(tmp_path / "h")
    assert {l: int(m.window) for l, m in loaded.gdn_modules().items()} == windows
    assert torch.equal(loaded.logits(held_out[:1]), calibrated.logits(held_out[:1]))
    matches_full(loaded, held_out[:1, :40], 9)
    with pytest.raises(ExportError, match="--format qwen3_5 exports GDN layers only, and this hybrid converted layer 1 \\(swa\\), layer 3 \\(swa\\)"):
        surgery.export(loaded, tmp_path / "qwen3_5", format="qwen3_5")  # --format hf: tests/test_export.py::test_swa_exports_as_a_windowed_mask
    assert not (tmp_path / "qwen3_5").exists()

    recipe = json.loads((tmp_path / "h" / "recipe.json").read_text())
    recipe["decisions"]["replace"]["modules"]["1"]["mixer"] = "mamba"
    (tmp_path / "h" / "recipe.json").write_text(json.dumps(recipe))
    with pytest.raises(CheckpointError, match=r"decisions.replace.modules\['1'\].mixer = 'mamba' is not one of gdn, swa"):
        surgery.load(tmp_path / "h")


def test_distill_refuses_a_hybrid_with_nothing_to_train(stories):
    from surgery.errors import DistillError
    from surgery.train.models import open_student

    graph = convert(stories(), layers=[1, 3], window=4)
    with pytest.raises(DistillError, match=r"converted layers \[1, 3\] to a mixer with nothing to train \(swa\)"):
        open_student(graph, "cpu", torch.float32)


@pytest.mark.parametrize("passes, config, words", [
    (["select", "replace"], {"replace": {"mixer": "swa", "window": 0}}, "window must be >= 1, got 0"),
    (["select", "replace", "calibrate"], {"replace": {"mixer": "swa"}, "calibrate": {"window_quantile": 1.5}}, r"window_quantile must lie in \(0, 1\], got 1.5"),
])
def test_bad_window_options_are_refused_before_any_work(stories, passes, config, words):
    graph = stories()
    with pytest.raises(PassConfigError, match=words):
        PassManager(passes, {"select": {"policy": "convert", "layers": [1]}, **config})(graph)
    assert graph.history == [] and "replace" not in graph.meta
