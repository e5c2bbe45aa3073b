"""select's decision, the one replace acts on: which attention layers become GDN and which stay.

A typed record in graph.meta["select"] (not a dict any reader may misspell); the recipe stores its
to_dict() and Select.replay rebuilds it with from_dict()."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from surgery.errors import CheckpointError


@dataclass
class LayerSelection:
    """policy              the select policy that decided
    convert, keep        the layers that become GDN / stay attention (together: every layer, once)
    keep_count           ar, retrieval, greedy: k, the number of layers kept
    metric               ar, retrieval, greedy: what the scores measure and which way is better
    teacher_perplexity   ar: the unablated teacher's perplexity on the scoring text
    teacher_answer_nll   retrieval: the unablated teacher's passkey-answer NLL on the scoring prompts
    init                 greedy: the passes each probe was initialised with
    tokens, scores       ar, retrieval, greedy: the scoring text's size and the per-layer scores
    window, kv_cache     with select.window other than any: the mode, and the KV cache the selection
                         keeps at 32k tokens (passes/kv_budget.kv_report); with granularity head, that cache too
    granularity          "head": select.granularity=head decided by KV heads (absent: by layers)
    kept_heads           granularity head: {layer: the KV heads it keeps as attention} for each layer
                         in `convert` that keeps some (its other heads become GDN): a split layer"""

    policy: str
    convert: list[int]
    keep: list[int]
    keep_count: int | None = None
    metric: str | None = None
    teacher_perplexity: float | None = None
    teacher_answer_nll: float | None = None
    init: list[str] | None = None
    tokens: int | None = None
    scores: list[dict] | None = None
    window: str | None = None
    kv_cache: dict | None = None
    granularity: str | None = None
    kept_heads: dict | None = None

    def split_layers(self) -> dict[int, list[int]]:
        """layer -> the KV heads it keeps, for the layers converted only in part."""
        return {int(l): list(h) for l, h in sorted((self.kept_heads or {}).items(), key=lambda item: int(item[0]))}

    def to_dict(self) -> dict:
        """Plain data; the fields a policy leaves unset are left out, as select has always written it."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data: dict) -> "LayerSelection":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown or not {"policy", "convert", "keep"} <= set(data):
            raise CheckpointError(f"The recorded select decision {sorted(data)} is not a layer selection (fields: {', '.join(sorted(names))}).",
                                  "The recipe was edited or written by another version; write it again with `surgery apply`.")
        return cls(**data)
