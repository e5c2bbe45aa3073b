"""An output directory (--out) the project may write, and may replace with --force.

--force replaces only what this project wrote itself: a saved hybrid (recipe.json and the files
`save` puts beside it) or a distillation run directory (distill.json, log.jsonl, checkpoint-*/,
last). Anything else in --out, and above all any input of the same command, makes it refuse,
naming the files. The checks run before any work, so a bad --out costs seconds, not a whole run."""
from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

from ..errors import CheckpointError, SurgeryError
from .json_safe import read_json

KINDS = ("hybrid", "run")
EXTRA_FILES = "extra_files"  # the recipe.json key listing what save's `extra` added
# what save writes into a hybrid directory; TRAINING_STATE: what a training run adds to its
# checkpoints through save(extra=...)
HYBRID_FILES = re.compile(r"recipe\.json|model\.safetensors|model-\d+-of-\d+\.safetensors|model\.safetensors\.index\.json")
HYBRID_DIRS = re.compile(r"tokenizer")
TRAINING_STATE = re.compile(r"trainer_state(\.[\w.]+)?")
# The layout of a distillation run directory (surgery.train writes it; named here, once, because
# --force and opening a run as a model read it too)
RUN_FILE, LOG_FILE, CHECKPOINT_PREFIX, LAST = "distill.json", "log.jsonl", "checkpoint-", "last"
RUN_FILES = re.compile("|".join(re.escape(name) for name in (RUN_FILE, LOG_FILE, LAST)))
CHECKPOINT = re.compile(re.escape(CHECKPOINT_PREFIX) + r"\d+")
REPLACE_HINT = "--force replaces only a hybrid or a distillation run directory that surgery wrote."


def staging_prefix(out: Path) -> str:
    """Prefix of save's staging directory beside `out` (the PID tells a live save from a killed one)."""
    return f".{out.name}.{os.getpid()}."


LOCK_SUFFIX = "lock"  # surgery.io.lock's file beside an output: .NAME.lock (what the project wrote, never foreign)


def lock_name(name: str) -> str:
    """The name of the writers' lock file of an output called `name` (it sits beside the output)."""
    return f".{name}.{LOCK_SUFFIX}"


TEMPORARY = re.compile(r"\.(?P<base>.+?)\.(?:old-\d+|\d+|lock|(?:\d+\.)?[a-z0-9_]{8})")  # .NAME.PID, .NAME.old-PID, .NAME.lock, staging


def is_temporary(name: str, *kinds: re.Pattern) -> bool:
    """An atomic writer's leftover (.NAME.PID, .NAME.old-PID, a staging dir) or the writers' lock
    (.NAME.lock) of a NAME the kind owns."""
    match = TEMPORARY.fullmatch(name)
    return bool(match) and any(kind.fullmatch(match["base"]) for kind in kinds)


def recorded_extra_files(folder: Path) -> set[str]:
    """The names save's `extra` wrote into this hybrid, as its recipe.json lists them."""
    try:
        listed = read_json(folder / "recipe.json").get(EXTRA_FILES, [])
    except (SurgeryError, AttributeError):
        return set()
    return {name for name in listed if isinstance(name, str) and "/" not in name} if isinstance(listed, list) else set()


def hybrid_leftovers(folder: Path) -> list[str]:
    """Entries of `folder` that are not part of a saved hybrid (its files, tokenizer/, training
    state, what save's `extra` wrote)."""
    bad, extra = [], recorded_extra_files(folder)
    for entry in sorted(folder.iterdir()):
        name = entry.name
        if name in extra:
            continue
        if entry.is_dir() and not entry.is_symlink():
            ok = HYBRID_DIRS.fullmatch(name)
        else:
            ok = HYBRID_FILES.fullmatch(name) or TRAINING_STATE.fullmatch(name) or is_temporary(name, HYBRID_FILES, TRAINING_STATE)
        if not ok:
            bad.append(name + ("/" if entry.is_dir() else ""))
    return bad


def run_leftovers(folder: Path) -> list[str]:
    """Entries of `folder` that are not part of a distillation run (checkpoints are hybrids)."""
    bad = []
    for entry in sorted(folder.iterdir()):
        name = entry.name
        if CHECKPOINT.fullmatch(name) and entry.is_dir() and not entry.is_symlink():
            bad += [f"{name}/{inner}" for inner in hybrid_leftovers(entry)]
        elif not (RUN_FILES.fullmatch(name) or is_temporary(name, RUN_FILES, CHECKPOINT)):
            bad.append(name + ("/" if entry.is_dir() else ""))
    return bad


def foreign_entries(out: Path, kinds: Iterable[str] = KINDS) -> list[str]:
    """What in the directory `out` the project did not write, judged as the kind it looks like
    (distill.json, log.jsonl or checkpoint-*: a run; else a hybrid). [] for an empty one."""
    names = [p.name for p in out.iterdir()]
    looks_like_run = any(RUN_FILES.fullmatch(n) or CHECKPOINT.fullmatch(n) for n in names)
    if "run" in kinds and (looks_like_run or "hybrid" not in kinds):
        return run_leftovers(out)
    if "hybrid" in kinds:
        return hybrid_leftovers(out)
    return sorted(names)


def inputs_inside(out: Path, inputs: Iterable) -> list[str]:
    """The inputs that are `out` or lie inside it (paths compared resolved; non-paths ignored)."""
    root = out.resolve()
    found = {}
    for item in inputs:
        if item is None or not isinstance(item, (str, os.PathLike)) or not Path(item).expanduser().exists():
            continue
        path = Path(item).expanduser().resolve()
        if path == root or root in path.parents:
            found.setdefault(path, str(item))  # one input given twice (a name and its resolved path) is named once
    return list(found.values())


