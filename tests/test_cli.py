"""The `surgery` command line, run in-process with typer's CliRunner."""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from typer.testing import CliRunner

import surgery
from surgery import PassManager
from surgery.data.text import tokenize
from surgery.eval.perplexity import perplexity

from cli_checks import assert_clean_failure, invoke

# rich wraps tables at the terminal width; a wide one keeps paths and names whole

STORY = (
    "Once upon a time, there was a little cat named Tom. Tom liked to play with a red ball in the garden. "
    "One day, the ball rolled under a big bush. Tom was sad because he could not find it. His friend, a "
    "small bird, flew down and said, \"I can help you, Tom!\" The bird looked under the bush and found the "
    "ball. Tom was very happy. He said, \"Thank you, bird!\" From that day on, Tom and the bird played "
    "together every day.\n\n"
    "Lily and her mom went to the park. The sun was warm and the sky was blue. Lily saw a big slide and ran "
    "to it. She went up the steps and slid down fast. \"Again!\" she said. Her mom laughed and pushed her on "
    "the swing. Then they ate apples under a tree. Lily gave a piece of her apple to a little duck. The duck "
    "said quack and Lily smiled. It was a happy day.\n"
) * 3


@pytest.fixture(scope="module")
def runner():
    return CliRunner()


@pytest.fixture(scope="module")
def story_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "story.txt"
    path.write_text(STORY)
    return path


@pytest.fixture(scope="module")
def applied(runner, stories_path, tmp_path_factory):
    """`surgery apply` of select,replace converting layers 1 and 3 of stories260K."""
    out = tmp_path_factory.mktemp("apply") / "hybrid"
    result = invoke(runner, "apply", "--model", stories_path, "--passes", "select,replace", "--layers", "1,3", "--out", out)
    assert result.exit_code == 0, result.output
    return out, result


def test_passes_lists_the_four_passes(runner):
    result = invoke(runner, "passes")
    assert result.exit_code == 0
    lines = [l for l in result.stdout.splitlines() if "(runs after:" in l]
    assert [l.split()[0] for l in lines] == ["select", "replace", "calibrate", "align"]  # pipeline order
    options = {c[0]: c[1:3] for c in (re.split(r"\s{2,}", l) for l in result.stdout.splitlines() if l.startswith(("select.", "align.")))}
    assert options["select.keep_ratio"] == ["float | None", "0.5"] and options["align.steps"] == ["int", "60"]
    assert options["align.schedule"] == ["str", "'cosine'"]


