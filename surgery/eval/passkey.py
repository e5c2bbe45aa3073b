"""Passkey retrieval: can the model copy a 5-digit key it read thousands of tokens earlier?

The prompt (the usual long-context probe, after Mohtashami & Jaggi's landmark-attention test) is the
tokenizer's BOS when it adds one (surgery.core.bos), a task line, corpus text with the sentence "The
pass key is NNNNN. Remember it. NNNNN is the pass key." spliced in at a chosen depth, then "What is
the pass key? The pass key is". A trial is correct
when greedy decoding continues with exactly the key's tokens. That is scored teacher-forced in ONE
forward pass over prompt + key: greedy decoding emits the key iff at every key position the argmax
of the logits is the next key token, so no generation loop is needed and any captured graph (a
teacher, a hybrid, a distilled hybrid) is measured the same way.

Filler comes from corpus text (the calibration files, or the built-in sample), cut at a seeded
offset per trial, so the key is the only thing the prompts of one length have in common.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from ..core import progress
from ..core.bos import lead_ids, leading_token
from ..core.graph import Graph
from ..data.cache import token_stream
from ..data.text import tokenize
from ..decode.fast import fast_runner
from ..errors import SurgeryError

TASK = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
        "I will quiz you about the important information there.\n")
NEEDLE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\nWhat is the pass key? The pass key is"


@dataclass
class PasskeyTrial:
    length: int
    depth: float
    key: str
    ids: torch.Tensor        # prompt + key tokens, 1-D
    answer_start: int        # index of the first key token in ids


def _encode(tokenizer, text: str) -> list[int]:
    return tokenize(tokenizer, text).tolist()


def build_trial(tokenizer, filler: torch.Tensor, length: int, depth: float, key: str, offset: int) -> PasskeyTrial:
    """A prompt of exactly `length` tokens (key excluded; a leading BOS, when the tokenizer adds one,
    counted in) with the needle at `depth` of the filler."""
    head, needle = lead_ids(_encode(tokenizer, TASK), leading_token(tokenizer)), _encode(tokenizer, NEEDLE.format(key=key))
    question, answer = _encode(tokenizer, QUESTION), _encode(tokenizer, " " + key)
    budget = length - len(head) - len(needle) - len(question)
    if budget < 1:
        fixed = length - budget
        raise SurgeryError(f"A passkey prompt of {length} tokens leaves no room for filler text: the task, needle "
                           f"and question alone take {fixed} tokens with this tokenizer.",
                           f"Use lengths above {fixed} tokens.")
    if filler.numel() < budget:
        raise SurgeryError(f"The filler text has {filler.numel()} tokens; a {length}-token prompt needs {budget}.",
                           "Pass longer corpus text with --text (several files are concatenated).")
    start = offset % (filler.numel() - budget + 1)
    body = filler[start:start + budget].tolist()
    cut = round(depth * budget)
    ids = head + body[:cut] + needle + body[cut:] + question
    return PasskeyTrial(length, depth, key, torch.tensor(ids + answer, dtype=torch.long), len(ids))


def filler_tokens(tokenizer, filler_files, lengths, depths: int, trials_per_depth: int, task: str = "Passkey") -> torch.Tensor:
    """The corpus text a retrieval task's statements hide in, after the checks every such task shares."""
    if tokenizer is None:
        raise SurgeryError(f"This model has no tokenizer, which the {task} prompts need.",
                           "Load the model from a directory or GGUF that carries one.")
    if not lengths or min(lengths) < 1 or depths < 1 or trials_per_depth < 1:
        raise SurgeryError(f"{task} needs at least one length, one depth and one trial per depth.",
                           "e.g. --lengths 1024,2048,4096 --depths 5 --trials 2")
    return token_stream(tokenizer, [str(f) for f in filler_files] if filler_files else None)


def make_trials(tokenizer, filler_files, lengths, depths: int, trials_per_depth: int, seed: int) -> list[PasskeyTrial]:
    """`depths` evenly spaced depths in [0, 1] per length, `trials_per_depth` keys at each."""
    filler = filler_tokens(tokenizer, filler_files, lengths, depths, trials_per_depth)
    rng = random.Random(seed)
    trials = []
    for length in lengths:
        for d in range(depths):
            depth = d / (depths - 1) if depths > 1 else 0.5
            for _ in range(trials_per_depth):
                key = str(rng.randint(10000, 99999))
                trials.append(build_trial(tokenizer, filler, length, depth, key, rng.randrange(1 << 30)))
    return trials


