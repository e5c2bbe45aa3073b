"""The pass protocol: a small class with a validated config, declared ordering, and a manager that
checks the whole pipeline before anything runs (after torch.fx.passes.infra's PassBase/PassManager,
with torchao's name -> config -> handler registry)."""
from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..errors import OUT_OF_MEMORY_FIX, PassConfigError, PassFailedError, PassOrderError, SurgeryError, first_line, ran_out_of_memory
from .graph import Graph


INT_LIMIT = 1 << 63  # a count past int64 overflows the first tensor or range it sizes (torch's integers)


def bad_number(value, path: str = ""):
    """(path, value) of the first number in `value` (through lists, tuples and dicts) that is NaN,
    ±inf or an integer past int64, or None. Such a value passes every `x < 0` check and is never what
    a user meant: NaN learning rates train nothing, 1e30 tokens never end."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return path, value
    if isinstance(value, int) and not -INT_LIMIT < value < INT_LIMIT:
        return path, value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    for key, item in items:
        found = bad_number(item, f"{path}[{key!r}]" if isinstance(value, dict) else f"{path}[{key}]")
        if found is not None:
            return found
    return None


@dataclass
class PassConfig:
    """Base of every pass config: a dataclass that validates itself and round-trips through JSON.

    Every number is checked once, here, when a config is made (from --set, a recipe or Python):
    finite and within int64; each subclass's validate() then checks its own ranges."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            found = bad_number(getattr(self, f.name))
            if found is not None:
                path, value = found
                what = "is not a finite number" if isinstance(value, float) else f"is out of range (at most {INT_LIMIT - 1:,})"
                raise PassConfigError(f"{type(self).__name__}.{f.name}{path} = {value!r} {what}.", "Give a finite number in the option's range.")

    def validate(self) -> None:
        """Raise PassConfigError naming the bad field; subclasses extend."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def project(self, cls):
        """This config's values for the fields of dataclass `cls` (a pass config that extends the
        options of a tcal function hands them over this way)."""
        return cls(**{f.name: getattr(self, f.name) for f in dataclasses.fields(cls)})

    @classmethod
    def from_dict(cls, data: dict | None) -> "PassConfig":
        data = dict(data or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise PassConfigError(f"{cls.__name__} has no option {', '.join(unknown)}.", f"Known options: {', '.join(sorted(names))}.")
        hints = typing.get_type_hints(cls)
        for key, value in list(data.items()):
            data[key] = _coerce(cls.__name__, key, hints[key], value)
        config = cls(**data)
        config.validate()
        return config


def _coerce(owner: str, key: str, hint, value):
    """Accept JSON and CLI spellings (a "0.5" string, a list for a tuple) but refuse wrong kinds."""
    if value is None:
        return None
    options = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    for kind in options:
        origin = typing.get_origin(kind) or kind
        try:
            if origin is dict:
                if isinstance(value, str):  # the CLI's spelling: JSON, e.g. select.heads={"1": [0, 2]}
                    value = json.loads(value)
                if isinstance(value, dict):
                    return dict(value)
                continue
            if origin in (list, tuple):
                items = value.split(",") if isinstance(value, str) else list(value)
                inner = (typing.get_args(kind) or (Any,))[0]
                return origin(_coerce(owner, key, inner, v) for v in items if v != "")
            if origin is bool:
                if isinstance(value, str):
                    if value.lower() in ("1", "true", "yes", "on"):
                        return True
                    if value.lower() in ("0", "false", "no", "off"):
                        return False
                    continue
                return bool(value)
            if origin in (int, float, str):
                if origin is int and isinstance(value, float) and not value.is_integer():
                    continue
                return origin(value)
            if origin is Any:
                return value
        except (TypeError, ValueError):
            continue
    raise PassConfigError(f"{owner}.{key} = {value!r} is not a valid {hint}.", "Fix the value and run again.")


@dataclass
class PassResult:
    graph: Graph
    modified: bool
    info: dict = field(default_factory=dict)


class Pass:
    """A graph rewrite. Subclasses set `name`, `config_cls`, the ordering they need, and `run`.

    runs_after passes that must have run before this one (an ordering declaration the manager checks
               before anything runs, not torch's PassBase.requires precondition hook)
    not_after  passes that must NOT have run before this one (e.g. calibrate after align would undo
               it); a pass naming itself runs once
    structural True when the pass changes the architecture: checkpoint.load replays it from the recipe

    check (before) and ensures (after) bracket run: check refuses what cannot work before anything
    changes, ensures verifies what the pass promises once it has run.
    """

    name: ClassVar[str] = ""
    config_cls: ClassVar[type[PassConfig]] = PassConfig
    runs_after: ClassVar[tuple[str, ...]] = ()
    not_after: ClassVar[tuple[str, ...]] = ()
    structural: ClassVar[bool] = False

    def __init__(self, config: PassConfig | dict | None = None, **options):
        if isinstance(config, PassConfig):
            if options:
                config = self.config_cls.from_dict(config.to_dict() | options)
        else:
            config = self.config_cls.from_dict(dict(config or {}) | options)
        config.validate()
        self.config = config

    def bind(self, pipeline: list["Pass"]) -> None:
        """Called by PassManager with the whole pipeline before anything runs: a pass whose work
        depends on the options of the passes around it (select's greedy probes) reads them here."""

    def preflight(self, graph: Graph) -> None:
        """What can be checked on the graph as it is before the pipeline's first pass runs (the
        text a later pass reads): PassManager calls it for every pass first, so too little
        calibration text fails in seconds, not after the layers were replaced."""

    def check(self, graph: Graph) -> None:
        """Everything that can be checked before mutating; raise a SurgeryError on failure."""

    def run(self, graph: Graph) -> PassResult:
        raise NotImplementedError

    def ensures(self, graph: Graph) -> None:
        """What the pass promises about the graph it leaves; raise broken(...) when it does not hold."""

    def layer_runs(self) -> list[tuple[str, int, int]]:
        """How this pass will run the converted layers, as (use, batch, tokens): "train" (a float32
        forward and backward) or "infer" (a forward in the graph's dtype). A helper process compiles
        their kernels ahead of the pass (surgery.core.kernel_warmup); none by default."""
        return []

    def broken(self, what: str) -> PassFailedError:
        """The error for a promise that does not hold: `what` says what broke."""
        return PassFailedError(f"Pass '{self.name}' did not keep its promise: {what}", "This is a bug in the pass; run with --debug and report it.")

    def replay(self, graph: Graph, decisions: dict) -> None:
        """Rebuild this pass's structural change from recorded decisions (checkpoint load)."""
        raise NotImplementedError(f"pass '{self.name}' is not structural")

    def __call__(self, graph: Graph) -> PassResult:
        self.check(graph)
        result = self.run(graph)
        if result.modified:
            lint(graph)
        self.ensures(graph)  # before the history records the pass: a broken promise is not a pass that ran
        graph.history.append({"pass": self.name, "config": self.config.to_dict()})
        return result

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config})"


