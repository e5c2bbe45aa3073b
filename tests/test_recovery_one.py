"""Issue 30's modes of bench/recovery.py on stories260K, CPU, tiny budgets: one init per call
(--init) appending to one records file, the table of both (--table, a pure function of the records,
checked against an independent interpolation), --resume only where the checkpoint is on this
machine (else one "start over" line, exit 2), and the recipe study (--recipes)."""
from __future__ import annotations

import argparse
import json
import math
import runpy
import socket
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import recovery_points as points  # noqa: E402
from surgery.errors import DistillError  # noqa: E402

STORIES = ROOT / "tests/assets/stories260k/stories260K.gguf"
SAMPLE = ROOT / "surgery/data/calibration_sample.txt"
FAST_TCAL = ["calibrate.samples=2", "calibrate.length=64", "align.samples=2", "align.length=64", "align.steps=2"]


def bench(monkeypatch, capsys, *args: str) -> tuple[int, str]:
    """bench/recovery.py ARGS in this process -> (exit code, stdout)."""
    monkeypatch.setattr(sys, "argv", ["recovery.py", *map(str, args)])
    code = 0
    try:
        runpy.run_path(str(ROOT / "bench/recovery.py"), run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
        if not isinstance(stop.code, int) and stop.code is not None:
            print(stop.code)
    return code, capsys.readouterr().out


def init_args(out: Path, init: str, *extra: str) -> list:
    """A run of 3 steps of 4 x 32 tokens, evaluated every step; a target (0.5x) it cannot reach."""
    return ["--init", init, "--model", STORIES, "--data", SAMPLE, "--eval", SAMPLE, "--tokens", 384, "--seq-len", 32,
            "--global-batch", 4, "--eval-every", 128, "--eval-tokens", 256, "--passkey-lengths", "300,400", "--passkey-trials", 5,
            "--lr", 3e-3, "--stop-multiple", 0.5, "--out", out, *extra]


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """Both inits, one call each, into one records file."""
    out = tmp_path_factory.mktemp("recovery")
    with pytest.MonkeyPatch.context() as mp:
        for init, extra in (("baseline", []), ("tcal", ["--retrieval", "passkey,multikey", "--set", *FAST_TCAL])):
            mp.setattr(sys, "argv", ["recovery.py", *map(str, init_args(out, init, *extra))])
            runpy.run_path(str(ROOT / "bench/recovery.py"), run_name="__main__")
    return out, [json.loads(line) for line in (out / "recovery.jsonl").read_text().splitlines()]


def reference_tokens(curve, target):
    """Independent: where log-perplexity, linear between evaluations, first reaches log(target)."""
    t = np.array([c[0] for c in curve], float)
    lp = np.log([c[1] for c in curve])
    below = np.nonzero(lp <= math.log(target))[0]
    if not below.size:
        return None
    i = below[0]
    return float(t[0]) if i == 0 else float(np.interp(math.log(target), lp[i - 1:i + 1][::-1], t[i - 1:i + 1][::-1]))


def test_crossing_and_end_rate_against_references():
    curve = [(0, 100.0), (10, 60.0), (20, 50.0), (30, 47.0)]
    for target in (120.0, 80.0, 60.0, 55.0, 48.0, 40.0):
        expected = reference_tokens(curve, target)
        got = points.crossing(curve, target)
        assert (got is None) == (expected is None) and (got is None or got == pytest.approx(expected))
    slope = np.polyfit([10, 20, 30], [60.0, 50.0, 47.0], 1)[0]
    assert points.end_rate(curve) == pytest.approx(slope * 1e7)
    assert points.end_rate(curve[:1]) is None
    runs = {"baseline": {"teacher_ppl": 20.830001, "layers": [0, 1]}, "tcal": {"teacher_ppl": 20.83, "layers": [0, 1]}}
    assert points.differences(runs) == []
    runs["tcal"] |= {"teacher_ppl": 20.9, "layers": [0, 2]}
    assert points.differences(runs) == ["layers", "teacher_ppl"]
    row = points.target_rows(curve, 40.0, (1.0,))[0]
    assert points.describe(row) == f"not reached in 3e-05M ({slope * 1e7:+.3g} ppl / 10M at 47.00)"
    base = {"tokens": 9e6, "trained_tokens": 9.4e6}
    assert points.ratio(base, {"tokens": None, "trained_tokens": 2.6e7}) == "< 0.35x (TC not reached)"
    assert points.ratio(base, {"tokens": None, "trained_tokens": 0}) == "TC not trained yet"  # the Gemma stay's ZeroDivisionError


def test_one_init_per_call_appends_and_the_table_compares(both, monkeypatch, capsys):
    out, records = both
    runs = points.latest_runs(records)
    assert set(runs) == {"baseline", "tcal"} and len({r["run_id"] for r in runs.values()}) == 2
    for run in runs.values():
        assert run["stopped"] == "budget" and run["curve"][-1][0] == 384 and [t for t, _ in run["curve"]] == [0, 128, 256, 384]
    assert points.differences(runs) == []  # same recipe, seed, layers and teacher: a fair comparison
    # passkey rows: the teacher once, each init at init and at the end (crossings: none below 0.5x... unless at 1.5x / 1.3x)
    pk = [(r["model"], r["point"]) for r in records if r["kind"] == "passkey"]
    assert {(r["model"], r["point"]) for r in records if r["kind"] == "multikey"} >= {("teacher", "teacher"), ("tcal", "init"), ("tcal", "end")}
    assert pk.count(("teacher", "teacher")) == 1
    for init in ("baseline", "tcal"):
        assert (init, "init") in pk and (init, "end") in pk
        assert all(r["trials_per_length"] == 5 and set(r["by_length"]) == {"300", "400"} for r in records if r["kind"] in ("passkey", "multikey"))
    init_rows = [r for r in records if r["kind"] in ("passkey", "multikey") and r["point"] == "init"]
    assert init_rows and all(r["warm_seconds"] > 0 for r in init_rows)  # the reserve's measure, beside the first pass
    crossed = {(r["init"], r["point"]) for r in records if r["kind"] == "crossing"}
    assert crossed and crossed <= set(pk)  # each crossing (Taylor-Calibrate's, here) has its passkey row
    assert not list(out.glob("*snapshot*"))  # the weights saved at a crossing go once scored
    code, text = bench(monkeypatch, capsys, "--table", out / "recovery.jsonl", "--plot", out / "curves.png")
    assert code == 0
    drawn = out / "curves.png"  # matplotlib is not a dependency: without it, one line says so
    assert (drawn.exists() and drawn.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n") or "matplotlib is not installed: no curves.png" in text
    assert "\n".join(points.targets_table(records)) in text and "| passkey: model | point | tokens | 300 | 400 |" in text and "| multikey: model | point | tokens | 300 | 400 |" in text
    teacher = runs["tcal"]["teacher_ppl"]
    for m in points.MULTIPLES:
        b, t = (reference_tokens(runs[i]["curve"], teacher * m) for i in ("baseline", "tcal"))
        line = next(x for x in text.splitlines() if x.startswith(f"| {m}x"))
        if b is not None and t:
            assert f"{b / t:.2f}x" in line
        if t is None:
            assert "not reached in 0.000384M" in line.split("|")[3]


def test_resume_only_on_this_machine(both, monkeypatch, capsys, tmp_path):
    out, _ = both
    code, text = bench(monkeypatch, capsys, *init_args(tmp_path / "elsewhere", "baseline", "--resume"))
    assert code == 2 and text.strip().count("\n") == 0 and text.startswith("start over: no run of baseline")
    marker = out / "distill-baseline.host.json"
    saved = marker.read_text()
    marker.write_text(json.dumps(json.loads(saved) | {"host": "another-machine"}))
    try:
        code, text = bench(monkeypatch, capsys, *init_args(out, "baseline", "--resume"))
    finally:
        marker.write_text(saved)
    assert code == 2 and text.strip() == f"start over: the run in {out / 'distill-baseline'} was written on another-machine, this is {socket.gethostname()}"
    code, text = bench(monkeypatch, capsys, *init_args(out, "baseline", "--resume"))  # it ended by its budget
    assert code == 0 and text.startswith("nothing to resume: baseline-") and "ended (budget) after 384 tokens" in text
    records = out / "recovery.jsonl"
    kept = records.read_text()
    lines = [line for line in kept.splitlines() if not ('"kind": "run"' in line and '"init": "baseline"' in line)]
    records.write_text("\n".join(lines) + "\n")  # as if the call had been cut off before its run record
    try:
        code, text = bench(monkeypatch, capsys, *init_args(out, "baseline", "--resume"))
        assert code == 0 and "baseline: stopped by budget after 384 tokens" in text
        run = points.latest_runs([json.loads(line) for line in records.read_text().splitlines()])["baseline"]
        assert run["curve"][-1][0] == 384 and run["run_id"] == json.loads(marker.read_text())["run_id"]
    finally:
        records.write_text(kept)


def test_a_deadline_already_past_fails_before_any_model_loads(monkeypatch, capsys, tmp_path):
    code, text = bench(monkeypatch, capsys, *init_args(tmp_path, "baseline", "--deadline-s", 30, "--reserve-s", 3600))
    assert code == 1 and text.strip().startswith("--deadline-s 30 is already past") and not (tmp_path / "recovery.jsonl").exists()
    monkeypatch.setattr(sys, "argv", ["recovery.py", *map(str, init_args(tmp_path, "baseline", "--plot", tmp_path / "c.png"))])
    with pytest.raises(SystemExit) as stop:  # --plot without --table: argparse's one line, nothing run
        runpy.run_path(str(ROOT / "bench/recovery.py"), run_name="__main__")
    assert stop.value.code == 2 and "--plot draws the curves of a records file" in capsys.readouterr().err


def test_the_deadline_takes_off_what_opening_the_run_took(monkeypatch, capsys, tmp_path):
    """--deadline-s counts from the process's start: the training time is set again when the run has opened
    (data, models), so a slow open shortens training instead of running past the deadline."""
    import time

    from bench import recovery_one

    limits, real = {}, recovery_one.distill

    def slow_open(model, data, out, config, *, on_open, **kwargs):
        limits["asked"] = config.time_limit
        time.sleep(1.0)  # an open that takes a second

        def opened(student):
            on_open(student)
            limits["opened"] = config.time_limit
        return real(model, data, out, config, on_open=opened, **kwargs)

    monkeypatch.setattr(recovery_one, "distill", slow_open)
    code, _ = bench(monkeypatch, capsys, *init_args(tmp_path, "baseline", "--deadline-s", 3600, "--reserve-s", 0, "--passkey-lengths", "300",
                                                    "--passkey-trials", 1))
    assert code == 0 and limits["asked"] - 60 < limits["opened"] <= limits["asked"] - 1.0


def test_recipes_run_both_inits_at_equal_tokens(both, monkeypatch, capsys, tmp_path):
    out, _ = both
    recipes = tmp_path / "recipes.json"
    recipes.write_text(json.dumps([{"name": "constant"}, {"name": "gates held", "freeze_gates_steps": 1, "schedule": "cosine"}]))
    args = init_args(out, "baseline")[2:]  # the same recipe of the command line, no --init
    code, text = bench(monkeypatch, capsys, "--recipes", recipes, *args, "--set", *FAST_TCAL, "--records", tmp_path / "r.jsonl",
                       "--recipe-retrieval", "--passkey-lengths", "300", "--passkey-trials", 5)
    assert code == 0, text
    rows = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    recipe_rows = [r for r in rows if r["kind"] == "recipe"]
    assert [(r["recipe"], r["init"]) for r in recipe_rows] == [("constant", "baseline"), ("constant", "tcal"),
                                                               ("gates held", "baseline"), ("gates held", "tcal")]
    assert all(r["curve"][-1][0] == 384 for r in recipe_rows)
    passkey = {(r["model"], r["point"]): r["by_length"] for r in rows if r["kind"] == "passkey"}
    assert set(passkey) == {(i, f"recipe: {n}") for i in ("baseline", "tcal") for n in ("constant", "gates held")}
    table = points.recipe_table(rows)
    assert "\n".join(table) in text and table[0].endswith("retrieval at the end, baseline | TC |")
    line = next(x for x in table if x.startswith("| gates held |"))
    want = [f"{100 * passkey[(i, 'recipe: gates held')]['300']:.0f}% passkey" for i in ("baseline", "tcal")]
    assert [c.strip() for c in line.split("|")[-3:-1]] == want
    saved = {r["init"]: r["saved_ppl"] for r in recipe_rows if r["recipe"] == "gates held"}  # the checkpoint from disk, whole eval text
    assert all(math.isfinite(v) and v > 1 for v in saved.values())
    assert [c.strip() for c in line.split("|")[-5:-3]] == [f"{saved[i]:.3f}" for i in ("baseline", "tcal")]
    for indices in ("2", "0,0", "a"):  # --recipe-indices outside the file, twice, or not numbers: one line, nothing built
        code, text = bench(monkeypatch, capsys, "--recipes", recipes, *args, "--recipe-indices", indices, "--out", tmp_path / "no")
        assert code == 1 and text.startswith(f"--recipe-indices {indices}:") and not (tmp_path / "no").exists()
    recipes.write_text(json.dumps([{"name": "x", "tokens": 5}]))
    code, text = bench(monkeypatch, capsys, "--recipes", recipes, *args)
    assert code == 1 and "equal tokens" in text


def test_the_recipe_table_reads_the_saving_at_the_baselines_final_perplexity():
    """A short study where the TC init starts below every target the baseline reaches: the saving is
    read where the baseline ended (interpolated in log-perplexity, as crossing does)."""
    def run(init, curve):
        return {"kind": "recipe", "recipe": "r", "init": init, "curve": curve, "teacher_ppl": 10.0}
    baseline = run("baseline", [[0, 200.0], [1_000_000, 60.0], [2_000_000, 40.0]])
    slow_tc = run("tcal", [[0, 50.0], [500_000, 45.0]])
    for tc, want in ((run("tcal", [[0, 45.0], [500_000, 30.0], [1_000_000, 25.0]]), None),
                     (run("tcal", [[0, 39.0], [500_000, 30.0]]), "0M (TC starts there)"),
                     (slow_tc, "not reached (45.00 > 40.00)")):
        line = next(x for x in points.recipe_table([baseline, tc]) if x.startswith("| r |"))
        cell = line.split("|")[8].strip()
        if want is None:
            tokens = 500_000 * math.log(45 / 40) / math.log(45 / 30)
            want = f"{tokens / 1e6:.3g}M ({2_000_000 / tokens:.1f}x)"
        assert cell == want
    assert points.targets_table([baseline, slow_tc]) == []  # a study's records: no "run --init" hint above its table


def test_the_shipped_recipe_study_is_valid():
    """bench/recipes30.json (issue 30's study) parses and every recipe passes DistillConfig's checks
    at the GPU command's scale (128 x 512 tokens a step, 4M tokens)."""
    from types import SimpleNamespace

    from bench.recovery_one import run_config
    from bench.recovery_recipes import read_recipes

    args = SimpleNamespace(seq_len=512, global_batch=128, tokens=4 * 2**20, schedule="constant", warmup=0.0, eval="wiki.test.raw",
                           eval_tokens=32768, eval_every=262144, save_every=None, seed=0, lr=2e-4, lr_rest=1.4e-5, micro_batch=None,
                           no_compile=False)
    recipes = read_recipes(str(ROOT / "bench/recipes30.json"))
    configs = [run_config(args, 0.0, **fields) for _, fields in recipes]
    assert len({name for name, _ in recipes}) == len(recipes) >= 6
    assert {c.stage for c in configs} == {"kl", "both"} and any(c.freeze_gates_steps for c in configs)
    args.micro_batch = 64  # the GPU study's --micro-batch: every recipe's global batch must split into it, checked before any run
    assert all(run_config(args, 0.0, **fields).micro_batch for _, fields in recipes)
    with pytest.raises(DistillError, match="do not divide a global batch of 32"):
        run_config(args, 0.0, seq_len=2048, global_batch=32)


def test_the_passkey_reserve_counts_the_warm_repeat_not_the_first_pass():
    """The first pass at init compiles kernels for each length; the rows after training are warm."""
    import argparse
    from bench.recovery_one import UNKNOWN_PASSKEY_S, reserve_seconds

    args = argparse.Namespace(reserve_s=None, retrieval=["passkey", "multikey"])
    rows = [{"kind": "passkey", "point": "init", "seconds": 38.0, "warm_seconds": 4.0},
            {"kind": "passkey", "point": "end", "seconds": 3.0}]
    assert reserve_seconds(args, rows) == 3 * (4.0 + UNKNOWN_PASSKEY_S) + 30.0
    rows.append({"kind": "multikey", "point": "init", "seconds": 9.0})  # a row written before warm repeats existed
    assert reserve_seconds(args, rows) == 3 * (4.0 + 9.0) + 30.0
    assert reserve_seconds(argparse.Namespace(reserve_s=12.0, retrieval=["passkey"]), rows) == 12.0


def test_the_second_init_converts_the_layers_the_first_run_recorded():
    import argparse
    from bench.recovery_one import earlier_selection

    keep = {"policy": "keep", "layers": [0, 3, 5]}
    records = [{"kind": "passkey", "model": "teacher"},
               {"kind": "run", "init": "baseline", "run_id": "baseline-1", "teacher": "/m/t.gguf", "layers": keep}]
    ar = argparse.Namespace(select_policy="ar", model="/m/t.gguf")
    assert earlier_selection(ar, records) == keep
    assert earlier_selection(argparse.Namespace(select_policy="ar", model="/m/other.gguf"), records) is None
    assert earlier_selection(argparse.Namespace(select_policy="uniform", model="/m/t.gguf"), records) is None
    assert earlier_selection(ar, records[:1]) is None


def test_the_log_alone_holds_the_curve_and_each_crossing(tmp_path, capsys):
    """A run whose records are lost with its machine (2026-12-03) still has its curve and interpolated
    crossings in the log that each poll brings back."""
    from bench.recovery_one import Crossings, Records

    run_out = tmp_path / "distill-tcal"
    run_out.mkdir()
    (run_out / "log.jsonl").write_text(json.dumps({"step": 0, "tokens": 0, "eval_ppl": 40.0, "teacher_ppl": 20.0}) + "\n")
    args = argparse.Namespace(passkey_at="end", stop_multiple=1.2, init="tcal")
    hook = Crossings(args, run_out, Records(tmp_path / "r.jsonl"), {}, [])
    hook.open(SimpleNamespace(gm=torch.nn.Linear(2, 2)))
    curve = [(0, 40.0), (2_000_000, 35.0), (4_000_000, 28.0), (6_000_000, 25.0)]
    for tokens, ppl in curve:
        hook.step({"tokens": tokens, "eval_ppl": ppl})
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if line.startswith("eval at")] == [
        "eval at 0 tokens: perplexity 40.000 (teacher 20.000)",
        "eval at 2,000,000 tokens: perplexity 35.000 (1.750x the teacher)",
        "eval at 4,000,000 tokens: perplexity 28.000 (1.400x the teacher)",
        "eval at 6,000,000 tokens: perplexity 25.000 (1.250x the teacher)"]
    for m, tokens in ((1.5, 4_000_000), (1.3, 6_000_000)):
        at = reference_tokens(curve, 20.0 * m)
        assert f"crossed {m}x at {tokens:,} tokens ({at / 1e6:.2f}M interpolated)" in "\n".join(lines), lines


def test_a_phase1_only_init_runs_no_align_and_the_table_names_its_passes(tmp_path):
    from bench.recovery_one import build_init, init_options, pipeline
    from surgery import capture, load

    args = argparse.Namespace(init="tcal", tcal_passes="calibrate", calibration=None, data=[str(SAMPLE)],
                              set=["calibrate.samples=2", "calibrate.length=64"])
    assert pipeline(args) == ["select", "replace", "calibrate"]
    assert pipeline(argparse.Namespace(init="tcal", tcal_passes="calibrate,align")) == ["select", "replace", "calibrate", "align"]
    init_dir, _ = build_init(args, capture(str(STORIES), device="cpu"), tmp_path, {"policy": "keep", "layers": [0, 2, 4]})
    meta = load(init_dir, device="cpu").meta
    assert "calibrate" in meta and "align" not in meta
    run = {"init": "tcal", "passes": pipeline(args)}
    assert points.passes_note(run) == " (select, replace, calibrate)"
    assert points.passes_note(run | {"passes": pipeline(argparse.Namespace(init="tcal", tcal_passes="calibrate,align"))}) == ""
    assert points.passes_note(run | {"set": ["align.lr_gates=1e-3"]}) == " (select, replace, calibrate) (align.lr_gates=1e-3)"
    assert init_options(args) == ["calibrate.samples=2", "calibrate.length=64"]
    assert init_options(argparse.Namespace(init="baseline", set=["align.steps=3"])) == []
