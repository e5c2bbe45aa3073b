"""How a captured graph runs fast: the one runner that evaluation, passkey and a Decoder's prefill
call, on the route surgery.core.compiled.ROUTES picks for the device and use.

A route has four parts. The causal-flag rewrite (surgery.decode.causal_flags) is proven for a longest
length, so the runner keeps one rewritten graph per length bucket (a power of two of at least
MIN_BUCKET tokens, capped at the graph's limit): a longer input moves to a larger bucket, never past
what its rewrite checked. Fused elementwise work (surgery.decode.fusions): each RMSNorm's
traced arithmetic, and each SwiGLU product, as one kernel. Replay (surgery.decode.replay, on CUDA): from an input shape's second call
the eager graph runs as a captured CUDA graph, the same kernels at a fraction of the host's cost. Sibling projections (q/k/v, gate/up) as one matmul each
on the fused route (surgery.decode.fused_linears.fused_siblings, over copies refreshed before each call).
Compiling (surgery.core.compiled.CompiledGraph, replayed as CUDA graphs on CUDA) starts once the eager
calls have cost what a compile costs (Route.compile_after).

The first compiled call of each bucket is also run eagerly and the two compared (agreement.
compiled_agrees): a compile that fails or disagrees is said in ONE warning and the runner stays
eager for good. A new replay graph is checked against its eager warm-up the same way, and a capture
that fails or disagrees turns replay off with one warning. Outputs of a CUDA-graph replay live in the graph's memory pool until the next call:
`borrowed` says so, and a caller that keeps them copies them first."""
from __future__ import annotations

import sys
import time
import warnings

import torch

from ..core.compiled import REPLAY_MODE, CompiledGraph, failure_reason, inference_route
from ..core.run import run_graph
from .agreement import compiled_agrees
from .causal_flags import CausalFlags
from .fused_linears import fused_siblings
from .fusions import fuse_elementwise
from .gqa import sdpa_on_grouped_heads, switched_on as gqa_switched_on
from .replay import Replays
from .weight_watch import WeightWatch

MIN_BUCKET = 2048  # shorter inputs share one rewrite (and one compiled graph): a compile per short length would not pay


def bucket(length: int, limit: int) -> int:
    """The longest length of the rewrite that serves `length` tokens."""
    return min(limit, max(MIN_BUCKET, 1 << max(0, length - 1).bit_length()))


def first_output(out) -> torch.Tensor:
    """The logits of a graph's output: a ModelOutput's, else its first entry."""
    return out.logits if hasattr(out, "logits") else out[0]


