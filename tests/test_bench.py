"""The bench harness runs: bench/ has at most 8 entry points, each named in harness.py's docstring and
answering --help, and the smoke modes of bench/speed.py (prefill with --profile and the `surgery apply`
hybrid, generate, decode, fsdp) and bench/quality.py (the ablation, --mixers) measure stories260K on
the CPU and print rows in the one format (bench/harness.py)."""
from __future__ import annotations

import importlib.util
import json
import os
import runpy
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import harness, quality, speed  # noqa: E402
from tests.cli_checks import invoke  # noqa: E402

ENTRY_POINTS = ("speed.py", "quality.py", "recovery.py", "sweep.py", "lm_eval_task.py")


def test_at_most_eight_entry_points_each_listed_in_the_harness():
    """An entry point: a shell script, or a Python file run as __main__ (modules, harness.py included, are not)."""
    found = sorted(p.name for p in (ROOT / "bench").iterdir()
                   if p.suffix == ".sh" or (p.suffix == ".py" and 'if __name__ == "__main__"' in p.read_text()))
    assert set(ENTRY_POINTS) <= set(found) and len(found) <= 8, found
    for name in found:
        assert f"bench/{name}" in harness.__doc__, name


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


def test_gpu_wait_refuses_a_job_this_machine_never_ran(tmp_path):
    """A poll on a fresh machine (the one that ran the job was released) says so at once instead of
    sleeping out its whole limit, which cost a session 575 s of device time."""
    env = {**os.environ, "BG_DIR": str(tmp_path)}
    done = subprocess.run(["bash", str(ROOT / "bench/gpu.sh"), "wait", "rec", "60"], capture_output=True, text=True,
                          env=env, timeout=30)
    assert done.returncode == 4 and "released" in done.stderr


def test_gpu_wait_brings_back_what_the_run_wrote(tmp_path):
    env = {**os.environ, "BG_DIR": str(tmp_path / "bg"), "OUT": str(tmp_path / "out")}
    (tmp_path / "out").mkdir()
    script = str(ROOT / "bench/gpu.sh")
    records = tmp_path / "records.jsonl"
    subprocess.run(["bash", script, "start", "rec", "bash", "-c", f"echo '{{}}' > {records}"], env=env, check=True,
                   capture_output=True)
    done = subprocess.run(["bash", script, "wait", "rec", "20", str(records), str(tmp_path / "absent")],
                          capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if p.suffix != ".gpu") == ["rec.log", "records.jsonl"]


