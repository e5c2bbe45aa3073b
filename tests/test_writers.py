"""One writer per output directory: a second apply/export/distill/save of the same --out is refused
at once with the holder's PID and command, a lock a dead process left is taken over, two processes
never hold one lock together, --force and the staging cleanup know the lock file as the project's,
and a reader of a directory that a save replaces meanwhile gets one version, never a mix.
Other processes are real subprocesses, each with a timeout."""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import surgery
from surgery import PassManager
from surgery.errors import OutputBusyError
from surgery.io.checkpoint import read_hybrid
from surgery.io.lock import lock_file, output_lock
from surgery.io.outdir import clean_stale_staging, foreign_entries

from cli_checks import assert_clean_failure, invoke

ENV = dict(os.environ, OMP_NUM_THREADS="1")
# A process that takes the lock of argv[1], says so on stdout, and holds it until stdin closes
# (or, with argv[2] == "die", is killed by SIGKILL while holding it).
HOLDER = textwrap.dedent("""
    import os, signal, sys
    from surgery.io.lock import acquire, release
    path = acquire(sys.argv[1])
    print("held", flush=True)
    if sys.argv[2] == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.stdin.read()
    release(path)
""")


class Holder:
    """A subprocess holding the lock of `out` while the `with` block runs."""

    def __init__(self, out, mode="hold"):
        self.proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(out), mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=ENV)

    def __enter__(self):
        line = self.proc.stdout.readline()
        assert line.strip() == "held", line
        return self.proc

    def __exit__(self, *exc):
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def hybrid(stories, tmp_path_factory):
    graph = stories()
    PassManager(["select", "replace"], {"select": {"keep_ratio": 0.5}})(graph)
    return graph, surgery.save(graph, tmp_path_factory.mktemp("hybrid") / "hybrid")


def test_a_second_writer_of_one_out_is_refused_at_once_by_the_holders_pid(hybrid, tmp_path):
    graph, saved = hybrid
    out = tmp_path / "out"
    runner = CliRunner()
    (tmp_path / "train.txt").write_text("Once upon a time there was a cat. " * 40)
    with Holder(out) as proc:
        holder = json.loads(lock_file(out).read_text())
        assert holder["pid"] == proc.pid and "-c" in holder["command"]
        started = time.perf_counter()
        for args in (["apply", "--model", saved, "--passes", "select,replace", "--out", out],
                     ["export", "--model", saved, "--out", out],
                     ["distill", "--model", saved, "--data", tmp_path / "train.txt", "--tokens", "1k", "--seq-len", 32, "--out", out]):
            assert_clean_failure(invoke(runner, *args), f"'{out}' is being written by another process (PID {proc.pid}:", "Wait for it")
        assert time.perf_counter() - started < 20  # refused before any model loads (one load takes longer)
        with pytest.raises(OutputBusyError, match=f"PID {proc.pid}"):
            surgery.save(graph, out)
        with pytest.raises(OutputBusyError, match=f"PID {proc.pid}"):
            surgery.export(saved, out)
        assert not out.exists() and lock_file(out).exists()
    assert not lock_file(out).exists()  # its holder deleted it as it let go
    surgery.save(graph, out)  # free again
    assert (out / "recipe.json").exists() and not lock_file(out).exists()


def test_the_lock_is_reentrant_in_one_thread_and_spelled_paths_share_it(hybrid, tmp_path):
    graph, _ = hybrid
    out = tmp_path / "a" / "out"
    with output_lock(out):
        with output_lock(tmp_path / "a" / ".." / "a" / "out"):  # the same lock, taken again
            surgery.save(graph, out)  # save takes it a third time
        assert lock_file(out).exists()
        other = subprocess.run([sys.executable, "-c", HOLDER, str(out), "hold"], stdin=subprocess.DEVNULL, capture_output=True,
                               text=True, env=ENV, timeout=300)
        assert other.returncode != 0 and "OutputBusyError" in other.stderr and f"PID {os.getpid()}:" in other.stderr, other.stderr[-2000:]
        failed = []
        thread = threading.Thread(target=lambda: failed.append(pytest.raises(OutputBusyError, surgery.save, graph, out)))
        thread.start()
        thread.join(timeout=30)
        assert failed and "another thread of this process" in str(failed[0].value)  # another thread is another writer
    assert not lock_file(out).exists()


def test_a_lock_left_by_a_killed_process_is_taken_over(hybrid, tmp_path):
    graph, _ = hybrid
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(out), "die"], stdout=subprocess.PIPE, text=True, env=ENV)
    assert proc.stdout.readline().strip() == "held"
    assert proc.wait(timeout=30) == -signal.SIGKILL
    assert json.loads(lock_file(out).read_text())["pid"] == proc.pid  # the file stays; the kernel dropped the flock
    surgery.save(graph, out)
    assert (out / "recipe.json").exists() and not lock_file(out).exists()


