"""Learning-rate schedules shared by Phase 2 (tcal.phase2) and distillation (surgery.train): a linear
warm-up, then a constant rate or a cosine decay to a floor."""
from __future__ import annotations

import math

SCHEDULES = ("constant", "cosine")


def lr_factor(step: int, warmup_steps: int, decay_steps: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak rate at 0-based `step`: (step + 1) / warmup_steps during the warm-up, then
    1 (constant) or a cosine that reaches `min_ratio` `decay_steps` steps after the warm-up."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, decay_steps))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
