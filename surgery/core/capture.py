"""Capture a causal LM into an FX GraphModule with torch.export (non-strict, dynamic batch and length).

The exported module keeps the model's state_dict names and records each node's module path in
node.meta["nn_module_stack"], which is all the later passes need."""
from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from ..errors import CaptureError, ModelLoadError, first_line
from . import progress
from .graph import Graph
from .load import load_model
from .rewrite import computed_buffers, token_dependent
from .slice_fill import drop_whole_slices, fold_slice_fills

CAPTURE_BATCH = 2
CAPTURE_LENGTH = 16
UNBOUNDED_LENGTH = 1 << 16


def max_positions(config) -> int:
    """The longest input the architecture declares (transformers maps n_positions etc. onto this name)."""
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else UNBOUNDED_LENGTH


def export_model(model: torch.nn.Module, max_length: int, debug: bool = False,
                 narrowed: Callable[[int, int], None] | None = None) -> torch.fx.GraphModule:
    """torch.export the model's forward(input_ids) with symbolic batch and sequence length, in one trace.
    narrowed(lowest, highest) is called when a shape guard in the model's forward narrows the lengths
    the graph accepts (a runtime check in the graph then refuses the others by name)."""
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (CAPTURE_BATCH, min(CAPTURE_LENGTH, max_length)), device=_device(model))
    # use_cache=False keeps KV caches out of the graph; a model whose forward has no such argument
    # (openai-gpt, granitemoe) never builds one
    extra = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
    # DYNAMIC hints with ranges, not named Dims: a guard export cannot prove over a named range (seen on
    # CUDA with torch 2.11: min(64*seq, 192*seq) == 64*seq) makes named Dims fail and a second trace
    # necessary, about 10 s of a cold start; a hint keeps it as a runtime check.
    dims = {0: torch.export.Dim.DYNAMIC(min=1, max=4096), 1: torch.export.Dim.DYNAMIC(min=1, max=max_length)}
    program, failure = None, None
    try:
        with torch.no_grad():
            program = torch.export.export(
                model, (), {"input_ids": ids, **extra},
                dynamic_shapes={"input_ids": dims, **{k: None for k in extra}}, strict=False,
            )
    except Exception as exc:
        failure = exc
    if program is None:
        if debug:
            raise failure
        raise CaptureError(
            f"torch.export could not trace {type(model).__name__}: {first_line(failure)}",
            "Run with --debug for the full trace; models with data-dependent control flow in forward cannot be captured.",
        ) from failure
    drop_length_one_guards(program, max_length)
    lengths = length_range(program)
    if narrowed is not None and lengths is not None and (lengths[0] > 2 or lengths[1] < max_length):
        narrowed(*lengths)
    gm = program.module()
    drop_metadata_asserts(gm)
    fold_slice_fills(gm)
    drop_whole_slices(gm)  # after the fills: a fill's slices are what it reads
    pin_position_precision(gm)
    gm.meta["max_length"] = max_length
    gm.meta["extra_inputs"] = extra
    return gm


def drop_length_one_guards(program, max_length: int) -> int:
    """Remove the input guards that refuse one token and nothing else. Export traces without the 0/1
    cases, and torch 2.11 wrote that assumption into XGLM's program as `seq < min(seq*seq, 4*seq*seq)`,
    so its graph refused one-token calls (a Decoder's steps) that torch >= 2.13's same graph runs. A
    guard on the length alone that fails at 1 and holds at every length from 2 to max_length is that."""
    code = getattr(program, "_guards_code", None)  # torch >= 2.9: what program.module()'s _guards_fn checks
    if not code:
        return 0
    kept = [guard for guard in code if not _refuses_only_one(guard, max_length)]
    if len(kept) < len(code):
        program._guards_code = kept
    return len(code) - len(kept)


class _LengthOnly:
    """input_ids as a guard sees it when only its length is known: size()[1]; anything else raises."""

    def __init__(self, length: int):
        self.length = length

    def size(self):
        return {1: self.length}


def _refuses_only_one(guard: str, max_length: int) -> bool:
    """Whether the guard reads the input's length alone, fails at 1 and holds from 2 to max_length. (The
    guards are the Python code torch.export wrote for this program, evaluated with no builtins.)"""
    try:
        code = compile(guard, "<export guard>", "eval")
    except SyntaxError:
        return False

    def value(length: int) -> bool | None:  # None: it reads more than the length
        try:
            out = eval(code, {"__builtins__": {}, "min": min, "max": max, "L": {"input_ids": _LengthOnly(length)}})
        except Exception:
            return None
        return out if isinstance(out, bool) else None

    return value(1) is False and all(value(n) is True for n in range(2, max_length + 1))


def length_range(program) -> tuple[int, int] | None:
    """(lowest, highest) sequence length the exported program accepts; None if the length is not symbolic.
    export reports a lowest of 2 for an unguarded dimension (it traces without the 0/1 cases), which
    still runs at 1."""
    for node in program.graph.nodes:
        if node.op == "placeholder" and node.name == "input_ids":
            length = node.meta["val"].shape[1]
            if not isinstance(length, torch.SymInt):
                return None
            bounds = program.range_constraints.get(length.node.expr)
            if bounds is None or not (bounds.lower.is_finite and bounds.upper.is_finite):
                return None
            return int(bounds.lower), int(bounds.upper)
    return None