CONTENDER = textwrap.dedent("""
    import os, sys
    from surgery.errors import OutputBusyError
    from surgery.io.lock import output_lock
    out, marker, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
    held = 0
    while held < rounds:
        try:
            with output_lock(out):
                fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # fails if another holder is inside
                os.close(fd)
                os.unlink(marker)
                held += 1
        except OutputBusyError:
            pass
    print(held)
""")


def test_two_processes_never_hold_one_lock_together(tmp_path):
    """Three processes take and drop the lock of one --out 150 times each, as fast as they can; each,
    while holding it, creates a marker file that must not exist (O_EXCL). A lock file deleted by
    its holder as another process opens it must not let two in."""
    out, marker = tmp_path / "out", tmp_path / "inside"
    procs = [subprocess.Popen([sys.executable, "-c", CONTENDER, str(out), str(marker), "150"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=ENV) for _ in range(3)]
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0 and stdout.strip() == "150", stderr[-2000:]
    assert not marker.exists() and not lock_file(out).exists()


def test_force_and_staging_cleanup_know_the_lock_files(hybrid, tmp_path):
    graph, _ = hybrid
    run = tmp_path / "run"
    run.mkdir()
    surgery.save(graph, run / "checkpoint-00000003", force=True)
    (run / "log.jsonl").write_text("")
    (run / ".checkpoint-00000003.lock").write_text('{"pid": 1, "command": "killed"}')  # a killed save's
    assert foreign_entries(run, ("run",)) == []
    (run / ".notes.lock").write_text("")  # not the lock of anything surgery writes
    assert foreign_entries(run, ("run",)) == [".notes.lock"]
    out = tmp_path / "out"
    surgery.save(graph, out)
    with Holder(out):
        assert clean_stale_staging(out) == [] and lock_file(out).exists()  # the live holder's file stays


VERSION_WRITER = textwrap.dedent("""
    import shutil, sys, time
    from pathlib import Path
    from surgery.io.checkpoint import write_staged
    out, a, b, stop = map(Path, sys.argv[1:5])
    n = 0
    while not stop.exists():
        source = (a, b)[n % 2]
        write_staged(out, lambda tmp: shutil.copytree(source, tmp, dirs_exist_ok=True))  # save's staging and swap
        n += 1
        time.sleep(0.5)  # a pause between replaces (a real save computes first), so reads are not starved
    print(n)
""")


def test_a_reader_gets_one_version_while_a_save_replaces_the_directory(hybrid, tmp_path):
    """A subprocess replaces `h` again and again with version A or B (different weights, recipe
    and tokenizer) through save's staging and rename; every read meanwhile is all A or all B."""
    graph, _ = hybrid
    versions = {}
    for name, max_length in (("A", 1000), ("B", 2000)):
        g = dataclasses.replace(graph, gm=copy.deepcopy(graph.gm), meta=dict(graph.meta, writers_version=name),
                                tokenizer=copy.deepcopy(graph.tokenizer))
        g.tokenizer.model_max_length = max_length
        if name == "B":
            with torch.no_grad():
                next(p for n, p in g.gm.named_parameters() if "embed" in n).add_(1.0)
        versions[name] = (surgery.save(g, tmp_path / name), max_length, g.gm.state_dict())
    out, stop = tmp_path / "h", tmp_path / "stop"
    surgery.save(graph, out)
    writer = subprocess.Popen([sys.executable, "-c", VERSION_WRITER, str(out), str(versions["A"][0]), str(versions["B"][0]), str(stop)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        began = time.perf_counter()
        while "writers_version" not in read_hybrid(out)[0]["results"] and time.perf_counter() - began < 300:
            time.sleep(0.05)  # the writer is starting (importing torch)
        assert "writers_version" in read_hybrid(out)[0]["results"], "the writer did not start in 300 s"
        seen, reads, deadline = set(), 0, time.perf_counter() + 6
        while time.perf_counter() < deadline or len(seen) < 2 and time.perf_counter() < deadline + 10:
            recipe, state, tokenizer = read_hybrid(out)
            name = recipe["results"]["writers_version"]
            _, max_length, weights = versions[name]
            assert tokenizer.model_max_length == max_length, (name, tokenizer.model_max_length)
            assert all(torch.equal(state[k], weights[k]) for k in state), name
            seen.add(name)
            reads += 1
        loaded = surgery.load(out)  # the whole load, while the writer runs
        name = loaded.meta["writers_version"]
        assert all(torch.equal(v, versions[name][2][k]) for k, v in loaded.gm.state_dict().items())
    finally:
        stop.touch()
        stdout, stderr = writer.communicate(timeout=300)
    assert writer.returncode == 0, stderr[-2000:]
    assert seen == {"A", "B"} and reads >= 5 and int(stdout) >= 5, (seen, reads, stdout)  # the reads overlapped several replaces
