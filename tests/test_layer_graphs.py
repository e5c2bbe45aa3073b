"""The export's one-token layer graphs (surgery/io/hf_modeling/layer_graphs.py), on the CPU through the
Rerun backend (a CUDA graph's contract: a replay sees only the static tensors of its capture): greedy
generate and the GDN state equal the eager export's; a layer that reads an argument which changes each
token, or that cannot be captured, stays eager with one warning; the switch turns it all off."""
from __future__ import annotations

import contextlib
import copy
import importlib.util
import sys
import warnings

import pytest
import torch

import surgery
from surgery import PassManager
from surgery.io.export import export
from surgery.io.hf_export import LAYER_GRAPHS_FILE

pytestmark = pytest.mark.versions


@pytest.fixture(scope="module")
def graphs_module():
    spec = importlib.util.spec_from_file_location("surgery_layer_graphs_under_test", LAYER_GRAPHS_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def stories_hf(stories, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("graphs")
    graph = stories()
    PassManager(["select", "replace"], {"select": {"policy": "convert", "layers": [0, 3]}})(graph)
    surgery.save(graph, root / "hybrid")
    return AutoModelForCausalLM.from_pretrained(str(export(root / "hybrid", root / "hf")), trust_remote_code=True,
                                                dtype=torch.float32).eval()


def exported_graphs_module(model):
    return sys.modules[type(model).__module__.rsplit(".", 1)[0] + ".layer_graphs"]


def greedy(model, ids, steps, mask=None):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids) if mask is None else mask, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                              output_scores=True, return_dict_in_generate=True, pad_token_id=0)


def graphed_against_eager(model, ids, steps, mask=None):
    """Greedy generate with the layer graphs off, then on through Rerun (captured at the first decoded token,
    checked at the second, replayed after): (eager, graphed, replays per token, the layers' LayerGraphs)."""
    module, shared = exported_graphs_module(model), model.surgery_step_graphs
    mask = torch.ones_like(ids) if mask is None else mask
    shared.enabled = False
    eager = greedy(model, ids, steps, mask)
    shared.enabled, shared.backend = True, module.Rerun()
    try:
        greedy(model, ids, 3, mask)
        graphed = [m.__dict__[module.ATTRIBUTE] for m in model.modules() if module.ATTRIBUTE in m.__dict__]
        replays = []
        for layer_graphs in graphed:
            for entry in layer_graphs.graphs.values():
                assert entry is not None and entry.checked, layer_graphs.label
                entry.replay = lambda replay=entry.replay: (replays.append(1), replay())
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # no layer refused
            got = greedy(model, ids, steps, mask)
    finally:
        shared.enabled, shared.backend = True, module.CudaGraphs()
    assert torch.equal(got.sequences, eager.sequences)
    for a, b in zip(got.scores, eager.scores):
        finite = torch.isfinite(b)
        assert torch.equal(torch.isfinite(a), finite) and (a[finite] - b[finite]).abs().max() <= 1e-5
    return eager, got, len(replays) / (steps - 1), graphed


def test_graphed_generate_equals_the_eager_export(stories_hf):
    ids = torch.randint(0, 512, (2, 11), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # a left-padded row
    eager, got, per_token, graphed = graphed_against_eager(stories_hf, ids, 9, mask)
    assert len(graphed) == 2 and per_token == 2  # each converted layer, every token after the prompt's
    for index in (0, 3):
        state = lambda out: getattr(out.past_key_values.layers[index], "surgery_gdn_state").recurrent  # noqa: E731
        assert (state(got) - state(eager)).abs().max() <= 1e-5


@pytest.mark.parametrize("mixer", ["gdn", "gla", "kda", "mamba2"])
def test_every_mixer_replays_its_step(stories, tmp_path, mixer):
    """With short convolutions, whose state the mixers replace rather than write in place."""
    from transformers import AutoModelForCausalLM

    hybrid = stories()
    PassManager(["select", "replace"], {"select": {"policy": "convert", "layers": [1, 3]},
                                        "replace": {"mixer": mixer, "use_short_conv": True}})(hybrid)
    model = AutoModelForCausalLM.from_pretrained(str(export(hybrid, tmp_path / "hf")), trust_remote_code=True, dtype=torch.float32).eval()
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(5))
    assert graphed_against_eager(model, ids, 6)[2] == 2


