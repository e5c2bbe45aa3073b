"""Variable tracking (RULER's VT, offline): a chain "The value of A is 12345." "The value of B is
the value of A." ... hidden in corpus text beside a distractor chain, then "What is the value of
<last>?". One hop is a copy; each further hop needs the model to follow a reference it read
earlier. Deterministic from the seed; scored as passkey is."""
from __future__ import annotations

import random
import string

from ..errors import SurgeryError
from .needles import grid, score_task, splice
from .passkey import filler_tokens

TASK = "Memorize and track the chain of variable assignments hidden in the following text.\n"
VALUE = "\nThe value of {name} is {value}.\n"
REFERENCE = "\nThe value of {name} is the value of {source}.\n"
QUESTION = "\nWhat is the value of {name}? The value of {name} is"


def chain(names: list[str], value: str) -> list[str]:
    """The statements of one chain, in order: the value, then each name refers to the one before."""
    return [VALUE.format(name=names[0], value=value)] + [REFERENCE.format(name=n, source=s) for s, n in zip(names, names[1:])]


def variable_names(rng: random.Random, count: int) -> list[str]:
    names: list[str] = []
    while len(names) < count:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        names += [name] if name not in names else []
    return names


def make_trials(tokenizer, filler_files, lengths, depths: int, trials_per_depth: int, seed: int, hops: int = 4, chains: int = 2):
    """Per trial `chains` chains of `hops` statements with distinct values; the asked chain starts at
    the trial's depth (its later statements after it, in order), the distractors at random depths."""
    if hops < 1 or chains < 1:
        raise SurgeryError(f"Variable tracking needs at least 1 hop and 1 chain, got {hops} and {chains}.", "Use e.g. 4 hops, 2 chains.")
    filler = filler_tokens(tokenizer, filler_files, lengths, depths, trials_per_depth, "Variable tracking")
    rng = random.Random(seed)
    trials = []
    for length, depth in grid(lengths, depths, trials_per_depth):
        names = variable_names(rng, hops * chains)
        values = [str(v) for v in rng.sample(range(10000, 100000), chains)]
        asked = chain(names[:hops], values[0])
        at = [depth] + sorted(depth + (1 - depth) * rng.random() for _ in asked[1:])
        inserts = list(zip(at, asked))
        for c in range(1, chains):
            other = chain(names[c * hops:(c + 1) * hops], values[c])
            inserts += zip(sorted(rng.random() for _ in other), other)
        trials.append(splice(tokenizer, filler, length, TASK, inserts, QUESTION.format(name=names[hops - 1]), values[0],
                             rng.randrange(1 << 30), depth))
    return trials


def vartrack(graph, filler_files=None, lengths=(1024, 2048, 4096), depths: int = 5, trials_per_depth: int = 2,
             seed: int = 0, batch_size: int = 8, compile: bool | None = None, hops: int = 4, chains: int = 2) -> dict:
    """Accuracy overall, per length and per depth of the chain's start, and each trial's answer."""
    trials = make_trials(graph.tokenizer, filler_files, list(lengths), depths, trials_per_depth, seed, hops, chains)
    return score_task("vartrack", graph, trials, seed, batch_size, compile) | {"hops": hops, "chains": chains}
