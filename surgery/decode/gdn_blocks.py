"""A static decode step's GDN decoder layers, each as one call (surgery.decode.gdn_block's kernel on CUDA).

`fuse_gdn_blocks` finds, in a step graph whose elementwise work is already fused (surgery.decode.
fusions) and whose sibling linears are one matmul (surgery.decode.fused_linears), every region

    h, n = add_rms_norm(a, b, w0);  y = GDNState(n);  h2, n2 = add_rms_norm(h, y, w1)
    gate, up = split(linear(n2, W_gu));  d = linear(silu_mul(gate, up), W_d)

with nothing else reading its inside, and makes it one GDNBlock call returning (h2, d). The pattern is
read from the graph (any architecture whose layer is pre-norm RMSNorm, a GDN mixer and a SwiGLU MLP);
a layer of another form keeps its kernels. GDNBlock runs the kernel where it applies (CUDA, bf16 or
fp16, gdn_block.STEP_ROWS rows, a layer the token step takes, widths the kernel holds) and the region's
own calls everywhere else, so a CPU step computes what it computed before the rewrite; `declined` says
why the last call did not take the kernel. Where the one-launch layer declines a CUDA call it could
otherwise take (more rows than it serves, or switched off), up to gdn_tail.MAX_ROWS rows may take the
tail kernel instead: the token step, o_proj and the post norm as one launch (surgery.decode.gdn_tail;
SURGERY_GDN_TAIL=off turns it off).

SURGERY_GDN_BLOCKS: "auto" (the default: at most one program per SM), "off" (not the one-launch layer),
or the most programs the kernel may use (at most the SM count). Its phases hand their outputs over as flagged
words (surgery.decode.flagged_words); SURGERY_GDN_BLOCK_FLAGS=off makes them meet at grid barriers instead. On an
H100 the 64k batch-1 step took 0.834-0.844 ms with flagged words against 0.879-0.886 with barriers, rows interleaved
in one process, and 0.827-0.832 against 0.878 on another (bench/RESULTS.md, fifty-fifth session); the flagged form
passes the CUDA tests' poisoned launches (words left from an earlier launch with NaN values), which an H100 failed
before flagged_words re-read each thread's own copy (fifty-fourth session)."""
from __future__ import annotations

import operator
import warnings

import torch
import torch.nn as nn
from torch.fx import GraphModule, Node

from tcal.gdn import TOKEN_STEP_V_SILU, takes_token_step
from tcal.switches import enabled, setting

from ..core.rewrite import prune, set_submodule
from ..errors import DecodeError
from .fused_linears import LINEAR
from .fused_norms import is_call, single_user
from .flagged_words import new_exchange
from .block_layout import BlockShape, block_tiles, exchange_words
from .gdn_block import ERROR_WORD, STEP_ROWS, gdn_block_torch, gdn_block_triton, new_sync, swiglu_mlp, sync_failed, triton
from .gdn_state import GDNState
from .gdn_tail import gdn_tail_triton, new_arrivals, tail_takes
from .residual_norm import add_rms_norm
from .row_linear import row_linear
from .swiglu import silu_mul

ENV = "SURGERY_GDN_BLOCKS"
FLAGS_ENV = "SURGERY_GDN_BLOCK_FLAGS"
ROLES = ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj")


def block_programs(device: torch.device) -> int | None:
    """Programs for the kernel on `device` from SURGERY_GDN_BLOCKS, or None: the region's own calls."""
    value = setting(ENV, numeric=True)
    if value == "off":
        return None
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if isinstance(value, int) and not 1 <= value <= sms:
        raise ValueError(f"{ENV}={value}: the kernel's programs must all be resident at once; this GPU has {sms} SMs.")
    return value if isinstance(value, int) else sms


