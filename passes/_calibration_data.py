"""Options and teacher data shared by the passes that read the teacher (calibrate, align)."""
from __future__ import annotations

from dataclasses import dataclass

from surgery.calibration import calibration_ids, collect
from surgery.errors import PassConfigError
from surgery.pass_base import PassConfig


@dataclass
class CalibrationDataConfig(PassConfig):
    """calibration  text files (default: the built-in sample); samples x length tokens are used"""

    calibration: list[str] | None = None
    samples: int = 16
    length: int = 256
    seed: int = 0
    batch_size: int = 4

    def validate(self) -> None:
        for key in ("samples", "length", "batch_size"):
            if getattr(self, key) < 1:
                raise PassConfigError(f"{key} must be >= 1, got {getattr(self, key)}.", "Use a positive number.")
        if self.length < 2:
            raise PassConfigError("length must be >= 2 tokens.", "Use e.g. 256.")


def teacher_data(graph, config: CalibrationDataConfig):
    """Per converted layer: the teacher's attention inputs, outputs, contexts and statistics,
    cached on the graph so calibrate and align read the teacher once (an entry for more layers on
    the same text serves fewer: select's greedy probes read every layer before the pipeline does)."""
    layers = graph.meta["replace"]["layers"]
    text = (tuple(config.calibration or ()), config.samples, config.length, config.seed)
    key = ("teacher_data", tuple(layers), *text)
    cached = graph.cache.get(key)
    if cached is not None:
        return cached
    for other, data in list(graph.cache.items()):
        if isinstance(other, tuple) and other[:1] == ("teacher_data",) and other[2:] == text and set(layers) <= set(data):
            return {l: data[l] for l in layers}
    ids = calibration_ids(graph, config.calibration, config.samples, config.length, config.seed)
    data = collect(graph, layers, ids, with_stats=True, batch_size=config.batch_size)
    graph.cache[key] = data
    return data
