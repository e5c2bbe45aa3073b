"""The student trained under FSDP2 (torch.distributed.fsdp.fully_shard): each process holds a
1/world slice of the trained weights, their gradients and AdamW states, and gathers one unit's full
weights at a time for its forward and backward.

Units: stage kl shards the student cut by layer_split (one unit per decoder layer, the embeddings
and the head in the root unit); stage l2 shards each GDN layer. A unit whose parameters another unit
also reads (tied weights) is left to the root unit. Options (DistillConfig):
* fsdp_mixed: bf16 weights in compute, float32 gradient reduction (MixedPrecisionPolicy); by default
  whenever the run computes under bf16 autocast (on CUDA), and only then: a captured graph fixes the
  dtypes of its casts (an RMSNorm casts back to float32), so only autocast keeps its matmuls in one dtype.
  Unit inputs are not cast (cast_forward_inputs=False): the residual stream between layers stays
  float32, as under autocast without FSDP;
* fsdp_offload: shards, gradients and optimizer states live in CPU memory (CPUOffloadPolicy), the
  optimizer step runs on the CPU;
* grad_checkpoint: each unit is recomputed in backward (per-layer activation checkpointing).

The trained copy is a deep copy of the student; the student Graph itself keeps full weights on every
process, refreshed from the shards (copy_to) before every evaluation and checkpoint and at the end
of a stage. Checkpoints therefore stay the plain format (model.safetensors plus the trainer state
with full, unsharded optimizer states, written by rank 0), and one resumes at any world size, with
or without --fsdp. No pickle anywhere: torch.distributed.checkpoint is not used, because in torch
2.13 its FileSystemWriter pickle.dump's the .metadata file and its reader pickle.load's it, so a
resume would unpickle a file from the run directory. The cost: one full copy of the student's
weights per process, and at each checkpoint every rank joins the gather of the optimizer states
(a tensor at a time) that rank 0 keeps whole in CPU memory (twice the trained weights in float32).
The teacher is frozen and whole on every process, or, with fsdp_teacher, in stage kl sharded the same
way (shard_teacher: each process keeps 1/world of its weights and gathers a decoder layer's at a time
for its forward; a teacher the run opened itself then drops its full copies)."""
from __future__ import annotations

import contextlib
import copy
from collections import Counter

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from ..core.graph import Graph
from ..errors import DistillError
from .layer_split import split_by_layer, unit_names
from .placement import Placement
from .stages import Layers, split_columns


def precision(mixed: bool | None, autocast: bool) -> MixedPrecisionPolicy:
    """bf16 weights in compute, float32 gradient reduction; None: when the run uses bf16 autocast."""
    if mixed and not autocast:
        raise DistillError("fsdp_mixed (bf16 weights in compute) needs bf16 autocast: the captured graph casts to the dtypes it was captured in.",
                           "Add --set autocast=true, or drop --set fsdp_mixed=true.")
    if mixed if mixed is not None else autocast:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
    return MixedPrecisionPolicy()


def checkpoint_unit(unit: torch.nn.Module) -> None:
    """Recompute the unit in backward: its forward runs under torch.utils.checkpoint (the class
    fully_shard gives the unit keeps this instance attribute; FSDP's hooks gather around it)."""
    unit.forward = lambda *args, unit=unit: torch.utils.checkpoint.checkpoint(type(unit).forward, unit, *args, use_reentrant=False)