def block_shape(layer: nn.Module, proj_rows: int, inter: int, gate_first: bool) -> BlockShape | None:
    """The kernel's shape for a GDN layer whose input projections are q, k, v, a (one decay input per
    head, read as the token step reads it), b and g, else None."""
    names = tuple(getattr(layer, "INPUT_PROJECTIONS", ()))
    if sorted(names) != sorted(ROLES):
        return None
    sentinel = object()
    try:
        if layer.token_decay_input({"a_proj": sentinel}) is not sentinel:
            return None
    except Exception:  # a layer whose decay input is computed (KDA's low-rank gate)
        return None
    sizes = [layer.get_submodule(n).out_features for n in names]
    starts = dict(zip(names, [sum(sizes[:i]) for i in range(len(sizes))]))
    heads, dim = layer.num_heads, layer.head_dim
    widths = dict(zip(names, sizes))
    if any(widths[n] != heads * dim for n in ("q_proj", "k_proj", "v_proj", "g_proj")) or widths["a_proj"] != heads \
            or widths["b_proj"] != heads or layer.o_proj.in_features != heads * dim:
        return None
    return BlockShape(layer.hidden_size, proj_rows, tuple(starts[n] for n in ROLES), heads, dim, inter, gate_first,
                      TOKEN_STEP_V_SILU.get(layer.v_activation, False))


class GDNBlock(nn.Module):
    """One GDN decoder layer of a static decode step: (a, b, w0, w1, W_gu, b_gu, W_d, b_d) -> (h2, d)."""

    def __init__(self, gdn_state: GDNState, eps0: float, eps1: float, inter: int, gate_first: bool):
        super().__init__()
        self.gdn_state = gdn_state
        self.eps0, self.eps1, self.inter, self.gate_first = eps0, eps1, inter, gate_first
        self.sync: torch.Tensor | None = None  # the phase counters (gdn_block.new_sync)
        self.declined: str | None = None        # why the last call composed the kernels instead, if it did
        self.failed = False                     # the kernel's first launch timed out waiting (see forward)
        self.shape: BlockShape | bool | None = None  # the kernel's shape once known (False: the layer has none)
        self.arrivals: torch.Tensor | None = None  # the tail kernel's row counters (gdn_tail.new_arrivals)
        self.exchange: torch.Tensor | None = None  # the flagged words the kernel's phases hand over (FLAGS_ENV)

    def forward(self, a, b, w0, w1, w_gu, b_gu, w_d, b_d):
        st = self.gdn_state
        found = self.step_inputs(a, w_gu, w_d)
        limit = self.block_limit(a, found[0]) if not isinstance(found, str) else found
        if isinstance(limit, str):
            self.declined = limit
            if not isinstance(found, str) and tail_takes(a.shape[0], found[0]):
                return self.tail(a, b, w0, w1, w_gu, b_gu, w_d, b_d, *found)
            return gdn_block_torch(a, b, w0, self.eps0, st, w1, self.eps1, w_gu, b_gu, w_d, b_d, self.inter, self.gate_first)
        self.declined = None
        shape, (w_in, bias_in) = found
        first = self.sync is None or self.sync.device != a.device
        if first:
            self.sync = new_sync(a.device)
        exchange = None
        if enabled(FLAGS_ENV, True):
            words = exchange_words(shape, a.shape[0])
            if first or self.exchange is None or self.exchange.numel() < words:
                self.exchange = new_exchange(words, a.device)
            exchange = self.exchange
        out = gdn_block_triton(a, b, w0, self.eps0, st.gdn, st.cache.recurrent, w_in, bias_in, w1, self.eps1, w_gu, b_gu,
                               w_d, b_d, shape, self.sync, limit, exchange=exchange)
        if first and not torch.cuda.is_current_stream_capturing() and self.take_fault():
            raise DecodeError("The one-kernel GDN decoder layer's programs could not all run at once on this GPU; this "
                              "step's output and GDN state are not to be trusted, and later steps use the layer's "
                              "separate kernels.", f"Reset the decoder and decode again, or set {ENV}=off.")
        return out

    def take_fault(self) -> bool:
        """Whether a launch's wait timed out since the last look (the programs were not all resident: a GPU
        shared with other work?); if so the layer composes its kernels from its next capture on, and the
        error word is cleared so that each fault is reported once."""
        if self.sync is None or not sync_failed(self.sync):
            return False
        self.failed = True
        self.sync[ERROR_WORD] = 0
        return True

    def tail(self, a, b, w0, w1, w_gu, b_gu, w_d, b_d, shape, projection):
        """The layer's kernels with the token step, o_proj and the post norm as one (surgery.decode.gdn_tail)."""
        h, n = add_rms_norm(a, b, w0, self.eps0)
        rows = a.shape[0]
        if self.arrivals is None or self.arrivals.device != a.device or self.arrivals.numel() < rows:
            self.arrivals = new_arrivals(rows, a.device)
        st = self.gdn_state
        h2, n2 = gdn_tail_triton(row_linear(n, *projection), shape, st.gdn, st.cache.recurrent, h, w1, self.eps1,
                                 self.arrivals)
        return h2, swiglu_mlp(n2, w_gu, b_gu, w_d, b_d, self.inter, self.gate_first)

    def step_inputs(self, a: torch.Tensor, w_gu: torch.Tensor, w_d: torch.Tensor):
        """(shape, the fused input projection) where a fused kernel (the one-launch layer, or the tail) can
        take this call, else why not."""
        st, layer = self.gdn_state, self.gdn_state.gdn
        if triton is None or not a.is_cuda:
            return "not CUDA with Triton"
        if a.dtype not in (torch.float16, torch.bfloat16) or a.dim() != 3 or a.shape[1] != 1:
            return f"rows {tuple(a.shape)} {a.dtype}: the fused kernels take bf16/fp16 rows of one token"
        projection = st.static_projection()
        if projection is None:
            return "not a static step"
        cache = st.step_cache()
        if not takes_token_step(layer, a, cache) or cache.recurrent.dtype != torch.float32:
            return "the layer does not take the token step (tcal.gdn.takes_token_step) with a float32 state"
        if any(t.dtype != a.dtype or not t.is_contiguous() for t in (projection[0], w_gu, w_d, layer.o_proj.weight)):
            return "a weight of another dtype, or not contiguous"
        if self.shape is None:  # fixed once the projection is fused: its rows are refreshed in place
            self.shape = block_shape(layer, projection[0].shape[0], self.inter, self.gate_first) or False
        if not self.shape:
            return "the layer's projections are not GDN's q, k, v, a (one decay per head), b, g"
        return self.shape, projection

    def block_limit(self, a: torch.Tensor, shape: BlockShape):
        """The one-launch layer's program limit where it takes this call, else why not."""
        if self.failed:
            return "the kernel's programs could not all run at once on this GPU"
        if a.shape[0] > STEP_ROWS:
            return f"{a.shape[0]} rows: the one-launch layer takes {STEP_ROWS}"
        limit = block_programs(a.device)
        if limit is None:
            return f"{ENV}=off"
        if block_tiles(shape, limit) is None:
            return "too wide for one program's registers"
        return limit


