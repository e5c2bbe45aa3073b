"""Prompts that hide several statements in corpus text and end with a question, for the RULER-style
retrieval tasks beside passkey (surgery.eval.multikey, surgery.eval.vartrack): the prompt layout
and the trial grid they share. A trial is a PasskeyTrial (its `key` the expected answer), scored as
passkey's are: teacher-forced greedy exact match of the answer's tokens, in one forward pass."""
from __future__ import annotations

import torch

from ..core.bos import lead_ids, leading_token
from ..data.text import tokenize
from ..errors import SurgeryError
from .passkey import PasskeyTrial, greedy_answers, report


def encode(tokenizer, text: str) -> list[int]:
    return tokenize(tokenizer, text).tolist()


def grid(lengths, depths: int, trials_per_depth: int):
    """(length, depth) of every trial: `depths` evenly spaced depths in [0, 1] per length."""
    for length in lengths:
        for d in range(depths):
            for _ in range(trials_per_depth):
                yield length, d / (depths - 1) if depths > 1 else 0.5


def splice(tokenizer, filler: torch.Tensor, length: int, task: str, inserts: list[tuple[float, str]], question: str,
           answer: str, offset: int, depth: float) -> PasskeyTrial:
    """A prompt of exactly `length` tokens (answer excluded, a leading BOS counted in): the task line,
    filler cut at a seeded offset with each insert at its depth (equal depths keep their order), the
    question; the answer's tokens follow."""
    head = lead_ids(encode(tokenizer, task), leading_token(tokenizer))
    pieces = [(d, encode(tokenizer, text)) for d, text in sorted(inserts, key=lambda item: item[0])]
    asked, answer_ids = encode(tokenizer, question), encode(tokenizer, " " + answer)
    budget = length - len(head) - sum(len(p) for _, p in pieces) - len(asked)
    if budget < 1:
        raise SurgeryError(f"A prompt of {length} tokens leaves no room for filler text: the task line, statements and question "
                           f"alone take {length - budget} tokens with this tokenizer.", f"Use lengths above {length - budget} tokens.")
    if filler.numel() < budget:
        raise SurgeryError(f"The filler text has {filler.numel()} tokens; a {length}-token prompt needs {budget}.",
                           "Pass longer corpus text with --text (several files are concatenated).")
    start = offset % (filler.numel() - budget + 1)
    body = filler[start:start + budget].tolist()
    ids, done = list(head), 0
    for d, piece in pieces:
        cut = max(round(d * budget), done)
        ids += body[done:cut] + piece
        done = cut
    ids += body[done:] + asked
    return PasskeyTrial(length, depth, answer, torch.tensor(ids + answer_ids, dtype=torch.long), len(ids))


def score_task(task: str, graph, trials: list[PasskeyTrial], seed: int, batch_size: int, compile: bool | None) -> dict:
    """passkey's result layout for another task's trials."""
    return report(task, graph.tokenizer, trials, greedy_answers(graph, trials, batch_size, compile), seed)
