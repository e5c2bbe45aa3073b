"""A converted decoder layer's one-token forward, replayed as a CUDA graph (the export's decode speed).

In transformers' generate every decoded token runs each decoder layer's Python: its norms, MLP,
residual adds and the mixer's glue, some 20-30 launches whose host time is far above the GPU's at
small batches. A layer whose attention became a recurrent mixer holds nothing that grows with the
context, so its one-token forward is the same kernels on same-shaped tensors every token: it is
captured once per call shape (batch, dtype, state) and then replayed. The state is copied into the
graph's own buffers before a replay and back after it, so any cache can be decoded and none is tied
to a graph.

What makes a replay safe: the capture sees only the hidden states and the state, every other
tensor argument (masks, positions, rotary tables) replaced by a stand-in (NaN, or zeros for integer
and bool tensors) that is never refreshed; the first replay of each shape is checked against the
eager forward on the same inputs, a step later than the capture, so a layer that reads a stand-in
or bakes a step's value into its launches disagrees. A failed capture or a disagreement leaves the
layer eager, with one warning. `SURGERY_EXPORT_GRAPHS=off` (or `model.surgery_step_graphs.enabled
= False`) keeps every layer eager.
"""
from __future__ import annotations

import copy
import functools
import os
import warnings

import torch

SWITCH = "SURGERY_EXPORT_GRAPHS"  # "off" or "0": no graphs
ATTRIBUTE = "surgery_layer_graphs"  # a graphed decoder layer's LayerGraphs, in its __dict__
MAX_SHAPES = 4  # call shapes kept per layer (the oldest goes first)
MAX_CAPTURES = 16  # a layer whose calls keep changing shape stops capturing after this many
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-9}  # relative; 16-bit dtypes: 1e-2


def tree_map(fn, tree):
    """fn on every tensor of nested tuples, lists and dicts; anything else passed as it is."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if type(tree) in (tuple, list):
        return type(tree)(tree_map(fn, item) for item in tree)
    if type(tree) is dict:
        return {key: tree_map(fn, value) for key, value in tree.items()}
    return tree


def leaves(tree) -> list:
    """Every leaf of nested tuples, lists and dicts (tensors and other values alike)."""
    if type(tree) in (tuple, list):
        return [leaf for item in tree for leaf in leaves(item)]
    if type(tree) is dict:
        return [leaf for value in tree.values() for leaf in leaves(value)]
    return [tree]


def tensors_in(tree) -> list[torch.Tensor]:
    return [leaf for leaf in leaves(tree) if isinstance(leaf, torch.Tensor)]


def signature(tree):
    """A hashable outline of a call's arguments: tensors by dtype and rank (a mask grows each token, and
    the capture never reads it), plain values by value, other objects (a cache) by type."""
    if isinstance(tree, torch.Tensor):
        return ("tensor", tree.dtype, tree.dim())
    if type(tree) in (tuple, list):
        return (type(tree).__name__, *(signature(item) for item in tree))
    if type(tree) is dict:
        return ("dict", *((key, signature(value)) for key, value in tree.items()))
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree
    return type(tree).__qualname__


def stand_in(tensor: torch.Tensor) -> torch.Tensor:
    """What the capture is given in place of an argument it must not read: NaN where that can be held,
    zeros otherwise (a valid index: an out-of-range one could stop the device)."""
    if tensor.is_floating_point() or tensor.is_complex():
        return torch.full_like(tensor, float("nan"))
    return torch.zeros_like(tensor)


def state_tensors(state) -> dict[str, torch.Tensor]:
    """A mixer's decoding state (GDNCache: `recurrent`, the `conv` streams) as {name: tensor}."""
    named = {}
    for key, value in vars(state).items():
        if isinstance(value, torch.Tensor):
            named[key] = value
        elif isinstance(value, dict):
            named.update({f"{key}.{k}": v for k, v in value.items() if isinstance(v, torch.Tensor)})
    return named


def put_state(state, tensors: dict[str, torch.Tensor]) -> None:
    """Point `state`'s attributes at `tensors` (state_tensors' names)."""
    for name, tensor in tensors.items():
        key, _, inner = name.partition(".")
        if inner:
            getattr(state, key)[inner] = tensor
        else:
            setattr(state, key, tensor)


def cloned_state(state):
    twin = copy.copy(state)
    for key, value in vars(state).items():
        if isinstance(value, dict):
            setattr(twin, key, dict(value))
    put_state(twin, {name: t.clone() for name, t in state_tensors(state).items()})
    return twin


