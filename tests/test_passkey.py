"""Passkey retrieval: prompt construction, and the one-pass teacher-forced scorer against an
independent greedy generation loop, with an oracle model that can solve the task (longest-suffix
copying, i.e. an ideal induction head) and one that cannot."""
from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from surgery.errors import SurgeryError
from surgery.eval.passkey import build_trial, make_trials, passkey, score


class CopyOracle:
    """Logits that put all mass on the token after the longest earlier match of the current suffix:
    reads a key it saw before, as retrieval needs. `shift` corrupts it into a model that fails."""

    TAIL = 8  # positions scored: the key (6 tokens at most here) and the one before it

    def __init__(self, tokenizer, vocab: int, shift: int = 0, max_length: int = 4096):
        self.tokenizer, self.vocab, self.shift, self.max_length = tokenizer, vocab, shift, max_length
        self.device = torch.device("cpu")

    def _next(self, seq: list[int]) -> int:
        best, best_len = 0, 0
        for j in range(len(seq) - 1):      # candidate: seq[j] aligned with the last token
            n = 0
            while n <= j and seq[j - n] == seq[len(seq) - 1 - n] and n < 64:
                n += 1
            if n > best_len:
                best, best_len = seq[j + 1], n
        return (best + self.shift) % self.vocab

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(*ids.shape, self.vocab)
        for b, row in enumerate(ids.tolist()):
            for t in range(max(len(row) - self.TAIL, 0), len(row)):  # earlier positions stay all-zero:
                out[b, t, self._next(row[: t + 1])] = 1.0           # a scorer reading them fails
        return out


def greedy_generate(model, prompt: torch.Tensor, n: int) -> list[int]:
    seq = prompt.tolist()
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[prompt.numel():]


@pytest.fixture(scope="module")
def tokenizer(stories_teacher):
    return stories_teacher.tokenizer


def test_trial_layout(tokenizer):
    filler = torch.tensor(tokenizer("The grass is green and the sky is blue. " * 60, add_special_tokens=False)["input_ids"])
    trial = build_trial(tokenizer, filler, 300, 0.5, "12345", offset=7)
    prompt = trial.ids[: trial.answer_start]
    assert prompt.numel() == 300
    assert tokenizer.decode(trial.ids[trial.answer_start:]).strip() == "12345"
    text = tokenizer.decode(prompt)
    assert text.count("12345") == 2 and text.rstrip().endswith("The pass key is")
    # the needle sits in the middle of the filler
    deep = build_trial(tokenizer, filler, 300, 1.0, "12345", offset=7)
    shallow = build_trial(tokenizer, filler, 300, 0.0, "12345", offset=7)
    def needle_at(t):
        return tokenizer.decode(t.ids[: t.answer_start]).index("The pass key is 12345")
    assert needle_at(shallow) < needle_at(trial) < needle_at(deep)


def test_scorer_matches_greedy_generation(tokenizer):
    vocab = len(tokenizer.get_vocab())
    trials = make_trials(tokenizer, None, [200, 240], depths=2, trials_per_depth=2, seed=3)
    assert len({t.key for t in trials}) > 1
    for shift, expected in ((0, True), (1, False)):
        oracle = CopyOracle(tokenizer, vocab, shift)
        scored = score(oracle, trials, batch_size=3)
        generated = [greedy_generate(oracle, t.ids[: t.answer_start], t.ids.numel() - t.answer_start) == t.ids[t.answer_start:].tolist() for t in trials]
        assert scored == generated
        assert all(ok == expected for ok in scored)


def test_passkey_report_and_errors(tokenizer, stories_teacher):
    oracle = CopyOracle(tokenizer, len(tokenizer.get_vocab()))
    oracle.tokenizer = tokenizer
    result = passkey(oracle, None, [200], depths=3, trials_per_depth=1)
    assert result["accuracy"] == 1.0 and result["trials"] == 3 and set(result["by_length"]) == {"200"}
    with pytest.raises(SurgeryError, match="no room for filler"):
        make_trials(tokenizer, None, [50], 1, 1, 0)
    with pytest.raises(SurgeryError, match="over this graph's limit"):
        passkey(stories_teacher, None, [stories_teacher.max_length], 1, 1)


def test_cli_passkey_json(stories_path):
    from surgery.cli.app import app

    result = CliRunner().invoke(app, ["eval", "--model", str(stories_path), "--task", "passkey", "--lengths", "200",
                                      "--depths", "2", "--trials", "1", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["task"] == "passkey" and report["trials"] == 2 and 0.0 <= report["accuracy"] <= 1.0
    bad = CliRunner().invoke(app, ["eval", "--model", str(stories_path), "--task", "recall"])
    assert bad.exit_code == 2 and "Unknown task" in bad.output