def drop_metadata_asserts(gm: torch.fx.GraphModule) -> int:
    """Remove export's per-tensor dtype/device asserts. They pin every checked intermediate to the
    dtype seen while tracing, so the graph fails under autocast (bf16 matmuls in a float32 graph, as
    distillation runs it on CUDA) although nothing is wrong; shapes keep their own guards."""
    dropped = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default and not node.users:
            gm.graph.erase_node(node)
            dropped += 1
    if dropped:
        gm.recompile()
    return dropped


# Ops that autocast runs in bf16/fp16 (torch's lower-precision cast list, as aten packets).
_AUTOCAST_LOWERED = {
    getattr(torch.ops.aten, name) for name in (
        "mm", "bmm", "matmul", "addmm", "baddbmm", "addbmm", "addmv", "addr", "mv", "linear", "einsum", "prelu",
        "conv1d", "conv2d", "conv3d", "convolution", "_convolution", "chain_matmul",
    ) if hasattr(torch.ops.aten, name)
}


def without_autocast(op, device_type: str, *args, **kwargs):
    """Run one captured op with autocast for `device_type` off, in the dtype it was captured in."""
    with torch.autocast(device_type=device_type, enabled=False):
        return op(*args, **kwargs)


def pin_position_precision(gm: torch.fx.GraphModule) -> int:
    """Keep what the graph computes from positions alone out of autocast. Models compute RoPE angles
    with a matmul inside `autocast(enabled=False)`; export traces through that context and drops it,
    so under an outer bf16 autocast (distillation, bf16 evaluation) inv_freq @ positions would run in
    bf16, where positions above 256 are rounded (SmolLM2: WikiText perplexity 63 instead of 22).
    Every autocast-lowered op that does not depend on the token values gets autocast switched off."""
    ids = next((n for n in gm.graph.nodes if n.op == "placeholder"), None)
    if ids is None:
        return 0
    value = token_dependent(gm, ids)
    pinned = 0
    for n in gm.graph.nodes:
        if (n.op == "call_function" and n not in value and getattr(n.target, "overloadpacket", None) in _AUTOCAST_LOWERED
                and isinstance(n.meta.get("val"), torch.Tensor)):
            n.args = (n.target, n.meta["val"].device.type, *n.args)  # the device it was traced on
            n.target = without_autocast
            pinned += 1
    if pinned:
        gm.recompile()
    return pinned


def to_compute(model: torch.nn.Module, device=None, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """model on `device` with its parameters and saved buffers in `dtype`. The buffers it computes from
    its config (non-persistent: a rotary embedding's inv_freq) keep their dtype, as transformers'
    from_pretrained(dtype=...) leaves them: model.to(bf16) would round RoPE's frequencies to bf16
    (SmolLM2 in bf16: WikiText-2 perplexity 19.2961 against HF's 19.2827, thirty-sixth session)."""
    names = computed_buffers(model)
    computed = {name: b for name, b in model.named_buffers() if name in names and b.is_floating_point()}
    model = model.to(device=device, dtype=dtype)
    for key, buffer in computed.items():
        owner, _, name = key.rpartition(".")
        model.get_submodule(owner)._buffers[name] = buffer.to(device) if device is not None else buffer
    return model


def capture_graph(source, *, tokenizer=None, max_length: int | None = None, dtype: torch.dtype | None = None,
                  device: str | torch.device | None = None, debug: bool = False) -> Graph:
    """Any model source -> Graph, its attention sites not yet found (surgery.capture finds them).

    The graph is captured on `device` in `dtype` because export bakes device constants into it:
    capture where the graph will run rather than moving it afterwards."""
    with progress.task("capture") as bar:  # no count to show: a line each interval says it is still at work
        bar.update(info="loading the weights")
        model, loaded_tokenizer, info = load_model(source, dtype=dtype or torch.float32)
        if device is not None or dtype is not None:
            model = to_compute(model, device, dtype)
        dtype = next(model.parameters()).dtype
        config = model.config
        if getattr(config, "is_encoder_decoder", False):
            raise ModelLoadError(f"{type(model).__name__} is an encoder-decoder model.", "surgery converts decoder-only causal LMs.")
        limit = max_length or max_positions(config)  # an explicit length may exceed the config (RoPE extrapolates)
        model.eval()
        bar.update(info="tracing with torch.export")
        gm = export_model(model, limit, debug=debug, narrowed=lambda low, high: bar.update(
            info=f"a shape guard in the model's forward narrows the lengths it accepts to {low}..{high}"))
    graph = Graph(gm=gm, config=config, source=info, tokenizer=tokenizer or loaded_tokenizer)
    graph.meta["capture"] = {"max_length": limit, "dtype": str(dtype).removeprefix("torch.")}
    return graph


def _device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")
