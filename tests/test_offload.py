"""Conversion of a teacher that does not fit the device (surgery.core.meta_capture, core.streamed):
captured on meta, read from its safetensors a layer at a time. The reference is the same teacher
loaded whole and converted the usual way; every comparison is bit for bit (the same ops run on the
same mini-batches in the same order, only the weights arrive later)."""
from __future__ import annotations

import copy

import pytest
import torch
from typer.testing import CliRunner

import surgery
from surgery import PassManager
from surgery.core.live_tensors import LiveTensors
from surgery.core.meta_capture import capture_offloaded
from surgery.core.weight_files import WeightFiles
from surgery.data.windows import calibration_ids
from surgery.errors import CheckpointError, ModelLoadError
from surgery.passes.teacher_data import collect

from cli_checks import invoke


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory, stories_eager, stories_teacher):
    """stories260K as a transformers directory with safetensors (the GGUF's weights, float32)."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("stories-safetensors")
    config = copy.deepcopy(stories_eager.config)  # the session's model keeps its own
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")  # a GGUF-loaded model refuses save_pretrained; a plain copy does not
    plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(stories_eager.state_dict())
    plain.save_pretrained(folder)
    stories_teacher.tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def offloaded(teacher_dir):
    return surgery.capture(teacher_dir, offload=True)


@pytest.fixture(scope="module")
def in_memory(teacher_dir):
    return surgery.capture(teacher_dir)


def test_meta_capture_holds_no_weights_and_runs_like_the_loaded_teacher(offloaded, in_memory):
    assert all(p.is_meta for p in offloaded.gm.parameters())
    assert [s.module_path for s in offloaded.sites] == [s.module_path for s in in_memory.sites]
    assert [(s.num_heads, s.head_dim, s.scale, s.q.heads, s.k.heads) for s in offloaded.sites] == \
           [(s.num_heads, s.head_dim, s.scale, s.q.heads, s.k.heads) for s in in_memory.sites]
    ids = torch.randint(0, 512, (2, 13), generator=torch.Generator().manual_seed(3))
    assert torch.equal(offloaded.logits(ids), in_memory.logits(ids))


def test_teacher_read_layer_by_layer_is_exact_and_holds_one_layer(offloaded, in_memory):
    """Peak bytes alive while the teacher is read (weights read from the files and everything ops make)
    against the model's size: one segment (an MLP and the next attention) plus small activations."""
    weights = offloaded.weights
    full = weights.nbytes(torch.float32)
    ids = calibration_ids(offloaded, None, 3, 16, 0)
    read = weights.load
    weights_alive, live = LiveTensors(), LiveTensors()
    weights.load = lambda *a, **k: weights_alive.track(live.track(read(*a, **k)))
    try:
        with live:
            got = collect(offloaded, [0, 2, 4], ids, with_stats=True, batch_size=2)
    finally:
        del weights.load
    with LiveTensors() as activations:  # the in-memory teacher's weights exist before: only what the read makes
        want = collect(in_memory, [0, 2, 4], ids, with_stats=True, batch_size=2)
    assert weights_alive.peak < 1.2 * full / offloaded.num_layers, (weights_alive.peak, full)
    assert live.peak <= weights_alive.peak + activations.peak, (live.peak, weights_alive.peak, activations.peak)
    assert live.peak < full / 2, (live.peak, full)
    for layer, data in want.items():
        for name in ("x", "target", "ctx"):
            assert torch.equal(getattr(got[layer], name), getattr(data, name)), (layer, name)
        assert data.stats.keys() == got[layer].stats.keys()
        for key, value in data.stats.items():
            same = torch.equal(got[layer].stats[key], value) if isinstance(value, torch.Tensor) else got[layer].stats[key] == value
            assert same, (layer, key)


def convert(graph):
    text = {"samples": 2, "length": 16, "batch_size": 1}
    PassManager(["select", "replace", "calibrate", "align"], {
        "select": {"policy": "convert", "layers": [1, 3]}, "calibrate": text,
        "align": {**text, "steps": 2, "progress": False, "compile": False}})(graph)
    return graph


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
def test_offloaded_conversion_writes_the_same_hybrid(kind, teacher_dir, stories_path, stories, tmp_path):
    """select, replace (projections read from the files), calibrate, align and save (the teacher's
    tensors written a shard at a time from its files): the same bytes as the in-memory conversion.
    A GGUF's tensors are dequantized one at a time by transformers' own processors."""
    whole, source = (surgery.capture(teacher_dir), teacher_dir) if kind == "safetensors" else (stories(), stories_path)
    a = surgery.save(convert(whole), tmp_path / "a")
    b = surgery.save(convert(surgery.capture(source, offload=True)), tmp_path / "b")
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    hybrid = surgery.load(b)
    if kind == "gguf":  # the offloaded graph's teacher tensors have no values to export: refused by name
        copy_only = surgery.capture(source, offload=True)
        PassManager(["select", "replace"], {"select": {"policy": "convert", "layers": [1]}})(copy_only)
        with pytest.raises(CheckpointError, match="has no values here"):
            surgery.export(copy_only, tmp_path / "hf")
        assert not (tmp_path / "hf").exists()
    assert hybrid.layer_kinds == ["attention", "gdn", "attention", "gdn", "attention"]
    assert hybrid.device == torch.device("cpu") and "offload" not in hybrid.meta


