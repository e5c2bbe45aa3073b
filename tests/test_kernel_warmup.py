"""The helper that compiles the converted layers' kernels while `surgery apply` loads
(surgery.core.kernel_warmup, tcal.warm_kernels). On the CPU there is nothing to compile, but the
helper runs its job all the same, so the protocol and the runs it makes are checked here."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from surgery import PassManager
from surgery.core import kernel_warmup as warmup_module
from surgery.core.kernel_warmup import HELPER, KernelWarmup, kernel_warmup, layer_jobs, shares, warmup_wanted
from tcal import warm_kernels
from tcal.gdn import GatedDeltaNet

from cli_checks import invoke

PIPELINE = ["select", "replace", "calibrate", "align"]
CONFIGS = {"select": {"policy": "convert", "layers": [1, 3]}, "calibrate": {"samples": 2, "length": 64},
           "align": {"samples": 3, "length": 32, "steps": 2}}


@pytest.fixture
def converted(stories):
    graph = stories()
    PassManager(["select", "replace"], {"select": CONFIGS["select"]})(graph)
    return graph


def test_runs_are_those_of_the_passes_still_to_run():
    manager = PassManager(PIPELINE, CONFIGS)
    assert manager.layer_runs() == [("infer", 2, 64), ("train", 3, 32)]
    assert manager.layer_runs(after="replace") == [("infer", 2, 64), ("train", 3, 32)]
    assert manager.layer_runs(after="calibrate") == [("train", 3, 32)]
    assert manager.layer_runs(after="align") == []
    assert PassManager(["select", "replace"], {"select": CONFIGS["select"]}).layer_runs() == []


def test_one_job_per_distinct_layer_training_first(converted):
    jobs = layer_jobs(converted, PassManager(PIPELINE, CONFIGS).layer_runs(after="replace"))
    assert len(jobs) == 1  # layers 1 and 3 differ only in their index
    job = jobs[0]
    assert job["mixer"] == "gdn" and job["uses"] == [["train", 3, 32], ["infer", 2, 64, "float32"]]
    module = converted.gdn_modules()[1]
    assert job["config"] == dict(module.gdn_config(), layer_idx=None)
    rebuilt = GatedDeltaNet.from_gdn_config(json.loads(json.dumps(job["config"])))  # what the helper builds
    assert {k: v.shape for k, v in rebuilt.state_dict().items()} == {k: v.shape for k, v in module.state_dict().items()}


def test_the_helper_runs_each_use(converted, monkeypatch):
    """Each use runs the layer on the batch shape and dtype it names: align's step in float32 with
    a gradient, calibrate's forward without one."""
    seen = []
    forward = GatedDeltaNet.forward

    def spy(self, x, *args, **kwargs):
        seen.append((tuple(x.shape), x.dtype, torch.is_grad_enabled(), next(self.parameters()).dtype))
        return forward(self, x, *args, **kwargs)

    monkeypatch.setattr(GatedDeltaNet, "forward", spy)
    job = {"layers": layer_jobs(converted, [("infer", 2, 8), ("train", 3, 4)])}
    job["layers"][0]["uses"][1][3] = "bfloat16"
    warm_kernels.run(json.loads(json.dumps(job)), torch.device("cpu"))
    hidden = converted.gdn_modules()[1].hidden_size
    assert seen == [((3, 4, hidden), torch.float32, True, torch.float32), ((2, 8, hidden), torch.bfloat16, False, torch.bfloat16)]
    with pytest.raises(ValueError, match="unknown use"):
        warm_kernels.warm_layer("gdn", job["layers"][0]["config"], [["predict", 1, 4]], torch.device("cpu"))


def test_the_helpers_take_one_job_a_share_each(converted):
    warmup = KernelWarmup.spawn("cpu", helpers=2)
    runs = [("train", 2, 16), ("infer", 1, 16)]
    try:
        assert len(warmup.processes) == 2
        assert not warmup.send(converted, [])  # no pass left that runs the layers
        assert warmup.send(converted, runs)
        assert not warmup.send(converted, runs)  # once
        assert [p.wait(timeout=300) for p in warmup.processes] == [0, 0]  # each read its share and ran it
    finally:
        warmup.close()


