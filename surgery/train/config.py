"""What a distillation run is asked to do: DistillConfig (its checks, the stages it plans, their
steps and learning rates) and the learning-rate schedule."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..core.pipeline import PassConfig
from ..errors import DistillError
from tcal.schedule import SCHEDULES, lr_factor as schedule_factor

STAGES = ("l2", "kl", "both")
# The most optimizer steps a run may plan. At 1 ms a step (no step of this project has been faster)
# 10^9 steps take 11.6 days; a budget past it is a typo (--tokens 1e30), not a run. Any budget below
# is reachable from any data: the data loops in epochs, and a bigger batch takes more tokens a step.
MAX_STEPS = 10**9
# Fields that change how a run is executed or reported but not the numbers it trains on; --resume
# accepts new values for these (micro_batch changes only the float summation order).
OPERATIONAL = ("micro_batch", "save_every", "keep_checkpoints", "grad_checkpoint", "eval_every", "eval_text", "eval_tokens", "time_limit",
               "compile", "fsdp", "fsdp_offload", "fsdp_teacher")


def stages_run(stage: str | None, l2_tokens: int | None, tokens: int, tokens_per_step: int) -> str:
    """The stage setting a run takes (DistillConfig.stage None: "both" where an l2 share was given or
    tokens // 7 is at least one optimizer step, else "kl"), from a config or a saved run's fields."""
    if stage is not None:
        return stage
    return "both" if l2_tokens is not None or tokens // 7 >= tokens_per_step else "kl"


@dataclass
class DistillConfig(PassConfig):
    """tokens         training tokens over all stages; a stage runs tokens // (global_batch x seq_len) steps
    stage          "l2" (per-layer, teacher-forced MSE), "kl" (end-to-end logits), or "both" in turn;
                   None (the default): "both" where its l2 share is at least one optimizer step, else "kl"
                   (issue 30's recipe study, bench/RESULTS.md, twenty-second session, has why)
    l2_tokens      with stage "both": tokens of stage 1 (default tokens // 7, the reference's 100M of 700M)
    global_batch   sequences per optimizer step over all processes; micro_batch: per forward on one
                   process (default: the process's whole share, i.e. no accumulation)
    lr_<stage>_<group>  groups: "new" (GDN parameters the teacher does not have: a/b/g_proj, A_log,
                   dt_bias, o_norm, convolutions), "copied" (q/k/v/o_proj, from the teacher), "rest"
                   (everything outside the GDN layers; only stage kl can move it). 0 freezes a group.
                   Defaults from METHOD.md: stage 1 lr 1e-3 on the GDN layers; stage 2 1e-4 / 7e-6.
    warmup         fraction of each stage's steps with a linear warmup; schedule: cosine | constant
    freeze_gates_steps  optimizer steps (of the whole run) in which the GDN gates (tcal's "gates" role:
                   a/b/g_proj, A_log, dt_bias) get no update, held as Taylor-Calibrate set them
    eval_every, save_every  in tokens; 0 = only at the start (eval) and at the end
    autocast       bf16 autocast (None: on CUDA); float32 master weights stay in the model's dtype
    time_limit     seconds of training in this process (0: none); then a checkpoint at the next step
                   boundary and a stop; --resume continues it as if uninterrupted
    compile        run the student's, the teacher's and the evaluation forwards through torch.compile
                   (None: where it pays, surgery.core.compiled)
    fsdp           shard the trained weights, gradients and optimizer states over the processes with FSDP2
                   (surgery.train.sharding), also on one; checkpoints stay full (any world size resumes them)
    fsdp_offload   with fsdp: keep shards, gradients and optimizer states in CPU memory
    fsdp_teacher   with fsdp: stage kl's teacher sharded the same way, frozen (1/N of its weights a process)
    fsdp_mixed     with fsdp: bf16 weights in compute, float32 gradient reduction (None: with autocast,
                   i.e. on CUDA; it needs autocast)"""

    tokens: int = 0
    stage: str | None = None
    l2_tokens: int | None = None
    seq_len: int = 512
    global_batch: int = 8
    micro_batch: int | None = None
    lr_l2_new: float = 1e-3
    lr_l2_copied: float = 1e-3
    lr_kl_new: float = 1e-4
    lr_kl_copied: float = 1e-4
    lr_kl_rest: float = 7e-6
    warmup: float = 0.01
    schedule: str = "cosine"
    freeze_gates_steps: int = 0
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.95
    clip: float = 1.0
    temperature: float = 1.0
    seed: int = 0
    eval_text: str | None = None
    eval_tokens: int = 32768
    eval_every: int = 0
    save_every: int = 0
    keep_checkpoints: int = 2
    grad_checkpoint: bool = False
    autocast: bool | None = None
    time_limit: float = 0.0
    compile: bool | None = None
    fsdp: bool = False
    fsdp_offload: bool = False
    fsdp_mixed: bool | None = None
    fsdp_teacher: bool = False

    def validate(self) -> None:
        def bad(problem: str, fix: str):
            raise DistillError(problem, fix)

        if self.stage is not None and self.stage not in STAGES:
            bad(f"stage '{self.stage}' is not one of {', '.join(STAGES)}.", "Use --stage l2, kl or both.")
        if self.schedule not in SCHEDULES:
            bad(f"schedule '{self.schedule}' is not one of {', '.join(SCHEDULES)}.", "Use cosine or constant.")
        for key in ("tokens", "seq_len", "global_batch", "eval_tokens", "keep_checkpoints"):
            if getattr(self, key) < 1:
                bad(f"{key} must be >= 1, got {getattr(self, key)}.", "Use a positive number.")
        if self.seq_len < 2:
            bad("seq_len must be >= 2 tokens.", "Use e.g. --seq-len 512.")
        if self.micro_batch is not None and self.micro_batch < 1:
            bad(f"micro_batch must be >= 1, got {self.micro_batch}.", "Use a positive number, or leave it unset.")
        if self.micro_batch is not None and self.global_batch % self.micro_batch:  # each process's share must split too
            bad(f"micro-batches of {self.micro_batch} sequences do not divide a global batch of {self.global_batch}.",
                "Use a --micro-batch that divides --batch-size (per process: --batch-size / processes).")
        for key in ("eval_every", "save_every", "freeze_gates_steps", "weight_decay", "clip", "min_lr_ratio", "time_limit") + tuple(f.name for f in dataclasses.fields(self) if f.name.startswith("lr_")):
            if getattr(self, key) < 0:
                bad(f"{key} must be >= 0, got {getattr(self, key)}.", "Use 0 or a positive number.")
        if not 0 <= self.warmup < 1:
            bad(f"warmup is a fraction of each stage's steps in [0, 1), got {self.warmup}.", "Use e.g. 0.01.")
        if self.min_lr_ratio > 1:
            bad(f"min_lr_ratio must be <= 1, got {self.min_lr_ratio}.", "Use e.g. 0.1.")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            bad(f"betas must lie in [0, 1), got {self.beta1}, {self.beta2}.", "Use e.g. 0.9 and 0.95.")
        if self.temperature <= 0:
            bad(f"temperature must be > 0, got {self.temperature}.", "Use e.g. 1.0.")
        if not self.fsdp and (self.fsdp_offload or self.fsdp_mixed is not None or self.fsdp_teacher):
            name = "fsdp_offload" if self.fsdp_offload else "fsdp_teacher" if self.fsdp_teacher else "fsdp_mixed"
            bad(f"{name} only applies to a sharded run.", "Add --fsdp, or drop the option.")
        if self.fsdp and self.compile:
            bad("compile is not supported with fsdp yet.", "Drop --compile (or --fsdp).")
        if self.fsdp and self.freeze_gates_steps:
            bad("freeze_gates_steps is not supported with fsdp yet.", "Drop --freeze-gates-steps (or --fsdp).")
        if self.l2_tokens is not None and self.stage not in ("both", None):
            bad("l2_tokens only applies to --stage both.", "Drop --l2-tokens, or use --stage both.")
        for name, tokens in self.plan():
            if tokens < self.tokens_per_step:
                bad(f"Stage {name} has a budget of {tokens:,} tokens, less than one optimizer step "
                    f"({self.global_batch} sequences x {self.seq_len} tokens = {self.tokens_per_step:,}).",
                    "Raise --tokens (or --l2-tokens), or lower --batch-size / --seq-len.")
            if tokens // self.tokens_per_step > MAX_STEPS:
                bad(f"Stage {name} has a budget of {tokens:,} tokens: {tokens // self.tokens_per_step:,} optimizer steps of {self.tokens_per_step:,} tokens, "
                    f"more than the {MAX_STEPS:,} a run may take (11.6 days at 1 ms a step).",
                    "Check --tokens (e.g. 50M), or raise --batch-size / --seq-len.")
            if not any(v > 0 for v in self.learning_rates(name).values()):
                bad(f"Every learning rate of stage {name} is 0: nothing would train.", f"Give stage {name} a positive learning rate (e.g. --lr).")

        total = sum(steps for _, steps in self.steps())
        if self.freeze_gates_steps >= total:
            bad(f"freeze_gates_steps {self.freeze_gates_steps} covers the whole run ({total} optimizer steps): the gates would never train.",
                "Use fewer steps (e.g. a tenth of the run), or --set lr_kl_new=0 to keep every new parameter fixed.")

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def plan(self) -> list[tuple[str, int]]:
        """[(stage, tokens)] in the order they run."""
        stage = self.stages_run()
        if stage == "both":
            l2 = self.tokens // 7 if self.l2_tokens is None else self.l2_tokens
            return [("l2", l2), ("kl", self.tokens - l2)]
        return [(stage, self.tokens)]

    def stages_run(self) -> str:
        """The stage setting this run takes: the one asked for, else "both" where --l2-tokens was given or
        the default l2 share (tokens // 7) is at least one optimizer step, else "kl"."""
        return stages_run(self.stage, self.l2_tokens, self.tokens, self.tokens_per_step)

    def steps(self) -> list[tuple[str, int]]:
        return [(name, tokens // self.tokens_per_step) for name, tokens in self.plan()]

    def learning_rates(self, stage: str) -> dict[str, float]:
        if stage == "l2":  # the rest cannot change a teacher-forced layer-local loss
            return {"new": self.lr_l2_new, "copied": self.lr_l2_copied, "rest": 0.0}
        return {"new": self.lr_kl_new, "copied": self.lr_kl_copied, "rest": self.lr_kl_rest}

    def differences(self, saved: dict) -> list[str]:
        """Fields (other than OPERATIONAL ones) whose value differs from a saved config."""
        now = self.to_dict() | {"stage": self.stages_run()}  # the stages a run takes, asked for or by default
        defaults = type(self)().to_dict()  # a field newer than the saved run was at its default there
        keys = sorted((set(now) | set(saved)) - set(OPERATIONAL))
        was = {k: saved.get(k, defaults.get(k)) for k in keys}
        if all(k in was for k in ("tokens", "l2_tokens", "global_batch", "seq_len")):
            was["stage"] = stages_run(was["stage"], was["l2_tokens"], was["tokens"], was["global_batch"] * was["seq_len"])
        return [f"{k} (run: {was[k]!r}, now: {now.get(k)!r})" for k in keys if was[k] != now.get(k)]


def lr_factor(step: int, steps: int, warmup: float, schedule: str, min_ratio: float) -> float:
    """Multiplier of the base learning rate at 0-based `step` of a stage of `steps` steps (`warmup` is
    a fraction of them; the cosine ends one step past the stage, so its last step stays above the floor)."""
    warm = math.ceil(warmup * steps)
    return schedule_factor(step, warm, steps - warm, schedule, min_ratio)
