"""Progress of a run on stderr, from rank 0 only (shown as surgery.core.progress shows every long step)."""
from __future__ import annotations

from ..core import progress


class Reporter:
    """distill's task: tokens done of the total, with the stage, loss and rates."""

    def __init__(self, enabled: bool, total_tokens: int, total_steps: int):
        self.total_steps = total_steps
        self.task = progress.start("distill", total_tokens, "tokens", enabled=enabled)

    def update(self, record: dict, tokens: int) -> None:
        self.task.update(tokens, info=f"step {record['step']}/{self.total_steps} ({record['stage']}), loss {record['loss']:.4g}, "
                                      f"{record['tokens_per_s']:,.0f} tok/s, {record['flops_per_s'] / 1e12:.3g} TFLOP/s")

    def note(self, text: str) -> None:
        self.task.note(text)

    def close(self) -> None:
        self.task.close()
