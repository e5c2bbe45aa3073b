"""Continue training a saved hybrid against its teacher (METHOD.md, "Distillation after
initialization"): stage 1 ("l2") fits each GDN layer to the teacher's attention output at its site,
teacher-forced; stage 2 ("kl") trains the whole student on KL(teacher || student) over the logits.

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
import copy
import dataclasses
import gc
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..core.files import sha256_file as file_digest
from ..core.graph import Graph
from ..core.pipeline import PassConfig
from ..core.rewrite import prune
from ..core.run import graph_logits, placeholder_values
from ..data.corpus import TokenCorpus, WindowOrder, check_files
from ..errors import DistillError
from ..io.checkpoint import save
from .losses import kl_divergence

STAGES = ("l2", "kl", "both")
SCHEDULES = ("cosine", "constant")
KINDS = ("new", "copied", "rest")
COPIED = ("q_proj", "k_proj", "v_proj", "o_proj")  # what replace.transfer_weights fills from the teacher
# Fields that change how a run is executed or reported but not the numbers it trains on; --resume
# accepts new values for these (micro_batch changes only the float summation order).
OPERATIONAL = ("micro_batch", "save_every", "keep_checkpoints", "grad_checkpoint", "eval_every", "eval_text", "eval_tokens", "time_limit")
RUN_FILE, LOG_FILE, STATE_FILE, PREFIX, LAST = "distill.json", "log.jsonl", "trainer_state.pt", "checkpoint-", "last"
STATE_VERSION = 1


@dataclass
class DistillConfig(PassConfig):
    """tokens         training tokens over all stages; a stage runs tokens // (global_batch x seq_len) steps
    stage          "l2" (per-layer, teacher-forced MSE), "kl" (end-to-end logits), or "both" in turn
    l2_tokens      with stage "both": tokens of stage 1 (default tokens // 7, the reference's 100M of 700M)
    global_batch   sequences per optimizer step over all processes; micro_batch: per forward on one
                   process (default: the process's whole share, i.e. no accumulation)
    lr_<stage>_<group>  groups: "new" (GDN parameters the teacher does not have: a/b/g_proj, A_log,
                   dt_bias, o_norm, convolutions), "copied" (q/k/v/o_proj, from the teacher), "rest"
                   (everything outside the GDN layers; only stage kl can move it). 0 freezes a group.
                   Defaults from METHOD.md: stage 1 lr 1e-3 on the GDN layers; stage 2 1e-4 / 7e-6.
    warmup         fraction of each stage's steps with a linear warmup; schedule: cosine | constant
    eval_every, save_every  in tokens; 0 = only at the start (eval) and at the end
    autocast       bf16 autocast (None: on CUDA); float32 master weights stay in the model's dtype
    time_limit     seconds of training in this process (0: none); when they are up the run writes a
                   checkpoint at the next step boundary and stops, and --resume continues it: a long run
                   fits job slots or time-limited machines, and its curve is that of an uninterrupted one"""

    tokens: int = 0
    stage: str = "kl"
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

    def validate(self) -> None:
        def bad(problem: str, fix: str):
            raise DistillError(problem, fix)

        if self.stage not in STAGES:
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
        for key in ("eval_every", "save_every", "weight_decay", "clip", "min_lr_ratio", "time_limit") + tuple(f.name for f in dataclasses.fields(self) if f.name.startswith("lr_")):
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
        if self.l2_tokens is not None and self.stage != "both":
            bad("l2_tokens only applies to --stage both.", "Drop --l2-tokens, or use --stage both.")
        for name, tokens in self.plan():
            if tokens < self.tokens_per_step:
                bad(f"Stage {name} has a budget of {tokens:,} tokens, less than one optimizer step "
                    f"({self.global_batch} sequences x {self.seq_len} tokens = {self.tokens_per_step:,}).",
                    "Raise --tokens (or --l2-tokens), or lower --batch-size / --seq-len.")
            if not any(v > 0 for v in self.learning_rates(name).values()):
                bad(f"Every learning rate of stage {name} is 0: nothing would train.", f"Give stage {name} a positive learning rate (e.g. --lr).")

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def plan(self) -> list[tuple[str, int]]:
        """[(stage, tokens)] in the order they run."""
        if self.stage == "both":
            l2 = self.tokens // 7 if self.l2_tokens is None else self.l2_tokens
            return [("l2", l2), ("kl", self.tokens - l2)]
        return [(self.stage, self.tokens)]

    def steps(self) -> list[tuple[str, int]]:
        return [(name, tokens // self.tokens_per_step) for name, tokens in self.plan()]

    def learning_rates(self, stage: str) -> dict[str, float]:
        if stage == "l2":  # the rest cannot change a teacher-forced layer-local loss
            return {"new": self.lr_l2_new, "copied": self.lr_l2_copied, "rest": 0.0}
        return {"new": self.lr_kl_new, "copied": self.lr_kl_copied, "rest": self.lr_kl_rest}

    def differences(self, saved: dict) -> list[str]:
        """Fields (other than OPERATIONAL ones) whose value differs from a saved config."""
        now = self.to_dict()
        keys = sorted((set(now) | set(saved)) - set(OPERATIONAL))
        return [f"{k} (run: {saved.get(k)!r}, now: {now.get(k)!r})" for k in keys if saved.get(k) != now.get(k)]


def lr_factor(step: int, steps: int, warmup: float, schedule: str, min_ratio: float) -> float:
    """Multiplier of the base learning rate at 0-based `step` of a stage of `steps` steps."""
    warm = math.ceil(warmup * steps)
    if step < warm:
        return (step + 1) / warm
    if schedule == "constant":
        return 1.0
    progress = (step - warm) / max(1, steps - warm)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


# ------------------------------------------------------------------------------------------------
# the graph side: parameter groups, teacher taps, FLOP counts


def param_kind(name: str, targets) -> str:
    for target in targets:
        if name.startswith(target + "."):
            return "copied" if name[len(target) + 1:].split(".")[0] in COPIED else "new"
    return "rest"


def param_groups(graph: Graph, lrs: dict[str, float], weight_decay: float) -> list[dict]:
    """AdamW groups per kind (new / copied / rest) with lr > 0; 1-D tensors and parameters marked
    _no_weight_decay (A_log, dt_bias) get no weight decay. Order follows named_parameters, which a
    reloaded hybrid reproduces, so optimizer states line up on resume."""
    targets = list(graph.gdn_targets().values())
    buckets: dict[tuple[str, bool], list] = {}
    for name, p in graph.gm.named_parameters():
        kind = param_kind(name, targets)
        if lrs[kind] > 0 and p.is_floating_point():
            decay = p.ndim >= 2 and not getattr(p, "_no_weight_decay", False)
            buckets.setdefault((kind, decay), []).append(p)
    return [{"params": ps, "lr": lrs[kind], "weight_decay": weight_decay if decay else 0.0, "kind": kind}
            for kind in KINDS for decay in (True, False) if (ps := buckets.get((kind, decay)))]


def tap_module(gm: torch.fx.GraphModule, names: list[str]) -> torch.fx.GraphModule:
    """A copy of gm's graph that returns the named nodes' values and stops there: what only feeds
    later layers and the LM head is pruned, so stage 1 never computes it. It shares gm's tensors and
    takes placeholder_values(gm, ids) positionally."""
    graph = torch.fx.Graph()
    env: dict = {}
    graph.graph_copy(gm.graph, env)
    by_name = {n.name: env[n] for n in gm.graph.nodes if n in env}
    missing = [n for n in names if n not in by_name]
    if missing:
        raise DistillError(f"The teacher graph has no node(s) {missing}.", "The teacher and its attention sites disagree; capture the teacher again.")
    graph.output(tuple(by_name[n] for n in names))
    tapped = torch.fx.GraphModule(gm, graph)
    tapped.meta = dict(getattr(gm, "meta", {}))
    prune(tapped)
    tapped.recompile()
    return tapped


LOOKUPS = (torch.ops.aten.embedding.default,)


def forward_params(gm: torch.nn.Module) -> int:
    """Parameters a forward pass multiplies with (a training step costs about 6 FLOPs per such
    parameter and token); a table used only for embedding lookups costs none and is left out."""
    named = dict(gm.named_parameters(remove_duplicate=False))
    lookup_only: dict[int, bool] = {}
    if isinstance(gm, torch.fx.GraphModule):
        for n in gm.graph.nodes:
            if n.op == "get_attr" and n.target in named:
                only = bool(n.users) and all(u.op == "call_function" and u.target in LOOKUPS for u in n.users)
                key = id(named[n.target])
                lookup_only[key] = lookup_only.get(key, True) and only
    unique = {id(p): p for p in gm.parameters()}
    return sum(p.numel() for key, p in unique.items() if not lookup_only.get(key, False))


class _Layers(torch.nn.Module):
    """The GDN modules as one module, so DDP sees exactly stage 1's trainable parameters."""

    def __init__(self, modules: dict[int, torch.nn.Module]):
        super().__init__()
        self.layers = torch.nn.ModuleDict({str(l): m for l, m in modules.items()})

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [m(x) for m, x in zip(self.layers.values(), xs)]


def _checkpointed_forward(module, x):
    return torch.utils.checkpoint.checkpoint(type(module).forward, module, x, use_reentrant=False)


@contextlib.contextmanager
def gradient_checkpointing(modules, enabled: bool):
    """Recompute each GDN layer in backward instead of keeping its internals (chunk matrices,
    gates): the layer's activations are the large part of its memory, its FLOPs a small part."""
    patched = []
    try:
        if enabled:
            for m in modules:
                m.forward = lambda x, m=m: _checkpointed_forward(m, x)
                patched.append(m)
        yield
    finally:
        for m in patched:
            del m.forward


# ------------------------------------------------------------------------------------------------
# processes


@dataclass
class Placement:
    """This process's place in the run: rank, world, device; owns_group when distill() started it."""

    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")
    owns_group: bool = False

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


def placement(device=None) -> Placement:
    """One process, or one of WORLD_SIZE started by torchrun (or already in a process group):
    nccl on CUDA, gloo on CPU. The device defaults to cuda:LOCAL_RANK when CUDA is there."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", local if world > 1 else torch.cuda.current_device())
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    owns = False
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
        owns = True
    if dist.is_initialized():
        return Placement(dist.get_rank(), dist.get_world_size(), dev, owns)
    return Placement(0, 1, dev, False)


# ------------------------------------------------------------------------------------------------
# models


def open_student(model, device, dtype) -> tuple[Graph, str]:
    """The hybrid to train: a Graph, or a directory written by `surgery apply` / checkpoint.save."""
    from ..io.checkpoint import load

    if isinstance(model, Graph):
        graph, name = model, "<in-memory hybrid>"
    else:
        path = Path(model)
        if not path.exists():
            raise DistillError(f"Model '{path}' does not exist.", "Pass the directory of a saved hybrid (`surgery apply --out DIR`) with --model.")
        if not (path.is_dir() and (path / "recipe.json").exists()):
            raise DistillError(f"'{path}' is not a saved hybrid (no recipe.json).", "Convert the teacher first (`surgery apply --model M --out DIR`), then distill DIR.")
        graph, name = load(path, device=device, dtype=dtype), str(path.resolve())
    if not graph.gdn_targets():
        raise DistillError(f"'{name}' has no GDN layers: its recipe converts nothing.", "Run `surgery apply` with select and replace first.")
    return graph, name


def teacher_path(source: dict) -> Path | None:
    """Where a recipe's source says the teacher lives, when it is a file or directory."""
    if source.get("kind") == "gguf" and source.get("path") and source.get("gguf_file"):
        return Path(source["path"]) / source["gguf_file"]
    if source.get("kind") == "dir" and source.get("path"):
        return Path(source["path"])
    return None


def describe_source(source) -> str:
    path = Path(str(source)).expanduser()
    return str(path.resolve()) if path.exists() else str(source)


def open_teacher(student: Graph, teacher, device, dtype) -> tuple[Graph, str]:
    """The teacher as a Graph with its own weights: an explicit source (or Graph), else the hybrid's
    in-memory teacher, else the source its recipe names. Weights it shares with the student (an
    in-memory teacher after `replace`) are copied, so training the student never moves the teacher."""
    from ..io.open import capture

    if isinstance(teacher, Graph):
        graph, name = teacher, f"<in-memory teacher {teacher.source.get('name', teacher.source.get('kind', ''))}>".replace(" >", ">")
    elif teacher is not None:
        graph, name = capture(teacher, device=device, dtype=dtype), describe_source(teacher)
    elif student.teacher is not None:
        graph = Graph(gm=student.teacher, config=student.config, source=student.source, tokenizer=student.tokenizer,
                      sites=student.sites, meta={"capture": dict(student.meta.get("capture", {}))})
        name = "<the hybrid's in-memory teacher>"
    else:
        path = teacher_path(student.source or {})
        if path is None:
            raise DistillError(f"The hybrid's recipe does not say where its teacher is (source: {student.source}).", "Pass the teacher with --teacher (a model directory, .gguf file or short name).")
        if not path.exists():
            raise DistillError(f"The hybrid's teacher '{path}' (named in its recipe) does not exist here.", "Pass the teacher with --teacher.")
        graph, name = capture(path, device=device, dtype=dtype), str(path.resolve())
    gm = graph.teacher_gm
    student_tensors = {p.data_ptr() for p in student.gm.parameters()}
    if any(p.data_ptr() in student_tensors for p in gm.parameters()):
        gm = copy.deepcopy(gm)
    graph = dataclasses.replace(graph, gm=gm, teacher=None, cache={})
    _check_teacher(student, graph, name)
    return graph, name


def _check_teacher(student: Graph, teacher: Graph, name: str) -> None:
    if len(teacher.sites) != len(student.sites):
        raise DistillError(f"The teacher {name} has {len(teacher.sites)} attention layers, the hybrid {len(student.sites)}.", "Pass the teacher the hybrid was converted from (--teacher).")
    targets = list(student.gdn_targets().values())
    mine = {n: p for n, p in student.gm.named_parameters() if param_kind(n, targets) == "rest"}
    theirs = dict(teacher.gm.named_parameters())
    common = set(mine) & set(theirs)
    wrong = sorted(n for n in common if mine[n].shape != theirs[n].shape)
    if not common or wrong:
        raise DistillError(f"The teacher {name} does not match the hybrid ({len(common)} shared parameter names, {len(wrong)} of other shapes, e.g. {wrong[:2]}).",
                           "Pass the teacher the hybrid was converted from (--teacher).")


# ------------------------------------------------------------------------------------------------
# the output directory


def checkpoints(out: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (a directory appears only by a final rename), oldest first."""
    found = []
    for path in out.glob(PREFIX + "*"):
        step = path.name[len(PREFIX):]
        if path.is_dir() and step.isdigit() and (path / STATE_FILE).exists():
            found.append((int(step), path))
    return sorted(found)


def _write_json_atomic(path: Path, data) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def _rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ------------------------------------------------------------------------------------------------
# the run


class _Reporter:
    """Progress on stderr (rank 0): a rich bar with tokens/s on a terminal, a line now and then
    otherwise (logs and CI)."""

    def __init__(self, enabled: bool, total_tokens: int, total_steps: int):
        self.enabled, self.total_steps = enabled, total_steps
        self.tty = enabled and sys.stderr.isatty()
        self.every = max(1, total_steps // 20)
        self.printed = time.perf_counter()
        self.bar = None
        if self.tty:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("distill {task.fields[stage]}"), BarColumn(),
                                TextColumn("{task.completed:,}/{task.total:,} tokens"), TextColumn("{task.fields[tps]:,.0f} tok/s"),
                                TextColumn("loss {task.fields[loss]:.4g}"), TimeElapsedColumn(), TimeRemainingColumn(),
                                console=Console(stderr=True))
            self.task = self.bar.add_task("distill", total=total_tokens, stage="", tps=0.0, loss=float("nan"))
            self.bar.start()

    def update(self, record: dict, tokens: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=tokens, stage=record["stage"], tps=record["tokens_per_s"], loss=record["loss"])
        elif self.enabled and (record["step"] % self.every == 0 or record["step"] == self.total_steps or time.perf_counter() - self.printed > 60):
            self.printed = time.perf_counter()
            print(f"distill step {record['step']}/{self.total_steps} ({record['stage']}): loss {record['loss']:.4e}, "
                  f"{record['tokens_per_s']:,.0f} tok/s, {record['flops_per_s'] / 1e12:.3g} TFLOP/s", file=sys.stderr, flush=True)

    def note(self, text: str) -> None:
        if self.bar is not None:
            self.bar.console.print(text)
        elif self.enabled:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


class _Run:
    def __init__(self, place: Placement, model, data, out, config: DistillConfig, *, teacher, resume, force, dtype, on_step):
        self.config, self.out, self.on_step, self.place = config, Path(out), on_step, place
        self.dtype = dtype or torch.float32
        c = config
        self.autocast_on = c.autocast if c.autocast is not None else self.place.device.type == "cuda"
        self.resume = resume
        self.digests = [file_digest(p) for p in check_files(data)]
        if c.global_batch % self.place.world:
            raise DistillError(f"A global batch of {c.global_batch} sequences cannot be split over {self.place.world} processes.", "Use a --batch-size divisible by the number of processes.")
        self.local = c.global_batch // self.place.world
        self.micro = c.micro_batch or self.local
        if self.local % self.micro:
            raise DistillError(f"Each process takes {self.local} sequences a step, which {self.micro}-sequence micro-batches do not divide.", "Use a --micro-batch that divides --batch-size / processes.")
        self._prepare_out(model, resume, force)
        last = checkpoints(self.out)[-1] if resume and checkpoints(self.out) else None
        self.state = torch.load(last[1] / STATE_FILE, map_location="cpu", weights_only=False) if last else None
        self.last_path = last[1] if last else None
        self.complete = self.state is not None and self.state["step"] >= sum(s for _, s in config.steps())
        if self.complete:  # a finished run resumed again: nothing to load
            return
        start_from = last[1] if last else model
        self.student, student_name = open_student(start_from, self.place.device, self.dtype)
        self.model_name = self.saved_run["model"] if resume and self.saved_run else student_name
        earlier = self.student.meta.get("distill") or {}
        # earlier distillation runs of the model this run started from, kept in every checkpoint's recipe
        self.previous = earlier.get("previous", []) if last else [*earlier.get("previous", []), {k: v for k, v in earlier.items() if k != "previous"}] if earlier else []
        teacher_dtype = torch.bfloat16 if self.autocast_on and self.place.device.type == "cuda" else self.student.dtype
        self.teacher, self.teacher_name = open_teacher(self.student, teacher, self.place.device, teacher_dtype)
        if resume and self.saved_run and self.saved_run["teacher"] != self.teacher_name:
            raise DistillError(f"--resume would use the teacher {self.teacher_name}, the run used {self.saved_run['teacher']}.", "Resume with the same teacher (--teacher), or start a new run.")
        for g, who in ((self.student, "hybrid"), (self.teacher, "teacher")):
            if c.seq_len > g.max_length:
                raise DistillError(f"seq_len {c.seq_len} exceeds what the {who} graph takes ({g.max_length} tokens).", f"Use --seq-len {g.max_length} or less.")
        tokenizer = self.teacher.tokenizer or self.student.tokenizer
        if self.place.main:  # rank 0 tokenises; the others then find the cache
            corpus = TokenCorpus.build(data, tokenizer, digests=self.digests)
        self.place.barrier()
        if not self.place.main:
            corpus = TokenCorpus.build(data, tokenizer, digests=self.digests)
        self.corpus = corpus
        self.order = WindowOrder(corpus, c.seq_len, c.global_batch, c.seed)
        if resume and self.saved_run and self.saved_run["corpus"] != corpus.key:
            raise DistillError("--resume would tokenise the training data differently (another tokenizer) than the run did.", "Resume with the run's teacher, or start a new run.")
        self.eval_ids = None
        if c.eval_text:
            from ..data.text import read_text, tokenize

            ids = tokenize(tokenizer, read_text(c.eval_text))[: c.eval_tokens]
            if ids.numel() < 2:
                raise DistillError(f"The evaluation text '{c.eval_text}' holds {ids.numel()} token(s).", "Use a longer --eval-text.")
            self.eval_ids = ids
        self.extra_s = self.student.gm.meta.get("extra_inputs", {})
        self.layers = self.student.gdn_targets()
        self.gdn = self.student.gdn_modules()
        if self.place.main:
            self._start_files(data)
        self.place.barrier()

    # -- output directory --------------------------------------------------------------------------

    def _prepare_out(self, model, resume: bool, force: bool) -> None:
        out, c = self.out, self.config
        self.saved_run = None
        if out.exists() and not out.is_dir():
            raise DistillError(f"--out '{out}' is a file.", "Choose a directory for --out.")
        if not isinstance(model, Graph) and Path(model).exists():
            m, o = Path(model).resolve(), out.resolve()
            if m == o or o in m.parents:
                raise DistillError(f"--out '{out}' would hold the model it starts from ('{model}').", "Write the run to another directory.")
        if resume:
            run_file = out / RUN_FILE
            if not run_file.exists():
                raise DistillError(f"--resume was given, but '{out}' holds no distillation run ({RUN_FILE} is missing).", "Drop --resume to start a new run (add --force to replace the directory).")
            self.saved_run = json.loads(run_file.read_text())
            diffs = c.differences(self.saved_run["config"])
            if diffs:
                raise DistillError(f"--resume was given a config that differs from the run in '{out}': {'; '.join(diffs)}.",
                                   "Resume with the run's settings (see its distill.json), or start a new run in another --out (or with --force).")
            if self.digests != self.saved_run["digests"]:
                raise DistillError("--resume was given other training data than the run used.", f"Resume with the same --data files ({', '.join(self.saved_run['data'])}), or start a new run.")
            if not isinstance(model, Graph) and describe_source(model) != self.saved_run["model"]:
                raise DistillError(f"--resume was given the model '{model}', the run in '{out}' started from '{self.saved_run['model']}'.",
                                   "Resume with the run's --model (see its distill.json), or start a new run.")
        elif out.exists() and any(out.iterdir()) and not force:
            raise DistillError(f"'{out}' already exists.", "Pass --resume to continue the run in it, --force to replace it, or choose another --out.")

    def _start_files(self, data) -> None:
        out = self.out
        if not self.resume and out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True, exist_ok=True)
        # temporary directories of a killed run: checkpoint.save's staging (.checkpoint-N.XXXX)
        for stale in out.glob(f".*{PREFIX}*"):
            shutil.rmtree(stale, ignore_errors=True)
        if not self.resume or self.saved_run is None:
            _write_json_atomic(out / RUN_FILE, {
                "config": self.config.to_dict(), "model": self.model_name, "teacher": self.teacher_name,
                "data": [str(Path(d).resolve()) for d in data], "digests": self.digests, "corpus": self.corpus.key, "corpus_tokens": len(self.corpus),
                "world": self.place.world,
            })
        log = out / LOG_FILE
        if self.resume and log.exists():  # drop records the interrupted run wrote after its last checkpoint
            done = self.state["step"] if self.state else 0
            keep = [line for line in log.read_text().splitlines() if line.strip() and json.loads(line).get("step", 0) <= done]
            if self.state is None:
                keep = []
            tmp = log.with_name(f".{LOG_FILE}.{os.getpid()}")
            tmp.write_text("".join(line + "\n" for line in keep))
            os.replace(tmp, log)

    def _log(self, record: dict) -> None:
        if self.place.main:
            with open(self.out / LOG_FILE, "a") as f:
                f.write(json.dumps(record) + "\n")

    # -- stages --------------------------------------------------------------------------------------

    def _autocast(self):
        return torch.autocast(self.place.device.type, dtype=torch.bfloat16, enabled=self.autocast_on)

    def _ddp(self, module):
        if self.place.world == 1:
            return module
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.place.device.index] if self.place.device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=ids, broadcast_buffers=False)

    def _stage_l2(self):
        sites = self.teacher.sites
        names = [n for l in self.layers for n in (sites[l].input_node, sites[l].output_node)]
        taps = tap_module(self.teacher.gm, names)
        wrapped = self._ddp(_Layers(self.gdn))

        def loss(ids):
            with torch.no_grad(), self._autocast():
                outs = taps(*placeholder_values(taps, ids))
            with self._autocast():
                preds = wrapped(list(outs[0::2]))
            return torch.stack([F.mse_loss(p.float(), t.float()) for p, t in zip(preds, outs[1::2])]).mean()

        gdn_params = sum(p.numel() for m in self.gdn.values() for p in m.parameters())
        return wrapped, loss, 6 * gdn_params + 2 * forward_params(taps)

    def _stage_kl(self):
        wrapped = self._ddp(self.student.gm)
        temperature = self.config.temperature

        def loss(ids):
            with torch.no_grad(), self._autocast():
                teacher = graph_logits(self.teacher.gm, ids)
            with self._autocast():
                student = graph_logits(wrapped, ids, self.extra_s)
            return kl_divergence(student, teacher, temperature)

        return wrapped, loss, 6 * forward_params(self.student.gm) + 2 * forward_params(self.teacher.gm)

    # -- evaluation and checkpoints --------------------------------------------------------------

    def _eval(self, graph: Graph) -> float | None:
        if self.eval_ids is None or not self.place.main:
            return None
        from ..eval.perplexity import perplexity

        with torch.no_grad(), self._autocast():
            return perplexity(graph, self.eval_ids)["perplexity"]

    def _save(self, step: int, stage_index: int, stage_step: int, optimizer, scheduler, summary: dict) -> Path | None:
        if not self.place.main:
            return None
        self.student.meta["distill"] = {
            "teacher": self.teacher_name, "config": self.config.to_dict(), "step": step, "tokens": step * self.config.tokens_per_step,
            "stage": self.stages[stage_index][0], **summary, "previous": self.previous,
        }
        name = f"{PREFIX}{step:08d}"
        state = {
            "version": STATE_VERSION, "step": step, "tokens": step * self.config.tokens_per_step,
            "stage": stage_index, "stage_step": stage_step, "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(), "rng": _rng_state(), "config": self.config.to_dict(),
            "world": self.place.world, "elapsed": self.elapsed(), "summary": dict(summary),
        }
        # the training state joins the model in save's staging directory: one final rename
        save(self.student, self.out / name, force=True, extra=lambda staging: torch.save(state, staging / STATE_FILE))
        link = self.out / f".{LAST}.{os.getpid()}"
        with contextlib.suppress(OSError):
            link.unlink(missing_ok=True)
            link.symlink_to(name)
            os.replace(link, self.out / LAST)
        for _, old in checkpoints(self.out)[:-self.config.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
        return self.out / name

    def elapsed(self) -> float:
        return self.elapsed_before + (time.perf_counter() - self.started)

    # -- the loop ------------------------------------------------------------------------------------

    def run(self, progress: bool) -> dict:
        c, place = self.config, self.place
        if self.complete:
            done = self.state["step"]
            return {"out": str(self.out), "checkpoint": str(self.last_path), "steps": done, "tokens": done * c.tokens_per_step,
                    **self.state["summary"], "rank": place.rank, "world": place.world, "tokens_per_s": None, "flops_per_s": None, "seconds": 0.0,
                    "complete": True, "stopped": None}
        self.stages = c.steps()
        total_steps = sum(s for _, s in self.stages)
        state = self.state
        done = state["step"] if state else 0
        self.elapsed_before = state["elapsed"] if state else 0.0
        self.started = time.perf_counter()
        if state:
            _set_rng_state(state["rng"])
        else:
            torch.manual_seed(c.seed)
        reporter = _Reporter(progress and place.main, total_steps * c.tokens_per_step, total_steps)  # whole steps: at most c.tokens
        summary = dict(state["summary"]) if state else {"loss": None, "eval_ppl": None, "teacher_ppl": None}
        last_path = checkpoints(self.out)[-1][1] if state else None
        if state is None:
            teacher_ppl, ppl = self._eval(self.teacher), self._eval(self.student)
            if ppl is not None:
                self._log({"step": 0, "tokens": 0, "eval_ppl": ppl, "teacher_ppl": teacher_ppl})
                summary.update(eval_ppl=ppl, teacher_ppl=teacher_ppl)
                reporter.note(f"start: perplexity {ppl:.4g} (teacher {teacher_ppl:.4g})")
        trained_tokens, train_seconds, flops_total = 0, 0.0, 0.0
        first, stopped = 0, False
        params_before = {p: p.requires_grad for p in self.student.gm.parameters()}
        try:
            for index, (stage, steps) in enumerate(self.stages):
                if done >= first + steps:
                    first += steps
                    continue
                for p in self.student.gm.parameters():
                    p.requires_grad_(False)
                groups = param_groups(self.student, c.learning_rates(stage), c.weight_decay)
                trainable = [p for g in groups for p in g["params"]]
                for p in trainable:
                    p.requires_grad_(True)
                optimizer = torch.optim.AdamW(groups, betas=(c.beta1, c.beta2), weight_decay=c.weight_decay)
                factor = lambda s, steps=steps: lr_factor(s, steps, c.warmup, c.schedule, c.min_lr_ratio)  # noqa: E731
                scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
                if state is not None and state["stage"] == index:
                    optimizer.load_state_dict(state["optimizer"])
                    scheduler.load_state_dict(state["scheduler"])
                wrapped, loss_fn, flops_per_token = (self._stage_l2 if stage == "l2" else self._stage_kl)()
                with gradient_checkpointing(self.gdn.values(), c.grad_checkpoint):
                    for stage_step in range(done - first, steps):
                        step = first + stage_step  # 0-based global step: its data is order.batch(step)
                        tick = time.perf_counter()
                        loss = self._step(step, optimizer, wrapped, loss_fn, trainable)
                        lrs = {g["kind"]: g["lr"] for g in reversed(optimizer.param_groups)}  # the ones this step used
                        scheduler.step()
                        seconds = time.perf_counter() - tick
                        done = step + 1
                        tokens = done * c.tokens_per_step
                        trained_tokens += c.tokens_per_step
                        train_seconds += seconds
                        flops_total += flops_per_token * c.tokens_per_step
                        record = {"step": done, "stage": stage, "tokens": tokens, "loss": loss["loss"], "grad_norm": loss["grad_norm"],
                                  "lr": lrs,
                                  "tokens_per_s": c.tokens_per_step / seconds, "flops_per_s": flops_per_token * c.tokens_per_step / seconds,
                                  "elapsed": round(self.elapsed(), 3)}
                        summary["loss"] = loss["loss"]
                        final = done == total_steps
                        before = tokens - c.tokens_per_step
                        if c.eval_every and before // c.eval_every < tokens // c.eval_every or final:
                            ppl = self._eval(self.student)
                            if ppl is not None:
                                record["eval_ppl"] = summary["eval_ppl"] = ppl
                        self._log(record)
                        reporter.update(record, tokens)
                        saving = c.save_every and before // c.save_every < tokens // c.save_every or final
                        stopped = not final and self._out_of_time()
                        if saving or stopped:
                            last_path = self._save(done, index, stage_step + 1, optimizer, scheduler, summary) or last_path
                        if self.on_step is not None:
                            self.on_step(record)
                        if stopped:
                            reporter.note(f"time limit ({c.time_limit:g} s) reached after {tokens:,} tokens: checkpoint written; --resume continues")
                            break
                del wrapped, loss_fn
                gc.collect()  # a DDP wrapper's gradient hooks must be gone before the next stage's
                if stopped:
                    break
                first += steps
        finally:
            reporter.close()
            for p, flag in params_before.items():
                p.requires_grad_(flag)
        place.barrier()
        result = {
            "out": str(self.out), "checkpoint": str(last_path) if last_path else None, "steps": done,
            "tokens": done * c.tokens_per_step, "loss": summary["loss"], "eval_ppl": summary.get("eval_ppl"),
            "teacher_ppl": summary.get("teacher_ppl"), "rank": place.rank, "world": place.world,
            "tokens_per_s": trained_tokens / train_seconds if train_seconds else None,
            "flops_per_s": flops_total / train_seconds if train_seconds else None,
            "seconds": round(time.perf_counter() - self.started, 3),
            "complete": done == total_steps, "stopped": "time_limit" if stopped else None,
        }
        return result

    def _out_of_time(self) -> bool:
        """Whether time_limit has passed; every rank takes rank 0's answer, so all stop at one step."""
        if not self.config.time_limit:
            return False
        late = time.perf_counter() - self.started >= self.config.time_limit
        if self.place.world == 1:
            return late
        flag = torch.tensor(float(late), device=self.place.device)
        dist.broadcast(flag, 0)
        return bool(flag.item())

    def _out_of_memory(self, exc: Exception) -> DistillError:
        """What to change when a micro-batch does not fit: a smaller one, or recomputed activations."""
        c, micro = self.config, self.micro
        first = (str(exc).strip().splitlines() or ["out of memory"])[0]
        smaller = f"a smaller --micro-batch (e.g. {micro // 2}: the global batch stays {c.global_batch})" if micro > 1 else "a shorter --seq-len"
        checkpointing = "" if c.grad_checkpoint else ", or --grad-checkpoint (recompute the GDN layers' activations)"
        return DistillError(f"Out of memory on a micro-batch of {micro} x {c.seq_len} tokens ({first}).",
                            f"Use {smaller}{checkpointing}.")

    def _step(self, step: int, optimizer, wrapped, loss_fn, trainable) -> dict:
        """One optimizer step over this rank's share of the global batch, in micro-batches. Each
        micro-batch loss is weighted by micro/local, so after DDP averages over ranks the gradient is
        the mean over the whole global batch."""
        place = self.place
        batch = self.order.batch(step, place.rank, place.world).to(place.device)
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), dtype=torch.float64, device=place.device)
        count = self.local // self.micro
        try:
            for i in range(count):
                sync = i == count - 1 or not hasattr(wrapped, "no_sync")
                with contextlib.nullcontext() if sync else wrapped.no_sync():
                    loss = loss_fn(batch[i * self.micro:(i + 1) * self.micro]) * (self.micro / self.local)
                    loss.backward()
                total += loss.detach().double()
        except torch.OutOfMemoryError as exc:
            optimizer.zero_grad(set_to_none=True)  # a caller that retries smaller gets the memory back
            raise self._out_of_memory(exc) from None
        if place.world > 1:
            dist.all_reduce(total)
            total /= place.world
        value = total.item()
        if not math.isfinite(value):
            raise DistillError(f"The loss became {value} at step {step + 1}.", "Lower the learning rates (--lr), check the data, or use float32 (--dtype float32).")
        norm = torch.nn.utils.clip_grad_norm_(trainable, self.config.clip if self.config.clip > 0 else float("inf"))
        optimizer.step()
        return {"loss": value, "grad_norm": float(norm)}


def distill(model, data, out, config: DistillConfig, *, teacher=None, resume: bool = False, force: bool = False,
            device=None, dtype: torch.dtype | None = None, progress: bool = True,
            on_step: Callable[[dict], None] | None = None) -> dict:
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
    Under torchrun (WORLD_SIZE > 1) each process runs this with the same arguments; it joins or starts
    the process group (nccl on CUDA, gloo on CPU) and trains with DDP.
    Returns a summary: final checkpoint, steps, tokens, loss, eval_ppl, tokens_per_s, flops_per_s.
    flops_per_s is model FLOP/s, (6 x trained forward params + 2 x teacher forward params) x tokens/s:
    stage kl counts the whole student and teacher, stage l2 the GDN layers and the teacher up to the
    last GDN site (what tap_module keeps); embedding lookups count nothing. Comparable with 6N of a
    plain training step."""
    config.validate()
    place = placement(device)
    try:
        run = _Run(place, model, data, out, config, teacher=teacher, resume=resume, force=force, dtype=dtype, on_step=on_step)
        return run.run(progress)
    finally:
        if place.owns_group:
            dist.destroy_process_group()