@pytest.mark.parametrize("name", ["gemma3", "gpt2", "phi3", "falcon_new"])
def test_other_decoder_layers_replay(tiny, tmp_path, name):
    """Decoder layers that take their hidden states and cache by position (GPT-2), read sliding flags
    (Gemma3), fuse QKV (Phi3) or run attention and MLP side by side (Falcon)."""
    from transformers import AutoModelForCausalLM

    t = tiny(name)
    t.require_sites()
    converted = t.graph.branch()
    PassManager(["select", "replace"], {"select": {"policy": "convert", "layers": [0]}})(converted)
    model = AutoModelForCausalLM.from_pretrained(str(export(converted, tmp_path / "hf")), trust_remote_code=True, dtype=torch.float32).eval()
    ids = torch.randint(0, t.model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    assert graphed_against_eager(model, ids, 6)[2] == 1


class ToyState:
    def __init__(self):
        self.recurrent = torch.zeros(2, 4)
        self.conv = {}


class ToyMixer(torch.nn.Module):
    """The mixer's side of the contract: one_token_state (the cache's part done) and using(state)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.given = None

    def one_token_state(self, hidden, args, kwargs):
        return kwargs["cache"]

    @contextlib.contextmanager
    def using(self, state):
        before, self.given = self.given, state
        try:
            yield
        finally:
            self.given = before

    def forward(self, hidden, cache=None):
        state = self.given if self.given is not None else cache
        state.recurrent.mul_(0.5).add_(self.proj(hidden[:, 0]))
        return hidden + state.recurrent[:, None]


class ToyLayer(torch.nn.Module):
    def __init__(self, reads_position: bool):
        super().__init__()
        self.mixer, self.mlp, self.reads_position = ToyMixer(), torch.nn.Linear(4, 4), reads_position

    def forward(self, hidden, position=None, cache=None):
        h = self.mixer(hidden, cache)
        h = h + self.mlp(h)
        return h + position[:, None, None] if self.reads_position else h


def run_steps(layer, steps=6):
    torch.manual_seed(0)
    state, outs = ToyState(), []
    with torch.no_grad():
        for step in range(steps):
            outs.append(layer(torch.randn(2, 1, 4), position=torch.full((2,), float(step)), cache=state))
    return outs, state


@pytest.mark.parametrize("reads_position", [False, True])
def test_a_layer_that_reads_a_changing_argument_stays_eager(graphs_module, reads_position):
    torch.manual_seed(1)
    eager = ToyLayer(reads_position)
    graphed = copy.deepcopy(eager)
    graphs_module.graph_layer(graphed, "mixer", "toy", graphs_module.StepGraphs(graphs_module.Rerun()))
    want, want_state = run_steps(eager)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, got_state = run_steps(graphed)
    assert all(torch.allclose(g, w, atol=1e-6) for g, w in zip(got, want))
    assert torch.allclose(got_state.recurrent, want_state.recurrent, atol=1e-6)
    entry = next(iter(graphed.__dict__[graphs_module.ATTRIBUTE].graphs.values()))
    messages = [str(w.message) for w in caught if "CUDA graph" in str(w.message)]
    if reads_position:
        assert entry is None and len(messages) == 1 and "disagreed with its eager forward" in messages[0]
    else:
        assert entry is not None and entry.checked and not messages


def test_a_capture_that_fails_leaves_the_layer_eager(graphs_module):
    class Failing(graphs_module.Rerun):
        def capture(self, step, device):
            raise RuntimeError("operation not permitted when stream is capturing")

    torch.manual_seed(1)
    eager = ToyLayer(False)
    graphed = copy.deepcopy(eager)
    graphs_module.graph_layer(graphed, "mixer", "toy", graphs_module.StepGraphs(Failing()))
    want, _ = run_steps(eager)
    with pytest.warns(UserWarning, match="could not be captured .RuntimeError: operation not permitted"):
        got, _ = run_steps(graphed)
    assert all(torch.allclose(g, w, atol=1e-6) for g, w in zip(got, want))


def test_the_switch_and_the_class_name(graphs_module, monkeypatch):
    monkeypatch.setenv(graphs_module.SWITCH, "off")
    assert not graphs_module.StepGraphs().enabled
    monkeypatch.setenv(graphs_module.SWITCH, "on")
    assert graphs_module.StepGraphs().enabled
    layer = ToyLayer(False)
    graphs_module.graph_layer(layer, "mixer", "toy", graphs_module.StepGraphs())
    graphs_module.graph_layer(layer, "mixer", "toy", graphs_module.StepGraphs())  # twice: one wrapper
    assert type(layer).__name__ == "ToyLayer" and isinstance(layer, ToyLayer)  # device maps match layers by class name
    assert sum(c is graphs_module.GraphedLayer for c in type(layer).__mro__) == 1
    twin = copy.deepcopy(layer)  # a copy gets empty graphs of its own
    assert twin.__dict__[graphs_module.ATTRIBUTE] is not layer.__dict__[graphs_module.ATTRIBUTE]


def test_moving_the_weights_drops_the_graphs(graphs_module):
    """A graph holds its capture's tensor addresses: after .to() (new storage) the layer captures again."""
    torch.manual_seed(1)
    eager = ToyLayer(False)
    graphed = copy.deepcopy(eager)
    graphs_module.graph_layer(graphed, "mixer", "toy", graphs_module.StepGraphs(graphs_module.Rerun()))
    run_steps(graphed, 3)
    layer_graphs = graphed.__dict__[graphs_module.ATTRIBUTE]
    assert len(layer_graphs.graphs) == 1
    graphed.double().float()
    assert not layer_graphs.graphs
    got, _ = run_steps(graphed, 4)
    want, _ = run_steps(eager, 4)
    assert len(layer_graphs.graphs) == 1 and all(torch.allclose(g, w, atol=1e-6) for g, w in zip(got, want))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_decode_as_the_eager_export(stories_hf):
    """The real backend: the export on CUDA (float32) decodes the same greedy tokens, its logits and GDN state
    within float32 rounding of the eager export's, and every converted layer replays a checked graph."""
    model = copy.deepcopy(stories_hf).cuda()
    module = exported_graphs_module(model)
    ids = torch.randint(0, 512, (2, 11), generator=torch.Generator().manual_seed(4)).cuda()
    model.surgery_step_graphs.enabled = False
    eager = greedy(model, ids, 12)
    model.surgery_step_graphs.enabled = True
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        greedy(model, ids, 3)
        got = greedy(model, ids, 12)
    graphed = [layer.__dict__[module.ATTRIBUTE] for layer in model.model.layers if module.ATTRIBUTE in layer.__dict__]
    assert len(graphed) == 2 and all(entry is not None and entry.checked for g in graphed for entry in g.graphs.values())
    assert torch.equal(got.sequences, eager.sequences)
    for a, b in zip(got.scores, eager.scores):
        finite = torch.isfinite(b)
        assert (a[finite] - b[finite]).abs().max() <= 1e-4
