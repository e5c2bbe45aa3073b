"""Shipped autotune winners (tcal/kernel_configs.py): pinned only where the GPU (or its compute capability), Triton
and fla match."""
import importlib.metadata
import json
import sys
import types

import pytest

from tcal import kernel_configs


class FakeConfig:
    def __init__(self, kwargs, num_warps, num_stages, num_ctas=1, maxnreg=None):
        self.kwargs, self.num_warps, self.num_stages, self.num_ctas, self.maxnreg = kwargs, num_warps, num_stages, num_ctas, maxnreg


class FakeBuildError(Exception):
    """Stands for triton.errors.TritonError: what Triton raises for a config it cannot build."""


class FakeTuner:
    """An autotuner: its candidates, its cache, and a run that autotunes a key it has not cached (the second
    candidate wins) and fails to build the configs in `unbuildable`."""

    def __init__(self):
        self.cache = {}
        self.configs = [FakeConfig({"BT": 64}, 4, 2), FakeConfig({"BT": 32}, 4, 2)]
        self.unbuildable = []
        self.tuned = 0

    def run(self, key):
        if key not in self.cache:
            self.cache[key] = self.configs[1]
            self.tuned += 1
        if self.cache[key].kwargs in self.unbuildable:
            raise FakeBuildError(f"out of shared memory: {self.cache[key].kwargs}")
        return self.cache[key].kwargs


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    """A table for a fake GPU, two kernels loaded in fake fla modules, CUDA pretended."""
    tuners = {"fla.ops.x.kernel_a": FakeTuner(), "fla.ops.y.kernel_b": FakeTuner()}
    table = {"gpu": "Fake_GPU", "capability": "9.0", "triton": "3.7.1", "fla": "0.6.0", "kernels": {
        "fla.ops.x.kernel_a": [{"key": [9, 64, True, "torch.bfloat16"], "config": {"kwargs": {"BT": 64}, "num_warps": 4, "num_stages": 2}}],
        "fla.ops.z.not_loaded": [{"key": [1], "config": {"kwargs": {}, "num_warps": 1, "num_stages": 1}}]}}
    (tmp_path / kernel_configs.table_name(table)).write_text(json.dumps(table))
    monkeypatch.setattr(kernel_configs, "DIRECTORY", tmp_path)
    monkeypatch.setattr(kernel_configs, "gpu_label", lambda: "Fake_GPU")
    monkeypatch.setattr(kernel_configs, "capability", lambda: "9.0")
    monkeypatch.setattr(kernel_configs, "versions", lambda: {"triton": "3.7.1", "fla": "0.6.0"})
    monkeypatch.setattr(kernel_configs, "autotuners", lambda: iter(tuners.items()))
    monkeypatch.setattr(kernel_configs.torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(Config=FakeConfig))
    monkeypatch.setitem(sys.modules, "triton.errors", types.SimpleNamespace(TritonError=FakeBuildError))
    monkeypatch.delenv(kernel_configs.SWITCH, raising=False)
    return tuners


def test_pins_recorded_keys_only(shipped):
    assert kernel_configs.pin_tuned_configs() == 1
    config = shipped["fla.ops.x.kernel_a"].cache[(9, 64, True, "torch.bfloat16")]
    assert (config.kwargs, config.num_warps, config.num_stages) == ({"BT": 64}, 4, 2)
    assert shipped["fla.ops.y.kernel_b"].cache == {}
    assert kernel_configs.pin_tuned_configs() == 0  # idempotent: what is in a cache stays


def test_an_autotuned_choice_is_never_replaced(shipped):
    mine = FakeConfig({"BT": 32}, 8, 3)
    shipped["fla.ops.x.kernel_a"].cache[(9, 64, True, "torch.bfloat16")] = mine
    assert kernel_configs.pin_tuned_configs() == 0
    assert shipped["fla.ops.x.kernel_a"].cache[(9, 64, True, "torch.bfloat16")] is mine


@pytest.mark.parametrize("change", ["fla", "architecture", "switch", "no_cuda"])
def test_nothing_pinned_when_anything_differs(shipped, monkeypatch, change):
    if change == "fla":
        monkeypatch.setattr(kernel_configs, "versions", lambda: {"triton": "3.7.1", "fla": "0.6.0", change: "9.9.9"})
    elif change == "architecture":  # another GPU of another compute capability
        monkeypatch.setattr(kernel_configs, "gpu_label", lambda: "Other_GPU")
        monkeypatch.setattr(kernel_configs, "capability", lambda: "8.0")
    elif change == "switch":
        monkeypatch.setenv(kernel_configs.SWITCH, "off")
    else:
        monkeypatch.setattr(kernel_configs.torch.cuda, "is_available", lambda: False)
    assert kernel_configs.pin_tuned_configs() == 0
    assert all(t.cache == {} for t in shipped.values())