def test_gpu_start_samples_the_gpu_while_the_run_lasts(tmp_path):
    """Where there is an nvidia-smi, `start` runs its dmon beside the job into NAME.gpu, stops it when the job
    ends, and `wait` brings the samples back (a figure read while the SM clock had dropped shows in them)."""
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "nvidia-smi").write_text('#!/usr/bin/env bash\necho "# args: $*"\nwhile true; do echo sample; sleep 0.1; done\n')
    (tools / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "BG_DIR": str(tmp_path / "bg"), "OUT": str(tmp_path / "out"), "PATH": f"{tools}{os.pathsep}{os.environ['PATH']}"}
    (tmp_path / "out").mkdir()
    script = str(ROOT / "bench/gpu.sh")
    subprocess.run(["bash", script, "start", "rec", "sleep", "0.5"], env=env, check=True, capture_output=True)
    done = subprocess.run(["bash", script, "wait", "rec", "20"], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0 and "rec ended with status 0" in done.stdout, done.stderr
    samples = (tmp_path / "out" / "rec.gpu").read_text()
    assert "# args: dmon -s pc -d 1 -o T" in samples and "sample" in samples
    written = (tmp_path / "bg" / "rec.gpu").stat().st_size
    time.sleep(0.5)
    assert (tmp_path / "bg" / "rec.gpu").stat().st_size == written  # the sampler stopped with the job


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


def in_process_cli(*args: str, env=None) -> dict:
    """`surgery ...` in this process (a subprocess would import torch again: seconds per call)."""
    result = invoke(CliRunner(), *args)
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def test_the_cuda_warm_up_takes_at_most_the_calls_a_caller_reserves(monkeypatch):
    """A decode step uses a cache position a call: the warm-up before the timed steps (up to WARM_SECONDS on
    CUDA) must stop at the positions the bench reserved for it (on the GPU it ran past a 64k cache's end)."""
    calls = []
    monkeypatch.setattr(harness, "sync", lambda device: None)
    monkeypatch.setattr(harness, "WARM_SECONDS", 60.0)
    harness.median_ms(lambda: calls.append(1), "cuda", repeats=5, warmup=3, warm_calls=7)
    assert len(calls) == 3 + 7 + 5
    assert speed.step_positions(speed.arguments(["--random", "--decode-steps", "32"])) >= 3 + speed.WARM_STEPS + 32


def test_speed_smoke(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(speed, "surgery_cli", in_process_cli)
    out = tmp_path / "speed.jsonl"
    rows = speed.main(["--smoke", "--sections", "prefill,generate,decode,host", "--shapes", "24x1", "--decode-batches", "1",
                       "--decode-compile", "off", "--decode-context", "16", "--generate-lengths", "16", "--repeats", "1",
                       "--decode-mixers", "mamba2", "--profile", "--casts", "--prefill-off",
                       "SURGERY_STATE_SPLITS,SURGERY_CHUNK_STATES=on+SURGERY_PDL=on", "--decode-off", "SURGERY_GDN_TAIL=off",
                       "--json", str(out)])
    check_rows(rows, out)
    names = {(r["name"], r["metric"]) for r in rows.rows}
    assert ("transformers forward (teacher)", "prefill") in names
    assert ("hybrid 75% GDN: fast_logits (default)", "prefill") in names and ("teacher fast_logits, compiled", "prefill") in names
    assert ("hybrid 75% GDN: fast_logits, compiled", "prefill") in names and ("teacher fast_logits (default)", "prefill") in names
    off = next(r for r in rows.rows if r["name"] == "hybrid 75% GDN: fast_logits (default), SURGERY_STATE_SPLITS=off")
    assert off["anchor"] == "compiled teacher" and "SURGERY_STATE_SPLITS" not in os.environ  # --prefill-off, restored after
    assert any(r["name"] == "hybrid 75% GDN: fast_logits (default), SURGERY_CHUNK_STATES=on+SURGERY_PDL=on" for r in rows.rows)
    assert "SURGERY_CHUNK_STATES" not in os.environ and "SURGERY_PDL" not in os.environ
    host = [r for r in rows.rows if r["metric"] == "host"]  # the CPU's host work of a replayed call, replay stubbed
    assert len(host) == 2 and all(0 < r["value"] < 1e5 for r in host) and speed.compiled_routes.ROUTES.get(("cpu", "eval")) is None
    applied = next(r for r in rows.rows if r["name"] == "hybrid 75% GDN: surgery apply -> surgery.load, fast_logits (default)")
    assert applied["anchor"] == "surgery.save -> load"
    assert ("hybrid 75% GDN: surgery.generate (surgery.load)", "time to first token") in names
    assert ("hybrid 75% GDN: Decoder (surgery.load)", "decode step") in names
    switched = [r for r in rows.rows if r["name"] == "hybrid 75% GDN: Decoder, SURGERY_GDN_TAIL=off"]  # --decode-off
    assert {r["anchor"] for r in switched} == {"default", "teacher Decoder"} and "SURGERY_GDN_TAIL" not in os.environ
    assert ("hybrid 75% GDN: default route without the fusions", "prefill") in names and ("teacher graph: Decoder without the fusions", "decode step") in names
    caches = next(r for r in rows.rows if r["name"] == "hybrid 75% mamba2: Decoder caches")  # --decode-mixers
    assert caches["anchor"] == "teacher" and caches["ratio"] > 1 and ("hybrid 75% mamba2: Decoder (surgery.load)", "decode step") in names
    printed = capsys.readouterr().out
    assert "| hybrid 75% GDN: Decoder (surgery.load) | context 16 x 1, compile off | decode step |" in printed
    top = printed.split("top 25 CPU ops of ")[1].split("|---|---:|---:|\n")[1].splitlines()[:25]  # --profile's table (the teacher's first)
    assert all(line.startswith("| ") and line.count(" | ") == 2 and float(line.split(" | ")[2].rstrip(" |")) >= 0 for line in top), top
    census = printed.split("default route, eager (not replayed), 24 x 1: ")[-1]  # --casts: the GDN kernels' chunk copies, by line
    assert "| kernels.py:" in census and "| graph: torch.ops.aten." in census


def test_speed_fsdp_smoke(tmp_path, monkeypatch):
    """The fsdp section (each row's child run in this process): plain is every row's anchor, and each
    mode reports the largest batch that fit."""
    monkeypatch.setattr(speed, "fsdp_child", lambda args, spec: speed.fsdp_one(spec))
    out = tmp_path / "fsdp.jsonl"
    rows = speed.main(["--smoke", "--sections", "fsdp", "--fsdp-modes", "fsdp_offload,plain,fsdp_teacher", "--fsdp-batches", "2",
                       "--fsdp-steps", "2", "--fsdp-seq-len", "32", "--json", str(out)])
    check_rows(rows, out)
    training = [r for r in rows.rows if r["metric"] == "training"]
    assert [r["mode"] for r in training] == ["plain", "fsdp_offload", "fsdp_teacher"]  # plain first: the anchor
    offload = training[1]
    assert offload["anchor"] == "plain" and offload["tokens_per_s"] == offload["value"] and offload["batch"] == 2
    assert training[2]["loss"] == pytest.approx(training[0]["loss"], rel=1e-5)  # the sharded teacher gives the same targets
    largest = [r for r in rows.rows if r["metric"] == "largest batch that fits"]
    assert [r["value"] for r in largest] == [2, 2, 2] and largest[1]["anchor"] == "plain"


def test_speed_fsdp_rows_on_two_processes(tmp_path):
    """--fsdp-procs 1,2: each row's child runs for real, the second under torchrun (two gloo processes);
    the 2-process row is anchored to the same mode and batch on one, reports the largest rank's peak,
    and trains the same steps (rank 0's final loss equals the one process's)."""
    out = tmp_path / "fsdp.jsonl"
    rows = speed.main(["--smoke", "--sections", "fsdp", "--fsdp-modes", "fsdp", "--fsdp-batches", "2", "--fsdp-procs", "1,2",
                       "--fsdp-steps", "2", "--fsdp-seq-len", "32", "--json", str(out)])
    check_rows(rows, out)
    one, two = [r for r in rows.rows if r["metric"] == "training"]
    assert (one["world"], two["world"]) == (1, 2) and one["value"] and two["value"], (one, two)
    assert two["config"] == "fsdp on 2 processes, 2 x 32" and two["anchor"] == "1 process(es)" and two["anchor_value"] == one["value"]
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-4) and "peak_rss_gib" in two
    assert [r["value"] for r in rows.rows if r["metric"] == "largest batch that fits"] == [2, 2]


def test_speed_refuses_an_unknown_fsdp_mode(capsys):
    with pytest.raises(SystemExit):
        speed.main(["--smoke", "--sections", "fsdp", "--fsdp-modes", "plain,zero3"])
    assert "unknown fsdp mode(s) zero3; known: plain, fsdp, fsdp_offload" in capsys.readouterr().err


def test_speed_cuda_only_sections_say_so_on_the_cpu(capsys, monkeypatch):
    """step_attention, floors and state_splits time CUDA kernels: on the CPU one line says so, no stack trace."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU's answer on any machine
    for section in ("floors", "step_attention", "state_splits"):
        with pytest.raises(SystemExit):
            speed.main(["--sections", section])
        assert f"section(s) {section} time CUDA kernels; this machine has no CUDA device" in capsys.readouterr().err


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
    for phase in ("import torch", "import transformers", "import the CLI (the rest)", "gguf header (check_gguf)", "transformers weights", "torch.export", "find_sites",
                  "pass replace", "diff", "save", "other", "total"):
        assert phase in rows, (phase, done.stderr[-2000:])
    wall = [float(r[0]) for name, r in rows.items() if name != "total"]
    assert sum(wall) == pytest.approx(float(rows["total"][0]), abs=0.1) and (out / "recipe.json").is_file()


def test_quality_mixers_smoke(tmp_path, monkeypatch):
    """--mixers: per mixer, perplexity, block error and decode state bytes (anchored to the copy-only
    baseline and the teacher), through save, and `surgery apply --set replace.mixer=M` -> `surgery eval`."""
    monkeypatch.setattr(quality, "surgery_cli", in_process_cli)
    out = tmp_path / "mixers.jsonl"
    rows = quality.main(["--smoke", "--mixers", "gdn,swa", "--rows", "baseline,phase1+2", "--cli-apply", "--json", str(out)])
    check_rows(rows, out)
    by = {(r["name"], r["config"], r["metric"]): r for r in rows.rows}
    for mixer in ("gdn", "swa"):
        config = f"keep 0.50, uniform, {mixer}"
        state = by[("baseline", config, "decode state, context 256")]
        assert state["anchor"] == "teacher" and state["ratio"] > 1  # fewer bytes than the teacher's KV cache
        assert by[("phase1+2", config, "block error, 2 x 128 tokens")]["anchor"] == "baseline"
        applied = by[("phase1+2", config, "calibration_sample.txt ppl, surgery apply -> surgery eval")]
        assert applied["anchor"] == "in memory"
    gdn = by[("phase1+2", "keep 0.50, uniform, gdn", "block error, 2 x 128 tokens")]
    assert gdn["ratio"] > 1.5  # Taylor-Calibrate cuts the converted blocks' error well below copy-only's


def test_quality_retrieval_rows_anchor_to_the_teacher(tmp_path, monkeypatch):
    """--retrieval: a row per task and length (each clipped to what the model holds), in percent, anchored
    to the teacher's accuracy where it has one. The task is replaced by one whose answers are known (the
    tiny teacher answers none), so the rows can be checked against them."""
    import surgery.eval.passkey as passkey_module

    calls = []

    def fake_passkey(graph, filler_files, lengths, depths, trials_per_depth, seed, batch_size=8):
        calls.append((list(lengths), depths, trials_per_depth))
        by_length = {"300": 0.6, "496": 0.0} if len(calls) == 1 else {"300": 0.3, "496": 0.2}
        return {"by_length": by_length, "trials": depths * trials_per_depth * len(lengths)}

    monkeypatch.setattr(passkey_module, "passkey", fake_passkey)
    monkeypatch.setattr(quality, "surgery_cli", in_process_cli)
    rows = quality.main(["--smoke", "--mixers", "swa", "--rows", "baseline", "--retrieval", "passkey",
                         "--retrieval-lengths", "300,1000", "--retrieval-trials", "10", "--json", str(tmp_path / "r.jsonl")])
    assert calls == [([300, 496], 5, 2)] * 2  # the teacher first, then the row; 1000 clipped to 512 - 16
    by = {(r["name"], r["metric"]): r for r in rows.rows if r["unit"] == "% correct"}
    assert by[("teacher", "passkey at 300")]["value"] == pytest.approx(60) and by[("teacher", "passkey at 300")]["anchor"] is None
    row = by[("baseline", "passkey at 300")]
    assert row["value"] == pytest.approx(30) and row["anchor"] == "teacher" and row["ratio"] == pytest.approx(0.5)
    assert by[("baseline", "passkey at 496")]["anchor"] is None and by[("baseline", "passkey at 496")]["trials"] == 10


def test_quality_retrieval_refuses_an_unknown_task():
    with pytest.raises(SystemExit):
        quality.arguments(["--smoke", "--retrieval", "needle"])


def test_quality_kernel_check_needs_cuda():
    with pytest.raises(SystemExit, match="--kernel-check compares fla's CUDA kernels"):
        quality.main(["--kernel-check", "--device", "cpu"])


def test_quality_set_accumulates_after_the_smoke_settings():
    """Every --set counts, after --smoke's own (a repeated --set used to keep only the last)."""
    args = quality.arguments(["--smoke", "--set", "select.policy=convert", "--set", "select.layers=1,3", "align.steps=3"])
    passes, configs = quality.row_configs(args, "phase1+2", 0.5, "uniform", "gla")
    assert configs["select"]["policy"] == "convert" and configs["select"]["layers"] == "1,3"
    assert configs["align"]["steps"] == "3" and configs["calibrate"]["samples"] == "2" and configs["replace"]["mixer"] == "gla"


