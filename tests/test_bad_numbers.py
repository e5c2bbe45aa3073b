"""Absurd and non-finite values are refused where they enter (issue 28, items 3-6 and 8): options,
recipe and config fields, JSON nesting, sizes that cannot fit, lengths past the position limit,
special files and empty text, each with one Error/Fix paragraph and, where the files allow it,
before any model loads. Every case ends within DEADLINE seconds."""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import time

import pytest

import surgery
from surgery import PassManager
from surgery.errors import CalibrationError, CheckpointError, DistillError, PassConfigError

from cli_checks import assert_clean_failure, invoke
from test_bad_input import TEXT, hybrid, no_model_loads, project, runner  # noqa: F401  (shared fixtures)

DEADLINE = 30  # seconds: no case may hang (a FIFO blocked forever, --tokens 1e30 trained on)


@pytest.fixture
def deadline():
    """Fail a case that runs past DEADLINE (an open() blocked on a FIFO is interrupted too)."""
    def expire(*_):
        raise TimeoutError(f"the case ran past {DEADLINE} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(DEADLINE)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def damaged_copy(hybrid, tmp_path, field: str, raw: str):
    """A copy of the saved hybrid whose recipe.json has `raw` (JSON text, written as is) at `field`."""
    damaged = tmp_path / "hybrid"
    shutil.copytree(hybrid, damaged)
    recipe = json.loads((damaged / "recipe.json").read_text())
    node, *path, last = field.split(".")
    place = recipe[node]
    for key in path:
        place = place[key]
    place[last] = "@@RAW@@"
    (damaged / "recipe.json").write_text(json.dumps(recipe, indent=1).replace('"@@RAW@@"', raw))
    return damaged


# ------------------------------------------------------------------------------------------------
# options


@pytest.mark.parametrize("setting", ["align.lr_qkv=nan", "align.lr_gates=inf", "calibrate.max_rate=-inf", "calibrate.beta_low=NaN",
                                     "align.steps=99999999999999999999"])
def test_non_finite_or_huge_pass_options_are_refused_before_loading(runner, stories_path, tmp_path, setting, no_model_loads, deadline):
    """NaN passed `lr < 0`: align trained nothing and recipe.json got a bare NaN."""
    result = invoke(runner, "apply", "--model", stories_path, "--set", setting, "--out", tmp_path / "o")
    assert_clean_failure(result, setting.split("=")[0].split(".")[1])
    assert not (tmp_path / "o").exists()


def test_every_pass_config_checks_its_numbers_when_made():
    from surgery.passes.align import AlignConfig
    from surgery.train import DistillConfig

    for make in (lambda: AlignConfig(lr_qkv=math.nan), lambda: surgery.core.pipeline.get_pass("align", {"lr_qkv": "nan"}),
                 lambda: surgery.core.pipeline.get_pass("select", {"keep_ratio": math.inf}),
                 lambda: DistillConfig(tokens=8192, lr_kl_new=math.nan)):
        with pytest.raises(PassConfigError, match="not a finite number"):
            make()


def test_generate_refuses_a_non_finite_temperature_before_loading(runner, stories_path, no_model_loads, deadline):
    """NaN passed `temperature < 0` and reached the sampler."""
    for value in ("nan", "inf"):
        assert_clean_failure(invoke(runner, "generate", "--model", stories_path, "--prompt", "Once", "--temperature", value), "--temperature", "not a finite number")


@pytest.mark.parametrize("args, words", [
    (["--lr", "nan"], ["lr_"]),
    (["--set", "temperature=inf"], ["temperature"]),
    (["--tokens", "1e30"], ["tokens"]),
    (["--tokens", "1e13"], ["optimizer steps"]),
])
def test_distill_refuses_absurd_numbers_before_loading(runner, hybrid, tmp_path, args, words, no_model_loads, deadline):
    """--tokens 1e30 started 'step 1/244140625000000000000000000'."""
    (tmp_path / "d.txt").write_text(TEXT)
    base = {"--tokens": "8k"} if "--tokens" not in args else {}
    result = invoke(runner, "distill", "--model", hybrid, "--data", tmp_path / "d.txt", *[x for kv in base.items() for x in kv], *args,
                    "--out", tmp_path / "run", "--device", "cpu")
    assert_clean_failure(result, *words)
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------------
# recipe and config fields, JSON


@pytest.mark.parametrize("field, raw, words", [
    ("config.rms_norm_eps", "NaN", ["config.rms_norm_eps", "not a finite number"]),
    ("config.rope_parameters.rope_theta", "Infinity", ["rope_theta", "not a finite number"]),
    ("config.rope_parameters.rope_theta", "1e400", ["rope_theta", "not a finite number"]),
    ("config.vocab_size", "1e30", ["config.vocab_size", "not an integer"]),
    ("config.vocab_size", str(10**30), ["config.vocab_size", "out of range"]),
    ("config.intermediate_size", str(2**40), ["intermediate_size = 1,099,511,627,776", "memory"]),
    ("config.num_hidden_layers", "-5", ["config.num_hidden_layers", "not a size"]),
    ("config.rms_norm_eps", "2.5", ["config.rms_norm_eps", "epsilon"]),
    pytest.param("results.deep", "[" * 100_000 + "]" * 100_000, ["100002 levels deep"], id="nested-100000-deep"),
])
def test_a_hand_edited_recipe_is_refused_naming_the_field(runner, hybrid, tmp_path, field, raw, words, deadline):
    """These gave a torch overflow, an allocation of 281 TB, a RecursionError, the wrong diagnosis
    ('not causal ... an encoder?') or minutes of work."""
    damaged = damaged_copy(hybrid, tmp_path, field, raw)
    with pytest.raises(CheckpointError) as info:
        surgery.load(damaged)
    for w in words:
        assert w in info.value.problem
    (tmp_path / "t.txt").write_text(TEXT)
    assert_clean_failure(invoke(runner, "eval", "--model", damaged, "--text", tmp_path / "t.txt"), "recipe.json")


def test_a_teacher_config_too_large_for_memory_is_refused_before_loading(runner, tmp_path, no_model_loads, deadline):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "teacher")
    data = json.loads((tmp_path / "teacher" / "config.json").read_text())
    (tmp_path / "teacher" / "config.json").write_text(json.dumps(data | {"intermediate_size": 2**40}))
    assert_clean_failure(invoke(runner, "inspect", "--model", tmp_path / "teacher"), "intermediate_size = 1,099,511,627,776", "memory")
    (tmp_path / "teacher" / "config.json").write_text(json.dumps(data | {"vocab_size": 1e30}))
    assert_clean_failure(invoke(runner, "apply", "--model", tmp_path / "teacher", "--out", tmp_path / "o"), "vocab_size", "not an integer")


