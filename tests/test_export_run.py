"""`eval`, `generate` and `inspect` handed an export directory: the manifest is verified, then the
directory runs with its own modeling code (transformers, trust_remote_code=True), and gives what its
saved hybrid gives (perplexity, greedy continuation, per-layer cache). The manifest is hashed once
per command even where two steps check it (eval --task lm-eval)."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import surgery
from surgery import PassManager
from surgery.io import export_manifest
from surgery.io.export import export

from cli_checks import assert_clean_failure, invoke

TEXT = ("Once upon a time, there was a little cat named Tom. Tom liked to play with a red ball in the garden. "
        "One day, the ball rolled under a big bush. Tom was sad because he could not find it. ") * 12


@pytest.fixture(scope="module")
def pair(stories, tmp_path_factory):
    """(saved stories260K hybrid with calibrated GDN layers 1 and 3, its export, a text file)."""
    root = tmp_path_factory.mktemp("export-run")
    graph = stories()
    PassManager(["select", "replace", "calibrate"], {"select": {"policy": "convert", "layers": [1, 3]},
                                                     "calibrate": {"samples": 2, "length": 64}})(graph)
    surgery.save(graph, root / "hybrid")
    (root / "text.txt").write_text(TEXT)
    return root / "hybrid", export(root / "hybrid", root / "hf"), root / "text.txt"


def run(*args):
    result = invoke(CliRunner(), *args)
    assert result.exit_code == 0, result.output
    return result.stdout


def test_eval_scores_an_export_as_its_hybrid(pair):
    hybrid, hf, text = pair
    got = [json.loads(run("eval", "--model", m, "--text", text, "--json")) for m in (hybrid, hf)]
    assert got[1]["tokens"] == got[0]["tokens"] and got[1]["chunks"] == got[0]["chunks"]
    assert got[1]["perplexity"] == pytest.approx(got[0]["perplexity"], rel=1e-5)
    passkey = [json.loads(run("eval", "--model", m, "--task", "passkey", "--lengths", "256", "--depths", "2", "--trials", "1", "--json"))
               for m in (hybrid, hf)]
    assert passkey[1]["by_depth"] == passkey[0]["by_depth"]


def test_generate_continues_an_export_as_its_hybrid(pair):
    hybrid, hf, _ = pair
    texts = [run("generate", "--model", m, "--prompt", "Once upon a time", "--max-new-tokens", "24") for m in (hybrid, hf)]
    assert texts[0].strip() and texts[1] == texts[0]


def test_inspect_an_export_shows_what_its_cache_keeps(pair):
    hybrid, hf, _ = pair
    graph, exported = (json.loads(run("inspect", "--model", m, "--json")) for m in (hybrid, hf))
    assert exported["verified"] and exported["gdn_paths"] == ["model.layers.1.self_attn", "model.layers.3.self_attn"]
    fields = ("layer", "now", "window", "kv_bytes_per_token", "state_bytes")
    assert [{k: r[k] for k in fields} for r in exported["sites"]] == [{k: r[k] for k in fields} for r in graph["sites"]]
    assert [r["kind"] for r in exported["sites"]] == ["softmax", "gdn", "softmax", "gdn", "softmax"]
    for key in ("layers", "softmax_layers", "gdn_layers", "kv_bytes_per_token", "state_bytes"):
        assert exported[key] == graph[key], key
    assert "5 layers: 3 softmax attention + 2 GDN" in run("inspect", "--model", hf)


def test_compile_on_an_export_is_refused_by_name(pair):
    _, hf, text = pair
    assert_clean_failure(invoke(CliRunner(), "eval", "--model", hf, "--text", text, "--compile"), "is an export", "--no-compile")


def test_lm_eval_on_an_export_hashes_it_once(pair, monkeypatch):
    _, hf, _ = pair
    pytest.importorskip("lm_eval")
    import surgery.eval.lm_harness as lm_harness

    export_manifest.VERIFIED.clear()
    hashed = []
    real = export_manifest.sha256
    monkeypatch.setattr(export_manifest, "sha256", lambda path: hashed.append(path.name) or real(path))
    monkeypatch.setattr(lm_harness, "run_tasks", lambda args, names, **_: {
        "results": {n: {"acc,none": 0.5, "acc_norm,none": 0.5, "sample_len": 1} for n in names}})
    run("eval", "--model", hf, "--task", "lm-eval", "--json")
    assert hashed and len(hashed) == len(set(hashed))  # every file once, though two steps verified it


def test_a_changed_export_is_hashed_again(pair, tmp_path):
    import shutil

    from surgery.errors import ExportError

    copy = tmp_path / "hf"
    shutil.copytree(pair[1], copy)
    export_manifest.verify_export(copy)
    with open(copy / "tokenizer.json", "a") as f:
        f.write(" ")
    with pytest.raises(ExportError, match="tokenizer.json was changed"):
        export_manifest.verify_export(copy)