def agree(got: torch.Tensor, want: torch.Tensor) -> bool:
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    scale = want.float().abs().max().clamp_min(1.0) if want.numel() else 1.0
    error = (got.float() - want.float()).abs().max() if want.numel() else torch.zeros(())
    return bool(error <= TOLERANCE.get(want.dtype, 1e-2) * scale)  # NaN compares False: a read stand-in disagrees


class CudaGraphs:
    """Captures on CUDA (torch.cuda.CUDAGraph), one memory pool per device for all of a model's layers
    (they replay one after another, never at once)."""

    def __init__(self):
        self.pools: dict = {}

    def takes(self, hidden: torch.Tensor) -> bool:
        """On the current CUDA device (a layer a device map put on another GPU stays eager), not inside a capture."""
        return hidden.is_cuda and hidden.device.index == torch.cuda.current_device() and not torch.cuda.is_current_stream_capturing()

    def capture(self, step, device: torch.device):
        """(replay, outputs): `step` run once on a side stream (torch's warm-up), then captured."""
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream(device).wait_stream(side)
        if device not in self.pools:
            self.pools[device] = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()  # thread_local: another thread's CUDA calls do not break this capture
        with torch.cuda.graph(graph, pool=self.pools[device], capture_error_mode="thread_local"):
            outputs = step()
        return graph.replay, outputs


class Rerun:
    """A CUDA graph's contract without a GPU (the tests' reference): a replay runs the captured step
    again on the same static tensors and writes its results into the first run's outputs."""

    def takes(self, hidden: torch.Tensor) -> bool:
        return True

    def capture(self, step, device: torch.device):
        outputs = step()

        def replay():
            for old, new in zip(tensors_in(outputs), tensors_in(step())):
                old.copy_(new)

        return replay, outputs


class StepGraphs:
    """What a model's graphed layers share: the switch, the capture backend and the pools."""

    def __init__(self, backend=None):
        self.enabled = os.environ.get(SWITCH, "on").strip().lower() not in ("off", "0", "false", "no")
        self.backend = backend or CudaGraphs()

    def __deepcopy__(self, memo):
        """A copied model gets no graphs (they hold the original's buffers), the same switch and kind of backend."""
        twin = StepGraphs(self.backend if isinstance(self.backend, Rerun) else None)
        twin.enabled = self.enabled
        return twin


class CapturedStep:
    """One captured one-token step: the static hidden input, the state tensors it reads and writes,
    and the static outputs."""

    def __init__(self, hidden, state_in: dict, state_out: dict, outputs, replay):
        self.hidden, self.state_in, self.state_out = hidden, state_in, state_out
        self.outputs, self.replay, self.checked = outputs, replay, False

    def run(self, hidden: torch.Tensor, real: dict[str, torch.Tensor]):
        """The step on `hidden`, the state's tensors `real` (state_tensors) updated as the eager step
        updates them; outputs are copies."""
        self.hidden.copy_(hidden)
        for name, tensor in self.state_in.items():
            tensor.copy_(real[name])
        self.replay()
        for name, tensor in self.state_out.items():
            real[name].copy_(tensor)
        return tree_map(torch.clone, self.outputs)