def test_stochastic_matmuls_round_to_a_neighbouring_bf16_value():
    """quality.py --decode-agreement's stand-in for the GPU's rounding: each bf16 matmul result is one of the
    two bf16 values around the float32 product (so within one bf16 step of it), not always the nearest."""
    import torch

    from bench.mixer_agreement import StochasticMatmuls

    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(64, 64, generator=gen).bfloat16() for _ in range(2))
    exact = a.float() @ b.float()
    with StochasticMatmuls(0):
        got = (a @ b).float()
    down = (exact.view(torch.int32) & ~0xFFFF).view(torch.float32)
    up = ((exact.view(torch.int32) & ~0xFFFF) + 0x10000).view(torch.float32)
    assert bool(((got == down) | (got == up)).all())
    assert not torch.equal(got, exact.bfloat16().float())


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed (a CUDA-side extra)")
def test_speed_registers_section():
    """tcal's GDN prefill kernels and the one-launch decode layer (both forms) compiled for sm_90a without a GPU: a row of registers
    and spills for each, no tile spilled."""
    rows = speed.main(["--sections", "registers", "--registers-pdl"])
    registers = {r["name"]: r["value"] for r in rows.rows if r["metric"] == "registers"}
    spills = {r["name"]: r["value"] for r in rows.rows if r["metric"] == "spill stores"}
    assert len(registers) == len(spills) == 10 and all(0 < n <= 255 for n in registers.values()), registers
    assert all(n <= 8 for n in spills.values()), spills  # a register or two at the 255 cap is ptxas' choice; a spilled tile is hundreds
