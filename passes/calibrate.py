"""calibrate (Phase 1): decay, write gate, value scale and output gate of every GDN layer from the
teacher's attention statistics on calibration text; each mixer's own Phase 1 (tcal.mixers) for the
others (swa: the window). All or nothing: a layer that fails leaves every layer as it was."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from surgery.errors import CalibrationError, PassConfigError
from surgery.core import progress
from surgery.core.graph import Graph
from surgery.core.pipeline import Pass, PassResult, register
from tcal.gate_forms import low_rank
from tcal.head_split import HeadSplitLayer, calibrate_split
from tcal.mixers import mixer_of
from tcal.phase1 import CONCENTRATION, GATES, Phase1Options

from .head_split import split_columns
from .teacher_data import TeacherDataConfig, check_text, teacher_data


@dataclass
class CalibrateConfig(TeacherDataConfig, Phase1Options):
    """Phase 1 options (tcal.phase1.Phase1Options) plus the calibration data."""

    def validate(self) -> None:
        super().validate()
        if self.gate not in GATES:
            raise PassConfigError(f"gate '{self.gate}' is not one of {GATES}.", "Pick one of them.")
        if self.concentration not in CONCENTRATION:
            raise PassConfigError(f"concentration '{self.concentration}' is not one of {CONCENTRATION}.", "Pick one of them.")
        if not 0 < self.window_quantile <= 1:
            raise PassConfigError(f"window_quantile must lie in (0, 1], got {self.window_quantile}.", "Use e.g. 0.9.")
        if not 0 < self.beta_low < self.beta_low + self.beta_span < 1:
            raise PassConfigError(f"Write-gate targets must lie in (0, 1): low {self.beta_low}, span {self.beta_span}.", "Use e.g. 0.3 and 0.4.")


@register
class Calibrate(Pass):
    name = "calibrate"
    config_cls = CalibrateConfig
    runs_after = ("replace",)
    not_after = ("align", "calibrate")

    def preflight(self, graph: Graph) -> None:
        check_text(graph, self.config)
        low = [str(layer) for layer, module in graph.gdn_modules().items() if low_rank(module)]
        if low and self.config.gate == "reference":
            raise PassConfigError(f"calibrate.gate=reference writes g_proj as a multiple of v_proj, and layer(s) {', '.join(low)} "
                                  "have a low-rank g_proj (replace.kimi_form=true).", "Use calibrate.gate=constant (the default) or tokenwise.")

    def layer_runs(self) -> list[tuple[str, int, int]]:
        return [("infer", self.config.samples, self.config.length)]  # Phase 1's forwards on the calibration windows

    def run(self, graph: Graph) -> PassResult:
        start = time.perf_counter()
        data = teacher_data(graph, self.config)
        options = self.config.project(Phase1Options)
        modules = graph.gdn_modules()
        saved = {layer: {k: v.clone() for k, v in gdn.state_dict().items()} for layer, gdn in modules.items()}
        reports = {}
        try:
            with progress.task("calibrate", len(modules), "layers") as bar:
                for layer, gdn in modules.items():
                    d = data[layer]
                    mixer = None if isinstance(gdn, HeadSplitLayer) else mixer_of(gdn)
                    try:
                        if mixer is None:
                            reports[layer] = calibrate_split(gdn, d.x, d.ctx, d.stats, options, split_columns(graph, layer))
                        elif mixer.replaces == "op":
                            reports[layer] = mixer.phase1(gdn, d.qkv, d.ctx, d.stats, options.window_quantile, graph.max_length)
                        else:
                            ctx = F.pad(d.ctx, (0, graph.sites[layer].mixer_head_dim - d.ctx.shape[-1]))  # MLA: as replace padded v
                            reports[layer] = mixer.phase1(gdn, d.x, ctx, d.target, d.stats, options)
                    except ValueError as exc:
                        raise CalibrationError(f"Phase 1 failed at layer {layer}: {exc}", "Check the calibration text and options.") from exc
                    r = reports[layer]
                    bar.advance(info=f"layer {layer}: relative error {r['rel_error_before']:.3g} -> {r['rel_error_after']:.3g}"
                                if "rel_error_before" in r else f"layer {layer} ({mixer.name})")
        except BaseException:
            with torch.no_grad():
                for layer, gdn in modules.items():
                    gdn.load_state_dict(saved[layer])
            raise
        seconds = time.perf_counter() - start
        graph.meta["calibrate"] = {"layers": reports, "seconds": seconds}
        before = sum(r["rel_error_before"] for r in reports.values()) / len(reports)
        after = sum(r["rel_error_after"] for r in reports.values()) / len(reports)
        return PassResult(graph, modified=True, info={"seconds": round(seconds, 2), "mean_rel_error_before": before, "mean_rel_error_after": after})

    def ensures(self, graph: Graph) -> None:
        require_finite(self, graph)


def require_finite(owner: Pass, graph: Graph) -> None:
    """The promise of the passes that set GDN weights: every parameter of every GDN is finite."""
    for layer, gdn in graph.gdn_modules().items():
        bad = [name for name, p in gdn.named_parameters() if not torch.isfinite(p).all()]
        if bad:
            raise owner.broken(f"layer {layer}'s GDN has NaN/inf in {', '.join(bad)}.")
