"""One diff: `surgery apply` prints exactly what `surgery diff MODEL OUT` prints afterwards (values
compared, not only shapes), identical layers joined into one row; `surgery.diff` takes what the CLI
takes (names, paths, saved hybrids) as well as Graphs."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import surgery
from surgery.errors import ModelLoadError
from surgery.eval.diff import layer_ranges

from cli_checks import invoke


@pytest.fixture(scope="module")
def aligned(stories_path, tmp_path_factory):
    """`surgery apply` converting layers 1, 3, 4 of stories260K with 2 align steps (align trains q_proj)."""
    out = tmp_path_factory.mktemp("diff") / "hybrid"
    result = invoke(CliRunner(), "apply", "--model", stories_path, "--passes", "select,replace,align", "--layers", "1,3,4",
                    "--set", "align.steps=2", "--set", "align.samples=2", "--set", "align.length=64", "--out", out)
    assert result.exit_code == 0, result.output
    return out, result


def test_apply_prints_what_diff_prints(aligned, stories_path):
    out, applied = aligned
    diffed = invoke(CliRunner(), "diff", stories_path, out)
    assert diffed.exit_code == 0, diffed.output
    assert applied.stdout == diffed.stdout  # the same table, title and all
    table = diffed.stdout
    assert "parameters compared by values" in table
    row = next(line for line in table.splitlines() if line.startswith("│ 1,3,4 "))  # three identical layers, one row
    assert "attention -> gdn" in row
    assert "~3 params (k_proj.weight," in table and "q_proj.weight" in table  # q_proj: same shape, values trained
    assert "unchanged: 0,2" in table


def test_diff_json_groups_identical_layers(aligned, stories_path):
    out, _ = aligned
    data = json.loads(invoke(CliRunner(), "diff", stories_path, out, "--json").stdout)
    assert data["compared"] == "values"
    converted = [g for g in data["groups"] if g["after"] == "gdn"]
    assert len(converted) == 1 and converted[0]["layers"] == [1, 3, 4] and converted[0]["label"] == "1,3,4"
    per_layer = {e["layer"]: e for e in data["layers"] if isinstance(e["layer"], int)}
    for layer in (1, 3, 4):
        changed = {c["name"].rsplit(".", 2)[-2]: c["what"] for c in per_layer[layer]["params_changed"]}
        assert changed == {"q_proj": "values", "k_proj": "shape", "v_proj": "shape"}


def test_python_diff_takes_what_the_cli_takes(aligned, stories_path, stories_teacher):
    out, _ = aligned
    from_strings = surgery.diff(str(stories_path), str(out))
    from_graphs = surgery.diff(stories_teacher, surgery.load(out))
    assert from_strings == from_graphs
    assert surgery.diff(stories_path, out) == from_graphs  # Path objects too
    with pytest.raises(ModelLoadError, match="No model at"):
        surgery.diff(str(out), str(out) + "-missing")


def test_layer_ranges():
    assert layer_ranges([1, 3, *range(5, 30)]) == "1,3,5-29"
    assert layer_ranges([0, 1]) == "0,1"
    assert layer_ranges([4, 2, 3, "outside layers"]) == "2-4,outside layers"
    assert layer_ranges([]) == ""


def test_same_tensor_is_one_tensor_only():
    """diff skips reading a parameter both graphs share; anything else (a copy, another view of the
    same memory) is compared by value."""
    import torch

    from surgery.eval.diff import same_tensor

    x = torch.arange(12.0).reshape(3, 4)
    assert same_tensor(x, x) and same_tensor(x, x.view(3, 4))
    assert not same_tensor(x, x.clone()) and not same_tensor(x, x.t()) and not same_tensor(x, x[1:])
    assert not same_tensor(x, x.view(4, 3)) and not same_tensor(x, x.to(torch.float64))
