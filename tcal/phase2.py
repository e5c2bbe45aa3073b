"""Phase 2 of Taylor-Calibrate: layer-local, teacher-forced alignment of GDN layers (METHOD.md).

Each layer learns to map the teacher's attention input to the teacher's attention output (MSE).
Layers are independent, so they train in one loop with one optimizer; gradient clipping and the
best state are per layer (each layer's best state is restored at the end), but early stopping is
shared: all layers stop together once no layer has improved for `patience` steps. Training runs in
float32 master weights whatever the model's dtype. The parameter groups follow the GDN's own roles
(GatedDeltaNet.param_groups): q/k/v and convolutions, gates; output projection and norm stay frozen.
The defaults are chosen by measurement (bench/align_budget.py, bench/RESULTS.md): 60 steps whose
learning rates (10x the reference's) decay by a cosine to `final_lr_ratio` of their peak reach a
lower perplexity than the reference's 300 steps at constant 1e-4 / 1e-3, in a fifth of the time
(`schedule="constant", steps=300, lr_qkv=1e-4, lr_gates=1e-3` is the reference). `warmup` adds
linear warm-up steps.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .gdn import GatedDeltaNet
from .schedule import lr_factor as schedule_factor


@dataclass
class AlignOptions:
    """steps           optimizer steps (every layer trained at once, each on its own loss)
    lr_qkv          learning rate of the q/k/v projections and convolutions
    lr_gates        learning rate of the gates and the decay
    weight_decay    AdamW weight decay
    clip            gradient-norm clip per layer (0: none)
    patience        stop after this many steps without a min_delta improvement
    min_delta       relative loss improvement that counts
    seed            seeds torch's random state for the run
    schedule        learning-rate schedule: cosine or constant
    warmup          warmup steps
    final_lr_ratio  cosine's last learning rate, as a fraction of the first"""

    steps: int = 60
    lr_qkv: float = 1e-3
    lr_gates: float = 1e-2
    weight_decay: float = 0.01
    clip: float = 1.0
    patience: int = 50
    min_delta: float = 1e-4
    seed: int = 0
    schedule: str = "cosine"
    warmup: int = 0
    final_lr_ratio: float = 0.1


def lr_factor(opts: AlignOptions, step: int) -> float:
    """The learning-rate multiplier at `step` (0-based); the cosine reaches final_lr_ratio at the last step."""
    return schedule_factor(step, opts.warmup, opts.steps - opts.warmup - 1, opts.schedule, opts.final_lr_ratio)


def _roles(gdn: GatedDeltaNet) -> tuple[list, list, list]:
    """(qkv, gates, frozen) parameters, each in named_parameters order."""
    roles = gdn.param_groups()

    def pick(*names):
        return [p for role in names for _, p in roles[role]]

    return pick("qkv", "conv"), pick("gates"), pick("output", "norm")


def _groups(gdn: GatedDeltaNet, opts: AlignOptions) -> list[dict]:
    qkv, gates, _ = _roles(gdn)
    no_decay = [p for p in gates if getattr(p, "_no_weight_decay", False)]
    decay = [p for p in gates if not getattr(p, "_no_weight_decay", False)]
    groups = [{"params": qkv, "lr": opts.lr_qkv}, {"params": decay, "lr": opts.lr_gates}]
    if no_decay:
        groups.append({"params": no_decay, "lr": opts.lr_gates, "weight_decay": 0.0})
    return groups


def _optimizer(modules: dict[int, GatedDeltaNet], opts: AlignOptions):
    """(trainable parameters per layer, one AdamW over every layer's groups, its schedule);
    frozen parameters stop requiring grad."""
    trainable, groups = {}, []
    for l, m in modules.items():
        frozen = {id(p) for p in _roles(m)[2]}
        for p in m.parameters():
            p.requires_grad_(id(p) not in frozen)
        layer_groups = _groups(m, opts)
        trainable[l] = [p for g in layer_groups for p in g["params"]]
        groups += layer_groups
    optimizer = torch.optim.AdamW(groups, weight_decay=opts.weight_decay, betas=(0.9, 0.999))
    return trainable, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(opts, step))


def align_layers(modules: dict[int, GatedDeltaNet], data: dict[int, tuple[torch.Tensor, torch.Tensor]],
                 opts: AlignOptions, progress=None, forwards: dict | None = None) -> dict:
    """Align every module on (x, target) in place. progress(step, losses) is called each step;
    forwards: per layer, how to run its module (e.g. compiled), the module itself where absent.

    Returns per-layer {initial, best, best_step, steps} losses (MSE) and the steps run."""
    torch.manual_seed(opts.seed)
    dtypes = {l: next(m.parameters()).dtype for l, m in modules.items()}
    for m in modules.values():
        m.float()
    trainable, optimizer, scheduler = _optimizer(modules, opts)
    best = {l: (float("inf"), -1, None) for l in modules}
    initial, last_improved, step = {}, 0, 0
    try:
        for step in range(opts.steps):
            optimizer.zero_grad(set_to_none=True)
            losses = {}
            improved = False
            for l, m in modules.items():
                x, target = data[l]
                with torch.enable_grad():
                    loss = F.mse_loss((forwards or {}).get(l, m)(x.float()), target.float())
                    loss.backward()
                value = loss.item()
                losses[l] = value
                initial.setdefault(l, value)
                if value < best[l][0] * (1 - opts.min_delta):
                    improved = True
                if value < best[l][0]:
                    best[l] = (value, step, [p.detach().clone() for p in trainable[l]])
                if opts.clip:
                    torch.nn.utils.clip_grad_norm_(trainable[l], opts.clip)
            if progress is not None:
                progress(step, losses)
            if improved:
                last_improved = step
            elif step - last_improved >= opts.patience:
                break
            optimizer.step()
            scheduler.step()
    finally:
        with torch.no_grad():
            for l, m in modules.items():
                if best[l][2] is not None:
                    for p, saved in zip(trainable[l], best[l][2]):
                        p.copy_(saved)
                for p in m.parameters():
                    p.requires_grad_(True)
                m.to(dtypes[l])
    return {
        "steps": step + 1,
        "layers": {l: {"initial": initial.get(l), "best": best[l][0], "best_step": best[l][1]} for l in modules},
    }