REGISTRY: dict[str, type[Pass]] = {}


def register(cls: type[Pass]) -> type[Pass]:
    """Class decorator: make a pass reachable by name (`--passes a,b,c`)."""
    if not cls.name:
        raise TypeError(f"{cls.__name__} has no name")
    REGISTRY[cls.name] = cls
    return cls


def known_passes() -> list[str]:
    """The registered passes (importing `surgery` imports surgery.passes, which registers them)."""
    return sorted(REGISTRY)


def get_pass(name: str, config: dict | None = None) -> Pass:
    names = known_passes()
    if name not in REGISTRY:
        raise PassConfigError(f"Unknown pass '{name}'.", f"Known passes: {', '.join(names)}.")
    return REGISTRY[name](config or {})


def lint(graph: Graph) -> None:
    """Graph invariants after every pass: well-formed graph and executable code."""
    graph.gm.graph.lint()
    graph.gm.recompile()


class PassManager:
    """Runs passes in order after checking that the order satisfies every pass's declarations."""

    def __init__(self, passes: list[Pass | str], configs: dict[str, dict] | None = None):
        configs = configs or {}
        self.passes = [get_pass(p, configs.get(p)) if isinstance(p, str) else p for p in passes]
        unused = set(configs) - {p.name for p in self.passes}
        if unused:
            raise PassConfigError(f"Options were given for passes that are not in the pipeline: {', '.join(sorted(unused))}.", "Add the pass or drop its options.")
        for p in self.passes:
            p.bind(self.passes)

    def validate(self, already: list[str] | None = None) -> None:
        done = list(already or [])
        for p in self.passes:
            if p.name in p.not_after and p.name in done:
                where = "has already run on this graph" if p.name in (already or []) else "appears twice"
                raise PassOrderError(f"Pass '{p.name}' {where} (order given: {self.order(already)}); it cannot run twice.",
                                     f"Give {p.name} once, e.g. --passes select,replace,calibrate,align.")
            missing = [r for r in p.runs_after if r not in done]
            if missing:
                raise PassOrderError(
                    f"Pass '{p.name}' requires {', '.join(repr(m) for m in missing)} to run before it; order given: {self.order(already)}.",
                    f"Put {', '.join(missing)} before {p.name}, e.g. --passes select,replace,calibrate,align.",
                )
            clash = [f for f in p.not_after if f in done]
            if clash:
                raise PassOrderError(
                    f"Pass '{p.name}' cannot run after {', '.join(repr(c) for c in clash)}; order given: {self.order(already)}.",
                    f"Run {p.name} before {', '.join(clash)}.",
                )
            done.append(p.name)

    def order(self, already=None) -> str:
        return ",".join(list(already or []) + [p.name for p in self.passes])

    def layer_runs(self, after: str | None = None) -> list[tuple[str, int, int]]:
        """The layer runs (Pass.layer_runs) of the passes after the first one named `after` (all: None)."""
        names = [p.name for p in self.passes]
        start = names.index(after) + 1 if after in names else 0
        return [run for p in self.passes[start:] for run in p.layer_runs()]

    def __call__(self, graph: Graph, progress=None) -> PassResult:
        self.validate([h["pass"] for h in graph.history])
        for p in self.passes:
            named(p, graph, p.preflight)
        modified, info = False, {}
        for p in self.passes:
            result = named(p, graph, p)
            modified |= result.modified
            info[p.name] = result.info
            if progress is not None:
                progress(p.name, result)
        return PassResult(graph, modified, info)


