"""The long-range retrieval tasks by name: one list for `surgery eval --task` and the benches. Each is
surgery.eval.<name>.<name>(graph, filler_files, lengths, depths, trials_per_depth, seed, batch_size=)
-> a report (surgery.eval.passkey.report), imported on first use."""
from __future__ import annotations

import importlib

from ..errors import SurgeryError

TASKS = ("passkey", "multikey", "vartrack")


def retrieval_task(name: str):
    """The task function called `name`."""
    if name not in TASKS:
        raise SurgeryError(f"Unknown retrieval task '{name}'.", f"Use one of {', '.join(TASKS)}.")
    return getattr(importlib.import_module(f"{__package__}.{name}"), name)
