"""A surgery hybrid as an ordinary transformers model, for people who never installed surgery.

The teacher's own transformers class is built from this config; each attention module that was
converted (config.surgery_hybrid["gdn_layers"], keyed by module path) is then swapped for its mixer's
layer (MIXERS: the project's GatedDeltaNet from gdn.py, kernels.py, split_state.py, state_pass.py, chunk_intra.py,
chunk_states.py, chunk_inputs.py, pdl.py, switches.py,
token_step.py, delta_inputs.py and gated_norm.py beside this file, copied verbatim by `surgery export`; gla, kda and
mamba2 from their own files beside it) called the way the teacher's decoder layer calls its attention (SwappedAttention).
A sliding-window (swa) layer keeps the teacher's attention module, whose 4-D attention mask a
forward pre-hook limits to the layer's window (WindowMask).

Imports only torch, transformers and, when they import, fla (through kernels.py, on CUDA) and
Triton (token_step.py, delta_inputs.py, gated_norm.py, chunk_intra.py, chunk_states.py). Loads in transformers 4.57 and later
(tests/test_export_versions.py checks 4.57.6 and the 5.x range); an older one is refused at import in one line.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import re

import torch
import transformers
from transformers import PreTrainedModel
from transformers.cache_utils import Cache
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

# transformers 4.x copies only the files this module imports itself: name gdn.py's own imports here
from .chunk_inputs import chunk_inputs_triton  # noqa: F401
from .chunk_intra import chunk_intra_triton  # noqa: F401
from .chunk_states import chunk_states_triton  # noqa: F401
from .delta_inputs import delta_inputs_torch  # noqa: F401
from .gated_norm import gated_rms_norm_torch  # noqa: F401
from .gdn import GatedDeltaNet
from .gla import GatedLinearAttention
from .gla_kernels import gla  # noqa: F401
from .kda import KimiDeltaAttention
from .kda_kernels import kda  # noqa: F401
from .kernels import fla_available  # noqa: F401
from .layer_graphs import StepGraphs, graph_layer
from .mamba2 import Mamba2
from .mamba2_kernels import ssd  # noqa: F401
from .pdl import pdl_launch  # noqa: F401
from .split_state import split_state_gated_delta_rule  # noqa: F401
from .state_pass import state_pass  # noqa: F401
from .surgery_teacher import TEACHER_CONFIG
from .switches import enabled  # noqa: F401
from .token_step import gdn_token_step  # noqa: F401

MIN_TRANSFORMERS = (4, 57)  # Cache.layers, which the GDN layers keep their state on


def release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".")[:2] if part.isdigit())


if release(transformers.__version__) < MIN_TRANSFORMERS or not hasattr(transformers, TEACHER_CONFIG):
    raise ImportError(f"This surgery export needs transformers >= {'.'.join(map(str, MIN_TRANSFORMERS))} with {TEACHER_CONFIG} "
                      f"(found {transformers.__version__}): pip install -U 'transformers>=4.57'.")

HYBRID_KEY = "surgery_hybrid"
STATE = "surgery_gdn_state"  # the attribute of a cache layer that holds its converted layer's state
LENGTH_READ = "surgery_length_read"  # the attribute of a cache that holds length_read's answers
MIXERS = {"gdn": GatedDeltaNet, "gla": GatedLinearAttention, "kda": KimiDeltaAttention, "mamba2": Mamba2}  # config "mixer" -> layer


class PaddingMask:
    """The 2-D attention mask of the current forward call, shared by the model and its GDN layers
    (the layers below only see the teacher's 4-D masks, which a recurrence cannot use)."""

    def __init__(self):
        self.set(None)

    def set(self, mask: torch.Tensor | None) -> None:
        self.mask, self.rows = mask, {}

    def keep(self, length: int) -> torch.Tensor | None:
        """The mask's last `length` columns as bool, None where every row keeps them all: read once per
        forward call (a device sync), not once per GDN layer, which would stall a decode step."""
        if self.mask is None:
            return None
        if length not in self.rows:
            keep = self.mask[:, -length:]  # all() reads any dtype as bool: no cast unless a row is padded
            self.rows[length] = None if bool(keep.all()) else keep.bool()
        return self.rows[length]


def concat_rows(rows: list[dict]) -> dict:
    """Per-row GDN states -> one batch state; a row without a tensor (nothing seen yet) gets zeros."""
    merged = {}
    for key in {k for row in rows for k in row}:
        like = next(row[key] for row in rows if row.get(key) is not None)
        merged[key] = torch.cat([row[key] if row.get(key) is not None else torch.zeros_like(like) for row in rows])
    return merged


class AttentionOutput(tuple):
    """(output, None), joinable to what the teacher's decoder layer joins it to: most attention modules
    return a tuple, some (OpenAI GPT's) a list that the layer concatenates to a list (`[h] + out[1:]`).
    A slice stays this type, and `list + it` gives a list (a list has no `+` slot for a tuple, so
    Python asks this one's __radd__), `tuple + it` a tuple."""

    def __getitem__(self, index):
        item = super().__getitem__(index)
        return AttentionOutput(item) if isinstance(index, slice) else item

    def __radd__(self, other):
        if isinstance(other, list):
            return other + list(self)
        if isinstance(other, tuple):
            return other + tuple(self)
        return NotImplemented


class SwappedAttention:
    """A mixer layer in an attention module's place (mixed into the layer's class by attention_class):
    forward(hidden_states, ...) returns (output, None) as the teacher's attention returns (output,
    weights). With a cache, the layer's recurrent and conv state live on the cache's layer object for
    this layer index, and the layer feeds that object zero-width keys and values, so the object sees
    every token. Where transformers reads that layer's length (length_read: for positions and masks),
    the keys are one element (a one) a token instead: it counts a dynamic layer's length only when its
    keys hold elements, a static layer's by its nonzero slots (zero-width keys left a converted layer 0
    at length 0, and a decode loop that asks the cache for its length went wrong). Those marks cost one
    element a token (2 bytes in bf16) and a copy each call, so only the layers read carry them."""

    def __init__(self, gdn_config: dict, cache_index: int, padding: PaddingMask):
        super().__init__(**gdn_config)
        self.cache_index = cache_index
        self.__dict__["padding"] = padding  # shared, not a submodule

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        given = self.__dict__.get("given_state")
        if given is not None:  # the decoder layer's one-token graph (layer_graphs) did the cache's part
            return AttentionOutput((super().forward(hidden_states, given), None))
        cache = cache_in(args, kwargs)
        state = self.cached_state(cache, hidden_states) if cache is not None else None
        keep = self.padding.keep(hidden_states.shape[1])
        if keep is None:
            return AttentionOutput((super().forward(hidden_states, state), None))
        return AttentionOutput((self.forward_rows(hidden_states, keep, state), None))

    def cached_state(self, cache: Cache, hidden_states: torch.Tensor):
        """This layer's GDN state in `cache` (created empty on the first call). The state is updated in
        place, so a one-token call takes the fused token step (token_step.py: one Triton kernel on CUDA,
        its PyTorch reference elsewhere) and carries the state without copying it; the prefill runs
        the chunked kernel (fla's on CUDA)."""
        batch, length = hidden_states.shape[:2]
        marks = hidden_states.new_ones(batch, 1, length, 1 if length_read(cache, self.cache_index) else 0)
        cache.update(marks, marks[..., :0], self.cache_index)
        layer = cache.layers[self.cache_index]
        if getattr(layer, STATE, None) is None:
            state = self.new_cache()
            state.in_place = True
            setattr(layer, STATE, state)
        return getattr(layer, STATE)

    def one_token_state(self, hidden_states: torch.Tensor, args: tuple, kwargs: dict):
        """For the decoder layer's one-token graph (layer_graphs.LayerGraphs): this layer's state once the
        cache has seen the token (the length marks written), or None, with the cache untouched, where
        the call must run as it is (no cache, nothing prefilled yet, a padded token)."""
        cache = cache_in(args, kwargs)
        layers = getattr(cache, "layers", None)
        if cache is None or not isinstance(layers, list) or self.cache_index >= len(layers):
            return None
        state = getattr(layers[self.cache_index], STATE, None)
        if state is None or state.recurrent is None or self.padding.keep(hidden_states.shape[1]) is not None:
            return None
        return self.cached_state(cache, hidden_states)

    @contextlib.contextmanager
    def using(self, state):
        """Within: forward runs on `state` and leaves the cache alone (one_token_state did its part)."""
        before = self.__dict__.get("given_state")
        self.__dict__["given_state"] = state
        try:
            yield
        finally:
            self.__dict__["given_state"] = before

    def forward_rows(self, hidden_states: torch.Tensor, keep: torch.Tensor, state):
        """Left-padded rows, one at a time over their real tokens only (a pad token must not enter
        the recurrence); pad positions get zeros. Right padding or holes cannot be continued."""
        out, recurrent, conv = torch.zeros_like(hidden_states), [], []
        length = hidden_states.shape[1]
        for b in range(hidden_states.shape[0]):
            n = int(keep[b].sum())
            if not bool(keep[b, length - n:].all()):
                raise ValueError("GDN layers support left padding only (each row's real tokens at its end); "
                                 "pass padding_side='left' to the tokenizer.")
            row = self.new_cache()
            if state is not None:
                row.recurrent = None if state.recurrent is None else state.recurrent[b:b + 1]
                row.conv = {k: v[b:b + 1] for k, v in state.conv.items()}
            if n:
                out[b:b + 1, length - n:] = super().forward(hidden_states[b:b + 1, length - n:], row)
            recurrent.append({"s": row.recurrent})
            conv.append(row.conv)
        if state is not None:
            state.recurrent = concat_rows(recurrent).get("s")
            state.conv = concat_rows(conv)
        return out


def cache_in(args: tuple, kwargs: dict) -> Cache | None:
    """The transformers cache a call was given, under whatever name or position (cache, past_key_values,
    past_key_value, layer_past, GPT-2's second positional argument)."""
    return next((v for v in (*args, *kwargs.values()) if isinstance(v, Cache)), None)


def length_read(cache: Cache, index: int) -> bool:
    """Whether transformers reads cache layer `index`'s length: get_seq_length's default layer (0) and,
    for masks, the first layer of each kind (full or sliding, the cache's is_sliding). Kept on the cache
    once its layers are known (is_sliding builds a list each read: not once per layer per token)."""
    known = vars(cache).setdefault(LENGTH_READ, {})
    if index not in known:
        kinds = getattr(cache, "is_sliding", None)
        if not isinstance(kinds, (list, tuple)) or index >= len(kinds):
            return index == 0  # a cache whose layers come as they are first updated: not kept
        known[index] = list(kinds).index(kinds[index]) == index
    return known[index]


class WindowMask:
    """A forward pre-hook on a kept attention module that surgery converted to sliding-window attention
    (config "mixer": "swa"): key j is seen by query i only when i - window < j <= i, positions as the
    cache holds them (the queries at the end of the keys, or at the cache's length in a static one).
    The module does the rest as the teacher's; its cache stays transformers' own (a full one)."""

    def __init__(self, window: int, layer_index: int):
        self.window, self.layer_index = window, layer_index

    def __call__(self, module, args, kwargs):
        signature = forward_signature(type(module))
        bound = signature.bind(module, *args, **kwargs)
        call = {}
        for name, value in list(bound.arguments.items())[1:]:
            kind = signature.parameters[name].kind
            if kind is inspect.Parameter.VAR_KEYWORD:
                call.update(value)
            elif kind is not inspect.Parameter.VAR_POSITIONAL:
                call[name] = value
            elif value:
                raise ValueError(f"{type(module).__name__} was called with extra positional arguments, which a windowed layer cannot pass on.")
        hidden = next(iter(call.values()))  # the module's first argument: the hidden states [B, T, ...]
        cache = cache_in((), call)
        past = cache.get_seq_length(self.layer_index) if cache is not None else 0
        implementation = getattr(getattr(module, "config", None), "_attn_implementation", None) or "sdpa"
        mask = call.get("attention_mask")
        if implementation not in ("sdpa", "eager") or not (mask is None or (isinstance(mask, torch.Tensor) and mask.dim() == 4)):
            raise ValueError("This export's sliding-window (swa) layers window the attention's 4-D mask, which attention "
                             f"implementation {implementation!r} does not take: load it with attn_implementation='sdpa' or 'eager'.")
        call["attention_mask"] = self.band(mask, hidden.shape[1], past, hidden, implementation == "eager")
        return (), call

    def band(self, mask, length: int, past: int, like: torch.Tensor, eager: bool):
        keys = mask.shape[-1] if mask is not None else past + length
        start = past if keys >= past + length else keys - length  # a static cache's slots, or the queries at the keys' end
        i = torch.arange(length, device=like.device)[:, None] + start
        j = torch.arange(keys, device=like.device)[None, :]
        allowed = (j <= i) & (i - j < self.window)
        if mask is None and not eager:
            return allowed[None, None]
        if mask is None:
            mask = torch.zeros(1, 1, length, keys, dtype=like.dtype, device=like.device)
        if mask.dtype == torch.bool:
            return mask & allowed
        return mask.masked_fill(~allowed, torch.finfo(mask.dtype).min)


@functools.lru_cache(maxsize=None)
def attention_class(mixer: str) -> type:
    """SwappedAttention over the layer class of `mixer` (one class per mixer)."""
    if mixer not in MIXERS:
        raise ValueError(f"This export's config names mixer {mixer!r}, which its code does not hold ({', '.join(MIXERS)}).")
    layer = MIXERS[mixer]
    return type(f"{mixer.upper()}Attention", (SwappedAttention, layer), {"__module__": __name__})


GDNAttention = attention_class("gdn")


@functools.lru_cache(maxsize=None)
def forward_signature(cls) -> inspect.Signature:
    """cls.forward's signature, read once (each forward call binds its arguments to it)."""
    return inspect.signature(cls.forward)


@functools.lru_cache(maxsize=None)
def argument_slot(cls, name: str) -> tuple[bool, int | None]:
    """Whether cls.forward has a parameter `name`, and its index among a call's positional arguments (self
    not counted; None where it cannot be passed by position)."""
    parameters = list(forward_signature(cls).parameters.values())[1:]
    named = any(p.name == name and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters)
    for i, p in enumerate(parameters):
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            break
        if p.name == name:
            return named, i
    return named, None


def call_argument(cls, name: str, args: tuple, kwargs: dict):
    """cls.forward's argument `name` in a call (None when not passed), as binding the call to forward's
    signature reads it, without the binding (inspect's costs ~6 us a forward call on the CPU)."""
    named, position = argument_slot(cls, name)
    if not named:
        return None
    if name in kwargs:
        return kwargs[name]
    return args[position] if position is not None and position < len(args) else None


def keep_flags(attention: torch.nn.Module, gdn: torch.nn.Module) -> None:
    """The attention module's plain attributes (is_sliding, layer_idx, ...) on its GDN, for a decoder
    layer that reads them (transformers 4.x's Gemma3 layer reads self_attn.is_sliding)."""
    for key, value in vars(attention).items():
        if not key.startswith("_") and isinstance(value, (bool, int, float, str, type(None))) and not hasattr(gdn, key):
            setattr(gdn, key, value)


def teacher_class(config) -> type:
    """The teacher's own causal-LM class for this config, by transformers' model-type table (not the
    auto mapping, where 4.x registers this very class for the teacher's config class)."""
    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type])


