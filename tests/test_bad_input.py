"""Bad input gets one paragraph before any work (issue 15): --force never replaces what surgery did
not write nor a command's own inputs, inputs are checked before a model loads, damaged files are
named for what they are, and killed saves leave nothing behind for long."""
from __future__ import annotations

import errno
import json
import lzma
import os
import shutil
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

import surgery
from surgery import PassManager
from surgery.errors import CheckpointError
from surgery.io import checkpoint as checkpoint_module
from surgery.io.outdir import check_replaceable, clean_stale_staging

from cli_checks import assert_clean_failure, invoke

TEXT = "Once upon a time there was a little cat named Tom. Tom liked to play with a red ball.\n" * 40


@pytest.fixture(scope="module")
def runner():
    return CliRunner()


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any model load fails the test: the checks under test must come before it."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the input check")

    import surgery.core.capture
    import surgery.io.open

    monkeypatch.setattr(surgery.core.capture, "load_model", refuse)
    monkeypatch.setattr(surgery.io.open, "load", refuse)


@pytest.fixture(scope="module")
def hybrid(stories, tmp_path_factory):
    """A saved stories260K hybrid (layers 1 and 3 converted); tests copy it before damaging it."""
    graph = stories()
    PassManager(["select", "replace"], {"select": {"policy": "convert", "layers": [1, 3]}})(graph)
    out = tmp_path_factory.mktemp("bad-input") / "hybrid"
    surgery.save(graph, out)
    return out


@pytest.fixture
def project(stories_path, tmp_path):
    """proj/ with a teacher GGUF, a data file and notes: what a user keeps beside an --out."""
    proj = tmp_path / "proj"
    proj.mkdir()
    shutil.copy(stories_path, proj / "teacher.gguf")
    (proj / "mydata.txt").write_text(TEXT)
    (proj / "notes.md").write_text("my notes")
    return proj


def names(folder):
    return sorted(p.name for p in folder.iterdir())


# ------------------------------------------------------------------------------------------------
# --force replaces only what surgery wrote, never an input


def test_force_never_deletes_the_input_gguf(runner, project, no_model_loads):
    result = invoke(runner, "apply", "--model", project / "teacher.gguf", "--passes", "select,replace", "--out", project, "--force")
    assert_clean_failure(result, "input", "teacher.gguf")
    assert names(project) == ["mydata.txt", "notes.md", "teacher.gguf"]
    result = invoke(runner, "apply", "--model", project / "teacher.gguf", "--passes", "select,replace", "--out", project / "teacher.gguf", "--force")
    assert_clean_failure(result, "is an input")


def test_force_never_deletes_calibration_inside_out(runner, project, stories_path, no_model_loads):
    result = invoke(runner, "apply", "--model", stories_path, "--passes", "select,replace,calibrate", "--calibration", project / "mydata.txt",
                    "--out", project, "--force")
    assert_clean_failure(result, "mydata.txt")
    assert (project / "mydata.txt").read_text() == TEXT


def test_force_refuses_foreign_files_naming_them(runner, hybrid, stories_path, tmp_path, no_model_loads):
    out = tmp_path / "out"
    shutil.copytree(hybrid, out)
    (out / "notes.md").write_text("mine")
    result = invoke(runner, "apply", "--model", stories_path, "--passes", "select,replace", "--out", out, "--force")
    assert_clean_failure(result, "did not write", "notes.md")
    assert (out / "notes.md").read_text() == "mine" and (out / "recipe.json").exists()


def test_distill_force_never_deletes_its_inputs_or_foreign_files(runner, project, hybrid, stories_path, no_model_loads):
    """The issue's case: distill --teacher proj/teacher.gguf --data proj/mydata.txt --out proj --force
    deleted teacher.gguf, mydata.txt and notes.md."""
    (project / "distill.json").write_text("{}")  # looks like a run directory, still holds inputs
    result = invoke(runner, "distill", "--model", hybrid, "--teacher", project / "teacher.gguf", "--data", project / "mydata.txt",
                    "--tokens", "8k", "--out", project, "--force", "--device", "cpu")
    assert_clean_failure(result, "input", "mydata.txt")
    assert names(project) == ["distill.json", "mydata.txt", "notes.md", "teacher.gguf"]
    (project / "mydata.txt").rename(project.parent / "mydata.txt")
    (project / "teacher.gguf").unlink()
    result = invoke(runner, "distill", "--model", hybrid, "--teacher", stories_path, "--data", project.parent / "mydata.txt",
                    "--tokens", "8k", "--out", project, "--force", "--device", "cpu")
    assert_clean_failure(result, "did not write", "notes.md")
    assert (project / "notes.md").read_text() == "my notes"


