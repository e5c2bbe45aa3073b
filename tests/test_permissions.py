"""What surgery publishes (a saved hybrid, an export, a distillation run and its checkpoints) has the
modes the user's umask gives, as mkdir and open would: 0755/0644 under umask 022, 0700/0600 under
077. Staging directories (tempfile.mkdtemp, 0700) and safetensors' own temporary file (0600) must
not leak their modes into the published directory."""
from __future__ import annotations

import copy
import dataclasses
import os
import stat
from pathlib import Path

import pytest

import surgery
from surgery import PassManager
from surgery.io.export import export
from surgery.train import DistillConfig, distill


@pytest.fixture
def umask():
    """Set the process umask for one test, restored after."""
    old = os.umask(0o022)
    os.umask(old)
    yield os.umask
    os.umask(old)


def modes(root: Path) -> dict[str, int]:
    """{relative path: permission bits} of root and everything under it (links skipped)."""
    found = {".": stat.S_IMODE(root.stat().st_mode)}
    for path in root.rglob("*"):
        if not path.is_symlink():
            found[str(path.relative_to(root))] = stat.S_IMODE(path.stat().st_mode)
    return found


def assert_modes(root: Path, mask: int) -> None:
    want_dir, want_file = 0o777 & ~mask, 0o666 & ~mask
    got = modes(root)
    wrong = {name: oct(mode) for name, mode in got.items()
             if mode != (want_dir if (root / name).is_dir() else want_file)}
    assert not wrong, f"under umask {oct(mask)} expected {oct(want_dir)}/{oct(want_file)}: {wrong}"
    assert len(got) > 3  # the check saw the weights, the recipe or config, and more


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_save_and_export_follow_the_umask(mask, umask, stories, tmp_path):
    hybrid = stories()
    PassManager(["select", "replace"], {"select": {"layers": "1,3", "policy": "convert"}})(hybrid)
    umask(mask)
    saved = surgery.save(hybrid, tmp_path / "hybrid")
    assert_modes(saved, mask)
    assert_modes(export(saved, tmp_path / "export"), mask)
    resaved = surgery.save(hybrid, tmp_path / "hybrid", force=True)  # the replacement too (staged, renamed)
    assert_modes(resaved, mask)


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_distill_run_directory_follows_the_umask(mask, umask, stories, stories_teacher, tmp_path):
    hybrid = stories()
    PassManager(["select", "replace"], {"select": {"layers": "1", "policy": "convert"}})(hybrid)
    # training writes the student's weights in place: a copy, so the session's teacher stays as it is
    hybrid = dataclasses.replace(hybrid, gm=copy.deepcopy(hybrid.gm), meta=copy.deepcopy(hybrid.meta))
    data = tmp_path / "train.txt"
    data.write_text("Once upon a time there was a little cat. The cat liked to play in the sun. " * 40)
    umask(mask)
    config = DistillConfig(tokens=2 * 2 * 32, stage="kl", seq_len=32, global_batch=2)
    distill(hybrid, [data], tmp_path / "run", config, teacher=stories_teacher, progress=False)
    run = tmp_path / "run"
    assert any(p.name.startswith("checkpoint-") for p in run.iterdir())
    assert_modes(run, mask)
