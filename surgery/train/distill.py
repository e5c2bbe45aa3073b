"""Continue training a saved hybrid against its teacher (METHOD.md, "Distillation after
initialization"): stage 1 ("l2") fits each GDN layer to the teacher's attention output at its site,
teacher-forced; stage 2 ("kl") trains the whole student on KL(teacher || student) over the logits.
The pieces, in the order a run meets them: config, placement, job (run_dir, state, models), stages,
trainer."""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist

from ..io.lock import output_lock
from .config import DistillConfig
from .job import open_job
from .placement import placement
from .trainer import Trainer

__all__ = ["DistillConfig", "distill"]


def distill(model, data, out, config: DistillConfig, *, teacher=None, resume: bool = False, force: bool = False,
            device=None, dtype: torch.dtype | None = None, progress: bool = True,
            on_step: Callable[[dict], None] | None = None, on_open: Callable | None = None, release_teacher: bool = False) -> dict:
    """Train the hybrid `model` (a saved-hybrid directory or a Graph) against its teacher on the text
    files `data`, writing checkpoints, log.jsonl and distill.json into `out`.

    teacher   a source for capture() or a Graph; default: the Graph's in-memory teacher, else the
              source in the hybrid's recipe
    A Graph `model` is trained in place: graphs that share its tensors (Graph.branch() copies share
    the teacher's non-GDN weights) move with it; deep-copy graph.gm first to keep them apart.
    resume    continue from out's last checkpoint (same config, data and teacher); a Graph `model` is
              then ignored in favour of the checkpoint
    dtype     of the student's (master) weights, float32 by default; on CUDA, compute runs under bf16
              autocast and a teacher captured here (a source, or the recipe's) is held in bf16;
              a Graph or in-memory teacher keeps the dtype it has
    on_step   called with each step's log record after its checkpoint (if any) is written
    on_open   called with the student Graph that trains (on resume, the checkpoint's) before the first
              step: a caller can snapshot or score it between steps (bench/recovery.py)
    release_teacher  with config.fsdp_teacher, drop a caller's teacher Graph's full weights once they are
              sharded, as a teacher the run captured itself always does (the Graph no longer runs after)
    The run holds out's writer lock (surgery.io.lock; rank 0 under torchrun): a second writer of
    `out` gets OutputBusyError at once.
    Under torchrun (WORLD_SIZE > 1) each process runs this with the same arguments; it joins or starts
    the process group (nccl on CUDA, gloo on CPU) and trains with DDP, or with config.fsdp sharded
    by FSDP2 (surgery.train.sharding; one process then makes a group of its own).
    Returns a summary: final checkpoint, steps, tokens, loss, eval_ppl, tokens_per_s, flops_per_s.
    flops_per_s is model FLOP/s, (6 x trained forward params + 2 x teacher forward params) x tokens/s:
    stage kl counts the whole student and teacher, stage l2 the GDN layers and the teacher up to the
    last GDN site (what tap_module keeps); embedding lookups count nothing. Comparable with 6N of a
    plain training step."""
    config.validate()
    place = placement(device, group=config.fsdp)
    try:
        with output_lock(out) if place.main else contextlib.nullcontext():  # one writer per run directory
            job = open_job(place, model, data, out, config, teacher=teacher, resume=resume, force=force, dtype=dtype,
                           release_teacher=release_teacher)
            if on_open is not None and job.student is not None:
                on_open(job.student)
            return Trainer(job, progress, on_step).run()
    finally:
        if place.owns_group:
            dist.destroy_process_group()