def test_inspect_json_on_the_gguf(runner, stories_path):
    result = invoke(runner, "inspect", "--model", stories_path, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["layers"] == 5 and data["architecture"] == "LlamaConfig"
    assert len(data["sites"]) == 5
    for i, row in enumerate(data["sites"]):
        assert (row["layer"], row["heads"], row["kv_heads"], row["head_dim"]) == (i, 8, 4, 8)
        assert row["path"] == f"model.layers.{i}.self_attn" and row["now"] == "attention"
        assert row["rope"] is True and row["fused_qkv"] is False


def test_inspect_a_model_directory_without_tokenizer(runner, tiny, tmp_path):
    tiny("llama").model.save_pretrained(tmp_path / "llama")
    result = invoke(runner, "inspect", "--model", tmp_path / "llama")
    assert result.exit_code == 0, result.output
    assert "2 softmax attention layers (llama)" in result.stdout
    assert "model.layers.0.self_attn" in result.stdout and "model.layers.1.self_attn" in result.stdout
    result = invoke(runner, "inspect", "--model", tmp_path / "llama", "--json")
    rows = json.loads(result.stdout)["sites"]
    assert [(r["heads"], r["kv_heads"], r["head_dim"]) for r in rows] == [(4, 2, 16)] * 2


def test_apply_writes_a_loadable_hybrid(applied, stories):
    out, result = applied
    assert (out / "recipe.json").exists() and (out / "model.safetensors").exists()
    assert "saved to" in result.stderr and "found 5 attention layers" in result.stderr
    assert "attention -> gdn" in result.stdout  # the diff table
    loaded = surgery.load(out)
    assert loaded.layer_kinds == ["attention", "gdn", "attention", "gdn", "attention"]
    # the CLI computes what the library computes
    g = stories()
    PassManager(["select", "replace"], {"select": {"policy": "convert", "layers": [1, 3]}})(g)
    ids = torch.randint(0, 512, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(ids), g(ids))


def test_inspect_a_saved_hybrid(runner, applied):
    out, _ = applied
    result = invoke(runner, "inspect", "--model", out, "--json")
    assert result.exit_code == 0, result.output
    assert [r["now"] for r in json.loads(result.stdout)["sites"]] == ["attention", "gdn", "attention", "gdn", "attention"]


def test_eval_json_on_teacher_and_hybrid(runner, applied, stories_path, stories_teacher, story_file):
    out, _ = applied
    results = {}
    for name, model in (("teacher", stories_path), ("hybrid", out)):
        result = invoke(runner, "eval", "--model", model, "--text", story_file, "--json")
        assert result.exit_code == 0, result.output
        results[name] = json.loads(result.stdout)  # exactly one JSON object on stdout
        assert set(results[name]) >= {"perplexity", "tokens", "nll", "chunks", "chunk_length"}
    ids = tokenize(stories_teacher.tokenizer, STORY)
    # chunks of min(2048, the graph's 512 positions) tokens: stories' BOS + 511 text tokens (surgery.core.bos),
    # the partial tail dropped, every text token predicted
    t = results["teacher"]
    assert (t["chunk_length"], t["chunks"]) == (512, ids.numel() // 511) and t["chunks"] >= 1
    assert t["tokens"] == t["chunks"] * 511
    want = perplexity(stories_teacher, ids)
    assert results["teacher"]["perplexity"] == pytest.approx(want["perplexity"], rel=1e-6)
    assert results["hybrid"]["tokens"] == results["teacher"]["tokens"]
    assert results["teacher"]["perplexity"] < results["hybrid"]["perplexity"]  # copy-only conversion hurts


def test_diff_teacher_against_saved_hybrid(runner, applied, stories_path):
    out, _ = applied
    result = invoke(runner, "diff", stories_path, out, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    layers = {e["layer"]: e for e in data["layers"] if isinstance(e["layer"], int)}
    assert sorted(layers) == [1, 3]
    for e in layers.values():
        assert (e["before"], e["after"]) == ("attention", "gdn")
        assert e["nodes_added"] == {"module:GatedDeltaNet": 1}
    assert {0, 2, 4} <= set(data["unchanged_layers"])


def test_apply_with_calibration_file_and_options(runner, stories_path, story_file, tmp_path):
    out = tmp_path / "calibrated"
    result = invoke(runner, "apply", "--model", stories_path, "--keep-ratio", "0.5", "--out", out,
                    "--calibration", story_file, "--set", "calibrate.samples=2", "--set", "calibrate.length=64",
                    "--set", "align.samples=2", "--set", "align.length=64", "--set", "align.steps=3")
    assert result.exit_code == 0, result.output
    recipe = json.loads((out / "recipe.json").read_text())
    assert [p["pass"] for p in recipe["passes"]] == ["select", "replace", "calibrate", "align"]
    calibrate, align = recipe["passes"][2]["config"], recipe["passes"][3]["config"]
    assert calibrate["calibration"] == [str(story_file)] and align["calibration"] == [str(story_file)]
    assert (calibrate["samples"], calibrate["length"], align["steps"]) == (2, 64, 3)
    assert recipe["decisions"]["select"]["convert"] == [1, 3, 4]
    assert "using the built-in calibration sample" not in result.stderr


def test_several_files_after_one_flag(runner, stories_path, story_file, tmp_path):
    """`--calibration a.txt b.txt` (one flag, several files) works like repeating the flag; extra
    arguments without the flag are an error that says how to pass several."""
    other = tmp_path / "other.txt"
    other.write_text(story_file.read_text())
    out = tmp_path / "two-files"
    result = invoke(runner, "apply", "--model", stories_path, "--passes", "select,replace,calibrate", "--out", out,
                    "--calibration", story_file, other, "--set", "calibrate.samples=2", "--set", "calibrate.length=64")
    assert result.exit_code == 0, result.output
    recipe = json.loads((out / "recipe.json").read_text())
    assert recipe["passes"][2]["config"]["calibration"] == [str(story_file), str(other)]
    assert_clean_failure(invoke(runner, "apply", "--model", stories_path, "--out", tmp_path / "x", str(other)), "--calibration a.txt b.txt")
    assert_clean_failure(invoke(runner, "generate", "--model", stories_path, "stray"), "--prompt")


def test_unknown_pass_name(runner, stories_path, tmp_path):
    result = invoke(runner, "apply", "--model", stories_path, "--passes", "select,quantize", "--out", tmp_path / "x")
    assert_clean_failure(result, "quantize", "align, calibrate, replace, select")
    assert not (tmp_path / "x").exists()


def test_apply_refuses_an_existing_out_without_force(runner, stories_path, tmp_path, applied):
    out = tmp_path / "exists"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = invoke(runner, "apply", "--model", stories_path, "--passes", "select,replace", "--out", out)
    assert_clean_failure(result, "already exists", "--force")
    assert (out / "keep.txt").read_text() == "mine"
    result = invoke(runner, "apply", "--model", stories_path, "--passes", "select,replace", "--out", out, "--force")
    assert_clean_failure(result, "did not write", "keep.txt")  # --force replaces only what surgery wrote
    assert (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()
    shutil.copytree(applied[0], out, dirs_exist_ok=True)
    result = invoke(runner, "apply", "--model", stories_path, "--passes", "select,replace", "--layers", "2", "--out", out, "--force")
    assert result.exit_code == 0, result.output
    assert json.loads((out / "recipe.json").read_text())["decisions"]["select"]["convert"] == [2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists"]  # nothing staged or moved aside is left


@pytest.mark.parametrize("args, words", [
    (["--passes", "calibrate,select"], ["requires"]),
    (["--passes", "select,replace", "--layers", "9"], ["out of range"]),
    (["--passes", "select,replace", "--set", "replace.v_activation=gelu"], ["gelu"]),
    (["--passes", "select,replace", "--set", "align.steps=5"], ["not in the pipeline"]),
    (["--passes", "select,replace", "--set", "nonsense"], ["pass.key=value"]),
    (["--passes", "select,replace,calibrate", "--set", "calibrate.samples=many"], ["samples"]),
])
def test_apply_errors_are_one_paragraph(runner, stories_path, tmp_path, args, words):
    result = invoke(runner, "apply", "--model", stories_path, "--out", tmp_path / "o", *args)
    assert_clean_failure(result, *words)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB."),
                                   RuntimeError("Triton Error [CUDA]: out of memory")])
def test_running_out_of_memory_is_one_paragraph(runner, stories_path, tmp_path, monkeypatch, error):
    """Out of device memory deep in a pass (torch's allocator, or a Triton launch) ends the command
    with what makes the work fit, no traceback, and no --out written."""
    import importlib  # the installed name: importing the top-level `passes` folder would register a second copy of every pass

    def no_room(*args, **kwargs):
        raise error

    monkeypatch.setattr(importlib.import_module("surgery.passes.calibrate"), "teacher_data", no_room)
    result = invoke(runner, "apply", "--model", stories_path, "--passes", "select,replace,calibrate", "--layers", "1", "--out", tmp_path / "o")
    assert_clean_failure(result, "Pass 'calibrate' ran out of memory", "calibrate.batch_size", "--micro-batch")
    assert not (tmp_path / "o").exists()
    # outside the passes: the command's guard says the same
    monkeypatch.setattr(importlib.import_module("surgery.eval.perplexity"), "perplexity", no_room)
    text = tmp_path / "t.txt"
    text.write_text("Once upon a time there was a cat. " * 20)
    result = invoke(runner, "eval", "--model", stories_path, "--text", text)
    assert_clean_failure(result, "Out of memory (", "eval --batch-size")


def test_missing_model_and_text(runner, tmp_path, stories_path):
    result = invoke(runner, "inspect", "--model", tmp_path / "nothing-here")
    assert_clean_failure(result, "nothing-here")
    result = invoke(runner, "eval", "--model", stories_path, "--text", tmp_path / "none.txt", "--json")
    assert_clean_failure(result, "none.txt")