@torch.no_grad()
def greedy_answers(graph, trials: list[PasskeyTrial], batch_size: int = 8, compile: bool | None = None) -> list[list[int]]:
    """Per trial, the argmax at each key position, teacher-forced, trials of equal length batched,
    through the fast runner (surgery.decode.fast; compile: None is the device's route). Up to and
    including its first token that differs from the key, this is exactly what greedy decoding would
    write (see the module's docstring); after that, greedy would have gone elsewhere."""
    longest = max(t.ids.numel() for t in trials)
    if longest > graph.max_length:
        raise SurgeryError(f"A passkey prompt plus its key takes {longest} tokens, over this graph's limit of {graph.max_length}.",
                           "Use shorter --lengths.")
    run = fast_runner(graph, compile, label="graph for passkey") if isinstance(graph, Graph) else getattr(graph, "logits", graph)  # an export, or ids -> logits
    answers: list[list[int]] = [[] for _ in trials]
    with progress.task("passkey", len(trials), "trials") as bar:
        for chunk in equal_length_batches(trials, batch_size):
            logits = run(torch.stack([trials[i].ids for i in chunk]).to(graph.device))
            for row, i in enumerate(chunk):
                answers[i] = logits[row, trials[i].answer_start - 1:-1].argmax(-1).tolist()
            bar.advance(len(chunk))
    return answers


def equal_length_batches(trials: list[PasskeyTrial], batch_size: int) -> list[list[int]]:
    """Indices of the trials in batches of at most batch_size whose ids (prompt + key) are equally long."""
    groups: dict[int, list[int]] = {}
    for i, t in enumerate(trials):
        groups.setdefault(t.ids.numel(), []).append(i)
    return [indices[s:s + batch_size] for indices in groups.values() for s in range(0, len(indices), batch_size)]


@torch.no_grad()
def answer_nll(graph, trials: list[PasskeyTrial], batch_size: int = 4) -> float:
    """The key's negative log-likelihood (summed over its tokens), teacher-forced, averaged over the
    trials: a graded retrieval score where exact match is all or nothing per trial (select's
    retrieval policy compares layers by it). Runs graph.logits: any branch or variant of a graph."""
    total = 0.0
    for chunk in equal_length_batches(trials, batch_size):
        start = trials[chunk[0]].answer_start  # every prompt is `length` tokens: the key starts at the same index
        ids = torch.stack([trials[i].ids for i in chunk]).to(graph.device)
        logp = graph.logits(ids)[:, start - 1:-1].float().log_softmax(-1)
        total -= logp.gather(-1, ids[:, start:, None]).sum().item()
    return total / len(trials)


def score(graph, trials: list[PasskeyTrial], batch_size: int = 8, compile: bool | None = None) -> list[bool]:
    """Teacher-forced greedy exact match of the key tokens."""
    return [answer == t.ids[t.answer_start:].tolist() for t, answer in zip(trials, greedy_answers(graph, trials, batch_size, compile))]


def answered(tokenizer, trial: PasskeyTrial, answer: list[int]) -> str:
    """What greedy decoding writes for the key's tokens: the answer up to its first wrong token."""
    key = trial.ids[trial.answer_start:].tolist()
    wrong = next((i for i, (a, k) in enumerate(zip(answer, key)) if a != k), None)
    return tokenizer.decode(answer if wrong is None else answer[:wrong + 1]).strip()


def passkey(graph, filler_files=None, lengths=(1024, 2048, 4096), depths: int = 5, trials_per_depth: int = 2,
            seed: int = 0, batch_size: int = 8, compile: bool | None = None) -> dict:
    """Accuracy overall, per length and per (length, depth), and each trial's key and greedy answer."""
    trials = make_trials(graph.tokenizer, filler_files, list(lengths), depths, trials_per_depth, seed)
    return report("passkey", graph.tokenizer, trials, greedy_answers(graph, trials, batch_size, compile), seed)


def report(task: str, tokenizer, trials: list[PasskeyTrial], answers: list[list[int]], seed: int) -> dict:
    """A retrieval task's result (passkey, surgery.eval.multikey, surgery.eval.vartrack): accuracy
    overall, per length and per (length, depth), and each trial's expected and greedy answer."""
    correct = [a == t.ids[t.answer_start:].tolist() for t, a in zip(trials, answers)]
    by_length: dict[int, list[bool]] = {}
    by_depth: dict[str, list[bool]] = {}
    for t, ok in zip(trials, correct):
        by_length.setdefault(t.length, []).append(ok)
        by_depth.setdefault(f"{t.length}@{t.depth:.2f}", []).append(ok)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {
        "task": task, "accuracy": mean(correct), "trials": len(trials),
        "by_length": {str(k): mean(v) for k, v in by_length.items()},
        "by_depth": {k: mean(v) for k, v in by_depth.items()},
        "answers": [{"length": t.length, "depth": round(t.depth, 4), "expected": t.key, "answered": answered(tokenizer, t, a), "correct": ok}
                    for t, a, ok in zip(trials, answers, correct)],
        "seed": seed,
    }
