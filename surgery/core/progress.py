"""Progress of the long steps (capture, teacher reading, calibrate, align, eval, distill, export), on stderr.

One owner for how progress shows. Library code opens a task and updates it:

    with progress.task("align", total=steps, unit="steps") as bar:
        bar.update(step + 1, info=f"mean loss {loss:.3e}")

and the reporter in force decides what a user sees:
  - Bar: a rich bar with elapsed time and time left, when stderr is a terminal;
  - Lines: off a terminal (logs, CI, pipes), a plain line every `interval` seconds (10) or every
    `fraction` of the total (5%), whichever comes first, plus the last; a task that goes silent
    (a long first step, a capture) still gets a line each interval from a heartbeat thread;
  - Reporter (the base): nothing.

Everything goes to stderr, never stdout, so a command's `--json` output is never mixed with it and
`--json` never turns it off. Called from Python, the library reports the same way (`auto()`: a bar
in a terminal, plain lines elsewhere, e.g. in a notebook or a log); `use(Reporter())` silences it,
`use(Lines(interval=...))` changes the cadence. The CLI installs its reporter once, at start.
"""
from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager

INTERVAL = 10.0   # seconds between plain lines at most
FRACTION = 0.05   # of a task's total between plain lines at most


def duration(seconds: float) -> str:
    """12 s, 3 min 20 s, 2 h 05 min."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class Task:
    """One long step's progress: `completed` of `total` (None: unknown) `unit`s, and a short `info`."""

    def __init__(self, reporter: "Reporter", label: str, total: int | None, unit: str):
        self.reporter, self.label, self.total, self.unit = reporter, label, total, unit
        self.completed, self.info = 0, ""
        self.started = reporter.clock()
        self.closed = False

    def update(self, completed: int | None = None, info: str | None = None) -> None:
        if completed is not None:
            self.completed = completed
        if info is not None:
            self.info = info
        self.reporter.show(self)

    def advance(self, count: int = 1, info: str | None = None) -> None:
        self.update(self.completed + count, info)

    def note(self, text: str) -> None:
        """A line of its own (an event, not progress), shown above a bar."""
        self.reporter.note(text)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.reporter.close(self)

    def elapsed(self) -> float:
        return self.reporter.clock() - self.started

    def line(self) -> str:
        """The plain-text state: 'align: 30/60 steps (50%), mean loss 1.2e-03, 12 s elapsed, ~12 s left'."""
        parts = []
        if self.total:
            parts.append(f"{self.completed:,}/{self.total:,} {self.unit} ({self.completed / self.total:.0%})")
        elif self.completed:
            parts.append(f"{self.completed:,} {self.unit}")
        if self.info:
            parts.append(self.info)
        elapsed = self.elapsed()
        parts.append(f"{duration(elapsed)} elapsed")
        if self.total and 0 < self.completed < self.total:
            parts.append(f"~{duration(elapsed / self.completed * (self.total - self.completed))} left")
        return f"{self.label}: {', '.join(parts)}"


class Reporter:
    """The quiet reporter (and the base of the others): tasks are counted, nothing is shown."""

    clock = staticmethod(time.monotonic)

    def open(self, task: Task) -> None:
        pass

    def show(self, task: Task) -> None:
        pass

    def close(self, task: Task) -> None:
        pass

    def note(self, text: str) -> None:
        pass