def test_a_gpu_without_a_table_takes_one_of_its_architecture(shipped, monkeypatch):
    monkeypatch.setattr(kernel_configs, "gpu_label", lambda: "Other_GPU")  # same capability, no table of its own
    assert kernel_configs.pin_tuned_configs() == 1
    assert shipped["fla.ops.x.kernel_a"].cache[(9, 64, True, "torch.bfloat16")].kwargs == {"BT": 64}


def test_a_gpus_own_table_comes_before_its_architectures(shipped, tmp_path, monkeypatch):
    key = [9, 64, True, "torch.bfloat16"]
    for name, bt in (("A_GPU", 16), ("Other_GPU", 32), ("Z_GPU", 128)):  # before and after the GPU's own by name
        table = {"gpu": name, "capability": "9.0", "triton": "3.7.1", "fla": "0.6.0", "kernels": {
            "fla.ops.x.kernel_a": [{"key": key, "config": {"kwargs": {"BT": bt}, "num_warps": 4, "num_stages": 2}}],
            "fla.ops.y.kernel_b": [{"key": [bt], "config": {"kwargs": {}, "num_warps": 1, "num_stages": 1}}]}}
        (tmp_path / kernel_configs.table_name(table)).write_text(json.dumps(table))
    monkeypatch.setattr(kernel_configs, "gpu_label", lambda: "Other_GPU")
    assert kernel_configs.pin_tuned_configs() == 4  # kernel_a's one key, kernel_b's three
    assert shipped["fla.ops.x.kernel_a"].cache[tuple(key)].kwargs == {"BT": 32}
    assert sorted(shipped["fla.ops.y.kernel_b"].cache) == [(16,), (32,), (128,)]


def test_record_round_trips_through_pin(shipped, tmp_path, monkeypatch):
    shipped["fla.ops.y.kernel_b"].cache[(4, "torch.float32")] = FakeConfig({"BK": 32}, 2, 1, 1, None)
    out = tmp_path / "Fake_GPU-triton-3.7.1.json"  # the shipped file
    assert kernel_configs.write(out) == 1
    shipped["fla.ops.y.kernel_b"].cache.clear()
    assert kernel_configs.pin_tuned_configs() == 2  # the recorded key and the table's own (kept by write)
    assert shipped["fla.ops.y.kernel_b"].cache[(4, "torch.float32")].kwargs == {"BK": 32}


def test_record_adds_to_a_table_of_the_same_versions_and_replaces_one_of_others(shipped, tmp_path, monkeypatch):
    out = tmp_path / "Fake_GPU-triton-3.7.1.json"  # the shipped file
    shipped["fla.ops.x.kernel_a"].cache[(4, 256, True, "torch.bfloat16")] = FakeConfig({"BT": 16}, 8, 3)
    assert kernel_configs.write(out) == 1
    keys = {k: [e["key"] for e in v] for k, v in json.loads(out.read_text())["kernels"].items()}
    assert keys == {"fla.ops.x.kernel_a": [[9, 64, True, "torch.bfloat16"], [4, 256, True, "torch.bfloat16"]],
                    "fla.ops.z.not_loaded": [[1]]}  # the shipped keys kept, the new one added
    shipped["fla.ops.x.kernel_a"].cache[(9, 64, True, "torch.bfloat16")] = FakeConfig({"BT": 32}, 2, 1)
    kernel_configs.write(out)
    entries = json.loads(out.read_text())["kernels"]["fla.ops.x.kernel_a"]
    assert [e["config"]["kwargs"] for e in entries] == [{"BT": 16}, {"BT": 32}]  # a key recorded again: the new winner
    monkeypatch.setattr(kernel_configs, "versions", lambda: {"triton": "3.8.0", "fla": "0.6.0"})
    kernel_configs.write(out)
    table = json.loads(out.read_text())
    assert table["triton"] == "3.8.0" and "fla.ops.z.not_loaded" not in table["kernels"]  # another Triton: nothing kept


def test_shipped_tables_name_their_versions():
    for path in kernel_configs.DIRECTORY.glob("*.json"):
        table = json.loads(path.read_text())
        assert path.name == kernel_configs.table_name(table) and table["fla"] and table["kernels"], path
        assert table["capability"].count(".") == 1, path  # e.g. "9.0": what lets another GPU of it take the table


def test_a_run_that_will_autotune_is_told_so(shipped, monkeypatch):
    assert kernel_configs.missing_note() is None  # a table serves this GPU
    monkeypatch.setattr(kernel_configs, "gpu_label", lambda: "Other_GPU")
    monkeypatch.setattr(kernel_configs, "capability", lambda: "8.0")
    note = kernel_configs.missing_note()
    assert "Other_GPU" in note and "8.0" in note and "Triton 3.7.1" in note and "autotunes" in note
    monkeypatch.setenv(kernel_configs.SWITCH, "off")  # autotuning asked for: nothing to say
    assert kernel_configs.missing_note() is None
    monkeypatch.delenv(kernel_configs.SWITCH)

    def absent():
        raise importlib.metadata.PackageNotFoundError("fla-core")
    monkeypatch.setattr(kernel_configs, "versions", absent)
    assert kernel_configs.missing_note() is None  # no fla: no fla kernels to tune


