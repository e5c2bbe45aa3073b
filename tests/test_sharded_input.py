"""Bad input for multi-process distillation, on the CPU with gloo: a world size that does not divide the
global batch, a rank that never joins, a rank killed while a checkpoint is written. Each is refused
before any work with one named line, or leaves the last complete checkpoint loadable."""
from __future__ import annotations

import json
import os
import socket
import traceback

import pytest
import torch

import surgery
from surgery import PassManager
from surgery.errors import DistillError
from surgery.train import DistillConfig, distill
from surgery.train.placement import placement

from forks import skip_unless_forked_ranks_train

L, G = 16, 4
TEXT = "Once upon a time, there was a little cat named Tom. Tom liked to play with a red ball in the garden. " * 12


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def train_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "train.txt"
    path.write_text(TEXT)
    return path


@pytest.fixture(scope="module")
def student(stories):
    graph = stories()
    PassManager(["select", "replace"], {"select": {"policy": "convert", "layers": [1]}})(graph)
    return graph


def on_ranks(world: int, run, tmp_path, timeout: float = 60) -> list:
    """run(rank) in `world` forked processes joined as a launcher would start them; -> each rank's exit
    code and its error's one line (written to a file: the children share nothing else with the test)."""
    port, context = free_port(), torch.multiprocessing.get_context("fork")

    def main(rank):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
        try:
            run(rank)
        except BaseException as exc:
            (tmp_path / f"error-{rank}").write_text(str(exc) if isinstance(exc, DistillError) else traceback.format_exc())
            os._exit(1)
        os._exit(0)

    procs = [context.Process(target=main, args=(rank,)) for rank in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    files = [tmp_path / f"error-{rank}" for rank in range(world)]
    return [(p.exitcode, f.read_text() if f.exists() else "") for p, f in zip(procs, files)]


def test_a_world_size_that_does_not_divide_the_batch_is_refused_before_any_work(student, stories_teacher, train_file, tmp_path):
    out = tmp_path / "run"
    config = DistillConfig(tokens=3 * L * 3, seq_len=L, global_batch=3, stage="kl")
    results = on_ranks(2, lambda rank: distill(student, [train_file], out, config, teacher=stories_teacher, progress=False, device="cpu"), tmp_path)
    for code, message in results:
        assert code == 1 and message.startswith("A global batch of 3 sequences cannot be split over 2 processes."), message
        assert "divisible by the number of processes" in message
    assert not out.exists()


def test_a_rank_that_never_joins_is_named(monkeypatch):
    """Rank 0 alone of 3: ranks 1 and 2 named after the timeout; rank 1 with no rank 0: rank 0 named.
    No process group is left behind."""
    monkeypatch.setenv("SURGERY_JOIN_TIMEOUT", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(DistillError, match=r"^Ranks 1, 2 of 3 did not join within 1 s\.") as info:
        placement("cpu")
    assert "WORLD_SIZE=3" in info.value.fix and "SURGERY_JOIN_TIMEOUT" in info.value.fix
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(DistillError, match=r"^Rank 1 of 3 never heard from rank 0 at 127\.0\.0\.1:\d+ within 1 s") as info:
        placement("cpu")
    assert "rank 0 first" in info.value.fix
    assert not torch.distributed.is_initialized()
    monkeypatch.setenv("SURGERY_JOIN_TIMEOUT", "soon")
    with pytest.raises(DistillError, match="SURGERY_JOIN_TIMEOUT='soon' is not a positive number"):
        placement("cpu")


def test_a_rank_killed_mid_save_leaves_the_last_complete_checkpoint(student, stories_teacher, train_file, tmp_path):
    """Two processes, a checkpoint every step; rank 0 (the writer) dies like kill -9 halfway through
    checkpoint 2's trainer state. The run directory still opens at checkpoint 1, which resumes."""
    skip_unless_forked_ranks_train()
    import surgery.train.run_dir as run_dir

    out = tmp_path / "run"
    step = L * G
    config = DistillConfig(tokens=3 * step, seq_len=L, global_batch=G, stage="kl", save_every=step, keep_checkpoints=5)
    real = run_dir.write_state

    def dying(staging, state):
        if state["step"] == 2:
            (staging / "trainer_state.json").write_text('{"step": 2, "optim')  # half a file, then the process is gone
            os._exit(9)
        real(staging, state)

    def run(rank):
        run_dir.write_state = dying
        distill(student, [train_file], out, config, teacher=stories_teacher, progress=False, device="cpu")

    results = on_ranks(2, run, tmp_path, timeout=90)
    assert results[0][0] == 9, results
    assert results[1][0] != 0  # its peer vanished: rank 1 fails too, it does not write
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-00000001"]
    assert (out / "last").resolve().name == "checkpoint-00000001"
    reopened = surgery.open_model(out)
    assert reopened.meta["distill"]["step"] == 1
    # 3 processes cannot split its batch of 4: the layout it was written in and the counts that fit
    results = on_ranks(3, lambda rank: distill(student, [train_file], out, config, teacher=stories_teacher, resume=True,
                                               progress=False, device="cpu"), tmp_path)
    for code, message in results:
        assert code == 1 and message.startswith(f"The run in '{out}' was written by 2 processes, DDP; this run has 3 processes, "
                                                "which cannot split its global batch of 4 sequences."), message
        assert "divides 4 (1, 2, 4)" in message
    summary = distill(student, [train_file], out, config, teacher=stories_teacher, resume=True, progress=False, device="cpu")
    assert summary["steps"] == 3
    assert json.loads((out / "last" / "trainer_state.json").read_text())["step"] == 3


def test_a_checkpoint_of_per_rank_shards_is_named(tmp_path, train_file, stories_teacher):
    """A torch.distributed.checkpoint directory (what FSDP trainers write): its layout and surgery's."""
    from surgery.errors import CheckpointError

    shards = tmp_path / "dcp"
    shards.mkdir()
    for rank in range(4):
        (shards / f"__{rank}_0.distcp").write_bytes(b"\0")
    (shards / ".metadata").write_bytes(b"\0")
    for attempt in (lambda: surgery.load(shards), lambda: surgery.open_model(shards)):
        with pytest.raises(CheckpointError, match=r"is a torch\.distributed\.checkpoint sharded over 4 ranks .*; surgery reads gathered safetensors") as info:
            attempt()
        assert "save_file" in info.value.fix and "any world size" in info.value.fix