def test_distill_refuses_binary_data_before_loading(runner, hybrid, stories_path, tmp_path, no_model_loads):
    binary = tmp_path / "data.bin"
    binary.write_bytes(bytes(range(256)) * 8)
    result = invoke(runner, "distill", "--model", hybrid, "--data", binary, "--tokens", "8k", "--out", tmp_path / "run", "--device", "cpu")
    assert_clean_failure(result, "not text")


def test_force_over_a_file_refuses_and_leaves_nothing_beside_it(runner, stories_path, tmp_path, no_model_loads):
    target = tmp_path / "result.bin"
    target.write_text("not a hybrid")
    result = invoke(runner, "apply", "--model", stories_path, "--passes", "select,replace", "--out", target, "--force")
    assert_clean_failure(result, "is a file")
    assert target.read_text() == "not a hybrid" and names(tmp_path) == ["result.bin"]


def test_save_force_refuses_a_directory_holding_the_graphs_source(stories, project):
    graph = stories()
    graph.source = {"kind": "gguf", "path": str(project), "gguf_file": "teacher.gguf", "name": "teacher.gguf"}
    (project / "notes.md").unlink()
    (project / "mydata.txt").unlink()
    with pytest.raises(CheckpointError) as info:
        surgery.save(graph, project, force=True)
    assert "teacher.gguf" in str(info.value) and names(project) == ["teacher.gguf"]


def run_dir(folder):
    """A distillation run directory as distill writes it (one checkpoint, the `last` link)."""
    folder.mkdir()
    (folder / "distill.json").write_text("{}")
    (folder / "log.jsonl").write_text("")
    ckpt = folder / "checkpoint-00000010"
    ckpt.mkdir()
    for name in ("recipe.json", "model.safetensors", "trainer_state.pt"):
        (ckpt / name).write_text("x")
    (ckpt / "tokenizer").mkdir()
    (folder / "last").symlink_to("checkpoint-00000010")
    return folder


def test_check_replaceable_recognises_a_run_directory(tmp_path):
    run = run_dir(tmp_path / "run")
    check_replaceable(run, force=True, inputs=[tmp_path / "elsewhere.txt"])
    with pytest.raises(CheckpointError, match="already exists"):
        check_replaceable(run, force=False)
    (run / "checkpoint-00000010" / "stray.txt").write_text("?")
    with pytest.raises(CheckpointError, match="checkpoint-00000010/stray.txt"):
        check_replaceable(run, force=True)
    (run / "checkpoint-00000010" / "stray.txt").unlink()
    data = run / "data.txt"
    data.write_text(TEXT)
    with pytest.raises(CheckpointError, match="input of this command: .*data.txt"):
        check_replaceable(run, force=True, inputs=["smollm2", data])
    check_replaceable(tmp_path / "new" / "deeper", force=False)  # a new --out below a writable directory


# ------------------------------------------------------------------------------------------------
# --out checked before work; a failing disk during save is one paragraph


def test_out_below_a_file_is_refused_before_loading(runner, stories_path, tmp_path, no_model_loads):
    (tmp_path / "file.txt").write_text("x")
    result = invoke(runner, "apply", "--model", stories_path, "--passes", "select,replace", "--out", tmp_path / "file.txt" / "out")
    assert_clean_failure(result, "cannot be created", "file.txt")


