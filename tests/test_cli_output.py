"""What a user reads from `surgery`: progress on stderr at a steady cadence (never turned off by
--json), library noise hidden unless --verbose, help that reads (-h, --version, examples, no <bool>,
options described), `passes` in pipeline order, and --json on every command that has a result."""
from __future__ import annotations

import dataclasses
import io
import json
import re
import time
import warnings
from contextlib import contextmanager
from importlib.metadata import version

import pytest
import typer
from typer.testing import CliRunner

from surgery import PassManager
from surgery.cli import quiet
from surgery.cli.app import app
from surgery.core import progress
from surgery.core.field_help import field_help
from surgery.core.load import SHORT_NAMES
from surgery.core.pipeline import REGISTRY

from cli_checks import invoke

TEXT = ("Once upon a time, there was a little cat named Tom. Tom liked to play with a red ball in the garden. "
        "One day, the ball rolled under a big bush. Lily and her mom went to the park. The sun was warm. ") * 12
# calibrate and align on a little text, two align steps: the whole pipeline in seconds on stories260K
SMALL = [f"--set={p}.{k}={v}" for p in ("calibrate", "align") for k, v in (("samples", 2), ("length", 64))] + ["--set=align.steps=2"]


@pytest.fixture(scope="module")
def runner():
    return CliRunner()


@pytest.fixture
def lines_every_update(monkeypatch):
    """The CLI's plain-line reporter with no interval: a line at every update."""
    monkeypatch.setattr(progress, "INTERVAL", 0.0)
    yield
    progress.use(None)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "story.txt"
    path.write_text(TEXT)
    return path


def command_names() -> list[str]:
    return list(typer.main.get_command(app).commands)


# ------------------------------------------------------------------------------------------------
# progress (surgery.core.progress)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_lines_every_fraction_when_updates_are_fast():
    clock, stream = FakeClock(), io.StringIO()
    with _task(progress.Lines(stream, interval=10, fraction=0.05, clock=clock, heartbeat=False), "align", 100, "steps") as bar:
        for step in range(1, 101):
            bar.update(step, info="mean loss 1e-3")
    lines = stream.getvalue().splitlines()
    assert [int(re.match(r"align: (\d+)/100", l).group(1)) for l in lines] == list(range(5, 101, 5))
    assert lines[0] == "align: 5/100 steps (5%), mean loss 1e-3, 0 s elapsed, ~0 s left"
    assert lines[-1].startswith("align: 100/100 steps (100%)") and "left" not in lines[-1]


def test_lines_every_interval_when_updates_are_slow():
    clock, stream = FakeClock(), io.StringIO()
    reporter = progress.Lines(stream, interval=10, fraction=0.05, clock=clock, heartbeat=False)
    with _task(reporter, "perplexity", 1000, "windows") as bar:
        for window in range(1, 41):  # 3 s a window: 10 s pass every 4th window, long before 5% (50 windows)
            clock.now += 3
            bar.update(window)
    lines = stream.getvalue().splitlines()
    assert [int(re.match(r"perplexity: (\d+)/1,000", l).group(1)) for l in lines[:-1]] == list(range(4, 41, 4))
    assert "12 s elapsed, ~49 min 48 s left" in lines[0]  # 3 s for each of the 996 windows left
    assert lines[-1] == "perplexity: done in 2 min 00 s"  # closed short of its total: the end is said


@contextmanager
def _task(reporter, label, total, unit):
    """A progress task under `reporter`, the reporter in force before restored after."""
    before = progress.use(reporter)
    try:
        with progress.task(label, total, unit) as bar:
            yield bar
    finally:
        progress.use(before)


def test_a_silent_step_still_gets_a_line_each_interval():
    stream = io.StringIO()
    with _task(progress.Lines(stream, interval=0.05), "capture", None, ""):
        time.sleep(0.4)  # no update at all: the heartbeat speaks
    lines = stream.getvalue().splitlines()
    assert len(lines) >= 3 and all(l.startswith("capture: ") and "elapsed" in l for l in lines[:-1])
    assert lines[-1].startswith("capture: done in")


def test_progress_goes_to_stderr_and_the_quiet_reporter_says_nothing(capsys):
    with _task(progress.Lines(interval=0), "eval", 2, "windows") as bar:
        bar.update(1)
        bar.update(2)
    with _task(progress.Reporter(), "eval", 2, "windows") as bar:
        bar.update(2)
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("eval: ") == 2


def test_the_bar_shows_on_a_terminal():
    from rich.console import Console

    screen = io.StringIO()
    with _task(progress.Bar(Console(file=screen, force_terminal=True, width=120)), "align", 4, "steps") as bar:
        bar.update(2, info="mean loss 5e-2")
        bar.reporter.progress.refresh()
    assert "align" in screen.getvalue() and "2/4 steps" in screen.getvalue() and "mean loss 5e-2" in screen.getvalue()