class Lines(Reporter):
    """Plain lines on stderr (or `stream`): every `interval` seconds or `fraction` of the total,
    whichever first, and the last. `clock` is injectable so a test checks the cadence without waiting."""

    def __init__(self, stream=None, interval: float | None = None, fraction: float | None = None, clock=None, heartbeat: bool = True):
        self.stream = stream
        self.interval = INTERVAL if interval is None else interval
        self.fraction = FRACTION if fraction is None else fraction
        if clock is not None:
            self.clock = clock
        self.heartbeat = heartbeat
        self.lock = threading.Lock()
        self.state: dict[int, dict] = {}

    def write(self, text: str) -> None:
        stream = self.stream or sys.stderr  # looked up each time: a test's or a caller's redirection holds
        print(text, file=stream, flush=True)

    def open(self, task: Task) -> None:
        state = {"printed_at": task.started, "printed": 0, "lines": 0, "stop": threading.Event()}
        self.state[id(task)] = state
        if self.heartbeat:
            threading.Thread(target=self.beat, args=(task, state), daemon=True, name=f"progress {task.label}").start()

    def due(self, task: Task, state: dict) -> bool:
        if self.clock() - state["printed_at"] >= self.interval:
            return True
        if task.total:
            return task.completed >= task.total > state["printed"] or (task.completed - state["printed"]) / task.total >= self.fraction
        return False

    def emit(self, task: Task, state: dict) -> None:
        self.write(task.line())
        state.update(printed_at=self.clock(), printed=task.completed, lines=state["lines"] + 1)

    def show(self, task: Task) -> None:
        state = self.state.get(id(task))
        with self.lock:
            if state is not None and self.due(task, state):
                self.emit(task, state)

    def beat(self, task: Task, state: dict) -> None:
        """A line each interval while the task makes no update (a long step, a capture)."""
        while not state["stop"].wait(max(self.interval, 0.05)):
            with self.lock:
                if not state["stop"].is_set() and self.clock() - state["printed_at"] >= self.interval:
                    self.emit(task, state)

    def close(self, task: Task) -> None:
        state = self.state.pop(id(task), None)
        if state is None:
            return
        state["stop"].set()
        with self.lock:
            if state["lines"] and not (task.total and state["printed"] >= task.total):
                self.write(f"{task.label}: done in {duration(task.elapsed())}")

    def note(self, text: str) -> None:
        with self.lock:
            self.write(text)


class Bar(Reporter):
    """A rich bar per open task (elapsed and time left) on `console` (default: a stderr console);
    bars vanish when their task closes, so a finished command leaves its results, not its bars."""

    def __init__(self, console=None):
        from rich.console import Console

        self.console = console or Console(stderr=True)
        self.progress = None
        self.ids: dict[int, int] = {}

    def open(self, task: Task) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        if self.progress is None:
            self.progress = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[count]}"),
                                     TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TextColumn("elapsed,"),
                                     TimeRemainingColumn(), TextColumn("left"),
                                     console=self.console, transient=True)
            self.progress.start()
        self.ids[id(task)] = self.progress.add_task(task.label, total=task.total, count="", info="")

    def show(self, task: Task) -> None:
        if id(task) in self.ids:
            count = f"{task.completed:,}/{task.total:,} {task.unit}" if task.total else f"{task.completed:,} {task.unit}" if task.completed else ""
            self.progress.update(self.ids[id(task)], completed=task.completed, count=count, info=task.info)

    def close(self, task: Task) -> None:
        if id(task) in self.ids:
            self.progress.remove_task(self.ids.pop(id(task)))
        if not self.ids and self.progress is not None:
            self.progress.stop()
            self.progress = None

    def note(self, text: str) -> None:
        (self.progress.console if self.progress is not None else self.console).print(text, markup=False, highlight=False)


def auto(console=None) -> Reporter:
    """A bar when stderr is a terminal, plain lines otherwise."""
    return Bar(console) if sys.stderr.isatty() else Lines()


_reporter: Reporter | None = None  # None: auto() at the first task


def current() -> Reporter:
    global _reporter
    if _reporter is None:
        _reporter = auto()
    return _reporter


def use(reporter: Reporter | None) -> Reporter | None:
    """Install `reporter` for every task from now on (None: auto() again); returns the one before."""
    global _reporter
    before, _reporter = _reporter, reporter
    return before


def start(label: str, total: int | None = None, unit: str = "", enabled: bool = True) -> Task:
    """Open a task (close it with task.close(); `task()` does both); enabled=False: a quiet one."""
    reporter = current() if enabled else Reporter()
    opened = Task(reporter, label, total, unit)
    reporter.open(opened)
    return opened


@contextmanager
def task(label: str, total: int | None = None, unit: str = "", enabled: bool = True):
    opened = start(label, total, unit, enabled)
    try:
        yield opened
    finally:
        opened.close()