def exclusive(root: torch.nn.Module, units: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The units whose parameters no other part of root reads."""
    paths = {id(m): name for name, m in root.named_modules()}
    holders: Counter = Counter()
    for name, p in root.named_parameters(remove_duplicate=False):
        owner = next((paths[id(u)] for u in units if name.startswith(paths[id(u)] + ".")), name)
        holders[id(p), owner] += 1
    owners = Counter(key for key, _ in holders)
    return [u for u in units if all(owners[id(p)] == 1 for p in u.parameters())]


def apply_fsdp(root: torch.nn.Module, units: list[torch.nn.Module], place: Placement, *, precision: MixedPrecisionPolicy,
               offload: bool, checkpoint: bool, reshard_after_forward: bool | None = None) -> None:
    mesh = init_device_mesh(place.device.type, (place.world,))
    policy = CPUOffloadPolicy(pin_memory=place.device.type == "cuda") if offload else OffloadPolicy()
    options = dict(mesh=mesh, mp_policy=precision, offload_policy=policy)
    if reshard_after_forward is not None:
        options["reshard_after_forward"] = reshard_after_forward
    for unit in units:
        if checkpoint:
            checkpoint_unit(unit)
    for unit in exclusive(root, units):
        fully_shard(unit, **options)
    fully_shard(root, **options)


def gather(value, device: torch.device):
    """The full tensor of a shard (a collective: every rank calls it in the same order)."""
    if not isinstance(value, DTensor):
        return value
    local = value.to_local().to(device)  # offloaded shards live on the CPU; the collective runs on device
    return DTensor.from_local(local, value.device_mesh, value.placements, shape=value.shape, stride=value.stride()).full_tensor()


def shard_like(full: torch.Tensor, param) -> torch.Tensor:
    """This rank's slice of `full`, laid out as the sharded parameter `param` (no communication)."""
    if not isinstance(param, DTensor) or full.shape != param.shape:
        return full
    mine = distribute_tensor(full.to(param.device_mesh.device_type), param.device_mesh, param.placements, src_data_rank=None).to_local()
    return DTensor.from_local(mine.to(param.to_local().device), param.device_mesh, param.placements, shape=param.shape, stride=param.stride())


class ShardedStudent(torch.nn.Module):
    """What a stage trains under FSDP: `root` (the FSDP module) and the student name of each of its
    parameters; no_sync() skips the gradient reduction between micro-batches, as DDP's does."""

    def __init__(self, root: torch.nn.Module, names: dict[str, str], place: Placement):
        super().__init__()
        self.root, self.names, self.place = root, names, place
        self.copied: int | None = None  # the step whose weights the student holds

    def forward(self, *args, **kwargs):
        return self.root(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        self.root.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.root.set_requires_gradient_sync(True)

    def params(self, student: Graph) -> dict:
        """Student parameter name -> the sharded parameter that trains it, under every name the
        student has for it (a tied weight: the graph may read it by one name, the student list it
        by another)."""
        mine = {self.names[n]: p for n, p in self.root.named_parameters(remove_duplicate=False)}
        aliases: dict[int, list[str]] = {}
        for name, p in student.gm.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        found = {}
        for names in aliases.values():
            trained = next((mine[n] for n in names if n in mine), None)
            found.update({n: trained for n in names if trained is not None})
        return found

    @torch.no_grad()
    def copy_to(self, student: Graph, step: int | None = None) -> None:
        """The trained weights into the student's full tensors, on every rank (a collective); once
        per optimizer `step` when one is given."""
        if step is not None and step == self.copied:
            return
        self.copied = step
        targets = dict(student.gm.named_parameters(remove_duplicate=False))
        for name, p in {id(p): (n, p) for n, p in self.params(student).items()}.values():  # a tied parameter once
            targets[name].copy_(gather(p, self.place.device))

    def full_optimizer_state(self, optimizer) -> dict | None:
        """optimizer.state_dict() with every sharded state gathered whole into CPU memory, on rank 0
        (None elsewhere): the format a one-process run saves. A collective."""
        saved = optimizer.state_dict()
        state = {}
        for index, entry in saved["state"].items():
            full = {k: gather(v, self.place.device) for k, v in entry.items()}
            state[index] = {k: v.cpu() if torch.is_tensor(v) else v for k, v in full.items()} if self.place.main else None
        return {"state": state, "param_groups": saved["param_groups"]} if self.place.main else None

    def load_optimizer_state(self, optimizer, saved: dict) -> None:
        """A full optimizer state (any world size, with or without FSDP) into the sharded optimizer."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        state = {int(i): {k: shard_like(v, params[int(i)]) if torch.is_tensor(v) else v for k, v in entry.items()}
                 for i, entry in saved["state"].items()}
        optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})


def shard_student(student: Graph, stage: str, place: Placement, config, autocast: bool) -> ShardedStudent:
    """A sharded deep copy of what `stage` trains: the GDN layers (l2) or the whole student (kl);
    autocast: whether the run computes under bf16 autocast."""
    policy = precision(config.fsdp_mixed, autocast)
    if stage == "l2":
        targets = student.gdn_targets()
        copies = {layer: copy.deepcopy(m) for layer, m in student.gdn_modules().items()}
        root, units = Layers(copies, split_columns(student)), list(copies.values())
        names = {f"layers.{layer}.{n}": f"{targets[layer]}.{n}" for layer, m in copies.items() for n, _ in m.named_parameters()}
    else:
        root = split_by_layer(copy.deepcopy(student.gm), student.sites)
        units = [m for name, m in root.named_children() if name.startswith("layer_")]
        names = unit_names(root)
    apply_fsdp(root, units, place, precision=policy, offload=config.fsdp_offload, checkpoint=config.grad_checkpoint)
    return ShardedStudent(root, names, place)


def shard_teacher(teacher: Graph, place: Placement, release: bool) -> torch.nn.Module:
    """Stage kl's teacher (fsdp_teacher) cut by layer and sharded as the student is: frozen, in its own
    dtype, each process keeping 1/world of its weights and gathering one decoder layer's at a time,
    resharding after every forward (the root too: no backward follows). The units read the teacher
    graph's own tensors; `release` (a teacher the run owns) then drops the graph's full copies."""
    root = split_by_layer(teacher.gm, teacher.sites)
    root.requires_grad_(False)
    units = [m for name, m in root.named_children() if name.startswith("layer_")]
    apply_fsdp(root, units, place, precision=MixedPrecisionPolicy(cast_forward_inputs=False), offload=False, checkpoint=False,
               reshard_after_forward=True)
    if release:
        drop_weights(teacher.gm)
    return root


def drop_weights(gm: torch.nn.Module) -> None:
    """Replace a module's parameters by meta tensors of their shapes (no memory; parameter counts stay
    right): a sharded copy holds them now, and the full tensors are freed (gm no longer runs)."""
    for module in gm.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=False))


def clip_grad_norm(params, max_norm: float, device: torch.device) -> float:
    """torch.nn.utils.clip_grad_norm_ (the total norm, as a float) for gradients that may be sharded:
    the squares of this rank's shards summed on `device` and all-reduced over their mesh, so shards
    kept in CPU memory (fsdp_offload) never meet an NCCL collective."""
    grads = [p.grad for p in params if p.grad is not None]
    if not any(isinstance(g, DTensor) for g in grads):
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    shards = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    total = torch.stack([s.detach().float().square().sum().to(device) for s in shards]).sum()
    dist.all_reduce(total, group=next(g for g in grads if isinstance(g, DTensor)).device_mesh.get_group())
    norm = total.sqrt()
    factor = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for s in shards:
        s.mul_(factor.to(s.device, s.dtype))
    return float(norm)