def test_shares_split_the_runs_training_first(converted):
    jobs = layer_jobs(converted, [("infer", 1, 16), ("train", 2, 16)])
    first, second = shares(jobs, 2)
    assert [j["uses"] for j in first] == [[["train", 2, 16]]] and [j["uses"] for j in second] == [[["infer", 1, 16, "float32"]]]
    assert shares(jobs, 1) == [jobs]
    assert shares(jobs, 3)[2] == []  # a helper with no share is sent nothing and ends


def test_the_helper_waits_for_converted_layers(stories):
    warmup = KernelWarmup.spawn("cpu")
    try:
        assert not warmup.send(stories(), [("train", 2, 16)])  # before replace: nothing to warm, nothing sent
        assert warmup.processes[0].poll() is None
    finally:
        warmup.close()
    assert warmup.processes[0].returncode is not None


def test_a_bad_job_fails_the_helper_only():
    process = subprocess.run([sys.executable, "-m", HELPER, "cpu"], input='{"layers": [{"mixer": "nope", "config": {}, "uses": []}]}\n',
                             capture_output=True, text=True, timeout=300)
    assert process.returncode != 0 and "unknown mixer" in process.stderr


def test_no_helper_without_cuda_or_runs_or_when_switched_off(monkeypatch):
    assert not warmup_wanted("cpu") and KernelWarmup.start("cpu") is None
    with kernel_warmup("cpu", [("train", 2, 16)]) as warmup:
        assert warmup is None
    monkeypatch.setenv(warmup_module.SWITCH, "off")
    assert not warmup_wanted("cuda:0")
    started = []
    monkeypatch.setattr(KernelWarmup, "start", staticmethod(lambda device, helpers=1: started.append(helpers)))
    with kernel_warmup("cuda:0", []):
        pass
    with kernel_warmup("cuda:0", [("infer", 2, 16), ("train", 2, 16), ("train", 4, 8)]):
        pass
    assert started == [2]  # none without runs; one helper per kind of run


def test_apply_with_the_helper_writes_the_same_hybrid(stories_path, tmp_path, monkeypatch):
    """`surgery apply` gives the helper the converted layers after replace, and its weights are the
    ones it writes without a helper (nothing the helper does reaches the main process)."""
    args = ["--passes", ",".join(PIPELINE), "--layers", "1,3", "--set", "calibrate.samples=2", "--set", "calibrate.length=64",
            "--set", "align.samples=2", "--set", "align.length=64", "--set", "align.steps=2"]
    runner = CliRunner()
    result = invoke(runner, "apply", "--model", stories_path, "--out", tmp_path / "plain", *args)
    assert result.exit_code == 0, result.output
    started = []

    def start(device, helpers=1):
        started.append(KernelWarmup.spawn("cpu", helpers))
        return started[-1]

    monkeypatch.setattr(KernelWarmup, "start", staticmethod(start))
    result = invoke(runner, "apply", "--model", stories_path, "--out", tmp_path / "warmed", *args)
    assert result.exit_code == 0, result.output
    warmup = started[0]
    assert len(started) == 1 and len(warmup.processes) == 2 and warmup.sent  # a helper per kind of run, given the job
    assert all(p.returncode is not None for p in warmup.processes)  # stopped with the command
    plain, warmed = (load_file(tmp_path / name / "model.safetensors") for name in ("plain", "warmed"))
    assert plain.keys() == warmed.keys() and all(torch.equal(plain[k], warmed[k]) for k in plain)


def test_helpers_only_with_memory_to_spare(monkeypatch):
    """A helper holds a CUDA context while the teacher loads: none starts on a device with less than
    MIN_FREE free, and a helper leaves its job where the loaded teacher left less than JOB_MIN_FREE."""
    free = {"bytes": 32 * 2**30}
    monkeypatch.delenv(warmup_module.SWITCH, raising=False)
    monkeypatch.setattr(warmup_module.os, "cpu_count", lambda: 8)
    monkeypatch.setattr(warmup_module.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["bytes"], 80 * 2**30))
    assert warmup_wanted("cuda:0")
    free["bytes"] = warmup_module.MIN_FREE - 1
    assert not warmup_wanted("cuda:0")
    free["bytes"] = warm_kernels.JOB_MIN_FREE
    assert warm_kernels.room_for_job(torch.device("cuda:0"))
    free["bytes"] = warm_kernels.JOB_MIN_FREE - 1
    assert not warm_kernels.room_for_job(torch.device("cuda:0")) and warm_kernels.room_for_job(torch.device("cpu"))