def borrowing(tmp_path, monkeypatch, here: str, tables: dict) -> None:
    """Tables of Fake_GPU recorded under other Triton versions (version -> kernel_a's BT for the fixture's key),
    beside the fixture's 3.7.1 one (BT 64); this process runs Triton `here`."""
    for version, bt in tables.items():
        table = {"gpu": "Fake_GPU", "capability": "9.0", "triton": version, "fla": "0.6.0", "kernels": {
            "fla.ops.x.kernel_a": [{"key": [9, 64, True, "torch.bfloat16"], "config": {"kwargs": {"BT": bt}, "num_warps": 4, "num_stages": 2}}]}}
        (tmp_path / kernel_configs.table_name(table)).write_text(json.dumps(table))
    monkeypatch.setattr(kernel_configs, "versions", lambda: {"triton": here, "fla": "0.6.0"})


@pytest.mark.parametrize("here, tables, taken, order", [
    ("3.8.1", {"3.9.0": 32}, {"BT": 64}, "3.7.1, 3.9.0"),  # 3.7.1 is a minor release away and a patch nearer
    ("3.10.2", {"3.9.0": 32, "3.10.0": 128}, {"BT": 32}, "3.10.0, 3.9.0, 3.7.1"),  # 3.10.0's BT 128 is no candidate here
])
def test_a_triton_without_a_table_borrows_the_nearest_releases_winner(shipped, tmp_path, monkeypatch, here, tables, taken, order):
    borrowing(tmp_path, monkeypatch, here, tables)
    assert kernel_configs.shipped_tables() == []
    assert kernel_configs.pin_tuned_configs() == 1
    assert shipped["fla.ops.x.kernel_a"].cache[(9, 64, True, "torch.bfloat16")].kwargs == taken
    note = kernel_configs.missing_note()
    assert f"Triton {here}" in note and f"({order}, in that order" in note


def test_a_borrowed_config_this_triton_cannot_build_autotunes_instead(shipped, tmp_path, monkeypatch):
    borrowing(tmp_path, monkeypatch, "3.8.0", {})
    tuner, key = shipped["fla.ops.x.kernel_a"], (9, 64, True, "torch.bfloat16")
    tuner.unbuildable = [{"BT": 64}]
    assert kernel_configs.pin_tuned_configs() == 1
    assert tuner.run(key) == {"BT": 32} and tuner.tuned == 1  # the borrowed config failed; the call autotuned
    assert tuner.run(key) == {"BT": 32} and tuner.tuned == 1
    tuner.unbuildable = [{"BT": 32}]  # a kernel that does not build whatever its config: the error is the caller's
    with pytest.raises(FakeBuildError):
        tuner.run(key)


def test_a_pin_for_this_triton_is_never_dropped(shipped, tmp_path, monkeypatch):
    """Only borrowed pins are guarded: a table recorded with this Triton is pinned as it was."""
    tuner = shipped["fla.ops.x.kernel_a"]
    tuner.unbuildable = [{"BT": 64}]
    assert kernel_configs.pin_tuned_configs() == 1
    with pytest.raises(FakeBuildError):
        tuner.run((9, 64, True, "torch.bfloat16"))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed (a CUDA-side extra)")
def test_triton_autotunes_a_kernel_whose_borrowed_config_does_not_build():
    """Triton's own Autotuner, under its CPU interpreter: a borrowed tile wider than the row fails its compile-time
    assertion, and the guarded call autotunes over the kernel's candidates (a benchmark stands in for the GPU's)."""
    from interpreted import run_interpreted

    script = """
import torch, triton, triton.language as tl
from tcal.kernel_configs import borrow_guard

def bench(fn, quantiles):  # Triton's benchmark on a GPU gives a config that does not build an infinite time
    try:
        fn()
    except Exception:
        return [float("inf")] * 3
    return [1.0] * 3

@triton.autotune(configs=[triton.Config({"B": 16}, num_warps=1), triton.Config({"B": 32}, num_warps=1)], key=["N"], do_bench=bench)
@triton.jit
def double(x, y, N: tl.constexpr, B: tl.constexpr):
    tl.static_assert(B <= N, "a tile wider than the row")
    i = tl.arange(0, B)
    tl.store(y + i, tl.load(x + i, mask=i < N) * 2, mask=i < N)

x, y = torch.arange(16.0), torch.zeros(16)
key, lent = (16, "torch.float32", "torch.float32"), triton.Config({"B": 32}, num_warps=1)
double.cache[key] = lent
borrow_guard(double, {key: lent})
double[(1,)](x, y, 16)
assert torch.equal(y, 2 * x) and double.cache[key].kwargs == {"B": 16}, double.cache
print("ok")
"""
    done = run_interpreted(script, timeout=120)
    assert done.returncode == 0 and "ok" in done.stdout, done.stdout + done.stderr
