"""DistillConfig.freeze_gates_steps: the GDN gates (tcal's "gates" role) stay exactly as initialised
for the first K optimizer steps while every other trained parameter moves, then train; the option's
checks and its `surgery distill` flag."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import surgery
from surgery import PassManager
from surgery.errors import DistillError
from surgery.train import DistillConfig, distill
from surgery.train.stages import gate_parameters

TEXT = ("Once upon a time, there was a little cat named Tom. Tom liked to play with a red ball in the garden. "
        "One day the ball rolled under a big bush and Tom was sad. A small bird flew down and found the ball. ") * 8
L, G = 32, 2


@pytest.fixture(scope="module")
def hybrid(stories):
    graph = stories()
    PassManager(["select", "replace"], {"select": {"keep_ratio": 0.5}})(graph)
    return graph


def gate_names(graph) -> set[str]:
    ids = {id(p) for p in gate_parameters(graph)}
    return {n for n, p in graph.gm.named_parameters() if id(p) in ids}


def test_gates_are_the_gate_role_of_every_gdn_layer(hybrid):
    names = gate_names(hybrid)
    leaves = {n.rsplit(".", 2)[-2] if n.endswith((".weight", ".bias")) else n.rsplit(".", 1)[-1] for n in names}
    assert leaves == {"a_proj", "b_proj", "g_proj", "A_log", "dt_bias"}
    per_layer = {len([n for n, _ in m.named_parameters() if n.split(".")[0] in leaves]) for m in hybrid.gdn_modules().values()}
    assert len(names) == sum(per_layer) * len(hybrid.gdn_modules()) // len(per_layer) and per_layer == {5}  # no biases here


def test_gates_hold_for_the_first_steps_then_train(hybrid, stories_teacher, tmp_path):
    (tmp_path / "t.txt").write_text(TEXT)
    student = dataclasses.replace(hybrid, gm=copy.deepcopy(hybrid.gm), meta=copy.deepcopy(hybrid.meta))
    start = {n: p.detach().clone() for n, p in student.gm.named_parameters()}
    gates = gate_names(student)
    moved_after: list[tuple[set, set]] = []

    def on_step(record):
        now = dict(student.gm.named_parameters())
        moved = {n for n, p in now.items() if not torch.equal(p.detach(), start[n])}
        moved_after.append((moved & gates, moved - gates))

    config = DistillConfig(tokens=4 * L * G, stage="kl", seq_len=L, global_batch=G, warmup=0.0, schedule="constant",
                           lr_kl_new=1e-3, lr_kl_copied=1e-3, lr_kl_rest=1e-4, freeze_gates_steps=2)
    distill(student, [tmp_path / "t.txt"], tmp_path / "run", config, teacher=stories_teacher, progress=False, on_step=on_step)
    assert [bool(g) for g, _ in moved_after] == [False, False, True, True]
    assert all(others for _, others in moved_after)          # the rest trains from the first step
    assert moved_after[-1][0] == gates                        # and every gate parameter once released


def test_freeze_checks_and_flag():
    base = dict(tokens=4 * L * G, seq_len=L, global_batch=G)
    DistillConfig(**base, freeze_gates_steps=3).validate()
    for bad, match in ((4, "covers the whole run"), (-1, "freeze_gates_steps must be >= 0")):
        with pytest.raises(DistillError, match=match):
            DistillConfig(**base, freeze_gates_steps=bad).validate()
    with pytest.raises(DistillError, match="not supported with fsdp"):
        DistillConfig(**base, freeze_gates_steps=1, fsdp=True).validate()
    # a run saved before the field existed resumes: the missing field counts as its default
    saved = DistillConfig(**base).to_dict()
    del saved["freeze_gates_steps"]
    assert DistillConfig(**base).differences(saved) == []
    assert DistillConfig(**base, freeze_gates_steps=1).differences(saved) == ["freeze_gates_steps (run: 0, now: 1)"]


def test_cli_flag_reaches_the_config(stories_path, tmp_path):
    from typer.testing import CliRunner

    from surgery.cli.app import app

    (tmp_path / "t.txt").write_text(TEXT)
    bad = CliRunner().invoke(app, ["distill", "--model", str(stories_path), "--data", str(tmp_path / "t.txt"), "--tokens", "128",
                                   "--seq-len", "32", "--batch-size", "2", "--out", str(tmp_path / "o"), "--freeze-gates-steps", "5"])
    assert bad.exit_code != 0 and "covers the whole run" in bad.output
