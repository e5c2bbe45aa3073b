"""Exports that can be checked: surgery_export.json lists what the export wrote; verify_export and
`surgery verify-export DIR` accept exactly that directory and name every difference (a changed file,
an added .py, an auto_map pointing outside, no manifest, re-hashed code); eval, generate and inspect
given an export directory verify it first, then run it with its own code (tests/test_export_run.py);
commands that need a graph (diff) refuse it by name."""
from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

import surgery
from surgery import PassManager
from surgery.errors import ExportError
from surgery.io.export import export
from surgery.io.export_manifest import MANIFEST, sha256, verify_export


@pytest.fixture(scope="module")
def exported(stories, tmp_path_factory):
    """(saved stories260K hybrid, its --format hf export)."""
    root = tmp_path_factory.mktemp("verify")
    graph = stories()
    PassManager(["select", "replace"], {"select": {"policy": "convert", "layers": [1]}})(graph)
    surgery.save(graph, root / "hybrid")
    return root / "hybrid", export(root / "hybrid", root / "hf")


@pytest.fixture
def copy(exported, tmp_path):
    shutil.copytree(exported[1], tmp_path / "hf")
    return tmp_path / "hf"


def cli(*args):
    from surgery.cli.app import app

    return CliRunner().invoke(app, [str(a) for a in args])


def rehash(folder, name) -> None:
    """Update the manifest for a changed file, as someone forging it would."""
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["files"][name] = sha256(folder / name)
    (folder / MANIFEST).write_text(json.dumps(manifest))


def test_manifest_lists_every_file_and_the_auto_map(exported):
    hybrid, out = exported
    manifest = json.loads((out / MANIFEST).read_text())
    assert set(manifest["files"]) == {p.name for p in out.iterdir()} - {MANIFEST}
    assert manifest["auto_map"] == json.loads((out / "config.json").read_text())["auto_map"]
    assert manifest["source"] == str(hybrid.resolve())
    assert verify_export(out)["format"] == "hf"
    result = cli("verify-export", out)
    assert result.exit_code == 0, result.output
    assert "the export surgery wrote" in result.output


@pytest.mark.parametrize("change, named", [
    (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:-4] + b"\0\0\0\0"), "model.safetensors was changed"),
    (lambda d: (d / "evil.py").write_text("import os\n"), "evil.py was added (Python code)"),
    (lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json is missing"),
    (lambda d: (d / MANIFEST).unlink(), f"has no {MANIFEST}"),
])
def test_tampered_export_is_refused_by_name(copy, change, named):
    change(copy)
    with pytest.raises(ExportError, match="not the export surgery wrote|has no"):
        verify_export(copy)
    result = cli("verify-export", copy)
    assert result.exit_code == 2
    assert named in " ".join(result.output.split())


def test_auto_map_pointing_outside_is_refused_even_when_rehashed(copy):
    config = json.loads((copy / "config.json").read_text())
    config["auto_map"]["AutoModelForCausalLM"] = "someone/else--modeling_evil.EvilForCausalLM"
    (copy / "config.json").write_text(json.dumps(config))
    rehash(copy, "config.json")
    with pytest.raises(ExportError, match="names code outside the directory") as caught:
        verify_export(copy)
    assert "auto_map differs from the manifest's" in caught.value.problem


def test_changed_code_is_refused_even_when_rehashed(copy):
    (copy / "gdn.py").write_text((copy / "gdn.py").read_text() + "\nimport os  # added\n")
    rehash(copy, "gdn.py")
    with pytest.raises(ExportError, match="gdn.py is not the code this surgery writes"):
        verify_export(copy)


def test_diff_refuses_an_export_by_name(exported):
    hybrid, out = exported
    for args in (["diff", hybrid, out],):
        result = cli(*args)
        assert result.exit_code == 2, result.output
        said = " ".join(result.output.split())
        assert "is a surgery export (a transformers directory with remote code)" in said
        assert str(hybrid.resolve()) in said  # the hybrid it came from


def test_inspect_describes_a_verified_export_and_refuses_a_tampered_one(copy):
    result = cli("inspect", "--model", copy, "--json")
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert info["verified"] and info["gdn_paths"] == ["model.layers.1.self_attn"] and info["gdn_layers"] == 1
    (copy / "extra.py").write_text("")
    result = cli("inspect", "--model", copy)
    assert result.exit_code == 2 and "extra.py was added" in " ".join(result.output.split())
    result = cli("eval", "--model", copy, "--text", copy / "config.json")
    assert result.exit_code == 2 and "extra.py was added" in " ".join(result.output.split())


def test_force_replaces_an_export_with_its_manifest(exported, tmp_path):
    hybrid, _ = exported
    out = export(hybrid, tmp_path / "hf")
    export(hybrid, out, force=True)
    assert verify_export(out)


def test_lm_eval_runs_a_verified_export_as_its_hybrid(exported):
    """eval --task lm-eval is a transformers run: a verified export is evaluated, with its hybrid's scores."""
    hybrid, out = exported
    scores = []
    for model in (hybrid, out):
        result = cli("eval", "--model", model, "--task", "lm-eval", "--limit", 4, "--json")
        assert result.exit_code == 0, result.output
        scores.append(json.loads(result.stdout.strip().splitlines()[-1])["tasks"])
    assert scores[0] == scores[1]


def test_lm_eval_from_python_refuses_a_tampered_export(copy):
    """surgery.eval.lm_harness.evaluate runs an export's code (trust_remote_code): it verifies first,
    as the CLI does, so an added .py is refused before lm-eval imports anything from the directory."""
    from surgery.eval.lm_harness import evaluate

    (copy / "extra.py").write_text("raise SystemExit('ran')\n")
    with pytest.raises(ExportError, match="extra.py"):
        evaluate(copy, limit=1)
