"""align (Phase 2): teacher-forced, layer-local MSE alignment of every GDN layer."""
from __future__ import annotations

import dataclasses
import time
import warnings
from dataclasses import dataclass

import torch

from surgery.errors import PassConfigError
from surgery.core import progress
from surgery.core.compiled import maybe_compiled
from surgery.core.graph import Graph
from surgery.core.pipeline import Pass, PassResult, register
from tcal.gate_regime import SHORT_MEMORY, gate_regime
from tcal.phase2 import AlignOptions, align_layers
from tcal.schedule import SCHEDULES

from .calibrate import require_finite
from .head_split import split_shares
from .teacher_data import TeacherDataConfig, check_text, teacher_data


@dataclass
class AlignConfig(TeacherDataConfig, AlignOptions):
    """Phase 2 options (tcal.phase2.AlignOptions) plus the calibration data.

    seed          seeds where the calibration windows are cut and torch's random state for the run
    progress      report the steps (surgery.core.progress); False: silent
    compile       each GDN layer's forward through torch.compile (None: where it pays, surgery.core.compiled)
    memory_retry  where the alignment leaves a layer remembering under one token that remembered more,
                  align every layer again from Phase 1's state with lr_gates times this (0: keep the first)"""

    progress: bool = True
    compile: bool | None = None
    memory_retry: float = 0.1

    def validate(self) -> None:
        super().validate()
        if self.steps < 1:
            raise PassConfigError(f"steps must be >= 1, got {self.steps}.", "Use e.g. 60.")
        if self.lr_qkv < 0 or self.lr_gates < 0:
            raise PassConfigError("Learning rates must be >= 0.", "Use e.g. lr_qkv=1e-3, lr_gates=1e-2.")
        if self.schedule not in SCHEDULES:
            raise PassConfigError(f"Unknown learning-rate schedule {self.schedule!r}.", f"Use one of: {', '.join(SCHEDULES)}.")
        if self.warmup < 0 or not 0 <= self.final_lr_ratio <= 1:
            raise PassConfigError("warmup must be >= 0 and final_lr_ratio within [0, 1].", "Use e.g. warmup=0, final_lr_ratio=0.1.")
        if not 0 <= self.memory_retry < 1:
            raise PassConfigError(f"memory_retry must be within [0, 1), got {self.memory_retry}.", "Use e.g. 0.1, or 0 to keep the first alignment.")


