"""The Decoder: incremental (stateful) decoding over a captured or rewritten graph.

A captured GraphModule recomputes the whole sequence on every call. From the plan of a graph
(surgery.decode.plan) the Decoder builds a second GraphModule over the same parameter tensors in which

  * every kept softmax-attention core (the SDPA op, or the eager softmax(QK^T)V region) becomes a
    KVCacheAttention: it appends the new K/V to a preallocated cache that is only as wide as the
    model's KV heads and attends over [cache; new] with the site's own scale, softcap and causal or
    sliding-window mask;
  * every GatedDeltaNet placed by the replace pass carries its recurrent and conv state (GDNState);
  * whatever the graph computes from the input's length alone is evaluated at cache+new length and
    sliced to the new tokens (surgery.decode.positions).

A self-check against full recomputation on a short probe guards what the plan cannot see: a wrong
answer is refused, never returned."""
from __future__ import annotations

import contextlib
import warnings

import torch

from ..core.compiled import FUSED_BY_DEFAULT, CompiledGraph, resolve_compile
from ..core.rewrite import fork, prune, set_submodule, splice_module
from ..core.run import graph_logits
from ..errors import DecodeError
from .caches import DecodeState, KVCacheAttention
from .fused_linears import fuse_sibling_linears
from .fusions import fuse_elementwise
from .gdn_blocks import fuse_gdn_blocks, report_timed_out
from .step_tables import hoist_tables
from .gdn_state import GDNState
from .lengths import FIX_FULL
from .masks import MASK_PROBE
from .plan import DecodePlan, plan_decode
from .positions import rewrite_positions
from .prefill import Prefill
from .regimes import History
from .row_linear import fuse_row_linears
from .self_check import self_check
from .static_step import StaticStep

STEP_MODES = ("auto", "dynamic", "static", "cuda-graph")


def check_step_mode(step_mode: str, device: torch.device, compiled: bool = False) -> str:
    """The step mode a Decoder on `device` runs ("auto" resolved; compiled steps need fixed shapes)."""
    if step_mode not in STEP_MODES:
        raise DecodeError(f"Unknown step_mode {step_mode!r}.", f"Use one of: {', '.join(STEP_MODES)}.")
    if step_mode == "cuda-graph" and device.type != "cuda":
        raise DecodeError(f"step_mode 'cuda-graph' needs the graph on a CUDA device, not {device}.", "Use step_mode 'static' or 'auto'.")
    if step_mode == "auto":
        step_mode = "cuda-graph" if device.type == "cuda" else "static" if compiled else "dynamic"
    return step_mode


def build_decode_graph(plan: DecodePlan, state: DecodeState, in_place: bool, device):
    """Rewrite plan.gm into the decode graph: KV-cache attention and GDN state modules in place of
    the layers, positions continued from the offset. Returns the attention and GDN modules by layer
    and the lengths where the positions switch (surgery.decode.regimes)."""
    gm = plan.gm
    attention: dict[int, KVCacheAttention] = {}
    for layer, p in plan.attention.items():
        attention[layer] = p.module(state, plan.max_length)
        splice_module(gm, f"_decode_attn.layer{layer}", attention[layer], [p.q, p.k_source, p.v_source], p.attn)
    gdn: dict[int, GDNState] = {}
    for n in list(gm.graph.nodes):
        if n.op == "call_module" and n.target in plan.gdn:
            layer = plan.gdn[n.target]
            gdn[layer] = GDNState(gm.get_submodule(n.target), in_place=in_place, state=state)
            set_submodule(gm, f"_decode_gdn.layer{layer}", gdn[layer])
            n.target = f"_decode_gdn.layer{layer}"
    prune(gm)
    set_submodule(gm, "_decode", state)
    regimes = rewrite_positions(gm, plan.lengths, "_decode", plan.max_length, device)
    prune(gm)
    gm.graph.lint()
    gm.recompile()
    return attention, gdn, regimes


def static_step_graph(gm, gdn: dict, fuse: bool | None, compiled: bool):
    """(the static steps' own fork of gm, its fused projections): sibling linears as one matmul, each GDN
    layer's input projections as one, and (fuse; None: FUSED_BY_DEFAULT; not when compiled,
    inductor fuses them itself) each RMSNorm and SwiGLU product as one kernel, then each GDN decoder layer as
    one call (surgery.decode.gdn_blocks), and the linears left as few-row kernels (surgery.decode.row_linear)."""
    step_gm = fork(gm)
    fused = fuse_sibling_linears(step_gm) + [m.fuse_projection() for m in gdn.values()]
    if (FUSED_BY_DEFAULT if fuse is None else fuse) and not compiled:
        fuse_elementwise(step_gm, in_place=True)
        fuse_gdn_blocks(step_gm)
        hoist_tables(step_gm)  # the RoPE / position tables once per capacity, not at every step
        fuse_row_linears(step_gm, in_place=True)  # after the blocks, which read the MLPs' aten.linear calls
    return step_gm, fused


