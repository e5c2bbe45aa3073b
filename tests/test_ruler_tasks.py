"""The RULER-style retrieval tasks beside passkey (surgery.eval.multikey, surgery.eval.vartrack) on
stories260K's tokenizer and prompt sizes: exact prompt lengths, determinism from the seed, the
scorer against an independent greedy generation loop, and oracles: the copying model of passkey's
tests solves multi-key (and one-hop tracking) and a shifted copier fails; multi-hop tracking needs
a model that follows references (a resolving oracle solves it, plain copying does not)."""
from __future__ import annotations

import json
import re

import pytest
import torch
from typer.testing import CliRunner

from surgery.errors import SurgeryError
from surgery.eval import multikey as mk, vartrack as vt
from surgery.eval.passkey import score

from test_passkey import CopyOracle, greedy_generate


@pytest.fixture(scope="module")
def tokenizer(stories_teacher):
    return stories_teacher.tokenizer


def vocab(tokenizer) -> int:
    return len(tokenizer.get_vocab())


class ResolvingOracle(CopyOracle):
    """Copies, except after "The value of NAME is": there it writes NAME's value, found by reading the
    prompt's statements as text and following "the value of OTHER" references to a number."""

    def _next(self, seq: list[int]) -> int:
        text = self.tokenizer.decode(seq)
        asked = list(re.finditer(r"What is the value of (\w+)\? The value of \1 is", text))
        if not asked:
            return super()._next(seq)
        statements = text[:asked[-1].start()]
        name = asked[-1].group(1)
        for _ in range(64):
            ref = re.search(rf"The value of {name} is the value of (\w+)\.", statements)
            if not ref:
                break
            name = ref.group(1)
        value = re.search(rf"The value of {name} is (\d+)\.", statements).group(1)
        q_end = self.question_end(seq, asked[-1].group(1))
        answer = self.tokenizer(" " + value, add_special_tokens=False)["input_ids"]
        written = len(seq) - q_end
        return answer[written] if written < len(answer) else 0

    def question_end(self, seq: list[int], name: str) -> int:
        question = self.tokenizer(vt.QUESTION.format(name=name), add_special_tokens=False)["input_ids"]
        for end in range(len(seq), len(question) - 1, -1):
            if seq[end - len(question):end] == question:
                return end
        raise AssertionError("the question's tokens are not in the sequence")


def test_prompts_have_the_asked_length_and_depend_only_on_the_seed(tokenizer):
    for make, extra in ((mk.make_trials, {"keys": 4}), (vt.make_trials, {"hops": 3, "chains": 2})):
        trials = make(tokenizer, None, [300, 400], 3, 2, seed=5, **extra)
        assert len(trials) == 12 and [t.answer_start for t in trials] == [t.length for t in trials]
        again = make(tokenizer, None, [300, 400], 3, 2, seed=5, **extra)
        assert all(torch.equal(a.ids, b.ids) for a, b in zip(trials, again))
        other = make(tokenizer, None, [300, 400], 3, 2, seed=6, **extra)
        assert not all(torch.equal(a.ids, b.ids) for a, b in zip(trials, other))
        assert all(tokenizer.decode(t.ids[t.answer_start:]).strip() == t.key for t in trials)


def test_multikey_prompt_holds_every_key_and_asks_one(tokenizer):
    trial = mk.make_trials(tokenizer, None, [400], 1, 1, seed=1, keys=5)[0]
    text = tokenizer.decode(trial.ids[:trial.answer_start])
    found = dict(re.findall(r"The special magic number for (\w+) is (\d+)\.", text))
    asked = re.search(r"What is the special magic number for (\w+)\?", text).group(1)
    assert len(found) == 5 and found[asked] == trial.key


def test_vartrack_chain_resolves_to_the_answer(tokenizer):
    trial = vt.make_trials(tokenizer, None, [400], 1, 1, seed=2, hops=4, chains=2)[0]
    text = tokenizer.decode(trial.ids[:trial.answer_start])
    assert len(re.findall(r"The value of \w+ is \d+\.", text)) == 2           # two chains
    assert len(re.findall(r"The value of \w+ is the value of \w+\.", text)) == 6  # of 3 references each
    oracle = ResolvingOracle(tokenizer, vocab(tokenizer))
    assert score(oracle, [trial]) == [True]


def test_scorer_matches_generation_and_copying_solves_multikey(tokenizer):
    trials = mk.make_trials(tokenizer, None, [300, 360], 2, 2, seed=3)
    for shift, expected in ((0, True), (1, False)):
        oracle = CopyOracle(tokenizer, vocab(tokenizer), shift)
        scored = score(oracle, trials, batch_size=3)
        generated = [greedy_generate(oracle, t.ids[:t.answer_start], t.ids.numel() - t.answer_start) == t.ids[t.answer_start:].tolist()
                     for t in trials]
        assert scored == generated and all(ok == expected for ok in scored)


def test_tracking_needs_the_hops(tokenizer):
    copier, resolver = CopyOracle(tokenizer, vocab(tokenizer)), ResolvingOracle(tokenizer, vocab(tokenizer))
    one_hop = vt.make_trials(tokenizer, None, [300], 2, 2, seed=4, hops=1)
    assert all(score(copier, one_hop))                   # one hop is a copy
    hops = vt.make_trials(tokenizer, None, [300, 360], 2, 2, seed=4, hops=3)
    assert not any(score(copier, hops)) and all(score(resolver, hops, batch_size=2))
    generated = [greedy_generate(resolver, t.ids[:t.answer_start], t.ids.numel() - t.answer_start) == t.ids[t.answer_start:].tolist()
                 for t in hops]
    assert all(generated)


def test_reports_and_errors(tokenizer, stories_teacher):
    oracle = CopyOracle(tokenizer, vocab(tokenizer))
    result = mk.multikey(oracle, None, [300], depths=3, trials_per_depth=1)
    assert result["task"] == "multikey" and result["accuracy"] == 1.0 and result["trials"] == 3 and set(result["by_length"]) == {"300"}
    with pytest.raises(SurgeryError, match="no room for filler"):
        vt.make_trials(tokenizer, None, [60], 1, 1, 0)
    with pytest.raises(SurgeryError, match="1 to 16 keys"):
        mk.make_trials(tokenizer, None, [300], 1, 1, 0, keys=0)
    with pytest.raises(SurgeryError, match="at least 1 hop"):
        vt.make_trials(tokenizer, None, [300], 1, 1, 0, hops=0)


@pytest.mark.parametrize("task", ["multikey", "vartrack"])
def test_cli_task(stories_path, task):
    from surgery.cli.app import app

    result = CliRunner().invoke(app, ["eval", "--model", str(stories_path), "--task", task, "--lengths", "450",
                                      "--depths", "2", "--trials", "1", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["task"] == task and report["trials"] == 2 and 0.0 <= report["accuracy"] <= 1.0
    bad = CliRunner().invoke(app, ["eval", "--model", str(stories_path), "--task", task, "--lengths", "0"])
    assert bad.exit_code != 0 and "--lengths" in bad.output


def test_retrieval_tasks_by_name():
    """One registry for `surgery eval --task` and the benches: each name is its module's function; any
    other name is a named error."""
    import pytest

    from surgery.errors import SurgeryError
    from surgery.eval import multikey, passkey, vartrack
    from surgery.eval.retrieval import TASKS, retrieval_task

    assert [retrieval_task(name) for name in TASKS] == [passkey.passkey, multikey.multikey, vartrack.vartrack]
    with pytest.raises(SurgeryError, match="Unknown retrieval task 'needle'"):
        retrieval_task("needle")
