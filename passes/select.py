"""select: decide which attention layers stay softmax and which become GDN."""
from __future__ import annotations

from dataclasses import dataclass

from surgery.errors import PassConfigError
from surgery.graph import Graph
from surgery.pass_base import Pass, PassConfig, PassResult, register

POLICIES = ("uniform", "keep", "convert")


@dataclass
class SelectConfig(PassConfig):
    """policy  uniform: keep `keep_ratio` of the layers (or every `stride`-th), evenly spaced from 0
               keep: keep exactly `layers`, convert the rest;  convert: convert exactly `layers`"""

    policy: str = "uniform"
    keep_ratio: float | None = 0.5
    stride: int | None = None
    layers: list[int] | None = None

    def validate(self) -> None:
        if self.policy not in POLICIES:
            raise PassConfigError(f"Unknown selection policy '{self.policy}'.", f"Use one of: {', '.join(POLICIES)}.")
        if self.policy == "uniform":
            if self.stride is not None and self.stride < 1:
                raise PassConfigError(f"stride must be >= 1, got {self.stride}.", "Use e.g. --stride 4 to keep layers 0, 4, 8, ...")
            if self.stride is None and (self.keep_ratio is None or not 0 <= self.keep_ratio < 1):
                raise PassConfigError(f"keep_ratio must be in [0, 1), got {self.keep_ratio}.", "A ratio of 1 would convert nothing; use e.g. 0.5.")
        elif not self.layers:
            raise PassConfigError(f"Policy '{self.policy}' needs a non-empty list of layers.", "Pass --layers i,j,...")


def uniform_keep(num_layers: int, keep_ratio: float | None, stride: int | None) -> list[int]:
    """Evenly spaced kept layers starting at 0: 7 of 28 gives [0, 4, ..., 24] as in the paper."""
    if stride is not None:
        return list(range(0, num_layers, stride))
    count = round(keep_ratio * num_layers)
    return sorted({(i * num_layers) // count for i in range(count)}) if count else []


@register
class Select(Pass):
    name = "select"
    config_cls = SelectConfig
    forbids = ("replace",)
    structural = True

    def decide(self, num_layers: int) -> list[int]:
        """The layers to convert."""
        c = self.config
        if c.policy == "uniform":
            keep = uniform_keep(num_layers, c.keep_ratio, c.stride)
            return [i for i in range(num_layers) if i not in keep]
        bad = [i for i in c.layers if not 0 <= i < num_layers]
        if bad:
            raise PassConfigError(f"Layer(s) {bad} out of range: this model has {num_layers} attention layers (0..{num_layers - 1}).", "Pick layers inside that range.")
        chosen = sorted(set(c.layers))
        return chosen if c.policy == "convert" else [i for i in range(num_layers) if i not in chosen]

    def check(self, graph: Graph) -> None:
        if not graph.sites:
            raise PassConfigError("The graph has no attention sites to select from.", "Capture the model with site discovery on.")
        if not self.decide(graph.num_layers):
            raise PassConfigError(f"The selection converts no layer (policy {self.config.policy}).", "Lower the keep ratio or name layers to convert.")

    def run(self, graph: Graph) -> PassResult:
        convert = self.decide(graph.num_layers)
        keep = [i for i in range(graph.num_layers) if i not in convert]
        graph.meta["select"] = {"policy": self.config.policy, "convert": convert, "keep": keep}
        return PassResult(graph, modified=False, info=graph.meta["select"])

    def replay(self, graph: Graph, decisions: dict) -> None:
        graph.meta["select"] = decisions