def test_unwritable_out_is_refused_before_loading(runner, stories_path, no_model_loads):
    if os.access("/sys", os.W_OK) and not os.path.ismount("/sys"):
        pytest.skip("no read-only directory to write into")
    try:
        with open("/sys/.surgery-probe", "w"):
            pytest.skip("/sys is writable here")
    except OSError:
        pass
    result = invoke(runner, "apply", "--model", stories_path, "--passes", "select,replace", "--out", "/sys/surgery-out")
    assert_clean_failure(result, "cannot be written")


def test_full_disk_during_save_is_a_checkpoint_error(stories, tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint_module, "save_file", full)
    with pytest.raises(CheckpointError, match="disk is full"):
        surgery.save(stories(), tmp_path / "out")
    assert names(tmp_path) == []


def test_full_disk_during_apply_is_one_paragraph(runner, stories_path, tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_module, "save_file", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")))
    result = invoke(runner, "apply", "--model", stories_path, "--passes", "select,replace", "--layers", "1", "--out", tmp_path / "out")
    assert_clean_failure(result, "disk is full")
    assert names(tmp_path) == []


# ------------------------------------------------------------------------------------------------
# text, devices and counts checked before any model loads


def binary_files(folder):
    (folder / "nul.txt").write_bytes(b"text\0\0\0binary")
    (folder / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    with lzma.open(folder / "packed.txt.xz", "wb") as f:
        f.write(b"\0\1\2\3" * 100)
    (folder / "broken.txt.xz").write_bytes(b"\xfd7zXZ\0 not really xz")
    return {"nul.txt": "NUL", "latin1.txt": "UTF-8", "packed.txt.xz": "NUL", "broken.txt.xz": "cannot be read"}


def test_binary_calibration_is_refused_before_loading(runner, stories_path, tmp_path, no_model_loads):
    for name, words in binary_files(tmp_path).items():
        result = invoke(runner, "apply", "--model", stories_path, "--passes", "select,replace,calibrate", "--calibration", tmp_path / name,
                        "--out", tmp_path / "out")
        assert_clean_failure(result, name, words)
    result = invoke(runner, "apply", "--model", stories_path, "--calibration", tmp_path / "missing.txt", "--out", tmp_path / "out")
    assert_clean_failure(result, "missing.txt", "does not exist")


def test_binary_eval_text_and_prompt_file_are_refused_before_loading(runner, stories_path, tmp_path, no_model_loads):
    binary_files(tmp_path)
    assert_clean_failure(invoke(runner, "eval", "--model", stories_path, "--text", tmp_path / "nul.txt"), "nul.txt", "not text")
    assert_clean_failure(invoke(runner, "eval", "--model", stories_path, "--task", "passkey", "--text", tmp_path / "latin1.txt"), "UTF-8")
    assert_clean_failure(invoke(runner, "generate", "--model", stories_path, "--prompt-file", tmp_path / "nul.txt"), "Prompt file", "not text")


@pytest.mark.parametrize("args, words", [
    (["--chunk", "0"], ["--chunk must be at least 2"]),
    (["--chunk", "-5"], ["--chunk must be at least 2"]),
    (["--chunk", "1"], ["--chunk must be at least 2"]),
    (["--batch-size", "0"], ["--batch-size must be at least 1"]),
    (["--task", "passkey", "--depths", "0"], ["--depths"]),
    (["--task", "passkey", "--trials", "-1"], ["--trials"]),
    (["--task", "passkey", "--lengths", "0,100"], ["--lengths"]),
])
def test_eval_counts_out_of_range(runner, stories_path, tmp_path, args, words, no_model_loads):
    (tmp_path / "t.txt").write_text(TEXT)
    text = [] if "passkey" in args else ["--text", tmp_path / "t.txt"]
    assert_clean_failure(invoke(runner, "eval", "--model", stories_path, *text, *args), *words)


@pytest.mark.parametrize("command", ["inspect", "eval", "generate", "apply"])
def test_devices_that_are_not_there(runner, stories_path, tmp_path, monkeypatch, command, no_model_loads):
    (tmp_path / "t.txt").write_text(TEXT)
    extra = {"inspect": [], "eval": ["--text", tmp_path / "t.txt"], "generate": ["--prompt", "Once"],
             "apply": ["--passes", "select,replace", "--out", tmp_path / "out"]}[command]
    run = lambda *args: invoke(runner, command, "--model", stories_path, *extra, *args)  # noqa: E731
    assert_clean_failure(run("--device", "tpu9"), "Unknown device 'tpu9'")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert_clean_failure(run("--device", "cuda"), "CUDA is not available")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert_clean_failure(run("--device", "cuda:7"), "1 CUDA device")
    assert_clean_failure(run("--device", "cpu", "--dtype", "float8_e4m3fn"), "Unsupported dtype 'float8_e4m3fn'")
    assert_clean_failure(run("--device", "cpu", "--dtype", "float33"), "Unknown dtype 'float33'")


def test_diff_checks_both_models_before_loading_either(runner, stories_path, tmp_path, no_model_loads):
    assert_clean_failure(invoke(runner, "diff", stories_path, tmp_path / "nothing"), "nothing")


# ------------------------------------------------------------------------------------------------
# options that used to be read as something else


@pytest.mark.parametrize("args, words", [
    (["--layers", ""], ["--layers", "names no layer"]),
    (["--layers", " , "], ["names no layer"]),
    (["--keep-ratio", "0"], ["--keep-ratio 0", "--keep-count 0"]),
    (["--passes", "select,replace,replace"], ["'replace' more than once"]),
])
def test_options_that_are_errors(runner, stories_path, tmp_path, args, words, no_model_loads):
    base = ["--passes", "select,replace"] if "--passes" not in args else []
    assert_clean_failure(invoke(runner, "apply", "--model", stories_path, *base, *args, "--out", tmp_path / "o"), *words)
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------------------------
# damaged files named for what they are


def test_a_hybrid_without_recipe_says_so(runner, hybrid, tmp_path):
    damaged = tmp_path / "hybrid"
    shutil.copytree(hybrid, damaged)
    (damaged / "recipe.json").unlink()
    for command in (["inspect", "--model", damaged], ["eval", "--model", damaged, "--task", "passkey"]):
        result = invoke(runner, *command)
        assert_clean_failure(result, "recipe.json is missing")
        assert "model_type" not in result.stderr


def test_a_truncated_gguf_says_truncated(runner, stories_path, tmp_path):
    data = stories_path.read_bytes()
    for cut in (len(data) // 2, len(data) - 7, 200):
        (tmp_path / "half.gguf").write_bytes(data[:cut])
        assert_clean_failure(invoke(runner, "inspect", "--model", tmp_path / "half.gguf"), "half.gguf' is truncated")


def test_recipe_with_layer_minus_one_is_refused_by_eval(runner, hybrid, tmp_path):
    """Python would read -1 as the last layer: eval returned a perplexity with exit 0."""
    damaged = tmp_path / "hybrid"
    shutil.copytree(hybrid, damaged)
    recipe = json.loads((damaged / "recipe.json").read_text())
    recipe["decisions"]["replace"]["layers"][0] = -1
    (damaged / "recipe.json").write_text(json.dumps(recipe))
    (tmp_path / "t.txt").write_text(TEXT)
    result = invoke(runner, "eval", "--model", damaged, "--text", tmp_path / "t.txt", "--json")
    assert_clean_failure(result, "decisions.replace.layers[0] = -1 is out of range 0..4")


# ------------------------------------------------------------------------------------------------
# leftovers of a killed save


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_stale_staging_of_the_same_out_is_cleaned(stories, tmp_path):
    out = tmp_path / "hybrid"
    stale = [tmp_path / ".hybrid.k2x9_q0z", tmp_path / f".hybrid.{dead_pid()}.abcdefgh"]
    for folder in stale:
        (folder / "tokenizer").mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"half")
    live = tmp_path / f".hybrid.{os.getpid()}.livelive"
    foreign = tmp_path / ".hybrid.zzzzzzzz"
    other = tmp_path / ".other.abcdefgh"
    for folder in (live, foreign, other):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"x")
    (foreign / "notes.md").write_text("not save's")
    surgery.save(stories(), out)
    assert names(tmp_path) == sorted([live.name, foreign.name, other.name, "hybrid"])
    assert clean_stale_staging(out) == []
