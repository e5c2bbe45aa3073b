"""The bench harness runs: every entry point answers --help, and the smoke modes of bench/speed.py and
bench/quality.py measure stories260K on the CPU and print rows in the one format (bench/harness.py)."""
from __future__ import annotations

import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import harness, quality, speed  # noqa: E402
from tests.cli_checks import invoke  # noqa: E402

ENTRY_POINTS = ("speed.py", "quality.py", "recovery.py", "sweep.py", "lm_eval_task.py")


@pytest.mark.parametrize("script", ENTRY_POINTS)
def test_help(script, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(ROOT / "bench" / script), run_name="__main__")
    assert stop.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_gpu_script_usage():
    done = subprocess.run(["bash", str(ROOT / "bench/gpu.sh")], capture_output=True, text=True)
    assert done.returncode == 2 and "pack" in done.stderr and "wait NAME SECONDS" in done.stderr


def check_rows(rows, path: Path) -> None:
    """Every row has the one format, each JSON line equals its row, and anchored rows carry a ratio."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == rows.rows and lines
    for row in lines:
        assert set(harness.COLUMNS) <= set(row)
        assert row["value"] is not None and row["value"] > 0, row
        if row["anchor"] is not None:
            better_lower = row["unit"] in harness.LOWER_IS_BETTER
            expected = row["anchor_value"] / row["value"] if better_lower else row["value"] / row["anchor_value"]
            assert row["ratio"] == pytest.approx(expected)


def test_rows_format(tmp_path, capsys):
    rows = harness.Rows(str(tmp_path / "r.jsonl"))
    rows.add("a", "cfg", "prefill", 2.0, "ms", ("anchor", 4.0))
    rows.add("b", "cfg", "decode", 300.0, "tokens/s", ("anchor", 100.0))
    out = capsys.readouterr().out
    assert "| name | config | metric | value | unit | anchor | ratio |" in out
    assert "| a | cfg | prefill | 2 | ms | anchor 4 | 2.00x |" in out and "| b | cfg | decode | 300 | tokens/s | anchor 100 | 3.00x |" in out
    check_rows(rows, tmp_path / "r.jsonl")


def test_speed_smoke(tmp_path, capsys):
    out = tmp_path / "speed.jsonl"
    rows = speed.main(["--smoke", "--sections", "prefill,generate,decode", "--shapes", "24x1", "--decode-batches", "1",
                       "--decode-compile", "off", "--decode-context", "16", "--generate-lengths", "16", "--repeats", "1",
                       "--json", str(out)])
    check_rows(rows, out)
    names = {(r["name"], r["metric"]) for r in rows.rows}
    assert ("transformers forward (teacher)", "prefill") in names
    assert ("hybrid 75% GDN: fast_logits (default)", "prefill") in names and ("teacher fast_logits, compiled", "prefill") in names
    assert ("hybrid 75% GDN: surgery.generate (surgery.load)", "time to first token") in names
    assert ("hybrid 75% GDN: Decoder (surgery.load)", "decode step") in names
    assert "| hybrid 75% GDN: Decoder (surgery.load) | context 16 x 1, compile off | decode step |" in capsys.readouterr().out


def in_process_cli(*args: str, env=None) -> dict:
    """`surgery ...` in this process (a subprocess would import torch again: seconds per call)."""
    result = invoke(CliRunner(), *args)
    assert result.exit_code == 0, result.output
    return json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])


def test_quality_smoke(tmp_path, monkeypatch):
    monkeypatch.setattr(quality, "surgery_cli", in_process_cli)
    out = tmp_path / "quality.jsonl"
    rows = quality.main(["--smoke", "--rows", "baseline,phase1", "--json", str(out)])
    check_rows(rows, out)
    by = {(r["name"], r["metric"]): r for r in rows.rows}
    assert by[("teacher", "calibration_sample.txt ppl, surgery eval")]["ratio"] == pytest.approx(1.0, rel=1e-4)
    saved = by[("phase1", "calibration_sample.txt ppl, surgery.save -> surgery eval")]
    assert saved["anchor"] == "in memory" and saved["ratio"] == pytest.approx(1.0, rel=5e-3)
    phase1 = by[("phase1", "calibration_sample.txt ppl, in memory")]
    assert phase1["anchor"] == "baseline" and phase1["ratio"] > 1  # Phase 1 beats the copy-only baseline


def test_apply_phases_times_every_phase(tmp_path, stories_path):
    """bench/apply_phases.py runs `surgery apply` as the CLI does and adds up each phase's time; the
    phases and the rest add up to the total, and the hybrid is written."""
    out = tmp_path / "hybrid"
    done = subprocess.run([sys.executable, str(ROOT / "bench/apply_phases.py"), "--", "--model", str(stories_path),
                           "--passes", "select,replace", "--layers", "1", "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = {line[:28].strip(): line[28:].split() for line in done.stderr.split("phase")[-1].splitlines()[1:] if line.strip()}
    for phase in ("import cli", "gguf header (check_gguf)", "transformers weights", "torch.export", "find_sites",
                  "pass replace", "diff", "save", "other", "total"):
        assert phase in rows, (phase, done.stderr[-2000:])
    wall = [float(r[0]) for name, r in rows.items() if name != "total"]
    assert sum(wall) == pytest.approx(float(rows["total"][0]), abs=0.1) and (out / "recipe.json").is_file()
