"""select: decide which attention layers stay softmax and which become GDN.

The data-driven policies follow the reference code (FutureMLS-Lab/Taylor-Calibrate,
scripts/ar_layer_selection.py and scripts/greedy_layer_selection.py), but they score on calibration
text, never on an evaluation set (the reference scores on WikiText-2 test):

ar      attention removal: per teacher layer, zero that layer's attention output (the residual carries
        the block's input on) and measure perplexity; keep the k layers whose removal raises it most.
retrieval  attention removal scored on long-range retrieval instead of perplexity: passkey prompts
        (surgery.eval.passkey) of `retrieval_length` tokens built from the calibration text, `samples`
        of them at evenly spaced depths; keep the k layers whose removal raises the key's NLL most.
        Perplexity-ranked layers can drop the few that carry retrieval (SmolLM2: ar's 15 of 30 kept
        scored 0% passkey after Phase 1 + 2; bench/RESULTS.md, twentieth session).
greedy  GA-S2: per layer, the hybrid that keeps ONLY that layer as attention, every other layer
        replaced and initialised (replace, then the `init` passes: by default those of the pipeline,
        else calibrate + align, i.e. Phase 1 + Phase 2 as the reference's default "taylor_calibrate"
        probe); keep the k layers whose probe has the lowest perplexity. Replace, Phase 1 and Phase 2
        treat each layer on its own, teacher-forced, so every layer is converted ONCE and the N probes
        reuse those modules (the reference rebuilds each probe: N times the work; only the random draw
        of the new parameters' default init can differ from a probe built from scratch). Probes are
        scored on windows held out from the ones their init was fitted on.

window (any policy that counts layers: uniform, ar, greedy) treats layers with a sliding window apart
from global ones, as the graph's masks show them (passes/kv_budget.py). A window layer's KV cache is
bounded (Gemma-3: 512 of 32k positions), so converting it saves little memory:
any           today's choice, blind to windows (default)
global-first  convert the global layers first, then window layers, each group chosen by the policy
global-only   convert global layers only;  local-only   convert window layers only
Within a group the policy decides as it would over all layers (uniform: evenly spaced within the
group; ar, greedy: the group's lowest-ranked layers). With a window mode the record adds the KV
cache each selection keeps at 32k tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

from surgery.core.graph import Graph
from surgery.core.pipeline import Pass, PassManager, PassResult, register
from surgery.core.bos import leading_token, text_length
from surgery.data.cache import token_stream
from surgery.data.windows import held_out_windows, window_spans, windows
from surgery.errors import PassConfigError, SurgeryError
from surgery.eval.ablation import keep_one_scores, removal_scores, window_perplexity
from surgery.eval.passkey import answer_nll, make_trials

from .teacher_data import TeacherDataConfig, check_text
from .align import AlignConfig
from .head_select import HEAD_POLICIES, check_heads, head_selection, split_problem
from .kv_budget import GLOBAL, WINDOW, kv_report, layer_kinds, layer_windows
from .calibrate import CalibrateConfig
from .replace import ReplaceConfig
from .selection import LayerSelection

POLICIES = ("uniform", "keep", "convert", "ar", "retrieval", "greedy")
SCORED = ("ar", "retrieval", "greedy")
INIT_CONFIGS = {"replace": ReplaceConfig, "calibrate": CalibrateConfig, "align": AlignConfig}
DEFAULT_INIT = ["calibrate", "align"]
GRANULARITIES = ("layer", "head")
WINDOW_GROUPS = {"any": None, "global-first": (GLOBAL, WINDOW), "global-only": (GLOBAL,), "local-only": (WINDOW,)}


@dataclass
class SelectConfig(TeacherDataConfig):
    """policy        uniform: keep k layers evenly spaced from 0;  keep: keep exactly `layers`;
                    convert: convert exactly `layers`;  ar, retrieval, greedy: keep the k best-scoring layers
    k               `keep_count`, else one layer in `stride`, else round(keep_ratio * layers)
    keep_ratio      fraction of attention layers kept
    stride          keep one layer in `stride` (overrides keep_ratio)
    keep_count      attention layers kept (overrides stride and keep_ratio)
    layers          the layers that policy keep or convert names
    calibration, samples, length, seed, batch_size   the scoring text (ar, greedy), as for calibrate;
                    retrieval: `samples` passkey prompts, their filler from `calibration`
    retrieval_length   retrieval: tokens per passkey prompt (clipped to the graph's position limit)
    init            greedy: passes applied after replace in every probe (default: the pipeline's
                    calibrate/align, else calibrate,align); "calibrate" alone skips Phase 2 for speed
    init_configs    greedy: {"replace"|"calibrate"|"align": options} for the probes, over the pipeline's own
    window          any | global-first | global-only | local-only: how sliding-window layers are treated (module docstring)
    granularity     layer (default) | head: keep KV heads, each with its query group, instead of whole layers;
                    policy distance | entropy | output | keep, k counted in KV heads of the whole model (passes/head_select.py)
    heads           granularity head, policy keep: {layer: [KV heads kept]}; layers not named are converted
    kv_bytes        granularity head, policy distance | entropy | output: keep KV heads up to this KV cache at 32k tokens
                    (batch 1, the graph's dtype) instead of keep_count / keep_ratio"""

    policy: str = "uniform"
    keep_ratio: float | None = 0.5
    stride: int | None = None
    keep_count: int | None = None
    layers: list[int] | None = None
    init: list[str] | None = None
    init_configs: dict | None = None
    window: str = "any"
    granularity: str = "layer"
    heads: dict | None = None
    kv_bytes: int | None = None
    retrieval_length: int = 1024

    def validate(self) -> None:
        super().validate()
        if self.granularity not in GRANULARITIES:
            raise PassConfigError(f"Unknown select.granularity '{self.granularity}'.", f"Use one of: {', '.join(GRANULARITIES)}.")
        if self.granularity == "head":
            self.validate_heads()
            return
        if self.heads is not None or self.kv_bytes is not None:
            raise PassConfigError("select.heads and select.kv_bytes choose KV heads, which only select.granularity=head reads.", "Add select.granularity=head.")
        if self.policy not in POLICIES:
            raise PassConfigError(f"Unknown selection policy '{self.policy}'.", f"Use one of: {', '.join(POLICIES)}.")
        if self.policy in ("uniform", *SCORED):
            if self.keep_count is not None:
                if self.keep_count < 0:
                    raise PassConfigError(f"keep_count must be >= 0, got {self.keep_count}.", "Use the number of layers to keep as attention, e.g. 2.")
            elif self.stride is not None:
                if self.stride < 1:
                    raise PassConfigError(f"stride must be >= 1, got {self.stride}.", "Use e.g. --stride 4 to keep layers 0, 4, 8, ...")
            elif self.keep_ratio is None or not 0 <= self.keep_ratio < 1:
                raise PassConfigError(f"keep_ratio must be in [0, 1), got {self.keep_ratio}.", "A ratio of 1 would convert nothing; use e.g. 0.5.")
        elif not self.layers:
            raise PassConfigError(f"Policy '{self.policy}' needs a non-empty list of layers.", "Pass --layers i,j,...")
        if self.retrieval_length < 2:
            raise PassConfigError(f"select.retrieval_length must be >= 2 tokens, got {self.retrieval_length}.", "Use e.g. 1024.")
        if self.window not in WINDOW_GROUPS:
            raise PassConfigError(f"Unknown select.window '{self.window}'.", f"Use one of: {', '.join(WINDOW_GROUPS)}.")
        if self.window != "any" and self.policy in ("keep", "convert"):
            raise PassConfigError(f"select.window={self.window} chooses among layers, but policy '{self.policy}' names them.",
                                  "Leave select.window at any, or use policy uniform, ar or greedy.")
        if self.init is not None:
            bad = [n for n in self.init if n not in DEFAULT_INIT]
            if bad or self.init != [n for n in DEFAULT_INIT if n in self.init]:
                raise PassConfigError(f"select.init {self.init} is not a list of distinct passes from {DEFAULT_INIT}, in that order.",
                                      "Use e.g. --set select.init=calibrate (Phase 1 only) or select.init=calibrate,align.")
        for name, options in (self.init_configs or {}).items():
            if name not in INIT_CONFIGS:
                raise PassConfigError(f"select.init_configs has options for '{name}'.", f"Give options for {', '.join(INIT_CONFIGS)} only.")
            INIT_CONFIGS[name].from_dict(options)

    def validate_heads(self) -> None:
        """The options of granularity head: its policies, a count of KV heads, no layer-level options."""
        if self.policy not in HEAD_POLICIES:
            raise PassConfigError(f"Policy '{self.policy}' does not choose heads.", f"With select.granularity=head use one of: {', '.join(HEAD_POLICIES)}.")
        if self.stride is not None or self.layers or self.window != "any" or self.init or self.init_configs:
            raise PassConfigError("select.granularity=head takes keep_ratio or keep_count (of KV heads) and heads; stride, layers, window "
                                  "and init are options of layer selection.", "Drop them, or use select.granularity=layer.")
        if self.policy == "keep" and not self.heads:
            raise PassConfigError("Policy keep at granularity head needs select.heads, {layer: [KV heads kept]}.", 'Pass e.g. select.heads={"1": [0]}.')
        if self.kv_bytes is not None and (self.policy == "keep" or self.kv_bytes < 0):
            raise PassConfigError(f"select.kv_bytes={self.kv_bytes} needs a scoring policy (distance, entropy, output) and a budget >= 0.",
                                  "Use e.g. select.policy=distance select.kv_bytes=50000000.")
        if self.policy != "keep":
            if self.keep_count is not None and self.keep_count < 0:
                raise PassConfigError(f"keep_count must be >= 0, got {self.keep_count}.", "Use the number of KV heads to keep, e.g. 4.")
            if self.keep_count is None and (self.keep_ratio is None or not 0 <= self.keep_ratio < 1):
                raise PassConfigError(f"keep_ratio must be in [0, 1), got {self.keep_ratio}.", "Use e.g. 0.5 of the KV heads.")


KEY_ROOM = 16  # tokens past a passkey prompt for its key (a 5-digit key with a leading space)
PROMPT_STREAM = 7919  # added to select.seed: keys and filler offsets apart from an evaluation's passkey prompts (seed 0 and up)


def retrieval_prompts(graph: Graph, config: SelectConfig) -> list:
    """The retrieval policy's scoring prompts: `samples` passkey trials at evenly spaced depths, of
    retrieval_length tokens (within the position limit), their filler cut from the calibration text."""
    if graph.tokenizer is None:
        raise PassConfigError("select.policy=retrieval builds passkey prompts, which need the model's tokenizer; this graph has none.",
                              "Capture the model from a directory or GGUF that carries a tokenizer, or use select.policy=ar.")
    length = min(config.retrieval_length, graph.max_length - KEY_ROOM)
    try:
        return make_trials(graph.tokenizer, config.calibration, [length], config.samples, 1, config.seed + PROMPT_STREAM)
    except SurgeryError as exc:
        raise PassConfigError(f"select.policy=retrieval: {exc.problem}",
                              "Raise select.retrieval_length, or give longer --calibration text.") from None


def removal_ranking(graph: Graph, config: SelectConfig, text) -> tuple[list[dict], list[dict], dict]:
    """ar (perplexity on the windows `text`) and retrieval (the key's NLL on the passkey prompts `text`):
    (per-layer rows, the rows best first, the record's fields)."""
    if config.policy == "ar":
        baseline, rows = removal_scores(graph, lambda g: window_perplexity(g, text, config.batch_size))
        return rows, sorted(rows, key=lambda r: (-r["perplexity"], r["layer"])), {
            "metric": "perplexity with the layer's attention output zeroed (higher: keep)", "teacher_perplexity": baseline,
            "tokens": int(text.numel())}
    baseline, rows = removal_scores(graph, lambda g: answer_nll(g, text, config.batch_size), "answer_nll")
    return rows, sorted(rows, key=lambda r: (-r["answer_nll"], r["layer"])), {
        "metric": "passkey answer NLL with the layer's attention output zeroed (higher: keep)", "teacher_answer_nll": baseline,
        "tokens": sum(t.ids.numel() for t in text)}


def uniform_keep(num_layers: int, keep_ratio: float | None, stride: int | None, count: int | None = None) -> list[int]:
    """Evenly spaced kept layers starting at 0: 7 of 28 gives [0, 4, ..., 24] as in the paper."""
    if count is None and stride is not None:
        return list(range(0, num_layers, stride))
    count = round(keep_ratio * num_layers) if count is None else count
    return sorted({(i * num_layers) // count for i in range(count)}) if count else []


def uniform_pick(group: list[int], count: int) -> list[int]:
    """The `count` layers of `group` uniform converts: the complement of evenly spaced kept ones."""
    keep = set(uniform_keep(len(group), None, None, len(group) - count))
    return [layer for i, layer in enumerate(group) if i not in keep]


def ranked_pick(ranked: list[int]):
    """pick() for a ranking (best to keep first): a group's `count` lowest-ranked layers."""
    def pick(group: list[int], count: int) -> list[int]:
        order = [layer for layer in ranked if layer in group]
        return order[len(order) - count:] if count else []
    return pick


def windowed_convert(kinds: list[str], count: int, mode: str, pick) -> list[int]:
    """The `count` layers to convert when `mode` limits conversion to one kind of layer, or converts
    one kind first: the groups of WINDOW_GROUPS[mode] in order, pick(group, m) choosing within each."""
    convert, left = [], count
    for kind in WINDOW_GROUPS[mode]:
        group = [i for i, k in enumerate(kinds) if k == kind]
        take = min(left, len(group))
        convert += pick(group, take)
        left -= take
    if left:
        found = f"{kinds.count(GLOBAL)} global and {kinds.count(WINDOW)} sliding-window layers"
        raise PassConfigError(f"select.window={mode} cannot convert {count} layers: this model has {found}.",
                              f"Convert at most {count - left} (raise keep_count or keep_ratio), or use select.window=global-first.")
    return sorted(convert)


@register
class Select(Pass):
    name = "select"
    config_cls = SelectConfig
    not_after = ("replace",)
    structural = True

    def keep_count(self, num_layers: int) -> int:
        """k, the number of layers kept as attention, checked against the model."""
        c = self.config
        if c.keep_count is not None:
            k = c.keep_count
        elif c.stride is not None:
            k = len(range(0, num_layers, c.stride))
        else:
            k = round(c.keep_ratio * num_layers)
        if k > num_layers:
            raise PassConfigError(f"keep_count {k} is more than the {num_layers} attention layers of this model.", f"Keep at most {num_layers - 1} layers.")
        return k

    def decide(self, num_layers: int) -> list[int]:
        """The layers to convert (the data-driven policies decide in run, from their scores)."""
        c = self.config
        if c.policy in SCORED:
            raise PassConfigError(f"Policy '{c.policy}' decides from scores on a graph.", "Run the select pass on a graph.")
        if c.policy == "uniform":
            keep = uniform_keep(num_layers, c.keep_ratio, c.stride, None if c.keep_count is None else self.keep_count(num_layers))
            return [i for i in range(num_layers) if i not in keep]
        bad = [i for i in c.layers if not 0 <= i < num_layers]
        if bad:
            raise PassConfigError(f"Layer(s) {bad} out of range: this model has {num_layers} attention layers (0..{num_layers - 1}).", "Pick layers inside that range.")
        chosen = sorted(set(c.layers))
        return chosen if c.policy == "convert" else [i for i in range(num_layers) if i not in chosen]

    def bind(self, pipeline: list[Pass]) -> None:
        """greedy probes with the init the pipeline applies: its replace/calibrate/align options."""
        c = self.config
        if c.policy != "greedy":
            return
        names = [p.name for p in pipeline]
        base = {p.name: p.config.to_dict() for p in pipeline if p.name in INIT_CONFIGS}
        user = c.init_configs or {}  # given options win one by one, the pipeline's others stay
        updates = {"init_configs": {n: base.get(n, {}) | user.get(n, {}) for n in [*base, *(n for n in user if n not in base)]}}
        if c.init is None and "replace" in names:
            updates["init"] = [n for n in names if n in DEFAULT_INIT]
        self.config = self.config_cls.from_dict(c.to_dict() | updates)

    def preflight(self, graph: Graph) -> None:
        if self.config.policy == "retrieval" and self.config.granularity == "layer":
            retrieval_prompts(graph, self.config)  # no tokenizer, too little text, prompts too short: before any pass runs
        elif self.config.policy in SCORED or (self.config.granularity == "head" and self.config.policy != "keep"):
            check_text(graph, self.config)

    def check(self, graph: Graph) -> None:
        if not graph.sites:
            raise PassConfigError("The graph has no attention sites to select from.", "Capture the model with site discovery on.")
        if self.config.granularity == "head":
            return check_heads(self.config, graph.sites)
        converts = graph.num_layers - self.keep_count(graph.num_layers) if self.config.policy in SCORED else len(self.decide(graph.num_layers))
        if not converts:
            raise PassConfigError(f"The selection converts no layer (policy {self.config.policy}).", "Lower the keep ratio or name layers to convert.")
        if self.config.window != "any":  # an impossible request fails before any scoring
            windowed_convert(layer_kinds(layer_windows(graph)), converts, self.config.window, uniform_pick)

    def run(self, graph: Graph) -> PassResult:
        c = self.config
        if c.granularity == "head":
            return self.record(graph, head_selection(graph, c))
        if c.policy not in SCORED:
            convert = self.decide(graph.num_layers) if c.window == "any" else self.windowed(graph, uniform_pick)
            keep = [i for i in range(graph.num_layers) if i not in convert]
            return self.record(graph, LayerSelection(c.policy, convert, keep, **self.window_record(graph, convert)))
        k = self.keep_count(graph.num_layers)
        text = self.scoring_windows(graph)  # before any model work: a short text fails fast
        if c.policy == "greedy":
            init = self.init_passes()
            rows = keep_one_scores(graph, self.converted_modules(graph, init), text, c.batch_size)
            ranked = sorted(rows, key=lambda r: (r["perplexity"], r["layer"]))
            extra = {"metric": "perplexity keeping only this layer as attention (lower: keep)", "init": ["replace", *init], "tokens": int(text.numel())}
        else:
            rows, ranked, extra = removal_ranking(graph, c, text)
        for rank, row in enumerate(ranked, 1):
            row["rank"] = rank
        order = [r["layer"] for r in ranked]
        convert = [i for i in range(graph.num_layers) if i not in order[:k]] if c.window == "any" else self.windowed(graph, ranked_pick(order))
        keep = [i for i in range(graph.num_layers) if i not in convert]
        extra |= self.window_record(graph, convert)
        return self.record(graph, LayerSelection(c.policy, convert, keep, keep_count=k, **extra, scores=rows))

    def windowed(self, graph: Graph, pick) -> list[int]:
        """The layers to convert under select.window, the policy choosing within each group by `pick`."""
        count = graph.num_layers - self.keep_count(graph.num_layers)
        return windowed_convert(layer_kinds(layer_windows(graph)), count, self.config.window, pick)

    def window_record(self, graph: Graph, convert: list[int]) -> dict:
        """With a window mode: the mode and the KV cache the selection keeps (nothing at window=any)."""
        if self.config.window == "any":
            return {}
        return {"window": self.config.window, "kv_cache": kv_report(graph, convert)}

    @staticmethod
    def record(graph: Graph, selection: LayerSelection) -> PassResult:
        graph.meta["select"] = selection
        return PassResult(graph, modified=False, info=selection.to_dict())

    def ensures(self, graph: Graph) -> None:
        s = graph.meta["select"]
        if sorted(s.convert + s.keep) != list(range(graph.num_layers)):
            raise self.broken(f"convert {s.convert} and keep {s.keep} do not split the {graph.num_layers} layers.")
        if split_problem(s, graph.sites):
            raise self.broken(split_problem(s, graph.sites))

    def init_passes(self) -> list[str]:
        return list(DEFAULT_INIT if self.config.init is None else self.config.init)

    def init_config(self, name: str):
        """The options a probe's replace/calibrate/align run with (calibration text: select's, unless given)."""
        options = dict((self.config.init_configs or {}).get(name) or {})
        if name != "replace":
            options.setdefault("calibration", self.config.calibration)
        return INIT_CONFIGS[name].from_dict(options)

    def scoring_windows(self, graph: Graph):
        """ar: the calibration windows; retrieval: passkey prompts; greedy: windows that avoid those its
        probes' init is fitted on."""
        c = self.config
        if c.policy == "retrieval":
            return retrieval_prompts(graph, c)
        length = min(c.length, graph.max_length)
        ids, lead = token_stream(graph.tokenizer, c.calibration), leading_token(graph.tokenizer)
        if c.policy == "ar":
            return windows(ids, c.samples, length, c.seed, lead)
        avoid = []
        for name in self.init_passes():
            fit = self.init_config(name)
            span = min(fit.length, graph.max_length)
            if tuple(fit.calibration or ()) == tuple(c.calibration or ()) and ids.numel() >= text_length(span, lead):
                avoid += window_spans(ids.numel(), fit.samples, span, fit.seed, lead)
        return held_out_windows(ids, c.samples, length, c.seed, avoid, lead)

    def converted_modules(self, graph: Graph, init: list[str]) -> dict:
        """Every layer converted once, on a branch, with the probe init: {layer: (target, module)}."""
        branch = graph.branch()
        layers = list(range(graph.num_layers))
        configs = {"select": {"policy": "convert", "layers": layers}} | {n: self.init_config(n).to_dict() for n in ["replace", *init]}
        PassManager(["select", "replace", *init], configs)(branch)
        return {l: (t, branch.gm.get_submodule(t)) for l, t in branch.gdn_targets().items()}

    def replay(self, graph: Graph, decisions: dict) -> None:
        graph.meta["select"] = LayerSelection.from_dict(decisions)
