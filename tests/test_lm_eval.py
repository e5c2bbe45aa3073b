"""lm-evaluation-harness on the shipped local task (surgery_next_sentence): for the stories260K
teacher and a stories260K hybrid (through its hf export), lm-eval's requests, log-likelihoods, picks
and accuracy equal the project's own scoring (surgery.eval.choice_task); the task loads from any
install location; `surgery eval --task lm-eval` prints it; the items file is what its generator builds."""
from __future__ import annotations

import hashlib
import json
import shutil

import pytest
from typer.testing import CliRunner

import surgery
from surgery import PassManager
from surgery.cli.app import app
from surgery.errors import EvalTaskError
from surgery.eval.choice_items import CORPUS, build_items, write_items
from surgery.eval.choice_task import TASK, TASKS_DIR, items_path, read_items, requests, score
from surgery.eval.lm_harness import check_tasks, evaluate

LIMIT = 16  # items (64 log-likelihoods) per model


@pytest.fixture(scope="module")
def hybrid(stories, tmp_path_factory):
    """A saved stories260K hybrid, layers 1 and 3 converted (copy-only: select, replace)."""
    graph = stories()
    PassManager(["select", "replace"], {"select": {"policy": "convert", "layers": [1, 3]}})(graph)
    return surgery.save(graph, tmp_path_factory.mktemp("lm-eval") / "hybrid")


def check_same(result: dict, own: dict) -> None:
    """lm-eval's samples against our rows: same requests, log-likelihoods, picks and accuracy."""
    samples = sorted(result["samples"][TASK], key=lambda s: s["doc_id"])
    items = read_items(limit=LIMIT)
    assert [s["doc_id"] for s in samples] == list(range(LIMIT))
    for sample, item, row in zip(samples, items, own["rows"], strict=True):
        assert [tuple(a) for a in sample["arguments"]] == requests(item)
        theirs = [resp[0] for resp in sample["filtered_resps"]]
        assert theirs == pytest.approx(row["loglikelihoods"], rel=1e-4, abs=1e-3), item["id"]
        assert sample["acc"] == float(row["pred"] == row["label"]) and sample["acc_norm"] == float(row["pred_norm"] == row["label"]), item["id"]
    assert result["tasks"][TASK] == {"acc": own["acc"], "acc_norm": own["acc_norm"], "items": LIMIT}


def test_teacher_lm_eval_equals_own_scoring(stories, stories_path):
    result = evaluate(stories_path, limit=LIMIT, log_samples=True)
    assert not result["exported"]
    check_same(result, score(stories(), limit=LIMIT))


def test_hybrid_export_lm_eval_equals_own_scoring(hybrid):
    result = evaluate(hybrid, limit=LIMIT, log_samples=True)
    assert result["exported"]
    check_same(result, score(surgery.load(hybrid), limit=LIMIT))


def test_task_loads_from_any_install_location(tmp_path, monkeypatch):
    """The YAML reads items.jsonl beside itself: a copy elsewhere, run from another folder, loads it."""
    from lm_eval.tasks import TaskManager

    shutil.copytree(TASKS_DIR, tmp_path / "site" / "tasks")
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    manager = TaskManager(include_path=str(tmp_path / "site" / "tasks"), include_defaults=False)
    task = manager.load([TASK])["tasks"][TASK]
    docs = list(task.test_docs())
    assert len(docs) == len(read_items()) == 300
    assert docs[7]["context"] == read_items()[7]["context"] and docs[7]["choices"] == read_items()[7]["choices"]


def test_cli_prints_lm_eval_accuracy(stories_path):
    runner = CliRunner()
    result = runner.invoke(app, ["eval", "--model", str(stories_path), "--task", "lm-eval", "--tasks", TASK, "--limit", "4", "--json"])
    assert result.exit_code == 0, result.output
    line = json.loads(result.stdout.strip().splitlines()[-1])
    assert line["tasks"][TASK]["items"] == 4 and 0 <= line["tasks"][TASK]["acc"] <= 1


def test_unknown_task_is_refused_before_loading(stories_path):
    with pytest.raises(EvalTaskError, match="Unknown lm-eval task 'nope'.*surgery_next_sentence"):
        check_tasks("nope")
    result = CliRunner().invoke(app, ["eval", "--model", str(stories_path), "--task", "lm-eval", "--tasks", f"{TASK},nope"])
    assert result.exit_code == 2 and "Unknown lm-eval task 'nope'" in result.output
    result = CliRunner().invoke(app, ["eval", "--model", str(stories_path), "--task", "lm-eval", "--limit", "0"])
    assert result.exit_code == 2 and "--limit must be at least 1" in result.output


def test_shipped_items_are_small_and_rebuilt_by_the_generator(tmp_path):
    shipped = items_path()
    assert shipped.stat().st_size < 300_000
    items = read_items()
    assert len({i["id"] for i in items}) == 300 and all(len(i["choices"]) == 4 and i["choices"][i["label"]] for i in items)
    if not (CORPUS / "austen.txt.xz").exists():
        pytest.skip(f"corpus not at {CORPUS}")
    write_items(build_items(), tmp_path / "items.jsonl")
    assert hashlib.sha256((tmp_path / "items.jsonl").read_bytes()).hexdigest() == hashlib.sha256(shipped.read_bytes()).hexdigest()