def test_apply_offload_layers_from_the_cli(teacher_dir, tmp_path, monkeypatch):
    """With 1000 bytes free, apply refuses the whole teacher (naming --offload-layers) and converts it
    layer by layer with the flag."""
    import surgery.io.config_check as config_check
    import surgery.io.memory as memory

    out = tmp_path / "h"
    args = ["apply", "-m", str(teacher_dir), "-o", str(out), "--passes", "select,replace", "--layers", "2", "--device", "cpu"]
    with monkeypatch.context() as patch:
        for module in (memory, config_check):
            patch.setattr(module, "available_bytes", lambda device: 1000)
        refused = invoke(CliRunner(), *args)
        result = invoke(CliRunner(), *args, "--offload-layers")
    assert refused.exit_code != 0 and "more than the 1000 B of memory free" in refused.output
    assert "--offload-layers" in " ".join(refused.output.split())
    assert result.exit_code == 0, result.output
    assert "capturing on the meta device" in result.output
    assert surgery.load(out).layer_kinds[2] == "gdn"


def test_offload_is_chosen_when_the_weights_exceed_free_memory(teacher_dir, monkeypatch, capsys):
    from cli.common import wants_offload
    import surgery.io.memory as memory

    monkeypatch.setattr(memory, "available_bytes", lambda device: 1000)
    assert wants_offload(teacher_dir, torch.device("cpu"), torch.float32, None)
    line = capsys.readouterr().err
    assert "more than the 1000 B free on cpu" in line and "--offload-layers" in line
    assert not wants_offload(teacher_dir, torch.device("cpu"), torch.float32, False)
    monkeypatch.setattr(memory, "available_bytes", lambda device: 1 << 40)
    assert not wants_offload(teacher_dir, torch.device("cpu"), torch.float32, None)


def test_offload_needs_a_model_directory_or_gguf(stories_path, tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ModelLoadError, match="neither a model directory with config.json nor a .gguf file"):
        capture_offloaded(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="holds no model.safetensors"):
        WeightFiles(tmp_path)


def test_bench_offload_section_smoke(capsys):
    """bench/speed.py's offload section (the 70B-shaped run the lead makes on the GPU) at its smoke shape."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from bench import speed

    rows = speed.main(["--smoke", "--sections", "offload", "--offload-layers", "1", "--offload-text", "2x16", "--offload-steps", "1"])
    metrics = {r["metric"]: r for r in rows.rows}
    for phase in ("capture + sites", "select .. align"):
        peak = metrics[f"peak memory on cpu, {phase}"]
        assert 0 < peak["value"] < peak["anchor_value"] / 20, phase  # a layer's weights (plus activations), not the teacher
    assert metrics["calibrate per layer"]["value"] > 0 and metrics["align per layer"]["value"] > 0


def test_select_by_attention_removal_scores_the_offloaded_teacher_alike(offloaded, in_memory):
    """select's ar policy scores each layer's removal by perplexity: every forward streamed."""
    config = {"select": {"policy": "ar", "keep_count": 2, "samples": 2, "length": 16}}
    a, b = offloaded.branch(), in_memory.branch()
    info_a = PassManager(["select"], config)(a).info["select"]
    info_b = PassManager(["select"], config)(b).info["select"]
    assert a.meta["select"].convert == b.meta["select"].convert
    assert info_a["scores"] == info_b["scores"]


def test_a_mixer_that_replaces_the_op_converts_the_offloaded_teacher_alike(offloaded, in_memory):
    """swa (replace checks each site's Q, K, V on a probe, calibrate reads them): the same windows and logits."""
    config = {"select": {"policy": "convert", "layers": [1, 3]}, "replace": {"mixer": "swa"}, "calibrate": {"samples": 2, "length": 16}}
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(0))
    graphs = [offloaded.branch(), in_memory.branch()]
    for graph in graphs:
        PassManager(["select", "replace", "calibrate"], config)(graph)
    assert [int(m.window) for m in graphs[0].gdn_modules().values()] == [int(m.window) for m in graphs[1].gdn_modules().values()]
    assert torch.equal(graphs[0].logits(ids), graphs[1].logits(ids))
