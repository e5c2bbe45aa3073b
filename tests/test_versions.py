"""The supported transformers range is one fact (surgery/core/versions.py = pyproject.toml), refused
outside at import in one line; optional dependencies (lm-eval) say how to install them."""
from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from surgery.cli.app import app
from surgery.core.versions import FLOOR, INSTALL, REQUIREMENT, UnsupportedVersionError, check_transformers, release, supported
from surgery.errors import EvalTaskError, SurgeryError

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_pyproject_declares_the_range_the_import_checks():
    deps = PYPROJECT["project"]["dependencies"]
    assert [d for d in deps if d.startswith("transformers")] == [REQUIREMENT]
    assert REQUIREMENT == f"transformers>={FLOOR},<6" and INSTALL == f'pip install "{REQUIREMENT}"'


def test_runtime_dependencies_hold_no_test_runner_and_no_lm_eval():
    names = [d.split("=")[0].split(">")[0].split("<")[0] for d in PYPROJECT["project"]["dependencies"]]
    assert "pytest" not in names and "lm-eval" not in names
    assert PYPROJECT["project"]["optional-dependencies"] == {"test": ["pytest>=8,<10", "pytest-xdist>=3.5,<4"], "eval": ["lm-eval==0.4.13"]}


@pytest.mark.parametrize("installed, ok", [(f"{FLOOR}.0", True), ("5.25.0", True), ("5.99.3", True), (f"{FLOOR}.1.dev0", True),
                                           ("5.17.0", False), ("5.23.0", False), ("4.57.6", False), ("6.0.0", False),
                                           ("6.0.0rc1", False), ("5", False)])
def test_the_range_is_floor_inclusive_and_below_6(installed, ok):
    assert supported(installed) is ok
    if ok:
        check_transformers(installed)
        return
    with pytest.raises(UnsupportedVersionError) as caught:
        check_transformers(installed)
    text = str(caught.value)
    assert "\n" not in text and f"transformers {installed} is installed" in text and REQUIREMENT in text and INSTALL in text
    assert isinstance(caught.value, SurgeryError) and isinstance(caught.value, ImportError)


def test_release_numbers():
    assert release("5.23.0") == (5, 23, 0) and release("5.24.0.dev0") == (5, 24, 0) and release("6.0.0rc1") == (6, 0, 0)


REFUSED = """
import importlib.metadata as metadata, sys
real = metadata.version
metadata.version = lambda name: {version!r} if name == "transformers" else real(name)
try:
    import surgery
except ImportError as exc:
    print(type(exc).__name__, "|", exc, "|", sorted(m for m in ("torch", "transformers") if m in sys.modules))
else:
    print("imported")
"""


@pytest.mark.parametrize("version", ["5.17.0", "4.57.6"])
def test_importing_surgery_with_another_transformers_is_refused_before_any_work(version):
    run = subprocess.run([sys.executable, "-c", REFUSED.format(version=version)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    kind, message, loaded = run.stdout.strip().split(" | ")
    assert kind == "UnsupportedVersionError" and loaded == "[]"  # neither torch nor transformers was imported
    assert message == f"transformers {version} is installed; surgery supports {REQUIREMENT}. Install a supported one: {INSTALL}"


@pytest.mark.skipif(not os.environ.get("SURGERY_PLAIN_PYTHON_4X"), reason="SURGERY_PLAIN_PYTHON_4X (a python with transformers 4.x; .ci/run sets it) not set")
def test_a_real_transformers_4_is_refused_in_one_line():
    run = subprocess.run([os.environ["SURGERY_PLAIN_PYTHON_4X"], "-c", "import surgery"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("surgery.core.versions.UnsupportedVersionError: transformers 4.") and INSTALL in last


def test_lm_eval_task_without_lm_eval_says_how_to_install_it(stories_path, monkeypatch):
    from surgery.eval.lm_harness import check_tasks

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if not installed: import and find_spec both fail
    with pytest.raises(EvalTaskError, match=r'pip install "surgery\[eval\]"'):
        check_tasks("surgery_next_sentence")
    result = CliRunner().invoke(app, ["eval", "--model", str(stories_path), "--task", "lm-eval", "--limit", "1"])
    assert result.exit_code == 2 and "lm-eval" in result.output and 'pip install "surgery[eval]"' in result.output
    assert "Traceback" not in result.output