def timed_out_blocks(gm: GraphModule) -> list[str]:
    """Names of gm's GDN blocks whose kernel gave up waiting (a grid barrier or a flagged word's poll) since
    the last look (GDNBlock.take_fault). Only the first launch is checked as it runs (GDNBlock.forward); a
    replayed step that gives up goes on with what it read, so its outputs from there on are not to be
    trusted, and the block's error word is all that shows it."""
    return [name for name, m in gm.named_modules() if isinstance(m, GDNBlock) and m.take_fault()]


def report_timed_out(gm: GraphModule, warn: bool = False) -> None:
    """Raise DecodeError (or, `warn`, warn) naming gm's GDN blocks that gave up waiting during the replayed steps
    since the last look (timed_out_blocks); nothing when none did."""
    names = timed_out_blocks(gm)
    if not names:
        return
    error = DecodeError(f"The one-kernel GDN decoder layer{'s' if len(names) > 1 else ''} {', '.join(names)} gave up waiting "
                        "for other programs during the last decode (its programs could not all run at once on this GPU); "
                        "the tokens decoded since are not to be trusted, and later steps use the layers' separate kernels.",
                        f"Decode again, or set {ENV}=off.")
    if not warn:
        raise error
    warnings.warn(str(error), stacklevel=3)


def _getitems(node: Node) -> dict[int, Node] | None:
    """index -> the getitem user of `node`, when getitems are all its users, one per index."""
    out = {}
    for user in node.users:
        if user.op != "call_function" or user.target is not operator.getitem or user.args[1] in out:
            return None
        out[user.args[1]] = user
    return out


def last_dim(node: Node, dim) -> bool:
    """Whether `dim` is the last dimension of node's traced value (-1, or its index)."""
    val = node.meta.get("val")
    return dim == -1 or (isinstance(val, torch.Tensor) and dim == val.dim() - 1)


