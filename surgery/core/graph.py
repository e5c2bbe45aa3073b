"""The object every pass reads and rewrites: a captured GraphModule plus what we know about it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .run import run_graph
from .streamed import streamed_logits


@dataclass
class Graph:
    """A captured causal LM.

    gm        torch.fx GraphModule from torch.export (parameter names = the model's state_dict names)
    config    the teacher's transformers config (rebuilds the architecture at load time)
    source    how the teacher was obtained: {"kind": "gguf"|"dir"|"module"|"config", "path": ..., ...}
    tokenizer the teacher's tokenizer, or None
    sites     the attention sites found at capture time, in execution order (layer i = sites[i])
    meta      decisions written by passes, keyed by pass name (the recipe records them)
    history   [{"pass": name, "config": dict}] of the passes applied, in order
    teacher   the untouched teacher GraphModule once a pass has rewritten gm (it shares parameter
              tensors with gm); calibration reads the teacher's attention from it
    """

    gm: torch.fx.GraphModule
    config: Any
    source: dict
    tokenizer: Any = None
    sites: list = field(default_factory=list)
    meta: dict = field(default_factory=dict)
    history: list = field(default_factory=list)
    teacher: torch.fx.GraphModule | None = None
    cache: dict = field(default_factory=dict, repr=False)  # runtime only (teacher activations); never saved

    def branch(self) -> "Graph":
        """A new Graph over the same teacher (shared weights, shared activation cache) with no passes
        applied: cheap what-if conversions without capturing again."""
        return Graph(gm=self.teacher_gm, config=self.config, source=self.source, tokenizer=self.tokenizer,
                     sites=self.sites, meta={"capture": dict(self.meta.get("capture", {})), **{k: dict(v) for k, v in self.meta.items() if k == "offload"}},
                     cache=self.cache)

    @property
    def teacher_gm(self) -> torch.fx.GraphModule:
        return self.teacher if self.teacher is not None else self.gm

    @property
    def num_layers(self) -> int:
        return len(self.sites)

    def gdn_targets(self) -> dict[int, str]:
        """layer -> module path of the GDN the replace pass put there, in layer order."""
        modules = self.meta.get("replace", {}).get("modules", {})
        return {int(l): modules[str(l)]["target"] for l in sorted(int(k) for k in modules)}

    def gdn_modules(self) -> dict[int, torch.nn.Module]:
        """layer -> the GatedDeltaNet module placed there, in layer order."""
        return {l: self.gm.get_submodule(t) for l, t in self.gdn_targets().items()}

    @property
    def layer_kinds(self) -> list[str]:
        """'attention' or the converted layer's mixer ('gdn', 'swa', ...) per layer, as the passes left it;
        'split' for a layer that keeps some KV heads as attention and converts the others (select.granularity=head)."""
        replace = self.meta.get("replace", {})
        replaced, modules = set(replace.get("layers", [])), replace.get("modules", {})
        def kind(entry: dict) -> str:
            return "split" if "kept_kv_heads" in entry else entry.get("mixer", "gdn")

        return [kind(modules.get(str(i), {})) if i in replaced else "attention" for i in range(self.num_layers)]

    @property
    def weights(self):
        """The teacher's files its meta parameters are read from (surgery.core.meta_capture), or None:
        every weight is in memory."""
        return self.cache.get("weights") if "offload" in self.meta else None

    @property
    def device(self) -> torch.device:
        """Where the graph computes (an offloaded graph: the device its layers are streamed to)."""
        if "offload" in self.meta:
            return torch.device(self.meta["offload"]["device"])
        for p in self.gm.parameters():
            return p.device
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        if "offload" in self.meta:
            return getattr(torch, self.meta["offload"]["dtype"])
        for p in self.gm.parameters():
            if p.is_floating_point():
                return p.dtype
        return torch.float32

    @property
    def max_length(self) -> int:
        return int(self.meta.get("capture", {}).get("max_length", 2048))

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Run the graph on token ids [B, T] and return logits [B, T, V]: the captured graph eagerly, the
        reference every check compares with (surgery.fast_logits takes the device's fast route)."""
        if self.weights is not None:
            return streamed_logits(self, input_ids)
        return run_graph(self, input_ids)

    __call__ = logits
