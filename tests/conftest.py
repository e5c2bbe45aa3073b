"""Shared fixtures: the real tiny teacher (stories260K, GGUF) and the tiny architectures of archs.py,
each captured once per session.

Capturing is the slow part of this suite (about 1 s per tiny architecture, 3 s for the first one), so:

* `stories_teacher` captures stories260K once; `stories` hands out `teacher.branch()` copies, which are
  fresh unconverted Graphs over the same (shared!) teacher weights. A test that changes a teacher
  weight must put it back.
* `tiny(name)` returns a cached `Tiny` for an architecture of archs.ARCHS: the eager model, the graph
  captured with find=False (so capture and site discovery fail separately), and the sites or the
  exception discovery raised. `tiny(name).graph` is the master; use `.branch()` to convert.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from surgery.core.run import placeholder_values

# One thread: every tensor here is tiny, and OpenMP barriers on the 2 shared cores cost more than the
# work (measured on 2 cores: the whole suite takes ~1.6 min with 1 thread, ~7 min with 2).
torch.set_num_threads(1)

MAX_WORKERS = 4  # pytest-xdist's -n auto (pyproject's addopts): every worker captures its own teachers, ~1-2 GB each


def pytest_xdist_auto_num_workers(config):
    """-n auto: one worker per core, at most MAX_WORKERS (the suite's tests are single-threaded)."""
    return max(1, min(os.cpu_count() or 1, MAX_WORKERS))


ASSETS = Path(__file__).parent / "assets"
STORIES = ASSETS / "stories260k" / "stories260K.gguf"


@pytest.fixture(scope="session", autouse=True)
def _isolated_token_cache(tmp_path_factory):
    """Calibration token streams are cached on disk; keep the suite's cache out of the user's home."""
    old = os.environ.get("SURGERY_CACHE")
    os.environ["SURGERY_CACHE"] = str(tmp_path_factory.mktemp("surgery-cache"))
    yield
    if old is None:
        os.environ.pop("SURGERY_CACHE", None)
    else:
        os.environ["SURGERY_CACHE"] = old


@pytest.fixture(scope="session", autouse=True)
def _export_once_per_model_shape():
    """torch.export is most of what a load costs (~4 s for stories260K), and the suite loads the same
    few models over and over (every saved hybrid, every CLI call rebuilds its teacher). Within the
    session an export is reused for a model of the same classes, code, config, dtype, device and
    length: the cached GraphModule is deep-copied and given the new model's tensors (shared, as export's
    own module shares them), so every test still runs its own weights. Models with instance-level forwards or hooks are always exported."""
    import copy

    import surgery.core.capture as capture_module

    real = capture_module.export_model
    cache: dict = {}

    def key_of(model, max_length, debug):
        if any("forward" in vars(m) or m._forward_hooks or m._forward_pre_hooks for m in model.modules()):
            return None
        config = getattr(model, "config", None)
        code = tuple(sorted({(type(m).__qualname__, id(type(m).forward)) for m in model.modules()}))
        first = next(model.parameters(), None)
        return (repr(model), config.to_json_string() if config is not None else None,
                getattr(config, "_attn_implementation", None), code, str(first.dtype) if first is not None else None,
                str(first.device) if first is not None else None, max_length, debug, model.training)

    def export_model(model, max_length, debug=False, narrowed=None):
        key = key_of(model, max_length, debug)
        if key is None or key not in cache:
            gm = real(model, max_length, debug=debug, narrowed=narrowed)
            if key is not None:
                cache[key] = copy.deepcopy(gm)
            return gm
        vocab = model.get_input_embeddings().weight.shape[0]  # the random ids export draws, so RNG streams match
        torch.randint(0, vocab, (capture_module.CAPTURE_BATCH, min(capture_module.CAPTURE_LENGTH, max_length)),
                      device=next(model.parameters()).device)
        gm = copy.deepcopy(cache[key])
        tensors = model.state_dict(keep_vars=True)
        if set(gm.state_dict()) != set(tensors):  # the graph does not hold exactly the model's tensors
            return real(model, max_length, debug=debug, narrowed=narrowed)
        for name, tensor in tensors.items():  # share the model's tensors, as export's own module does
            owner, _, leaf = name.rpartition(".")
            module = gm.get_submodule(owner)
            (module._parameters if leaf in module._parameters else module._buffers)[leaf] = tensor
        return gm

    capture_module.export_model = export_model
    yield
    capture_module.export_model = real


# ------------------------------------------------------------------------------------------------
# stories260K


@pytest.fixture(scope="session")
def stories_path() -> Path:
    assert STORIES.exists(), f"test asset missing: {STORIES}"
    return STORIES


@pytest.fixture(scope="session")
def stories_teacher(stories_path):
    """The captured stories260K teacher (sites found). Do not convert it: use `stories()`."""
    import surgery

    return surgery.capture(stories_path)


@pytest.fixture(scope="session")
def stories_eager(stories_path):
    """stories260K as transformers loads it from the GGUF: the independent reference."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(stories_path.parent, gguf_file=stories_path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def stories(stories_teacher):
    """Factory: a fresh unconverted Graph over the session's stories260K teacher."""
    return stories_teacher.branch


# ------------------------------------------------------------------------------------------------
# tiny architectures


@dataclass
class Tiny:
    name: str
    model: torch.nn.Module                  # the eager transformers model (float32, eval)
    graph: object = None                    # surgery Graph captured with find=False; sites set when found
    capture_error: BaseException | None = None
    sites_error: BaseException | None = None
    extra: dict = field(default_factory=dict)

    def require_graph(self):
        if self.capture_error is not None:
            pytest.fail(f"{self.name}: capture failed: {type(self.capture_error).__name__}: {self.capture_error}")
        return self.graph

    def require_sites(self) -> list:
        self.require_graph()
        if self.sites_error is not None:
            pytest.fail(f"{self.name}: site discovery failed: {type(self.sites_error).__name__}: {self.sites_error}")
        return self.graph.sites


_TINY: dict[str, Tiny] = {}


def _randomise_biases(model: torch.nn.Module, seed: int = 1) -> None:
    """transformers initialises every bias to zero, which would let a dropped or misplaced bias go
    unnoticed: give each bias small random values (seeded, before capture) instead."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") and p.is_floating_point():
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def get_tiny(name: str) -> Tiny:
    """Build and capture one tiny architecture, once per session."""
    if name not in _TINY:
        from archs import build

        import surgery
        from surgery.sites import find_sites

        entry = Tiny(name, build(name))
        _randomise_biases(entry.model)
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                entry.graph = surgery.capture(entry.model, find=False)
        except Exception as exc:  # recorded; the tests that need the graph fail with it
            entry.capture_error = exc
        if entry.graph is not None:
            try:
                entry.graph.sites = find_sites(entry.graph)
            except Exception as exc:
                entry.sites_error = exc
        _TINY[name] = entry
    return _TINY[name]


@pytest.fixture(scope="session")
def tiny():
    return get_tiny


# ------------------------------------------------------------------------------------------------
# graph helpers


class _Recorder(torch.fx.Interpreter):
    def __init__(self, gm, names):
        super().__init__(gm)
        self.names = set(names)
        self.values = {}

    def run_node(self, n):
        value = super().run_node(n)
        if n.name in self.names:
            self.values[n.name] = value.detach().clone() if isinstance(value, torch.Tensor) else value
        return value


def node_values(gm: torch.fx.GraphModule, ids: torch.Tensor, names) -> dict:
    """Run an exported GraphModule on token ids and return {node name: value} for `names`."""
    names = [n for n in names if n]
    missing = set(names) - {n.name for n in gm.graph.nodes}
    assert not missing, f"graph has no node(s) {sorted(missing)}"
    rec = _Recorder(gm, names)
    with torch.no_grad():
        rec.run(*placeholder_values(gm, ids))
    return rec.values


@pytest.fixture(scope="session")
def record():
    return node_values


def gdn_of(graph, layer: int):
    """The GatedDeltaNet module that replaced `layer` in a converted graph."""
    target = graph.meta["replace"]["modules"][str(layer)]["target"]
    return graph.gm.get_submodule(target)


@pytest.fixture(scope="session")
def gdn_at():
    return gdn_of