class FastGraph:
    """ids [B, T] -> the output of `gm` (whatever structure it returns) on `route`.

    rewrite: applied to each bucket's graph after the causal flags (a Decoder adds its cache taps).
    `compiled` maps each bucket to its CompiledGraph once compiling started; `failed` is the one-line
    reason the runner fell back to eager for good, if it did."""

    def __init__(self, gm, device, use: str, flag: bool | None, *, limit: int, label: str = "graph", rewrite=None,
                 report=sys.stderr, shared_copies: dict | None = None):
        self.gm, self.device, self.limit, self.label, self.report = gm, torch.device(device), limit, label, report
        self.route = inference_route(flag, self.device, use)
        self.rewrite = rewrite
        self.graphs: dict = {}      # bucket (None without the flags) -> the graph eager calls run
        self.fused: dict = {}       # bucket -> the FusedWeights its graph reads (copies of sibling projections)
        self.copies = {} if shared_copies is None else shared_copies  # the buckets' one copy of each (fused_siblings)
        self.compiled: dict = {}    # bucket -> CompiledGraph
        self.eager_seconds = 0.0
        self.shapes: set = set()    # input shapes run eagerly so far (a shape's first call is not counted)
        self.failed: str | None = None
        self.borrowed = False
        self.replays = Replays() if self.route.replay else None
        self.watch = WeightWatch(lambda: [*gm.parameters(), *gm.buffers()])  # one look a call (follow_weights)

    def key(self, length: int):
        return bucket(length, self.limit) if self.route.causal_flags else None

    def follow_weights(self) -> None:
        """Once a call: after a parameter (or buffer) was edited, moved or cast, the fused copies refreshed from
        their sources (every graph rebuilt when one was cast or moved: a copy cannot follow), every replay
        graph dropped (it may read copies captured with the old values)."""
        if not self.watch.changed():
            return
        if not all(weight.refresh() for weights in self.fused.values() for weight in weights):
            self.graphs.clear(), self.fused.clear(), self.copies.clear(), self.compiled.clear()
        if self.replays is not None:
            self.replays.drop()

    def graph(self, key):
        """The eager graph of a bucket: the flags' rewrite, then `rewrite` (which names nodes of the
        captured graph, a Decoder's cache taps), then the fusions (if the route has them), over fused
        weights that follow_weights keeps current."""
        if key not in self.graphs:
            gm = CausalFlags(key)(self.gm) if key is not None else self.gm
            gm = self.rewrite(gm) if self.rewrite is not None else gm
            if self.route.fused:
                fused, self.fused[key] = fused_siblings(gm, self.device, self.copies)
                gm = fuse_elementwise(fused, in_place=fused is not gm)[0]
                if gqa_switched_on():  # GQA layers' SDPA without the repeated key/value copies (SURGERY_SDPA_GQA=off: with)
                    gm = sdpa_on_grouped_heads(gm)[0]
            self.graphs[key] = gm
        return self.graphs[key]

    def compiling(self) -> bool:
        after = self.route.compile_after
        return self.failed is None and after is not None and self.eager_seconds >= after

    def eager(self, ids: torch.Tensor):
        """The bucket's graph run eagerly (the reference the compiled graph is checked against)."""
        self.follow_weights()
        return self.run_eager(ids)

    def run_eager(self, ids: torch.Tensor):
        """eager() inside a call that already looked at the weights."""
        gm = self.graph(self.key(ids.shape[-1]))
        return gm(input_ids=ids, **gm.meta.get("extra_inputs", {}))

    meta: dict = {}  # no extra inputs asked of a caller (graph_logits): each bucket's graph adds its own

    def __call__(self, input_ids: torch.Tensor, **_):
        self.follow_weights()
        ids = input_ids
        key = self.key(ids.shape[-1])
        if not self.compiling():
            if self.replays is not None and self.replays.ready(ids, key):
                return self.replayed(ids, key)
            self.borrowed = False
            return self.timed(ids)
        first = key not in self.compiled
        if first:
            options = {"mode": REPLAY_MODE} if self.device.type == "cuda" else {}
            self.compiled[key] = CompiledGraph(self.graph(key), label=self.label, report=self.report, **options)
        runner = self.compiled[key]
        gm = self.graph(key)
        out = runner(input_ids=ids, **gm.meta.get("extra_inputs", {}))
        if runner.failed is not None:  # CompiledGraph warned once and ran eagerly
            self.failed, self.borrowed = runner.failed, False
            return out
        self.borrowed = self.device.type == "cuda"
        if first:
            out = self.checked(out, ids)
        return out

    def checked(self, out, ids: torch.Tensor):
        """The first compiled call's output against the eager graph's on the same ids; eager from now
        on (one warning) if they disagree."""
        got = first_output(out).clone()
        reference = self.run_eager(ids)
        ok, why = compiled_agrees(got, first_output(reference))
        if ok:
            return out
        self.failed, self.borrowed = f"its logits disagree with eager ({why})", False
        warnings.warn(f"The compiled {self.label} disagrees with the eager one ({why}); running it eagerly.", stacklevel=3)
        return reference

    def replayed(self, ids: torch.Tensor, key):
        """The bucket's eager graph through its CUDA-graph replay (surgery.decode.replay); eager for good,
        with one warning, if capturing fails or the new graph disagrees with its eager warm-up."""
        gm = self.graph(key)
        forward = lambda static: gm(input_ids=static, **gm.meta.get("extra_inputs", {}))  # noqa: E731
        try:
            out, warm = self.replays.run(forward, ids, key)
        except Exception as exc:
            return self.no_replay(f"capturing it as a CUDA graph failed ({failure_reason(exc)})", self.run_eager(ids))
        if warm is not None:
            ok, why = compiled_agrees(first_output(out).clone(), first_output(warm))
            if not ok:
                return self.no_replay(f"its CUDA-graph replay disagrees with eager ({why})", warm)
        self.borrowed = True
        return out

    def no_replay(self, why: str, out):
        self.replays.give_up(why)
        self.borrowed = False
        warnings.warn(f"Replaying the {self.label}: {why}; running it eagerly.", stacklevel=4)
        return out

    def timed(self, ids: torch.Tensor):
        """An eager call, its time counted towards compiling when the route compiles at all. A shape's
        first call is not: it includes one-off work (fla compiles and autotunes its kernels there, 46 s
        for the hybrid's first forward on the H200, issue 29) that compiling would not save."""
        if self.route.compile_after is None or self.failed is not None or ids.shape not in self.shapes:
            self.shapes.add(ids.shape)
            return self.run_eager(ids)
        start = time.perf_counter()
        out = self.run_eager(ids)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the time the forward took, not the time to launch it
        self.eager_seconds += time.perf_counter() - start
        return out


def fast_graph(graph, compile: bool | None = None, *, use: str = "eval", label: str = "graph", report=sys.stderr) -> FastGraph:
    """The FastGraph of `graph` for `use` on its device's route, one per route, kept in graph.cache."""
    route = inference_route(compile, graph.device, use)
    key = ("fast", graph.gm, use, route)
    if key not in graph.cache:
        graph.cache[key] = FastGraph(graph.gm, graph.device, use, compile, limit=graph.max_length, label=label, report=report)
    return graph.cache[key]


def fast_runner(graph, compile: bool | None = None, *, use: str = "eval", label: str = "graph", report=sys.stderr):
    """ids [B, T] -> logits [B, T, V] of `graph` on the fast route for its device and `use`
    (fast_graph), with graph.logits's input checks. On the CPU by default this is graph.logits's own
    computation. On CUDA a caller reads each call's logits before the next call (they may live in a
    CUDA graph's pool). An offloaded teacher (graph.weights) runs layer by layer: graph.logits."""
    if graph.weights is not None:
        return graph.logits
    fast = fast_graph(graph, compile, use=use, label=label, report=report)
    return lambda input_ids: run_graph(graph, input_ids, fast)


def fast_logits(graph, input_ids: torch.Tensor, compile: bool | None = None, *, use: str = "eval") -> torch.Tensor:
    """graph's logits for input_ids [B, T] on the fast route (fast_runner): the public default path."""
    with torch.no_grad():
        return fast_runner(graph, compile, use=use)(input_ids)
