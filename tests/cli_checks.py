"""What every CLI test needs: run a `surgery` command in-process and check a clean failure."""
from __future__ import annotations

from surgery.cli.app import app

ENV = {"COLUMNS": "240", "TERM": "dumb"}


def invoke(runner, *args):
    """`surgery ARGS...` through typer's CliRunner, with a wide fixed-width terminal."""
    return runner.invoke(app, [str(a) for a in args], env=ENV)


def assert_clean_failure(result, *words):
    """Exit code 2, one Error/Fix paragraph on stderr naming `words`, no traceback anywhere."""
    assert result.exit_code == 2, (result.exit_code, result.output)
    assert isinstance(result.exception, SystemExit)
    text = result.stdout + result.stderr
    assert "Traceback" not in text
    assert "Error:" in result.stderr and "Fix:" in result.stderr
    for w in words:
        assert w in result.stderr, f"{w!r} not in {result.stderr!r}"
