"""One writer per output directory: an advisory lock (flock) on `.NAME.lock` beside --out.

The lock file sits in --out's parent, not inside it, so it survives the directory's replacement
by rename (save stages beside `out` and swaps it in). apply, save, export and distill hold it for
their whole run; a second writer is refused at once, by the PID and command written in the file.
The kernel drops a flock when its process dies, so a lock file a killed process left behind is
simply taken over. Only the holder deletes the file, while holding it; whoever locks a file checks
that it is still the one at the path (else it retries), so a deleted file is never locked twice.
Within one thread the lock is re-entrant (the CLI takes it, then the library function again);
another thread of the same process is refused like another process."""
from __future__ import annotations

import contextlib
import fcntl
import functools
import inspect
import json
import os
import shlex
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError, OutputBusyError
from .outdir import check_writable, describe_os_error, lock_name

TRIES = 50  # a lock file deleted between our open and our flock: open the new one (a handful at most)


@dataclass
class Held:
    fd: int
    depth: int
    thread: int  # the thread that holds it: another thread of this process is a second writer too


HELD: dict[str, Held] = {}  # lock file -> this process's hold on it
GUARD = threading.RLock()


def lock_file(out: str | os.PathLike) -> Path:
    """The lock file of `out`: `.NAME.lock` in its parent (parent resolved, so `a/../b` and `b` share it)."""
    out = Path(os.path.abspath(os.fspath(out)))
    return out.parent.resolve() / lock_name(out.name)


def this_command() -> str:
    """How this process was started, for the message a second writer gets."""
    argv = [os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python", *sys.argv[1:]]
    text = shlex.join(argv)
    return text if len(text) <= 300 else text[:297] + "..."


def holder(fd: int) -> str:
    """'PID 123: surgery distill ...' from a lock file another process holds ('' when unreadable)."""
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
        return f"PID {int(info['pid'])}: {info['command']}"
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def open_locked(path: Path, out: Path) -> int:
    """An fd of `path`, flocked by us and still the file at `path` (a file its holder deleted in
    between is let go, and the new one opened)."""
    for _ in range(TRIES):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            check_writable(out)  # the usual message for a parent that is a file or read-only
            raise CheckpointError(f"--out '{out}' cannot be locked: {describe_os_error(exc, path)}.", "Choose a writable --out.") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            who = holder(fd)
            os.close(fd)
            raise OutputBusyError(f"'{out}' is being written by another process ({who or 'its PID is not written yet'}); "
                                  f"two writers of one output would mix their files.",
                                  f"Wait for it to finish (or stop it), or choose another --out. The lock is '{path}'.") from None
        mine = os.fstat(fd)
        try:
            now = os.stat(path)
        except FileNotFoundError:
            now = None
        if now is not None and (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
            return fd
        os.close(fd)  # its holder deleted it as it let go: lock the file now at the path
    raise OutputBusyError(f"The lock '{path}' of '{out}' keeps being replaced.", "Another process is taking and dropping it; try again.")


def acquire(out: str | os.PathLike) -> Path:
    """Take (or, in this thread, take again) the lock of `out`; OutputBusyError when another process
    or thread holds it."""
    path = lock_file(out)
    key = str(path)
    with GUARD:
        if key in HELD and HELD[key].thread == threading.get_ident():
            HELD[key].depth += 1
            return path
        if key in HELD:
            raise OutputBusyError(f"'{out}' is being written by another thread of this process (PID {os.getpid()}).",
                                  "Write each output from one thread at a time, or choose another output.")
        fd = open_locked(path, Path(out))
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "command": this_command()}).encode("utf-8"), 0)
        HELD[key] = Held(fd, 1, threading.get_ident())
    return path


def release(path: Path) -> None:
    """Undo one acquire; the last one deletes the file (while still holding it) and lets go."""
    key = str(path)
    with GUARD:
        held = HELD[key]
        held.depth -= 1
        if held.depth:
            return
        del HELD[key]
        with contextlib.suppress(OSError):
            mine, now = os.fstat(held.fd), os.stat(path)
            if (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
                os.unlink(path)
        os.close(held.fd)


@contextlib.contextmanager
def output_lock(out: str | os.PathLike) -> Iterator[Path]:
    """Hold the lock of `out` for the block (re-entrant within this process)."""
    path = acquire(out)
    try:
        yield path
    finally:
        release(path)


def holds_output(argument: str = "out") -> Callable:
    """Decorator: the function holds the lock of its `argument` (an output path) while it runs."""

    def wrap(fn: Callable) -> Callable:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def locked(*args, **kwargs):
            with output_lock(signature.bind(*args, **kwargs).arguments[argument]):
                return fn(*args, **kwargs)

        return locked

    return wrap
