"""Progress of a run on stderr, from rank 0 only."""
from __future__ import annotations

import sys
import time


class Reporter:
    """Progress on stderr (rank 0): a rich bar with tokens/s on a terminal, a line now and then
    otherwise (logs and CI)."""

    def __init__(self, enabled: bool, total_tokens: int, total_steps: int):
        self.enabled, self.total_steps = enabled, total_steps
        self.tty = enabled and sys.stderr.isatty()
        self.every = max(1, total_steps // 20)
        self.printed = time.perf_counter()
        self.bar = None
        if self.tty:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("distill {task.fields[stage]}"), BarColumn(),
                                TextColumn("{task.completed:,}/{task.total:,} tokens"), TextColumn("{task.fields[tps]:,.0f} tok/s"),
                                TextColumn("loss {task.fields[loss]:.4g}"), TimeElapsedColumn(), TimeRemainingColumn(),
                                console=Console(stderr=True))
            self.task = self.bar.add_task("distill", total=total_tokens, stage="", tps=0.0, loss=float("nan"))
            self.bar.start()

    def update(self, record: dict, tokens: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=tokens, stage=record["stage"], tps=record["tokens_per_s"], loss=record["loss"])
        elif self.enabled and (record["step"] % self.every == 0 or record["step"] == self.total_steps or time.perf_counter() - self.printed > 60):
            self.printed = time.perf_counter()
            print(f"distill step {record['step']}/{self.total_steps} ({record['stage']}): loss {record['loss']:.4e}, "
                  f"{record['tokens_per_s']:,.0f} tok/s, {record['flops_per_s'] / 1e12:.3g} TFLOP/s", file=sys.stderr, flush=True)

    def note(self, text: str) -> None:
        if self.bar is not None:
            self.bar.console.print(text)
        elif self.enabled:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
