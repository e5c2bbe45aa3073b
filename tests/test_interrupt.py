"""Ctrl-C and SIGTERM during `surgery distill` keep the work: the step under way finishes, a
checkpoint is written, the command exits 130 (SIGINT) or 143 (SIGTERM), and --resume then repeats
the uninterrupted run exactly (losses and weights). A second signal aborts at once and leaves no
half-written checkpoint. While a run writes its --out, a second distill of it is refused.
Every run here is a real process (a subprocess with a timeout) on stories260K."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import surgery
from surgery import PassManager
from surgery.train import DistillConfig, distill

from cli_checks import assert_clean_failure, invoke

ENV = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="400")  # one thread: the same arithmetic as this process (conftest: one thread)
TEXT = " ".join(["Once upon a time, there was a little cat named Tom. Tom liked to play with a red ball in the garden.",
                 "Lily and her mom went to the park. The sun was warm and the sky was blue. Lily saw a big slide.",
                 "Ben had a blue boat. He took it to the pond every day. One day the wind blew hard."] * 3)
L, G = 32, 4
STEP = L * G
STEPS = 6
ARGS = ["--tokens", str(STEPS * STEP), "--seq-len", str(L), "--batch-size", str(G), "--stage", "kl", "--device", "cpu"]

# Runs `surgery distill ARGS` in this process after patching what argv[1] names:
#   signal-in-step N SIG   the process signals itself in the middle of optimizer step N (1-based)
#   abort-in-save N        while checkpoint N is being staged: SIGINT, then SIGINT again after the grace
SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    import surgery.train.trainer as trainer
    import surgery.train.run_dir as run_dir
    from surgery.train.interrupt import GRACE
    mode, n, args = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    if mode == "signal-in-step":
        sig, args = getattr(signal, args[0]), args[1:]
        real_step = trainer.optimizer_step
        def optimizer_step(job, step, *rest):
            if step + 1 == n:
                os.kill(os.getpid(), sig)  # handled at once: the step goes on
            return real_step(job, step, *rest)
        trainer.optimizer_step = optimizer_step
    if mode == "abort-in-save":
        real_write = run_dir.write_state
        def write_state(folder, state):
            if state["step"] == n:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(GRACE + 0.3)
                os.kill(os.getpid(), signal.SIGINT)  # aborts here, inside the checkpoint's staging
            return real_write(folder, state)
        run_dir.write_state = write_state
    from surgery.cli.app import main
    sys.argv = ["surgery", "distill", *args]
    main()
""")


@pytest.fixture(scope="module")
def setup(stories, tmp_path_factory):
    """A saved stories260K hybrid and training text."""
    folder = tmp_path_factory.mktemp("interrupt")
    graph = stories()
    PassManager(["select", "replace"], {"select": {"keep_ratio": 0.5}})(graph)
    hybrid = surgery.save(graph, folder / "hybrid")
    (folder / "train.txt").write_text(TEXT)
    return hybrid, folder / "train.txt"


@pytest.fixture(scope="module")
def reference(setup, tmp_path_factory):
    """The uninterrupted run (in this process)."""
    hybrid, train = setup
    out = tmp_path_factory.mktemp("reference") / "run"
    distill(str(hybrid), [train], out, config(), progress=False)
    return out


def config() -> DistillConfig:
    """What ARGS give the CLI."""
    return DistillConfig(tokens=STEPS * STEP, seq_len=L, global_batch=G, stage="kl")


def run_script(mode: str, n: int, *args, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, mode, str(n), *map(str, args)], capture_output=True, text=True,
                          env=ENV, timeout=timeout)


def logged_steps(out) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "log.jsonl").read_text().splitlines()]


def losses(out) -> list[float]:
    return [r["loss"] for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "loss" in r]


def checkpoints(out) -> list[str]:
    return sorted(p.name for p in out.glob("checkpoint-*"))


