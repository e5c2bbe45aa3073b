"""Everything one distillation run trains with, opened and checked before its first step: the run
directory and the state it resumes from, the student and teacher, the data order, the evaluation
text. Cheap checks come first, so a bad input fails before any model is loaded."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..core.files import sha256_file
from ..core.graph import Graph
from ..core.bos import leading_token
from ..data.corpus import TokenCorpus, WindowOrder, check_files
from ..errors import DistillError
from .config import DistillConfig
from .models import check_lengths, open_student, open_teacher, teacher_dtype
from .placement import Placement
from .run_dir import RunDir, read_run
from .sharding import precision


@dataclass
class Job:
    """state: the trainer state of the checkpoint resumed from (None: a new run), at `last`;
    complete: that state already finished every step (nothing is opened then)."""

    place: Placement
    config: DistillConfig
    run_dir: RunDir
    local: int
    micro: int
    autocast_on: bool
    state: dict | None = None
    last: Path | None = None
    complete: bool = False
    student: Graph | None = None
    teacher: Graph | None = None
    teacher_name: str = ""
    owns_teacher: bool = False  # its weights are the run's own (open_teacher): a sharded teacher may drop them
    previous: list = field(default_factory=list)
    order: WindowOrder | None = None
    eval_ids: torch.Tensor | None = None

    def autocast(self):
        return torch.autocast(self.place.device.type, dtype=torch.bfloat16, enabled=self.autocast_on)

    def total_steps(self) -> int:
        return sum(s for _, s in self.config.steps())


def shares(place: Placement, config: DistillConfig, out: Path, resume: bool) -> tuple[int, int]:
    """place.shares; a resumed run that cannot split its batch over this many processes is told the
    layout the run was written in and the process counts that can resume it."""
    try:
        return place.shares(config.global_batch, config.micro_batch)
    except DistillError as exc:
        run = read_run(out) if resume else None
        if not isinstance(run, dict) or not isinstance(run.get("world"), int):
            raise
        world, fsdp = run["world"], bool(run.get("config", {}).get("fsdp"))
        layout = f"{world} process{'es' if world > 1 else ''}" + (", FSDP-sharded" if fsdp else ", DDP" if world > 1 else "")
        fits = [w for w in range(1, config.global_batch + 1) if config.global_batch % w == 0]
        raise DistillError(f"The run in '{out}' was written by {layout}; this run has {place.world} processes, which cannot split its global batch "
                           f"of {config.global_batch} sequences.", f"Resume with a number of processes that divides {config.global_batch} "
                           f"({', '.join(map(str, fits[:8]))}): checkpoints are gathered, so any of them resumes it, with or without --fsdp.") from exc


def open_job(place: Placement, model, data, out, config: DistillConfig, *, teacher, resume: bool, force: bool, dtype,
             release_teacher: bool = False) -> Job:
    c = config
    digests = [sha256_file(p) for p in check_files(data)]
    local, micro = shares(place, c, Path(out), resume)
    run_dir = RunDir(out)
    inputs = [p for p in (model, teacher, *data, c.eval_text) if isinstance(p, (str, Path))]
    run_dir.prepare(model, c, digests, resume, force, inputs)
    last, state = run_dir.last() if resume else (None, None)
    autocast_on = c.autocast if c.autocast is not None else place.device.type == "cuda"
    if c.fsdp:
        precision(c.fsdp_mixed, autocast_on)  # refuses bf16 FSDP weights without autocast before any model loads
    job = Job(place, c, run_dir, local, micro, autocast_on, state=state, last=last)
    job.complete = state is not None and state["step"] >= job.total_steps()
    if job.complete:  # a finished run resumed again: nothing to load
        return job
    model_name = open_models(job, last or model, teacher, dtype or torch.float32)
    job.owns_teacher |= release_teacher
    tokenizer = job.teacher.tokenizer or job.student.tokenizer
    corpus = place.main_first(lambda: TokenCorpus.build(data, tokenizer, digests=digests))  # rank 0 tokenises; the others find the cache
    lead = leading_token(tokenizer)
    job.order = WindowOrder(corpus, c.seq_len, c.global_batch, c.seed, lead)  # BOS-led when the tokenizer adds one
    run_dir.check_corpus(corpus.key, lead)
    job.eval_ids = eval_ids(c, tokenizer)
    if place.main:
        run = {"config": c.to_dict(), "model": model_name, "teacher": job.teacher_name, "data": [str(Path(d).resolve()) for d in data],
               "digests": digests, "corpus": corpus.key, "lead": lead, "corpus_tokens": len(corpus), "world": place.world}
        run_dir.start(run, resume, state["step"] if state else None)
    place.barrier()
    return job


def open_models(job: Job, start_from, teacher, dtype: torch.dtype) -> str:
    """Open the student (the last checkpoint when resuming) and the teacher into job; the run's model name."""
    place, run_dir = job.place, job.run_dir
    job.student, student_name = open_student(start_from, place.device, dtype)
    earlier = job.student.meta.get("distill") or {}
    # earlier distillation runs of the model this run started from, kept in every checkpoint's recipe
    if job.last:
        job.previous = earlier.get("previous", [])
    elif earlier:
        job.previous = [*earlier.get("previous", []), {k: v for k, v in earlier.items() if k != "previous"}]
    job.teacher, job.teacher_name, job.owns_teacher = open_teacher(job.student, teacher, place.device, teacher_dtype(job.student, job.autocast_on, place.device))
    run_dir.check_teacher(job.teacher_name)
    check_lengths(job.config.seq_len, job.student, job.teacher)
    return run_dir.saved["model"] if run_dir.saved else student_name


def eval_ids(config: DistillConfig, tokenizer) -> torch.Tensor | None:
    """The first eval_tokens tokens of eval_text, scored at the start, every eval_every and the end."""
    if not config.eval_text:
        return None
    from ..data.cache import text_ids

    ids = text_ids(config.eval_text, tokenizer)[: config.eval_tokens]
    if ids.numel() < 2:
        raise DistillError(f"The evaluation text '{config.eval_text}' holds {ids.numel()} token(s).", "Use a longer --eval-text.")
    return ids
