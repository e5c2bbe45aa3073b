"""Multi-key needle (RULER's MK-NIAH, offline): several "special magic number for NAME" statements
hidden in corpus text, one of them asked for. Retrieval must pick the right key among look-alikes,
which a single passkey cannot test. Deterministic from the seed; scored as passkey is."""
from __future__ import annotations

import random

from ..errors import SurgeryError
from .needles import grid, score_task, splice
from .passkey import filler_tokens

TASK = ("Some special magic numbers are hidden inside a lot of irrelevant text. Find them and memorize them. "
        "I will quiz you about one of them.\n")
NEEDLE = "\nThe special magic number for {name} is {value}.\n"
QUESTION = "\nWhat is the special magic number for {name}? The special magic number for {name} is"
NAMES = ("apple", "river", "candle", "garden", "pencil", "window", "rabbit", "yellow", "mountain", "button", "cookie",
         "forest", "rocket", "silver", "tiger", "violin")


def make_trials(tokenizer, filler_files, lengths, depths: int, trials_per_depth: int, seed: int, keys: int = 4):
    """Per trial `keys` distinct names with distinct 5-digit values; the asked one at the trial's
    depth, the others at seeded random depths."""
    if not 1 <= keys <= len(NAMES):
        raise SurgeryError(f"Multi-key needs 1 to {len(NAMES)} keys, got {keys}.", "Use e.g. 4 keys.")
    filler = filler_tokens(tokenizer, filler_files, lengths, depths, trials_per_depth, "Multi-key")
    rng = random.Random(seed)
    trials = []
    for length, depth in grid(lengths, depths, trials_per_depth):
        names = rng.sample(NAMES, keys)
        values = [str(v) for v in rng.sample(range(10000, 100000), keys)]
        inserts = [(depth, NEEDLE.format(name=names[0], value=values[0]))]
        inserts += [(rng.random(), NEEDLE.format(name=n, value=v)) for n, v in zip(names[1:], values[1:])]
        trials.append(splice(tokenizer, filler, length, TASK, inserts, QUESTION.format(name=names[0]), values[0],
                             rng.randrange(1 << 30), depth))
    return trials


def multikey(graph, filler_files=None, lengths=(1024, 2048, 4096), depths: int = 5, trials_per_depth: int = 2,
             seed: int = 0, batch_size: int = 8, compile: bool | None = None, keys: int = 4) -> dict:
    """Accuracy overall, per length and per depth of the asked key, and each trial's answer."""
    trials = make_trials(graph.tokenizer, filler_files, list(lengths), depths, trials_per_depth, seed, keys)
    return score_task("multikey", graph, trials, seed, batch_size, compile) | {"keys": keys}