def _same_value(node) -> Node:
    """node, or what it casts when it is a cast to the dtype its input already has (a float32 trace's no-op)."""
    if isinstance(node, Node) and node.op == "call_function" and node.target is torch.ops.aten.to.dtype and len(node.users) == 1:
        src, dtype = node.args[0], node.args[1]
        val = src.meta.get("val") if isinstance(src, Node) else None
        if isinstance(val, torch.Tensor) and val.dtype == dtype:
            return src
    return node


def match_block(gm: GraphModule, y: Node) -> dict | None:
    """The region around GDNState call `y` (module docstring), or None."""
    if y.op != "call_module" or not isinstance(gm.get_submodule(y.target), GDNState) or len(y.args) != 1 or y.kwargs:
        return None
    n = y.args[0]
    if not is_call(n, operator.getitem) or n.args[1] != 1 or len(n.users) != 1 or not is_call(n.args[0], add_rms_norm):
        return None
    pair0 = n.args[0]
    items0 = _getitems(pair0)
    pair1 = single_user(y)
    if items0 is None or set(items0) != {0, 1} or not is_call(pair1, add_rms_norm):
        return None
    h = items0[0]
    residual = [x for x in pair1.args[:2] if x is not y]
    if len(residual) != 1 or _same_value(residual[0]) is not h or len(h.users) != 1:
        return None
    items1 = _getitems(pair1)
    if items1 is None or set(items1) != {0, 1}:
        return None
    gate_up = single_user(items1[1])
    if not is_call(gate_up, LINEAR) or gate_up.args[0] is not items1[1] or gate_up.kwargs:
        return None
    split = single_user(gate_up)
    if not is_call(split, torch.ops.aten.split_with_sizes.default) or len(split.args) != 3 or not last_dim(gate_up, split.args[2]):
        return None
    sizes = list(split.args[1])
    parts = _getitems(split)
    if len(sizes) != 2 or sizes[0] != sizes[1] or parts is None or set(parts) != {0, 1}:
        return None
    product = single_user(parts[0])
    if not is_call(product, silu_mul) or single_user(parts[1]) is not product or set(product.args) != {parts[0], parts[1]}:
        return None
    down = single_user(product)
    if not is_call(down, LINEAR) or down.args[0] is not product or down.kwargs:
        return None
    a, b, w0, eps0 = pair0.args
    w1, eps1 = pair1.args[2], pair1.args[3]
    if any(w is not None and w.op != "get_attr" for w in (w0, w1, gate_up.args[1], down.args[1])):
        return None
    bias = [node.args[2] if len(node.args) > 2 else None for node in (gate_up, down)]
    return dict(inputs=(a, b, w0, w1, gate_up.args[1], bias[0], down.args[1], bias[1]), eps=(eps0, eps1),
                inter=sizes[0], gate_first=product.args[0] is parts[0], h2=items1[0], d=down, layer=y.target, at=pair1)


def fuse_gdn_blocks(gm: GraphModule) -> int:
    """Rewrite gm in place: every region `match_block` finds becomes one GDNBlock call. Returns how many."""
    count = 0
    for node in list(gm.graph.nodes):  # matched one at a time: a block's inputs may be the previous block's outputs
        m = match_block(gm, node)
        if m is None:
            continue
        count += 1
        target = f"_decode_block.{m['layer'].replace('.', '_')}"
        set_submodule(gm, target, GDNBlock(gm.get_submodule(m["layer"]), *m["eps"], m["inter"], m["gate_first"]))
        order = {node: i for i, node in enumerate(gm.graph.nodes)}
        with gm.graph.inserting_before(m["at"]):  # where h2 was made: every reader of h2 comes after it
            call = gm.graph.call_module(target, m["inputs"])
            h2, d = gm.graph.call_function(operator.getitem, (call, 0)), gm.graph.call_function(operator.getitem, (call, 1))
        for node in m["inputs"]:  # the MLP's weights, read later in the region, are read here now
            if isinstance(node, Node) and order[node] > order[m["at"]]:
                call.prepend(node)
        h2.meta, d.meta = dict(m["h2"].meta), dict(m["d"].meta)
        m["h2"].replace_all_uses_with(h2)
        m["d"].replace_all_uses_with(d)
    if count:
        prune(gm)
        gm.graph.lint()
        gm.recompile()
    return count