def check_replaceable(out: str | Path, *, force: bool, inputs: Iterable = (), kinds: Iterable[str] = KINDS) -> None:
    """Refuse, before any work, an --out that cannot be written or replaced (CheckpointError):
    one that is or holds an input of the command (even with --force), one that exists without
    --force, and one with --force that holds anything the project did not write (named).

    `inputs` are every path the command reads: model, teacher, GGUF, calibration/data/eval files.
    Replacement itself happens later, after the new output is complete (save's final rename).
    distill wires it as: check_replaceable(out, force=force, inputs=[model, teacher, *data, eval_text],
    kinds=("run",)) before anything loads (skipped with --resume), then replaces --out only once its
    new content is staged."""
    out = Path(out)
    if not os.path.lexists(out):
        check_writable(out)
        return
    held = inputs_inside(out, inputs)
    if held:
        what = "is" if any(Path(h).expanduser().resolve() == out.resolve() for h in held) else "holds"
        raise CheckpointError(f"--out '{out}' {what} an input of this command: {', '.join(held)}.",
                              "Write the output to another directory; --force never replaces a command's own inputs.")
    if not force:
        raise CheckpointError(f"'{out}' already exists.", "Choose another --out, or pass --force to replace it.")
    if out.is_symlink():
        raise CheckpointError(f"--out '{out}' is a symbolic link (to '{os.readlink(out)}'); --force does not replace what a link points at.",
                              f"Pass the directory itself as --out, or remove the link yourself ({REPLACE_HINT})")
    if not out.is_dir():
        raise CheckpointError(f"--out '{out}' is a file, not a directory surgery wrote.", f"Remove it yourself or choose another --out ({REPLACE_HINT})")
    foreign = foreign_entries(out, tuple(kinds))
    if foreign:
        shown = ", ".join(foreign[:10]) + (f" and {len(foreign) - 10} more" if len(foreign) > 10 else "")
        raise CheckpointError(f"--out '{out}' holds files surgery did not write: {shown}.",
                              f"Move them away or choose another --out ({REPLACE_HINT})")
    check_writable(out)


def check_writable(out: str | Path) -> None:
    """The directory that will receive `out` (its parent, or the nearest existing ancestor that
    mkdir would start from) must be a writable directory: probed by creating a file there."""
    out = Path(out).absolute()
    base = out.parent
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        raise CheckpointError(f"--out '{out}' cannot be created: '{base}' is a file, not a directory.", "Choose an --out whose parent is a directory.")
    check_name_lengths(out, base)
    try:
        with tempfile.TemporaryFile(dir=base):
            pass
    except OSError as exc:
        raise CheckpointError(f"--out '{out}' cannot be written: {describe_os_error(exc, base)}.", "Choose a writable --out.") from exc


STAGING_BYTES = 32  # what the writers' temporary names add to --out's name (.NAME.PID.XXXXXXXX, .NAME.old-PID-XXXXXXXX)


def check_name_lengths(out: Path, base: Path) -> None:
    """Each name to be created under `base` fits the file system's NAME_MAX, --out's own with room
    for the staging names beside it: a name too long would fail only at the final save."""
    try:
        limit = os.pathconf(base, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    parts = out.relative_to(base).parts
    for i, name in enumerate(parts):
        room = limit - (STAGING_BYTES if i == len(parts) - 1 else 0)
        if len(os.fsencode(name)) > room:
            raise CheckpointError(f"--out '{out}': the name '{name[:40]}...' is {len(os.fsencode(name))} bytes long; this file system takes "
                                  f"{limit} bytes at most{f', and surgery needs {STAGING_BYTES} of them for its staging names' if room < limit else ''}.",
                                  f"Choose an --out whose names are at most {room} bytes.")


def describe_os_error(exc: OSError, path) -> str:
    """One line for the OSErrors a writer meets (full disk, read-only, permissions)."""
    reason = {errno.ENOSPC: "the disk is full", errno.EROFS: "the file system is read-only", errno.EDQUOT: "the disk quota is exceeded",
              errno.EACCES: "permission denied", errno.EPERM: "permission denied"}.get(exc.errno, exc.strerror or str(exc))
    return f"'{path}': {reason}"


def clean_stale_staging(out: str | Path) -> list[Path]:
    """Remove what a killed save to `out` left beside it: staging directories named by save's own
    prefix (.NAME.PID.XXXXXXXX, or .NAME.XXXXXXXX from before the PID) and, once `out` exists, the
    old copy a swap moved aside (.NAME.old-PID); only those of a process that is gone and holding
    nothing but what save writes. Returns them."""
    out = Path(out)
    if not out.parent.is_dir():
        return []
    name = re.escape(out.name)
    staging = re.compile(rf"\.{name}\.(?:(?P<pid>\d+)\.)?[a-z0-9_]{{8}}")
    moved_aside = re.compile(rf"\.{name}\.old-(?P<pid>\d+)")
    removed = []
    for entry in out.parent.glob(f".{glob_escape(out.name)}.*"):
        match = staging.fullmatch(entry.name) or (out.exists() and moved_aside.fullmatch(entry.name))
        if not match or not entry.is_dir() or entry.is_symlink():
            continue
        if match["pid"] is not None and process_alive(int(match["pid"])):
            continue
        if not hybrid_leftovers(entry):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True
