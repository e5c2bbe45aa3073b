"""Read one version of a directory that a writer may replace meanwhile.

save replaces a hybrid by renames (the old directory moved aside, the new one renamed in, the old
one deleted), so a reader that opens DIR/recipe.json and later DIR/model.safetensors by name could
take them from two versions. A reader here opens the directory once and reads every file through
that handle (/proc/self/fd/N on Linux: lookups follow the directory it opened, wherever it was
renamed); when the version it reads is deleted under it, it reads the new one from the start.
A writer that replaced the directory again and again, faster than one read takes, would starve a
reader: it gets a named error after TRIES versions. Without /proc the files are read by name,
under the same checks."""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ..errors import CheckpointError
from .outdir import glob_escape

T = TypeVar("T")
TRIES = 20      # versions a reader tries before it gives up (each replaced while it was read)
SWAP_WAIT = 0.01  # seconds between tries while a writer's rename leaves DIR missing for an instant


def tree(folder: Path) -> list[str]:
    """The relative paths of every file and directory under `folder`, sorted."""
    found = []
    for root, dirs, files in os.walk(folder):
        rel = os.path.relpath(root, folder)
        found += [os.path.join(rel, name) for name in dirs + files]
    return sorted(found)


def swapping(path: Path) -> bool:
    """Whether a writer is between its two renames: `path` is gone and its old copy moved aside."""
    if os.path.lexists(path) or not path.parent.is_dir():
        return False
    return any(path.parent.glob(f".{glob_escape(path.name)}.old-*"))


def names(path: Path, fd: int) -> bool:
    """Whether `path` still names the directory open as `fd` (not yet replaced: nothing of it deleted)."""
    try:
        now, mine = os.stat(path), os.fstat(fd)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino)


def read_one_version(path: str | os.PathLike, read: Callable[[Path], T]) -> T:
    """read(folder) with `folder` naming one version of the directory `path` throughout: either
    the version there before a concurrent replace or the one after, never a mix. A version still
    at `path` after its file list was taken is complete (a writer deletes only what it replaced);
    the read counts when that list is unchanged at the end. Errors of a version nobody replaced
    are read's own (a missing directory: read(path) names it)."""
    path = Path(path)
    for attempt in range(TRIES):
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_CLOEXEC)
        except OSError:
            if attempt + 1 < TRIES and swapping(path):
                time.sleep(SWAP_WAIT)
                continue
            return read(path)  # not a directory, or gone for good: read names the problem
        try:
            proc = Path(f"/proc/self/fd/{fd}")
            folder = proc if proc.is_dir() else path
            before = tree(folder)
            if not names(path, fd):
                continue  # replaced already: its deletion may have begun
            try:
                result = read(folder)
            except Exception:
                if attempt + 1 < TRIES and (tree(folder) != before or not names(path, fd)):
                    continue  # the version was replaced while read: read the new one
                raise
            if tree(folder) == before:  # nothing of this (complete) version was deleted while read
                return result
        finally:
            os.close(fd)
    raise CheckpointError(f"'{path}' was replaced {TRIES} times while it was read.", "Read it once its writer has finished.")
