"""`surgery inspect` tells the truth about a hybrid: the title counts softmax and GDN layers, the
kind column says gdn for a GDN layer, the window column shows each layer's sliding window (read from
the graph's masks), and the KV bytes per token and GDN state bytes are what decoding keeps; the
--json output carries every one of these fields."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cli_checks import invoke


def inspect_json(model) -> dict:
    result = invoke(CliRunner(), "inspect", "--model", model, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def stories_hybrid(stories_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("inspect") / "hybrid"
    result = invoke(CliRunner(), "apply", "--model", stories_path, "--passes", "select,replace", "--layers", "1,3,4", "--out", out)
    assert result.exit_code == 0, result.output
    return out


def test_inspect_a_saved_hybrid_counts_and_sizes_its_layers(stories_hybrid):
    data = inspect_json(stories_hybrid)
    assert (data["layers"], data["softmax_layers"], data["gdn_layers"], data["dtype"]) == (5, 2, 3, "float32")
    rows = data["sites"]
    assert [r["kind"] for r in rows] == ["sdpa", "gdn", "sdpa", "gdn", "gdn"]
    assert [r["now"] for r in rows] == ["attention", "gdn", "attention", "gdn", "gdn"]
    assert [r["window"] for r in rows] == [None] * 5  # stories260K: full causal everywhere
    # stories260K: 4 KV heads of 8 dims, float32: K and V = 2 * 4 * 8 * 4 bytes a token; a GDN layer's
    # state: 8 heads of an 8 x 8 matrix in float32, no short convolutions
    assert [r["kv_bytes_per_token"] for r in rows] == [256, 0, 256, 0, 0]
    assert [r["state_bytes"] for r in rows] == [0, 8 * 8 * 8 * 4, 0, 8 * 8 * 8 * 4, 8 * 8 * 8 * 4]
    assert (data["kv_bytes_per_token"], data["state_bytes"]) == (512, 3 * 2048)
    table = invoke(CliRunner(), "inspect", "--model", stories_hybrid).stdout
    assert "5 layers: 2 softmax attention + 3 GDN (llama)" in table
    assert "│ gdn " in table and "full" in table


def test_inspect_a_teacher(stories_path):
    data = inspect_json(stories_path)
    assert (data["softmax_layers"], data["gdn_layers"], data["state_bytes"]) == (5, 0, 0)
    assert {r["kind"] for r in data["sites"]} == {"sdpa"}
    assert "5 softmax attention layers (llama)" in invoke(CliRunner(), "inspect", "--model", stories_path).stdout


def test_inspect_shows_sliding_windows(tiny, tmp_path):
    """tests/archs.py's gemma3: layers 0 and 2 slide over 8 positions, layer 1 is global; converting
    the global layer leaves the two window layers as they were."""
    from archs import WINDOW

    tiny("gemma3").model.save_pretrained(tmp_path / "gemma3")
    teacher = inspect_json(tmp_path / "gemma3")
    assert [r["window"] for r in teacher["sites"]] == [WINDOW, None, WINDOW]
    size = teacher["sites"][0]
    assert size["kv_bytes_per_token"] == 2 * size["kv_heads"] * size["head_dim"] * 4
    result = invoke(CliRunner(), "apply", "--model", tmp_path / "gemma3", "--passes", "select,replace", "--layers", "1", "--out", tmp_path / "h")
    assert result.exit_code == 0, result.output
    hybrid = inspect_json(tmp_path / "h")
    assert [(r["kind"], r["window"]) for r in hybrid["sites"]] == [(size["kind"], WINDOW), ("gdn", None), (size["kind"], WINDOW)]
    assert (hybrid["softmax_layers"], hybrid["gdn_layers"]) == (2, 1)
    assert hybrid["sites"][1]["state_bytes"] > 0 and hybrid["sites"][1]["kv_bytes_per_token"] == 0