def named(p: Pass, graph: Graph, step):
    """step(graph), its errors naming the pass and what ran on the graph before it."""
    before = ", ".join(h["pass"] for h in graph.history) or "nothing"
    try:
        return step(graph)
    except SurgeryError as exc:
        raise type(exc)(f"Pass '{p.name}' failed (after: {before}). {exc.problem}", exc.fix) from exc
    except Exception as exc:
        if ran_out_of_memory(exc):
            raise PassFailedError(f"Pass '{p.name}' ran out of memory (after: {before}): {first_line(exc)}", OUT_OF_MEMORY_FIX) from exc
        raise PassFailedError(f"Pass '{p.name}' failed (after: {before}): {type(exc).__name__}: {exc}", "Run with --debug for the trace.") from exc


def parse_options(items, into: dict | None = None) -> dict:
    """["align.steps=100", ...] -> {"align": {"steps": "100"}} (values stay text: each pass's config
    coerces them), merged into `into` when given. The CLI's --set and the benchmarks' use this."""
    configs = into if into is not None else {}
    for item in items or []:
        key, sep, value = item.partition("=")
        name, dot, option = key.partition(".")
        if not sep or not dot:
            raise PassConfigError(f"Option '{item}' is not of the form pass.key=value.", "Write e.g. --set align.steps=100.")
        configs.setdefault(name, {})[option] = value
    return configs
