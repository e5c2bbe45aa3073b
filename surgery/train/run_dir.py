"""A run's output directory: distill.json (what the run trains: config, model, teacher, data),
log.jsonl (a record per step and evaluation), checkpoint-N/ (a loadable hybrid with the trainer
state beside it) and `last`, a link to the newest. Every file appears by a final rename, so a run
killed at any moment leaves a directory that --resume continues."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from ..core.files import write_atomic, write_json_atomic
from ..core.graph import Graph
from ..errors import DistillError, SurgeryError
from ..io.json_safe import loads, read_json
from ..io.checkpoint import save
from ..io.outdir import CHECKPOINT_PREFIX, LAST, LOG_FILE, RUN_FILE, check_replaceable
from .config import DistillConfig
from .models import describe_source
from .state import has_state, read_state, write_state

PREFIX = CHECKPOINT_PREFIX


def logged_step(line: str) -> float:
    """The step of a log.jsonl record; a line a killed run left half-written counts as after every step."""
    try:
        return loads(line, LOG_FILE, finite=False).get("step", 0) if line.strip() else float("inf")
    except (SurgeryError, AttributeError):
        return float("inf")


def read_run(out: Path) -> dict | None:
    """The run's distill.json, or None where it is missing or unreadable (prepare says which)."""
    try:
        return json.loads((out / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None


class RunDir:
    """saved: the distill.json of the run being resumed (None for a new run)."""

    def __init__(self, out):
        self.path = Path(out)
        self.saved: dict | None = None

    def prepare(self, model, config: DistillConfig, digests: list[str], resume: bool, force: bool, inputs: list) -> None:
        """Refuse a directory the run cannot use, and a --resume that would not continue the same run.
        A new run may replace only a run directory (--force) and never one holding its `inputs`."""
        out = self.path
        if out.exists() and not out.is_dir():
            raise DistillError(f"--out '{out}' is a file.", "Choose a directory for --out.")
        if not isinstance(model, Graph) and Path(model).exists():
            m, o = Path(model).resolve(), out.resolve()
            if m == o or o in m.parents:
                raise DistillError(f"--out '{out}' would hold the model it starts from ('{model}').", "Write the run to another directory.")
        if resume:
            self.check_resume(model, config, digests)
        elif out.exists() and any(out.iterdir()) and not force:
            raise DistillError(f"'{out}' already exists.", "Pass --resume to continue the run in it, --force to replace it, or choose another --out.")
        elif out.exists() and any(out.iterdir()):
            check_replaceable(out, force=force, inputs=inputs, kinds=("run",))

    def check_resume(self, model, config: DistillConfig, digests: list[str]) -> None:
        out, run_file = self.path, self.path / RUN_FILE
        if not run_file.exists():
            raise DistillError(f"--resume was given, but '{out}' holds no distillation run ({RUN_FILE} is missing).", "Drop --resume to start a new run (add --force to replace the directory).")
        self.saved = read_json(run_file, DistillError, f"Start a new run (another --out, or --force); '{run_file}' is damaged.")
        diffs = config.differences(self.saved["config"])
        if diffs:
            raise DistillError(f"--resume was given a config that differs from the run in '{out}': {'; '.join(diffs)}.",
                               "Resume with the run's settings (see its distill.json), or start a new run in another --out (or with --force).")
        if digests != self.saved["digests"]:
            raise DistillError("--resume was given other training data than the run used.", f"Resume with the same --data files ({', '.join(self.saved['data'])}), or start a new run.")
        if not isinstance(model, Graph) and describe_source(model) != self.saved["model"]:
            raise DistillError(f"--resume was given the model '{model}', the run in '{out}' started from '{self.saved['model']}'.",
                               "Resume with the run's --model (see its distill.json), or start a new run.")

    def check_teacher(self, name: str) -> None:
        if self.saved and self.saved["teacher"] != name:
            raise DistillError(f"--resume would use the teacher {name}, the run used {self.saved['teacher']}.", "Resume with the same teacher (--teacher), or start a new run.")

    def check_corpus(self, key: str, lead: int | None = None) -> None:
        """Resume reads the run's sequences: the same tokens (corpus key) led by the same token (BOS or none)."""
        if self.saved and self.saved["corpus"] != key:
            raise DistillError("--resume would tokenise the training data differently (another tokenizer) than the run did.", "Resume with the run's teacher, or start a new run.")
        if self.saved and self.saved.get("lead") != lead:
            raise DistillError(f"--resume would start each training sequence with token {lead} where the run started them with "
                               f"{self.saved.get('lead')} (a run made before sequences began with the tokenizer's BOS?).",
                               "Start a new run (without --resume), or resume with the version that made this run.")

    def checkpoints(self) -> list[tuple[int, Path]]:
        """Complete checkpoints (a directory appears only by a final rename), oldest first."""
        found = []
        for path in self.path.glob(PREFIX + "*"):
            step = path.name[len(PREFIX):]
            if path.is_dir() and step.isdigit() and has_state(path):
                found.append((int(step), path))
        return sorted(found)

    def last(self) -> tuple[Path | None, dict | None]:
        """The newest checkpoint and its trainer state, or (None, None)."""
        found = self.checkpoints()
        return (found[-1][1], read_state(found[-1][1])) if found else (None, None)

    def start(self, run: dict | None, resume: bool, done: int | None) -> None:
        """Make the directory ready (rank 0): a new run replaces it and writes distill.json (`run`);
        a resumed one drops what a killed run left after its last checkpoint (step `done`). The run
        a new one replaces (--force) is moved aside, and deleted only once the new run has written
        its first checkpoint: a run that fails before that leaves the old one in .OUT.old-PID-*/
        (a replaced run without any checkpoint holds nothing to keep and is deleted at once)."""
        out = self.path
        if not resume and out.exists():
            if self.checkpoints():
                holder = Path(tempfile.mkdtemp(prefix=f"{self.aside_prefix()}{os.getpid()}-", dir=out.parent))
                os.replace(out, holder / out.name)
            else:
                shutil.rmtree(out)
        out.mkdir(parents=True, exist_ok=True)
        # temporary directories of a killed run: checkpoint.save's staging (.checkpoint-N.XXXX)
        for stale in out.glob(f".*{PREFIX}*"):
            shutil.rmtree(stale, ignore_errors=True)
        if not resume or self.saved is None:
            write_json_atomic(out / RUN_FILE, run)
        log = out / LOG_FILE
        if resume and log.exists():
            keep = [] if done is None else [line for line in log.read_text().splitlines() if logged_step(line) <= done]
            write_atomic(log, "".join(line + "\n" for line in keep))

    def log(self, record: dict) -> None:
        with open(self.path / LOG_FILE, "a") as f:
            f.write(json.dumps(record) + "\n")

    def save(self, student: Graph, step: int, state: dict, keep: int) -> Path:
        """checkpoint-<step>: the student with the trainer state in save's staging directory (one
        final rename), then `last` points at it and all but the newest `keep` go."""
        name = f"{PREFIX}{step:08d}"
        save(student, self.path / name, force=True, extra=lambda staging: write_state(staging, state))
        link = self.path / f".{LAST}.{os.getpid()}"
        with contextlib.suppress(OSError):
            link.unlink(missing_ok=True)
            link.symlink_to(name)
            os.replace(link, self.path / LAST)
        for _, old in self.checkpoints()[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        for aside in self.path.parent.glob(self.aside_prefix() + "*"):  # the new run has a checkpoint:
            if (aside / self.path.name / RUN_FILE).exists():            # the runs it replaced can go
                shutil.rmtree(aside, ignore_errors=True)
        return self.path / name

    def aside_prefix(self) -> str:
        return f".{self.path.name}.old-"
