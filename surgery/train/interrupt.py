"""Ctrl-C (SIGINT) and SIGTERM during training keep the work: the first asks the trainer to stop
after the current step with a checkpoint (every rank agrees on the step: Placement.any); a second
one aborts at once, without writing (an interrupted checkpoint leaves only its staging directory,
which save removes). A repeat within GRACE seconds is the same interrupt delivered twice (the
terminal signals torchrun and its workers, then torchrun forwards it) and is ignored."""
from __future__ import annotations

import os
import signal
import threading
import time

GRACE = 1.0  # seconds: a second signal sooner than this is the first one delivered again
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Aborted(KeyboardInterrupt):
    """A second interrupt during training: stop now, write nothing. signum: the signal."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def exit_code(signum: int) -> int:
    """The shell's code for a process stopped by a signal: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + signum


class Interrupts:
    """Context: while inside, SIGINT and SIGTERM are caught (main thread only; elsewhere signals
    keep their handlers). `signum` is the first one caught, or None."""

    def __init__(self, announce: bool):
        self.announce = announce
        self.signum: int | None = None
        self.at = 0.0
        self.previous: dict = {}

    def __enter__(self) -> "Interrupts":
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self.handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> bool:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        self.previous = {}
        return False

    def handle(self, signum: int, frame) -> None:
        now = time.monotonic()
        if self.signum is None:
            self.signum, self.at = signum, now
            self.say(f"\n{signal.Signals(signum).name}: finishing this step, then a checkpoint; "
                     f"{'Ctrl-C' if signum == signal.SIGINT else 'the signal'} again aborts without writing\n")
            return
        if now - self.at < GRACE:
            return
        self.say(f"\n{signal.Signals(signum).name} again: aborting without writing a checkpoint\n")
        raise Aborted(signum)

    def say(self, text: str) -> None:
        """A note on stderr, written raw: a signal handler must not re-enter a buffered print."""
        if self.announce:
            try:
                os.write(2, text.encode())
            except OSError:
                pass
