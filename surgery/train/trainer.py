"""The training loop: per stage an AdamW optimizer and its schedule, then steps of micro-batches,
with evaluation, logging, checkpoints and the time limit between steps.

Determinism is the design constraint, because it is what makes resume and multi-process runs
trustworthy:
* the sequences of optimizer step s are a pure function of (seed, s); rank r of w takes the r-th
  slice of a global batch whose size is fixed by the config, never by the world size;
* each micro-batch loss is weighted by its share of the global batch, so the gradient after DDP's
  average is the global-batch mean whatever the number of processes or micro-batches;
* a checkpoint holds everything the next step reads: weights (a loadable hybrid), optimizer,
  scheduler, step, tokens and RNG states. A resumed run therefore repeats the uninterrupted loss
  curve exactly, and N processes repeat one process up to float summation order.
"""
from __future__ import annotations

import contextlib
import gc
import math
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..core.compiled import resolve_compile
from ..decode.causal_flags import CausalFlags
from ..errors import DistillError, first_line, ran_out_of_memory
from .config import lr_factor
from .interrupt import Interrupts
from .job import Job
from .progress import Reporter
from .sharding import ShardedStudent, clip_grad_norm, shard_student, shard_teacher
from .stages import Stage, gate_parameters, gradient_checkpointing, param_groups, stage_kl, stage_l2
from .state import rng_state, set_rng_state


@dataclass
class Tally:
    """What this call has done: steps (of the whole run), tokens, seconds and FLOPs it trained."""

    done: int = 0
    tokens: int = 0
    seconds: float = 0.0
    flops: float = 0.0
    stopped: str | None = None  # why the run stopped early: "time_limit" or the signal's name ("SIGINT")
    last_path: Path | None = None


def build_optimizer(job: Job, index: int, stage: str, steps: int, sharded: ShardedStudent | None = None):
    """(AdamW, its LambdaLR, the trained parameters) of a stage; a resumed stage gets its saved state
    back. Only the stage's parameters require grad; under FSDP they are `sharded`'s."""
    c = job.config
    trained = sharded.params(job.student) if sharded is not None else None
    for p in [*job.student.gm.parameters(), *(trained or {}).values()]:
        p.requires_grad_(False)
    groups = param_groups(job.student, c.learning_rates(stage), c.weight_decay, trained)
    trainable = [p for g in groups for p in g["params"]]
    for p in trainable:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(groups, betas=(c.beta1, c.beta2), weight_decay=c.weight_decay)
    factor = lambda s, steps=steps: lr_factor(s, steps, c.warmup, c.schedule, c.min_lr_ratio)  # noqa: E731
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    if job.state is not None and job.state["stage"] == index:
        if sharded is not None:
            sharded.load_optimizer_state(optimizer, job.state["optimizer"])
        else:
            optimizer.load_state_dict(job.state["optimizer"])
        scheduler.load_state_dict(job.state["scheduler"])
    return optimizer, scheduler, trainable


def out_of_memory(exc: Exception, job: Job) -> DistillError:
    """What to change when a micro-batch does not fit: a smaller one, or recomputed activations."""
    c, micro = job.config, job.micro
    smaller = f"a smaller --micro-batch (e.g. {micro // 2}: the global batch stays {c.global_batch})" if micro > 1 else "a shorter --seq-len"
    checkpointing = "" if c.grad_checkpoint else ", or --grad-checkpoint (recompute the GDN layers' activations)"
    return DistillError(f"Out of memory on a micro-batch of {micro} x {c.seq_len} tokens ({first_line(exc, 'out of memory')}).",
                        f"Use {smaller}{checkpointing}.")


def optimizer_step(job: Job, step: int, optimizer, stage: Stage, trainable, frozen=()) -> dict:
    """One optimizer step over this rank's share of the global batch, in micro-batches. Each
    micro-batch loss is weighted by micro/local, so after DDP averages over ranks the gradient is
    the mean over the whole global batch. frozen: parameters whose gradient is dropped before the
    step (AdamW then leaves them, and their weight decay, alone)."""
    place, micro, local = job.place, job.micro, job.local
    batch = job.order.batch(step, place.rank, place.world).to(place.device)
    optimizer.zero_grad(set_to_none=True)
    total = torch.zeros((), dtype=torch.float64, device=place.device)
    count = local // micro
    try:
        for i in range(count):
            sync = i == count - 1 or not hasattr(stage.module, "no_sync")
            with contextlib.nullcontext() if sync else stage.module.no_sync():
                loss = stage.loss(batch[i * micro:(i + 1) * micro]) * (micro / local)
                loss.backward()
            total += loss.detach().double()
    except RuntimeError as exc:
        if not ran_out_of_memory(exc):
            raise
        optimizer.zero_grad(set_to_none=True)  # a caller that retries smaller gets the memory back
        raise out_of_memory(exc, job) from None
    for p in frozen:
        p.grad = None
    value = place.mean(total).item()
    if not math.isfinite(value):
        raise DistillError(f"The loss became {value} at step {step + 1}.", "Lower the learning rates (--lr), check the data, or use float32 (--dtype float32).")
    norm = clip_grad_norm(trainable, job.config.clip if job.config.clip > 0 else float("inf"), place.device)
    optimizer.step()
    return {"loss": value, "grad_norm": norm}