class Decoder:
    """Incremental decoding of a Graph (teacher or hybrid): reset, prefill, then step token by token.

        dec = Decoder(graph); dec.reset(batch_size=1, capacity=prompt + new)
        logits = dec.prefill(ids)              # [B, T, V]
        logits = dec.step(next_ids)            # next_ids [B, 1] -> [B, 1, V]

    Parameters are shared with graph.gm (only fuse_projections copies some), so a Decoder is cheap next to the
    model; graph.gm itself stays stateless. verify=True compares prefill + steps with full
    recomputation on a short probe at construction and refuses the graph if they disagree (in bf16/fp16,
    if a float32 copy disagrees too; else it warns and decodes: surgery.decode.self_check).

    step_mode: how `step` runs once reset was given a capacity. "dynamic": the graph on exactly the
    tokens cached so far (shapes grow each step). "static": fixed shapes (KV buffers at capacity with
    a position mask, positions picked by a device index, GDN states updated in place; surgery.decode.static_step).
    "cuda-graph": static steps captured once per reset and replayed (CUDA only). "auto": cuda-graph on
    CUDA, dynamic elsewhere (static when compiled). compile: static steps run through torch.compile
    (then, as cuda-graph, the compiled step is what is captured); None: where it pays
    (surgery.core.compiled). A first prefill takes the device's fast route (surgery.decode.prefill);
    later prefills and dynamic steps run the decode graph eagerly. fuse_projections: static steps
    run linears that share an input as one matmul over a copy of their weights (more memory, fewer
    kernels; surgery.decode.fused_linears), copied again at each reset if a weight changed. fuse_elementwise:
    uncompiled static steps (with fuse_projections) run each RMSNorm and each SwiGLU product as one
    kernel (surgery.decode.fusions); None: surgery.core.compiled.FUSED_BY_DEFAULT."""

    def __init__(self, graph, *, verify: bool = True, mask_probe: int = MASK_PROBE, step_mode: str = "auto",
                 compile: bool | None = None, fuse_projections: bool = True, fuse_elementwise: bool | None = None):
        self.compiled = resolve_compile(compile, graph.device, "decode")
        self.step_mode = check_step_mode(step_mode, graph.device, self.compiled)
        self.capacity: int | None = None
        self.graph = graph
        plan = plan_decode(graph, mask_probe=mask_probe)
        self.max_length = plan.max_length
        self.state = DecodeState()
        self.fast_prefill = Prefill(self, plan, compile)  # before the decode graph rewrites plan.gm
        self.attention, self.gdn, self.regimes = build_decode_graph(plan, self.state, self.step_mode != "dynamic", graph.device)
        self.history = History(self.regimes)
        self.gm = plan.gm
        self.cores = plan.attention
        self._warned = False
        static = self.step_mode != "dynamic" and fuse_projections
        self.step_gm, self.fused = static_step_graph(self.gm, self.gdn, fuse_elementwise, self.compiled) if static else (self.gm, [])
        runner = CompiledGraph(self.step_gm, label="decode step") if self.compiled and self.step_mode != "dynamic" else None
        self._static = StaticStep(self, cuda_graph=self.step_mode == "cuda-graph", runner=runner)
        self.reset()
        if verify:
            self_check(self, plan.vocab, lambda twin: Decoder(twin, mask_probe=mask_probe, step_mode=self.step_mode, compile=False,
                                                             fuse_projections=fuse_projections, fuse_elementwise=fuse_elementwise))

    @property
    def offset(self) -> int:
        """Tokens in the caches."""
        return self.state.offset

    def reset(self, batch_size: int | None = None, capacity: int | None = None) -> "Decoder":
        """Empty every cache. capacity (prompt + new tokens) preallocates the KV caches; without it
        they start at the prefill's length and double (a warning where check_kernels would raise)."""
        report_timed_out(self.step_gm, warn=True)
        if capacity is not None and capacity > self.max_length:
            raise DecodeError(f"A capacity of {capacity} tokens exceeds this graph's position limit of {self.max_length}.", "Use a shorter prompt or fewer new tokens.")
        if capacity is not None:
            self.regimes.check(capacity)
        self._static.release()
        self.state.offset = 0
        self.history.clear()
        self.batch_size, self.capacity = batch_size, capacity
        for m in self.attention.values():
            m.reset(batch_size, capacity)
        for m in self.gdn.values():
            m.reset()
        for fused in self.fused:  # fused weight copies follow their sources, in place (per reset: ~0.2 ms of checks)
            if not fused.refresh():
                raise DecodeError("A weight changed dtype or device after the Decoder was built.",
                                  "Build a new Decoder after moving or casting the model.")
        return self

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Feed T new tokens [B, T] (or one row [T]) after those already cached; logits [B, T, V]."""
        return self._feed(self._checked(input_ids))

    __call__ = forward

    def _feed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The graph on checked ids (see _checked), advancing the offset. A call that crosses a
        switch of the position tables recomputes the caches from the whole sequence, as full
        recomputation would see it (transformers' Phi3 does the same at LongRoPE's switch)."""
        if self.regimes.crosses(self.state.offset, input_ids.shape[1]):
            whole = self.history.joined(input_ids)
            self.reset(self.batch_size, self.capacity)
            return self._feed(whole)[:, -input_ids.shape[1]:]
        with torch.no_grad():
            logits = graph_logits(self.gm, input_ids)
        self.state.offset += input_ids.shape[1]
        self.history.add(input_ids)
        return logits

    def _checked(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids on the graph's device, after every check of what the caches can take."""
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.dim() != 2 or input_ids.shape[1] < 1:
            raise DecodeError(f"Token ids must be [batch, length >= 1], got shape {tuple(input_ids.shape)}.", "Pass a 2-D LongTensor.")
        if self.batch_size is not None and input_ids.shape[0] != self.batch_size:
            raise DecodeError(f"The decoder was reset for batch {self.batch_size} but got {input_ids.shape[0]} rows.", "Call reset(batch_size) first.")
        need = self.state.offset + input_ids.shape[1]
        if need > self.max_length:
            raise DecodeError(f"{need} tokens exceed this graph's position limit of {self.max_length}.", "Use a shorter prompt or fewer new tokens.")
        self.regimes.check(need)
        for c in self.cores.values():
            if need > c.exact_len and c.rule is None:
                raise DecodeError(f"The mask of attention {c.layer} could only be checked up to {c.exact_len} tokens; {need} were asked for.", FIX_FULL)
            if need > c.exact_len and not self._warned:
                warnings.warn(f"Attention {c.layer} looked like full causal attention up to {c.exact_len} tokens; a longer sliding window "
                              "would not have been seen.", stacklevel=2)
                self._warned = True
        return input_ids.to(self.graph.device)

    def prefill(self, input_ids: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """The prompt [B, T] (in one call; later calls continue it): logits [B, T, V] ([B, 1, V]: last_only)."""
        ids = self._checked(input_ids)
        logits = self.fast_prefill(ids, last_only) if self.fast_prefill.takes(ids) else self._feed(ids)
        return logits[:, -1:] if last_only else logits

    def step(self, next_ids: torch.Tensor) -> torch.Tensor:
        """One new token per row ([B, 1] or [B]): logits [B, 1, V]."""
        if next_ids.dim() == 2 and next_ids.shape[1] != 1:
            raise DecodeError(f"step takes one token per row, got shape {tuple(next_ids.shape)}.", "Use prefill for several tokens.")
        ids = self._checked(next_ids.reshape(-1, 1))
        if self.step_mode != "dynamic" and self._static.ready(ids):
            logits = self._static(ids)
            self.history.add(ids)
            return logits
        return self._feed(ids)

    def check_kernels(self) -> None:
        """DecodeError naming the one-kernel GDN layers that gave up waiting since the last look (gdn_blocks)."""
        report_timed_out(self.step_gm)

    def cache_bytes(self, per_layer: bool = False) -> dict:
        """Bytes held by the caches, by layer kind ({"attention", "gdn", "total"}) or by layer."""
        att = {i: m.nbytes() for i, m in self.attention.items()}
        gdn = {i: m.nbytes() for i, m in self.gdn.items()}
        if per_layer:  # a head-split layer holds both
            return {i: att.get(i, 0) + gdn.get(i, 0) for i in sorted(att.keys() | gdn.keys())}
        return {"attention": sum(att.values()), "gdn": sum(gdn.values()), "total": sum(att.values()) + sum(gdn.values())}

    @contextlib.contextmanager
    def eagerly(self):
        """Prefills and steps run eagerly inside (the self-check's probes: compiling for their shapes would not
        serve later ones); reset on the way out."""
        runner, self._static.runner, self.fast_prefill.eager_only = self._static.runner, None, True
        try:
            yield self
        finally:
            self._static.runner, self.fast_prefill.eager_only = runner, False
            self.reset()