def test_calibrate_and_the_teacher_reading_report_progress(stories):
    stream = io.StringIO()
    before = progress.use(progress.Lines(stream, interval=0))
    try:
        # a graph with a cache of its own: teacher windows another test read would not be read again
        PassManager(["select", "replace", "calibrate"], {"calibrate": {"samples": 2, "length": 64}})(dataclasses.replace(stories(), cache={}))
    finally:
        progress.use(before)
    text = stream.getvalue()
    assert "reading the teacher: 2/2 windows (100%)" in text
    assert re.search(r"calibrate: 1/3 layers \(33%\), layer 1: relative error [\d.]+ -> [\d.]+", text)
    assert "calibrate: 3/3 layers (100%)" in text


# ------------------------------------------------------------------------------------------------
# --json: the result alone on stdout, progress still on stderr


def test_apply_json_with_progress_on_stderr(runner, stories_path, tmp_path, lines_every_update):
    result = invoke(runner, "apply", "--model", stories_path, "--out", tmp_path / "h", *SMALL, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert set(data["passes"]) == {"select", "replace", "calibrate", "align"}
    assert data["passes"]["select"]["convert"] == [1, 3, 4] and data["out"] == str(tmp_path / "h")
    assert data["layer_kinds"] == ["attention", "gdn", "attention", "gdn", "gdn"]
    for line in ("capture: ", "reading the teacher: 2/2 windows", "calibrate: 3/3 layers", "align: 2/2 steps (100%)"):
        assert line in result.stderr
    # each pass in one readable line, no JSON
    assert "✓ select: policy uniform; convert 1, 3, 4; keep 0, 2" in result.stderr
    summary = next(l for l in result.stderr.splitlines() if l.startswith("✓ calibrate:"))
    assert re.fullmatch(r"✓ calibrate: seconds [\d.]+; mean rel error before [\d.]+; mean rel error after [\d.]+", summary)
    assert "{" not in result.stderr


def test_eval_json_keeps_progress(runner, stories_path, text_file, lines_every_update):
    result = invoke(runner, "eval", "--model", stories_path, "--text", text_file, "--chunk", "64", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["chunks"] > 1
    n = data["chunks"]
    done = [int(m.group(1)) for m in re.finditer(rf"^perplexity: (\d+)/{n} windows", result.stderr, re.M)]
    assert sorted(set(done)) == list(range(1, n + 1)) and done[-1] == n  # a line at every window (no interval)


def test_passkey_reports_each_answer(runner, stories_path, lines_every_update):
    result = invoke(runner, "eval", "--model", stories_path, "--task", "passkey", "--lengths", "200", "--depths", "2",
                    "--trials", "1", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert len(data["answers"]) == 2 and "passkey: 2/2 trials (100%)" in result.stderr
    for a in data["answers"]:
        assert set(a) == {"length", "depth", "expected", "answered", "correct"}
        assert re.fullmatch(r"\d{5}", a["expected"]) and a["correct"] == (a["answered"] == a["expected"])
    text = invoke(runner, "eval", "--model", stories_path, "--task", "passkey", "--lengths", "200", "--depths", "2", "--trials", "1")
    assert data["answers"][0]["expected"] in text.stdout and "answered" in text.stdout


def test_generate_export_and_passes_print_json(runner, stories_path, tmp_path):
    gen = invoke(runner, "generate", "--model", stories_path, "--prompt", "Once upon a time", "Lily", "-n", "6", "--json")
    assert gen.exit_code == 0, gen.output
    data = json.loads(gen.stdout)
    assert [c["prompt"] for c in data["continuations"]] == ["Once upon a time", "Lily"]
    assert all(c["new_tokens"] == 6 and c["text"] for c in data["continuations"])
    assert gen.stderr.count("generate: 6/6 tokens (100%)") == 2  # no stream on stdout with --json: progress on stderr
    streamed = invoke(runner, "generate", "--model", stories_path, "--prompt", "Once upon a time", "-n", "6")
    assert streamed.stdout == data["continuations"][0]["text"] + "\n"  # the same text, streamed

    hybrid = tmp_path / "h"
    assert invoke(runner, "apply", "--model", stories_path, "--passes", "select,replace", "--out", hybrid).exit_code == 0
    exported = invoke(runner, "export", "--model", hybrid, "--out", tmp_path / "hf", "--json")
    assert exported.exit_code == 0, exported.output
    data = json.loads(exported.stdout)
    assert data["out"] == str(tmp_path / "hf") and "config.json" in data["files"] and "model.safetensors" in data["files"]

    passes = json.loads(invoke(runner, "passes", "--json").stdout)
    assert [p["name"] for p in passes["passes"]][:4] == ["select", "replace", "calibrate", "align"]


# ------------------------------------------------------------------------------------------------
# help


def test_every_command_has_h_an_example_and_no_bool_metavar(runner):
    top = invoke(runner, "-h")
    assert top.exit_code == 0 and "Examples:" in top.stdout and "<bool>" not in top.stdout
    for name in command_names():
        result = invoke(runner, name, "-h")
        assert result.exit_code == 0, (name, result.output)
        assert "Examples:" in result.stdout and "$ surgery " + name in result.stdout, name
        assert "<bool>" not in result.stdout, name


def test_every_option_is_described():
    group = typer.main.get_command(app)
    for command in [group, *group.commands.values()]:
        for param in command.params:
            assert (getattr(param, "help", None) or "").strip(), f"{command.name} {param.name} has no description"


def test_version_model_names_and_text_metavar(runner):
    result = invoke(runner, "--version")
    assert result.exit_code == 0 and result.stdout.strip() == f"surgery {version('surgery')}"
    helps = invoke(runner, "eval", "-h").stdout
    assert all(name in helps for name in SHORT_NAMES)
    text = next(l for l in helps.splitlines() if "--text" in l)
    assert "FILE" in text and "list" not in text


def test_passes_in_pipeline_order_with_types_defaults_descriptions(runner):
    result = invoke(runner, "passes")
    assert result.exit_code == 0, result.output
    headers = [l.split()[0] for l in result.stdout.splitlines() if "(runs after:" in l]
    assert headers[:4] == ["select", "replace", "calibrate", "align"] and sorted(headers) == sorted(REGISTRY)
    row = next(l for l in result.stdout.splitlines() if l.startswith("align.steps "))
    assert row.split()[1:3] == ["int", "60"] and "optimizer steps" in row
    data = json.loads(invoke(runner, "passes", "--json").stdout)
    for p in data["passes"]:
        for option in p["options"]:
            assert option["help"] and option["type"], (p["name"], option)
    steps = next(o for p in data["passes"] if p["name"] == "align" for o in p["options"] if o["name"] == "steps")
    assert steps == {"name": "steps", "type": "int", "default": 60, "help": steps["help"]}


def test_field_help_reads_names_lists_and_continuations():
    from dataclasses import dataclass

    @dataclass
    class Base:
        """a      first
        b, c   shared
               and continued
        not_a_field  ignored"""
        a: int = 1
        b: int = 2
        c: int = 3

    @dataclass
    class Child(Base):
        """a  the child's own"""

    assert field_help(Base) == {"a": "first", "b": "shared and continued", "c": "shared and continued"}
    assert field_help(Child)["a"] == "the child's own" and field_help(Child)["c"] == "shared and continued"


# ------------------------------------------------------------------------------------------------
# quiet by default


def test_library_warnings_hidden_unless_verbose(runner, monkeypatch):
    from surgery.core import field_help as module

    original = module.describe_fields

    def noisy(cls):
        warnings.warn("torch.utils._pytree.LeafSpec is deprecated", FutureWarning)
        return original(cls)

    monkeypatch.setattr(module, "describe_fields", noisy)
    for args, shown in ((["passes"], False), (["--verbose", "passes"], True)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert invoke(runner, *args).exit_code == 0
        assert any(issubclass(w.category, FutureWarning) for w in caught) == shown, args


def test_quiet_hides_library_warnings_not_ours():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet.quiet_libraries(verbose=False)
        warnings.warn_explicit("TF32 is off", UserWarning, "functional.py", 1, module="torch.nn.functional")
        warnings.warn_explicit("TRITON_DEFAULT_FP_FUSION is unset", UserWarning, "knobs.py", 504, module="triton.knobs")
        warnings.warn_explicit("Compiling the align failed; running it eagerly.", UserWarning, "compiled.py", 1, module="surgery.core.compiled")
        warnings.warn_explicit("use the new API", DeprecationWarning, "copyreg.py", 1, module="copyreg")
    assert [str(w.message) for w in caught] == ["Compiling the align failed; running it eagerly."]


def test_a_real_run_off_a_terminal_is_quiet_and_its_json_parses(stories_path):
    """The console script as a pipe sees it: stdout one JSON document, stderr without transformers'
    GGUF tqdm bar (carriage returns in a log) or any library warning."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(sys.executable).parent / "surgery"
    proc = subprocess.run([str(script), "inspect", "--model", str(stories_path), "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["layers"] == 5
    for noise in ("Warning", "de-quantizing", "\r"):
        assert noise not in proc.stderr, proc.stderr