class SurgeryHybridForCausalLM(PreTrainedModel):
    """Stands for the teacher's class with its converted attention swapped: from_pretrained and
    from_config build `hybrid_class(teacher)`, a subclass of both this class and the teacher's."""

    config_class = getattr(transformers, TEACHER_CONFIG)  # transformers 5.17-5.18 register every remote class by it
    _hybrid_classes: dict = {}

    @classmethod
    def hybrid_class(cls, config) -> type:
        teacher = teacher_class(config)
        if teacher not in cls._hybrid_classes:
            cls._hybrid_classes[teacher] = type(cls.__name__, (cls, teacher), {"config_class": type(config), "__module__": cls.__module__})
        return cls._hybrid_classes[teacher]

    @classmethod
    def is_resolved(cls) -> bool:
        return cls is not SurgeryHybridForCausalLM and SurgeryHybridForCausalLM in cls.__mro__[1:]

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, config=None, **kwargs):
        if cls.is_resolved():
            return super().from_pretrained(pretrained_model_name_or_path, *args, config=config, **kwargs)
        if config is None:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(pretrained_model_name_or_path, trust_remote_code=kwargs.get("trust_remote_code"))
        renamed = getattr(config, HYBRID_KEY).get("legacy_names")
        if renamed and release(transformers.__version__) < (5,):  # the file holds 5.x's names; 4.x's model others
            kwargs.setdefault("key_mapping", {f"^{re.escape(new)}$": old for new, old in renamed.items()})
        return cls.hybrid_class(config).from_pretrained(pretrained_model_name_or_path, *args, config=config, **kwargs)

    @classmethod
    def _from_config(cls, config, **kwargs):
        if cls.is_resolved():
            return super()._from_config(config, **kwargs)
        return cls.hybrid_class(config)._from_config(config, **kwargs)

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.gdn_padding = PaddingMask()
        self.surgery_step_graphs = StepGraphs()  # one-token CUDA graphs of the converted decoder layers
        for path, entry in getattr(config, HYBRID_KEY)["gdn_layers"].items():
            parent_path, _, name = path.rpartition(".")
            parent = self.get_submodule(parent_path)
            attention = getattr(parent, name)
            cache_index = getattr(attention, "layer_idx", None)
            index = entry["layer"] if cache_index is None else cache_index
            if entry.get("mixer") == "swa":
                attention.register_forward_pre_hook(WindowMask(int(entry["gdn_config"]["window"]), index), with_kwargs=True)
                continue
            swapped = attention_class(entry.get("mixer", "gdn"))
            gdn = swapped(entry["gdn_config"], index, self.gdn_padding)
            keep_flags(attention, gdn)
            setattr(parent, name, gdn.to(dtype=self.dtype))
            graph_layer(parent, name, parent_path, self.surgery_step_graphs)
        self.register_forward_pre_hook(self.record_padding, with_kwargs=True)
        self.register_forward_hook(self.forget_padding, with_kwargs=True)

    def record_padding(self, module, args, kwargs):
        mask = call_argument(type(self), "attention_mask", args, kwargs)
        self.gdn_padding.set(mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None)

    def forget_padding(self, module, args, kwargs, output):
        self.gdn_padding.set(None)