def leftovers(out) -> list[str]:
    """Hidden entries of a run directory and beside it: staging, moved-aside copies, locks."""
    return sorted(p.name for folder in (out, out.parent) for p in folder.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_finishes_the_step_writes_a_checkpoint_and_resume_repeats_the_run(setup, reference, tmp_path, sig):
    hybrid, train = setup
    out = tmp_path / "run"
    proc = run_script("signal-in-step", 3, sig, "--model", hybrid, "--data", train, *ARGS, "--out", out)
    assert proc.returncode == 128 + getattr(signal, sig), proc.stderr[-3000:]
    assert f"{sig}: finishing this step, then a checkpoint" in proc.stderr
    assert f"{sig}: stopped after {3 * STEP:,} tokens (step 3): checkpoint {out / 'checkpoint-00000003'} written" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert checkpoints(out) == ["checkpoint-00000003"] and logged_steps(out) == [1, 2, 3] and leftovers(out) == []
    result = distill(str(hybrid), [train], out, config(), resume=True, progress=False)
    assert result["complete"] and result["steps"] == STEPS and result["stopped"] is None
    assert logged_steps(out) == list(range(1, STEPS + 1))
    assert losses(out) == losses(reference)  # exactly: the interrupted-then-resumed run is the uninterrupted one
    mine, theirs = (load_file(d / f"checkpoint-{STEPS:08d}" / "model.safetensors") for d in (out, reference))
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_a_second_signal_aborts_without_a_half_written_checkpoint(setup, tmp_path):
    hybrid, train = setup
    out = tmp_path / "run"
    proc = run_script("abort-in-save", 2, "--model", hybrid, "--data", train, *ARGS, "--save-every", 2 * STEP, "--out", out)
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert "SIGINT again: aborting without writing a checkpoint" in proc.stderr
    assert f"aborted by a second SIGINT: no checkpoint written since the last one in {out}" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert checkpoints(out) == [] and logged_steps(out) == [1, 2] and leftovers(out) == []  # staging and locks gone
    result = distill(str(hybrid), [train], out, config(), resume=True, progress=False)  # nothing to resume from: starts over
    assert result["complete"] and logged_steps(out) == list(range(1, STEPS + 1))


def test_sigterm_from_outside_stops_a_real_run_that_a_second_writer_cannot_join(setup, tmp_path):
    """`surgery distill` as a user starts it, stopped by SIGTERM from another process; while it runs,
    a second distill of its --out is refused naming its PID (before any model loads)."""
    hybrid, train = setup
    out = tmp_path / "run"
    args = ["--model", hybrid, "--data", train, "--tokens", "10M", "--seq-len", L, "--batch-size", G, "--stage", "kl",
            "--device", "cpu", "--out", out]
    proc = subprocess.Popen([sys.executable, "-m", "surgery.cli.app", "distill", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        began = time.perf_counter()
        while not ((out / "log.jsonl").exists() and (out / "log.jsonl").read_text().count("\n") >= 1):
            assert proc.poll() is None and time.perf_counter() - began < 400, proc.stderr.read() if proc.poll() is not None else "slow"
            time.sleep(0.05)
        second = invoke(CliRunner(), "distill", *args[:-2], "--seed", 2, "--out", out)
        assert_clean_failure(second, f"'{out}' is being written by another process (PID {proc.pid}:", "distill")
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, stderr[-3000:]
    steps = logged_steps(out)
    assert steps == list(range(1, len(steps) + 1))  # one run's log, no step twice
    assert checkpoints(out) == [f"checkpoint-{steps[-1]:08d}"] and leftovers(out) == []
    assert f"SIGTERM: stopped after {steps[-1] * STEP:,} tokens (step {steps[-1]})" in stderr


def children(pid: int) -> list[int]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found += [int(x) for x in f.read().split()]
    return found


def rank_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    except OSError:
        return None
    return int(env[b"RANK"]) if b"RANK" in env else None


def test_under_torchrun_a_signal_to_one_rank_stops_every_rank_at_the_same_step(setup, tmp_path):
    """Two gloo processes; SIGTERM reaches rank 1 alone. The ranks agree on the stop step (an
    all-reduce of the flag): rank 0 writes that step's checkpoint and both exit 143, none hangs."""
    hybrid, train = setup
    out = tmp_path / "ddp"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
           "-m", "surgery.cli.app", "distill", "--model", hybrid, "--data", train, "--tokens", "10M", "--seq-len", L, "--batch-size", G,
           "--stage", "kl", "--device", "cpu", "--out", out]
    proc = subprocess.Popen([str(a) for a in cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        began = time.perf_counter()
        while not ((out / "log.jsonl").exists() and (out / "log.jsonl").read_text().count("\n") >= 1):
            assert proc.poll() is None and time.perf_counter() - began < 400, "torchrun ended or is slow"
            time.sleep(0.05)
        rank1 = [pid for pid in children(proc.pid) if rank_of(pid) == 1]
        assert len(rank1) == 1
        os.kill(rank1[0], signal.SIGTERM)
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    steps = logged_steps(out)
    assert steps == list(range(1, len(steps) + 1)), stderr[-3000:]
    assert checkpoints(out) == [f"checkpoint-{steps[-1]:08d}"], stderr[-3000:]
    assert f"SIGTERM: stopped after {steps[-1] * STEP:,} tokens (step {steps[-1]})" in stderr  # rank 0, which no signal reached
    assert proc.returncode != 0 and "exitcode  : 143" in stderr, stderr[-3000:]  # torchrun reports its workers