class LayerGraphs:
    """The one-token graphs of one converted decoder layer, by call shape (None: that shape runs eagerly)."""

    def __init__(self, mixer_name: str, label: str, shared: StepGraphs):
        self.mixer_name, self.label, self.shared = mixer_name, label, shared
        self.graphs: dict = {}
        self.captures, self.warned = 0, False

    def __deepcopy__(self, memo):
        return LayerGraphs(self.mixer_name, self.label, copy.deepcopy(self.shared, memo))

    def call(self, layer, forward, args: tuple, kwargs: dict):
        hidden = args[0] if args else None
        if not self.wanted(hidden):
            return forward(*args, **kwargs)
        mixer = getattr(layer, self.mixer_name)
        state = mixer.one_token_state(hidden, args, kwargs)  # the cache has seen the token from here on
        if state is None:
            return forward(*args, **kwargs)
        real = state_tensors(state)
        key = (tuple(hidden.shape), hidden.dtype, hidden.device, torch.is_inference_mode_enabled(), autocast(hidden.device.type),
               signature(args[1:]), signature(kwargs), tuple((n, tuple(t.shape), t.dtype) for n, t in real.items()))
        with mixer.using(state):
            if key not in self.graphs:
                out = forward(*args, **kwargs)
                self.add(key, mixer, forward, hidden, state, args, kwargs)
                return out
            entry = self.graphs[key]
            if entry is None:
                return forward(*args, **kwargs)
            if not entry.checked:
                return self.check(key, entry, forward, hidden, state, args, kwargs)
        return entry.run(hidden, real)

    def wanted(self, hidden) -> bool:
        return (self.shared.enabled and isinstance(hidden, torch.Tensor) and hidden.dim() == 3 and hidden.shape[1] == 1
                and not torch.is_grad_enabled() and not is_compiling() and self.shared.backend.takes(hidden))

    def add(self, key, mixer, forward, hidden, state, args, kwargs) -> None:
        """Capture the step for `key` (after the eager step of this call, which set the kernels up)."""
        if len(self.graphs) >= MAX_SHAPES:
            del self.graphs[next(iter(self.graphs))]
        self.captures += 1
        if self.captures > MAX_CAPTURES:
            self.graphs[key] = None
            return self.refuse(f"was captured {MAX_CAPTURES} times (its calls keep changing shape)")
        static_hidden, static_state = hidden.clone(), cloned_state(state)
        state_in = state_tensors(static_state)
        rest = tree_map(stand_in, (args[1:], kwargs))

        def step():
            put_state(static_state, state_in)  # every replay reads the same tensors
            with mixer.using(static_state):
                out = forward(static_hidden, *rest[0], **rest[1])
            return out, state_tensors(static_state)

        try:
            replay, (outputs, state_out) = self.shared.backend.capture(step, hidden.device)
        except Exception as error:  # noqa: BLE001 - any failure leaves the layer eager, which is always right
            self.graphs[key] = None
            return self.refuse(f"could not be captured ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})")
        if set(state_out) != set(state_in) or any(t is not None and not isinstance(t, torch.Tensor) for t in leaves(outputs)):
            self.graphs[key] = None
            return self.refuse("changes its state's layout or returns something other than tensors")
        self.graphs[key] = CapturedStep(static_hidden, state_in, state_out, outputs, replay)

    def check(self, key, entry: CapturedStep, forward, hidden, state, args, kwargs):
        """The first replay of a shape against the eager step on the same inputs; returns the eager result."""
        scratch_tensors = state_tensors(cloned_state(state))
        replayed = entry.run(hidden, scratch_tensors)
        out = forward(*args, **kwargs)
        got, want = tensors_in(replayed), tensors_in(out)
        real = state_tensors(state)  # after the eager step: a mixer may have replaced its tensors
        same = (len(got) == len(want) and all(agree(g, w) for g, w in zip(got, want))
                and set(scratch_tensors) == set(real) and all(agree(scratch_tensors[n], real[n]) for n in real))
        if same:
            entry.checked = True
        else:
            self.graphs[key] = None
            self.refuse("disagreed with its eager forward (it reads an argument that changes each token)")
        return out

    def refuse(self, why: str) -> None:
        if not self.warned:
            self.warned = True
            warnings.warn(f"surgery export: decoder layer {self.label}'s one-token CUDA graph {why}; that call shape "
                          f"decodes eagerly (set {SWITCH}=off to turn the graphs off).", stacklevel=3)


def autocast(device_type: str):
    """The autocast mode a call runs under (a graph keeps the casts of its capture)."""
    try:
        return torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type)
    except (TypeError, AttributeError):  # torch before 2.4: no per-device queries
        return torch.is_autocast_enabled()


def is_compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and hasattr(compiler, "is_compiling") and compiler.is_compiling())


class GraphedLayer:
    """Mixed into a converted decoder layer's class (graphed_class): a call goes through the layer's
    LayerGraphs, which runs one-token calls from a graph and everything else as the teacher's forward."""

    def forward(self, *args, **kwargs):
        graphs = self.__dict__.get(ATTRIBUTE)
        if graphs is None:
            return super().forward(*args, **kwargs)
        return graphs.call(self, super().forward, args, kwargs)

    def _apply(self, fn, *args, **kwargs):
        """`.to()`, `.half()`, `.cuda()` and the like give the parameters new storage, which a captured graph would
        not see: the layer's graphs are dropped first and captured again on the next decoded token."""
        graphs = self.__dict__.get(ATTRIBUTE)
        if graphs is not None:
            graphs.graphs.clear()
        return super()._apply(fn, *args, **kwargs)


@functools.lru_cache(maxsize=None)
def graphed_class(cls: type) -> type:
    """cls with GraphedLayer first, under cls's own name (device maps match decoder layers by class name)."""
    return type(cls.__name__, (GraphedLayer, cls), {"__module__": cls.__module__, "__qualname__": cls.__qualname__})


def graph_layer(layer: torch.nn.Module, mixer_name: str, label: str, shared: StepGraphs) -> None:
    """Give `layer` (a decoder layer whose attention is the mixer at attribute `mixer_name`) its graphs."""
    if not isinstance(layer, GraphedLayer):
        layer.__class__ = graphed_class(type(layer))
    layer.__dict__[ATTRIBUTE] = LayerGraphs(mixer_name, label, shared)