@register
class Align(Pass):
    name = "align"
    config_cls = AlignConfig
    runs_after = ("replace",)
    not_after = ("align",)

    def preflight(self, graph: Graph) -> None:
        check_text(graph, self.config)

    def layer_runs(self) -> list[tuple[str, int, int]]:
        return [("train", self.config.samples, self.config.length)]  # every window at once, float32 (tcal.phase2)

    def run(self, graph: Graph) -> PassResult:
        start = time.perf_counter()
        modules = {l: m for l, m in graph.gdn_modules().items() if m.param_groups()}  # swa: nothing to align
        if not modules:
            graph.meta["align"] = {"steps": 0, "layers": {}, "seconds": 0.0}
            return PassResult(graph, modified=False, info={"steps": 0, "note": "no converted layer has parameters to align"})
        data = teacher_data(graph, self.config)
        pairs = {l: (data[l].x, data[l].target) for l in modules}
        shares = split_shares(graph, modules, data)  # a head split: the converted heads' share of the layer output
        forwards = {l: maybe_compiled(m, self.config.compile, graph.device, use="align", label=f"GDN layer {l}")
                    for l, m in modules.items() if l not in shares}
        for l, (forward, target) in shares.items():
            forwards[l], pairs[l] = forward, (data[l].x, target)
        opts = self.config.project(AlignOptions)
        before = horizons(modules, data)
        phase1 = states(modules) if self.config.memory_retry else None
        report = self.align(modules, pairs, opts, forwards, "align")
        after, retried = horizons(modules, data), {}
        if phase1 is not None and (lost := lost_memory(before, after)):
            retried = {"lr_gates": opts.lr_gates * self.config.memory_retry, "layers": lost,
                       "first_horizons": after, "first_report": report}
            restore(modules, phase1)
            opts = dataclasses.replace(opts, lr_gates=retried["lr_gates"])
            report = self.align(modules, pairs, opts, forwards, f"align again (lr_gates {opts.lr_gates:.3g}: memory lost)")
            after = horizons(modules, data)
        seconds = time.perf_counter() - start
        graph.meta["align"] = report | {"seconds": seconds, "horizons": {l: [before[l], after[l]] for l in after},
                                        **({"memory_retry": retried} if retried else {})}
        layers = report["layers"].values()
        warn_short_memory(before, after)
        return PassResult(graph, modified=True, info={
            "seconds": round(seconds, 2), "steps": report["steps"],
            "mean_initial_loss": sum(r["initial"] for r in layers) / len(report["layers"]),
            "mean_best_loss": sum(r["best"] for r in layers) / len(report["layers"]),
            **({"aligned_again_for_memory": retried["layers"]} if retried else {}),
            **({"short_memory_layers": short} if (short := [l for l, h in after.items() if h < SHORT_MEMORY]) else {}),
        })

    def align(self, modules: dict, pairs: dict, opts: AlignOptions, forwards: dict, label: str) -> dict:
        """One alignment of every layer, with its progress."""
        with progress.task(label, opts.steps, "steps", enabled=self.config.progress) as bar:
            def on_step(step, losses):
                bar.update(step + 1, info=f"mean loss {sum(losses.values()) / len(losses):.3e}")

            return align_layers(modules, pairs, opts, progress=on_step, forwards=forwards)

    def ensures(self, graph: Graph) -> None:
        require_finite(self, graph)


HORIZON_WINDOWS = 4  # calibration windows the memory horizons are measured on (cheap next to the steps)


def horizons(modules: dict, data: dict) -> dict[int, float]:
    """Each layer's memory horizon in tokens (tcal.gate_regime) on its first calibration windows; layers
    without a decay (no horizon) or without forward_parts (a head split's layer) are left out."""
    found = {l: gate_regime(m, data[l].x[:HORIZON_WINDOWS].to(next(m.parameters()).dtype)).get("horizon")
             for l, m in modules.items() if hasattr(m, "forward_parts")}
    return {l: h for l, h in found.items() if h is not None}


def lost_memory(before: dict[int, float], after: dict[int, float]) -> list[int]:
    """The layers alignment left remembering less than one token that remembered more before it."""
    return [l for l in after if after[l] < SHORT_MEMORY <= before.get(l, 0.0)]


def states(modules: dict) -> dict[int, dict]:
    """Each layer's parameters and buffers, copied to host memory (what a second alignment starts
    from; kept off the accelerator, where a large teacher's aligned layers already fill it)."""
    return {l: {k: v.detach().to("cpu", copy=True) for k, v in m.state_dict().items()} for l, m in modules.items()}


def restore(modules: dict, saved: dict[int, dict]) -> None:
    with torch.no_grad():
        for l, m in modules.items():
            m.load_state_dict(saved[l])


def warn_short_memory(before: dict[int, float], after: dict[int, float]) -> None:
    """Name the layers alignment left remembering less than one token that remembered more before it."""
    fell = lost_memory(before, after)
    if fell:
        detail = ", ".join(f"{l} ({before[l]:.3g} -> {after[l]:.2g})" for l in fell)
        warnings.warn(f"align left layers {detail} with a memory horizon under one token (their decay gates saturated). "
                      "Distillation hardly moves such gates: on Gemma-3-270M an init like this recovered more slowly than the "
                      "copy-only one (bench/RESULTS.md, twenty-third session). Lower the gates' learning rate "
                      "(--set align.lr_gates=1e-4), or keep Phase 1's gates by running without align "
                      "(--passes select,replace,calibrate).", stacklevel=2)