def finished_result(job: Job) -> dict:
    """The result of resuming a run that already finished: its last checkpoint, nothing trained."""
    done, place = job.state["step"], job.place
    return {"out": str(job.run_dir.path), "checkpoint": str(job.last), "steps": done, "tokens": done * job.config.tokens_per_step,
            **job.state["summary"], "rank": place.rank, "world": place.world, "tokens_per_s": None,
            "flops_per_s": None, "seconds": 0.0, "complete": True, "stopped": None}


def stop_reason(place, interrupts: Interrupts, time_limit: float | None, started: float) -> str | None:
    """"time_limit" once it has passed (every rank takes rank 0's answer), else the name of a signal
    any rank caught (an all-reduce), else None: every rank stops at the same step."""
    if time_limit and place.agree(time.perf_counter() - started >= time_limit):
        return "time_limit"
    signum = place.largest(interrupts.signum or 0)  # a rank other than this one may have caught it
    return signal.Signals(signum).name if signum else None


class Trainer:
    """Trains a Job's stages from where its state left off; on_step(record) runs after each step's
    checkpoint (if any) is written."""

    def __init__(self, job: Job, progress: bool, on_step: Callable[[dict], None] | None = None):
        self.job, self.config, self.place, self.on_step = job, job.config, job.place, on_step
        self.progress = progress
        self.stages = self.config.steps()
        self.total_steps = sum(s for _, s in self.stages)
        self.compile = not self.config.fsdp and resolve_compile(self.config.compile, self.place.device, "train", self.config.tokens)
        self.sharded: ShardedStudent | None = None  # what trains under FSDP, this stage

    def run(self) -> dict:
        if self.job.complete:
            return finished_result(self.job)
        params_before = {p: p.requires_grad for p in self.job.student.gm.parameters()}
        with Interrupts(self.place.main) as self.interrupts:
            self.train_all(params_before)
        self.place.barrier()
        return run_result(self)

    def train_all(self, params_before: dict) -> None:
        """Every stage from where the state left off, until done or stopped (time limit, signal)."""
        self.begin()
        try:
            first = 0
            for index, (stage, steps) in enumerate(self.stages):
                if self.tally.done < first + steps:
                    self.train_stage(index, stage, steps, first)
                    if self.tally.stopped:
                        break
                first += steps
        finally:
            self.reporter.close()
            for p, flag in params_before.items():
                p.requires_grad_(flag)

    def begin(self) -> None:
        """Clocks, RNG, the progress bar and the summary; a new run scores teacher and student first."""
        c, state = self.config, self.job.state
        self.tally = Tally(done=state["step"] if state else 0, last_path=self.job.last)
        self.elapsed_before = state["elapsed"] if state else 0.0
        self.started = time.perf_counter()
        if state:
            set_rng_state(state["rng"])
        else:
            torch.manual_seed(c.seed)
        self.reporter = Reporter(self.progress and self.place.main, self.total_steps * c.tokens_per_step, self.total_steps)  # whole steps: at most c.tokens
        self.summary = dict(state["summary"]) if state else {"loss": None, "eval_ppl": None, "teacher_ppl": None}
        if state is None:
            teacher_ppl, ppl = self.evaluate(self.job.teacher), self.evaluate(self.job.student)
            if ppl is not None:
                self.job.run_dir.log({"step": 0, "tokens": 0, "eval_ppl": ppl, "teacher_ppl": teacher_ppl})
                self.summary.update(eval_ppl=ppl, teacher_ppl=teacher_ppl)
                self.reporter.note(f"start: perplexity {ppl:.4g} (teacher {teacher_ppl:.4g})")

    def train_stage(self, index: int, stage: str, steps: int, first: int) -> None:
        job = self.job
        self.sharded = shard_student(job.student, stage, self.place, self.config, job.autocast_on) if self.config.fsdp else None
        optimizer, scheduler, trainable = build_optimizer(job, index, stage, steps, self.sharded)
        flags = CausalFlags(self.config.seq_len)  # used only when compiling
        if stage == "l2":
            built = stage_l2(job.student, job.teacher, self.place, job.autocast, self.compile, flags, self.sharded)
        else:
            teacher = shard_teacher(job.teacher, self.place, release=job.owns_teacher) if self.config.fsdp_teacher else None  # nothing runs teacher.gm after
            built = stage_kl(job.student, job.teacher, self.place, job.autocast, self.config.temperature, self.compile, flags, self.sharded, teacher)
        with gradient_checkpointing(job.student.gdn_modules().values(), self.config.grad_checkpoint):
            for stage_step in range(self.tally.done - first, steps):
                record = self.train_step(first + stage_step, stage, optimizer, scheduler, built, trainable)
                if self.after_step(record, index, stage_step, optimizer, scheduler):
                    break
        self.refresh()
        self.sharded = None
        del built
        gc.collect()  # a DDP wrapper's gradient hooks must be gone before the next stage's

    def train_step(self, step: int, stage: str, optimizer, scheduler, built: Stage, trainable) -> dict:
        """Global step `step` (0-based: its data is order.batch(step)) and its log record."""
        c, t = self.config, self.tally
        tick = time.perf_counter()
        frozen = gate_parameters(self.job.student) if step < c.freeze_gates_steps else ()
        loss = optimizer_step(self.job, step, optimizer, built, trainable, frozen)
        lrs = {g["kind"]: g["lr"] for g in reversed(optimizer.param_groups)}  # the ones this step used
        scheduler.step()
        seconds = time.perf_counter() - tick
        t.done = step + 1
        t.tokens += c.tokens_per_step
        t.seconds += seconds
        t.flops += built.flops_per_token * c.tokens_per_step
        self.summary["loss"] = loss["loss"]
        return {"step": t.done, "stage": stage, "tokens": t.done * c.tokens_per_step, "loss": loss["loss"], "grad_norm": loss["grad_norm"],
                "lr": lrs, "tokens_per_s": c.tokens_per_step / seconds, "flops_per_s": built.flops_per_token * c.tokens_per_step / seconds,
                "elapsed": round(self.elapsed(), 3)}

    def after_step(self, record: dict, index: int, stage_step: int, optimizer, scheduler) -> bool:
        """Evaluate, log, checkpoint as the config asks; whether the time limit stops the run here."""
        c, done, tokens = self.config, record["step"], record["tokens"]
        final = done == self.total_steps
        before = tokens - c.tokens_per_step
        if c.eval_every and before // c.eval_every < tokens // c.eval_every or final:
            self.refresh()
            ppl = self.evaluate(self.job.student)
            if ppl is not None:
                record["eval_ppl"] = self.summary["eval_ppl"] = ppl
        if self.place.main:
            self.job.run_dir.log(record)
        self.reporter.update(record, tokens)
        saving = c.save_every and before // c.save_every < tokens // c.save_every or final
        stopped = None if final else stop_reason(self.place, self.interrupts, c.time_limit, self.started)
        if saving or stopped:
            self.tally.last_path = self.save(done, index, stage_step + 1, optimizer, scheduler) or self.tally.last_path
        if self.on_step is not None:
            self.on_step(record)
        if stopped:
            why = f"time limit ({c.time_limit:g} s) reached" if stopped == "time_limit" else f"{stopped}: stopped"
            self.reporter.note(f"{why} after {tokens:,} tokens (step {done}): checkpoint {self.tally.last_path} written; --resume continues")
        self.tally.stopped = stopped
        return stopped is not None

    def evaluate(self, graph) -> float | None:
        if self.job.eval_ids is None or not self.place.main:
            return None
        from ..eval.perplexity import perplexity

        with torch.no_grad(), self.job.autocast():
            return perplexity(graph, self.job.eval_ids, compile=self.compile)["perplexity"]

    def refresh(self) -> None:
        """Under FSDP, the student's full weights from the shards (every rank; once a step)."""
        if self.sharded is not None:
            self.sharded.copy_to(self.job.student, self.tally.done)

    def save(self, step: int, index: int, stage_step: int, optimizer, scheduler) -> Path | None:
        self.refresh()
        optimizer_state = self.sharded.full_optimizer_state(optimizer) if self.sharded is not None else optimizer.state_dict()
        if not self.place.main:
            return None
        job, c = self.job, self.config
        job.student.meta["distill"] = {
            "teacher": job.teacher_name, "config": c.to_dict(), "step": step, "tokens": step * c.tokens_per_step,
            "stage": self.stages[index][0], **self.summary, "previous": job.previous,
        }
        state = {
            "step": step, "tokens": step * c.tokens_per_step, "stage": index, "stage_step": stage_step,
            "optimizer": optimizer_state, "scheduler": scheduler.state_dict(), "rng": rng_state(), "config": c.to_dict(),
            "world": self.place.world, "elapsed": self.elapsed(), "summary": dict(self.summary),
        }
        return job.run_dir.save(job.student, step, state, c.keep_checkpoints)

    def elapsed(self) -> float:
        return self.elapsed_before + (time.perf_counter() - self.started)


def run_result(trainer: Trainer) -> dict:
    """What distill() returns: where the run stands, its loss and perplexity, its speed."""
    c, t, place, summary = trainer.config, trainer.tally, trainer.place, trainer.summary
    return {
        "out": str(trainer.job.run_dir.path), "checkpoint": str(t.last_path) if t.last_path else None, "steps": t.done,
        "tokens": t.done * c.tokens_per_step, "loss": summary["loss"], "eval_ppl": summary.get("eval_ppl"),
        "teacher_ppl": summary.get("teacher_ppl"), "rank": place.rank, "world": place.world,
        "tokens_per_s": t.tokens / t.seconds if t.seconds else None,
        "flops_per_s": t.flops / t.seconds if t.seconds else None,
        "seconds": round(time.perf_counter() - trainer.started, 3),
        "complete": t.done == trainer.total_steps, "stopped": t.stopped,
    }