def test_json_reader_limits_depth_and_refuses_non_finite_numbers():
    from surgery.io.json_safe import MAX_DEPTH, loads

    assert loads("[" * MAX_DEPTH + "]" * MAX_DEPTH, "ok.json") is not None
    assert loads('{"a": "[[[[" }', "brackets-in-strings.json") == {"a": "[[[["}
    for text, words in (("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), "levels deep"), ('{"a": [1, NaN]}', "a[1] = nan"),
                        ('{"a": -Infinity}', "a = -inf"), ('{"a": 1e999}', "a = inf")):
        with pytest.raises(surgery.errors.SurgeryError, match=words.replace("[", r"\[").replace("]", r"\]")):
            loads(text, "x.json")


def test_a_deeply_nested_trainer_state_is_a_distill_error(tmp_path):
    from surgery.train.state import read_state

    (tmp_path / "trainer_state.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(DistillError, match="levels deep"):
        read_state(tmp_path)
    (tmp_path / "trainer_state.json").write_text('{"version": 2, "loss": NaN}')
    with pytest.raises(DistillError, match="not a finite number"):
        read_state(tmp_path)


def test_save_writes_no_nan_or_infinity_into_the_recipe(stories, tmp_path):
    graph = stories()
    graph.meta["probe"] = {"loss": math.inf, "values": [1.0, math.nan, -math.inf]}
    surgery.save(graph, tmp_path / "h")

    def refuse(literal):
        raise AssertionError(f"recipe.json holds {literal}")

    json.loads((tmp_path / "h" / "recipe.json").read_text(), parse_constant=refuse)


# ------------------------------------------------------------------------------------------------
# lengths against the position limit


def test_generate_refuses_more_new_tokens_than_positions_before_loading(runner, hybrid, no_model_loads, deadline):
    """--max-new-tokens 10000000 on a 512-position model printed nothing for 60 s."""
    assert_clean_failure(invoke(runner, "generate", "--model", hybrid, "--prompt", "Once", "--max-new-tokens", "10000000"), "512 positions")
    assert_clean_failure(invoke(runner, "generate", "--model", hybrid, "--prompt", "Once", "--max-new-tokens", "512"), "--max-new-tokens 511")


def test_distill_refuses_a_seq_len_past_the_position_limit_before_loading(runner, hybrid, tmp_path, no_model_loads, deadline):
    (tmp_path / "d.txt").write_text(TEXT)
    result = invoke(runner, "distill", "--model", hybrid, "--data", tmp_path / "d.txt", "--tokens", "1M", "--seq-len", "100000",
                    "--out", tmp_path / "run", "--device", "cpu")
    assert_clean_failure(result, "--seq-len 100000", "512 positions")


# ------------------------------------------------------------------------------------------------
# special files and empty text


def special_files(folder):
    fifo = folder / "fifo"
    os.mkfifo(fifo)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(folder / "sock"))
    return {fifo: "named pipe", folder / "sock": "socket", "/dev/null": "character device"}, sock


def test_special_files_are_refused_as_text_inputs(runner, stories_path, hybrid, tmp_path, no_model_loads, deadline):
    """A FIFO as --calibration blocked forever."""
    files, sock = special_files(tmp_path)
    try:
        for path, kind in files.items():
            for command in (["apply", "--model", stories_path, "--calibration", path, "--out", tmp_path / "o"],
                            ["eval", "--model", stories_path, "--text", path],
                            ["generate", "--model", stories_path, "--prompt-file", path],
                            ["distill", "--model", hybrid, "--data", path, "--tokens", "8k", "--out", tmp_path / "r", "--device", "cpu"]):
                assert_clean_failure(invoke(runner, *command), kind, "not a regular file")
    finally:
        sock.close()


@pytest.mark.parametrize("text, words", [("", "is empty"), (" \n\t\n  \r\n", "holds only whitespace")])
def test_empty_or_blank_text_is_refused_before_loading(runner, stories_path, hybrid, tmp_path, text, words, no_model_loads, deadline):
    blank = tmp_path / "blank.txt"
    blank.write_text(text)
    assert_clean_failure(invoke(runner, "apply", "--model", stories_path, "--calibration", blank, "--out", tmp_path / "o"), words)
    assert_clean_failure(invoke(runner, "distill", "--model", hybrid, "--data", blank, "--tokens", "8k", "--out", tmp_path / "r", "--device", "cpu"), words)
    assert_clean_failure(invoke(runner, "eval", "--model", stories_path, "--text", blank), words)


def test_too_little_calibration_text_fails_before_any_layer_is_replaced(stories, tmp_path):
    """A one-token calibration file was refused by calibrate, after replace had run."""
    short = tmp_path / "one.txt"
    short.write_text("Once")
    graph = stories()
    with pytest.raises(CalibrationError, match="one window needs"):
        PassManager(["select", "replace", "calibrate", "align"], {"calibrate": {"calibration": [str(short)]}})(graph)
    assert graph.history == [] and not graph.gdn_modules()


# ------------------------------------------------------------------------------------------------
# --out: name length and messages


def test_an_out_name_past_name_max_is_refused_before_loading(runner, stories_path, tmp_path, no_model_loads, deadline):
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    for name in ("x" * 300, "y" * (limit - 8)):  # too long for the file system; too long for save's staging names
        started = time.perf_counter()
        assert_clean_failure(invoke(runner, "apply", "--model", stories_path, "--out", tmp_path / name), "bytes long", str(limit))
        assert time.perf_counter() - started < DEADLINE


def test_a_symlinked_out_is_called_a_link_not_a_file(runner, hybrid, stories_path, tmp_path, no_model_loads):
    shutil.copytree(hybrid, tmp_path / "real")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    result = invoke(runner, "apply", "--model", stories_path, "--passes", "select,replace", "--out", tmp_path / "link", "--force")
    assert_clean_failure(result, "symbolic link")
    assert "is a file" not in result.stderr
    assert (tmp_path / "real" / "recipe.json").exists()


def test_an_input_inside_out_is_named_once(runner, project, no_model_loads):
    result = invoke(runner, "apply", "--model", project / "teacher.gguf", "--passes", "select,replace", "--out", project, "--force")
    assert_clean_failure(result, "holds an input")
    assert result.stderr.count("teacher.gguf") == 1, result.stderr


def test_a_model_larger_than_the_devices_free_memory_is_refused(hybrid, monkeypatch):
    """On CUDA the free memory comes from torch.cuda.mem_get_info; here the CPU's is made small."""
    import torch

    import surgery.io.config_check as config_check

    monkeypatch.setattr(config_check, "available_bytes", lambda device: 1000)
    with pytest.raises(CheckpointError, match="more than the 1000 B of memory free on cpu"):
        config_check.check_fits_on(hybrid, torch.device("cpu"), torch.float32)
