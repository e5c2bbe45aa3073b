"""Running a captured graph (or any module that runs one) through torch.compile / inductor.

Eagerly a captured graph runs one aten op at a time, so a small model is bound by launches and
Python, not by the device. CompiledGraph compiles lazily on the first call and reports how long that
took; any failure to compile is said in one line and the eager module runs instead, for good.

Lengths: torch's automatic dynamic shapes (dynamic=None). The first call is compiled for its exact
shapes (the fastest kernels: evaluation runs one chunk length, a static decode step one shape);
a second shape recompiles once with the changed dimension symbolic, and that graph serves every
later length. No bucketing, so no padding to get wrong in the losses.

Caches: inductor's FX graph cache and AOTAutograd's cache are on by default and live under torch's
own cache directory (TORCHINDUCTOR_CACHE_DIR); a later run of the same graph loads its kernels from
there instead of compiling them (the report says "cache hit").

Policy ("on where it pays"): every default lives in this file. Training, alignment and decode
steps: COMPILE_BY_DEFAULT (compile_default). Inference forwards (evaluation, passkey, a Decoder's
prefill; surgery.decode.fast runs them): ROUTES, the causal flags and a compile once the eager calls
have cost what a compile does. On the 2 CPU cores measured, stories260K (5 layers) took ~45 s to
compile, then ran a 64-token forward in 2.5 ms against 7.1 ms eagerly; a CPU job would need some
10,000 forwards to win the compile time back, so nothing compiles on the CPU unless asked.
surgery.decode.precision.float32_gaps measures whether a compiled graph is as near float32 as eager.

Precision (issue 17's 42.6 max-abs logits gap, compiled vs eager captured teacher in bf16): not
reproduced on CPU. stories260K bf16, 2 x 500 tokens: max |diff| 0.80 (logits up to 19), 0.16 with
torch._inductor.config.emulate_precision_casts (inductor keeps fused intermediates in float32 where
eager rounds each op to bf16); float32: 1e-5. The position/RoPE ops are float32 in the graph and
stay so compiled. precise_casts=True turns the emulation on; bench/compile_speed.py measures the
gap on the GPU with and without it, in float32, and by position, to pin the GPU cause down.
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
import warnings
from dataclasses import dataclass

import torch

from ..errors import first_line


# (device type, use) where compiling is the default, each measured (bench/RESULTS.md, 2026-12-01): on the
# H200, distillation ran 126.1k tokens/s compiled against 69.5k eager (32 x 512, fla's backward), and the
# compiled bf16 SmolLM2 teacher's logits were nearer its float32 logits than eager bf16's (max relative
# gap 0.030 against 0.046). Alignment and decode steps stay opt-in: a 30-50 s compile outweighs what one
# typical call saves (a few hundred align steps, a short generation). Inference forwards (evaluation,
# a Decoder's prefill) follow ROUTES below, which compiles only once the eager calls have paid for it.
COMPILE_BY_DEFAULT: frozenset[tuple[str, str]] = frozenset({("cuda", "train")})
USES = ("train", "align", "eval", "decode", "prefill")
# ... and only for a run long enough to win its compile back. The first compile of the teacher and the
# student took 108 s on the H200 (64 x 512), and compiling saves 3.5 us a token with PyTorch's GDN
# backward (70.5k -> 93.6k tokens/s) or 6.4 us with fla's (69.5k -> 126.1k): 17-31M tokens to break
# even on a cold cache. At 128 x 512 with fla's backward (twelfth session) the first step took 190 s
# compiled against 24 s eager and compiling saved 5.2 us a token (103k -> 225k): 32M tokens.
# Shorter runs train eagerly unless --compile says otherwise.
TRAIN_COMPILE_PAYS_AFTER = 30_000_000  # tokens
BACKEND = "inductor"  # torch.compile's backend for every CompiledGraph that names none (tests use "aot_eager")
# Fixed-shape inference on CUDA (surgery.decode.fast): compiled, then replayed as CUDA graphs. On the H200 at
# 2k tokens, batch 1, the compiled 75% GDN hybrid ran 37.6 ms as launched kernels (the GPU busy 27% of
# the time: fla's Triton launches and Python) and 5.5 ms replayed (bench/compile_speed.py, RESULTS.md).
REPLAY_MODE = "reduce-overhead"


@dataclass(frozen=True)
class Route:
    """How inference runs a graph on one device for one use (surgery.decode.fast runs it).

    causal_flags   SDPA masks proven plain causal become is_causal (surgery.decode.CausalFlags):
                   flash attention instead of a materialised [L, L] mask; bit-identical on the CPU
                   teachers checked (RESULTS, tenth session), so it costs no agreement
    compile_after  eager seconds this runner spends before it compiles (0: at once; None: never).
                   Compiling costs COMPILE_SECONDS once; spending that much eagerly first is the
                   ski-rental rule: never more than twice the cost of the best choice in hindsight,
                   whether the caller then runs one more call or a million.
    replay         until then, an input shape's second and later calls replay the eager graph as a
                   CUDA graph (surgery.decode.replay): the same kernels, bit-identical logits, a
                   capture of ~0.1 s instead of a compile.
    fused          each RMSNorm's traced arithmetic, and each SwiGLU product, as one kernel (surgery.decode.fusions),
                   and sibling projections as one matmul (surgery.decode.fused_linears.fused_siblings): for
                   the uncompiled routes, since inductor fuses the elementwise work itself."""

    causal_flags: bool = False
    compile_after: float | None = None
    replay: bool = False
    fused: bool = False


# A compile of the 75% hybrid (SmolLM2-135M shapes) took 22-32 s on the H200, the teacher's 27-38 s, on a
# cold inductor cache; 6-7 s from a warm one (bench/RESULTS.md, eighth to eleventh sessions).
COMPILE_SECONDS = 30.0
# THE table of inference routes, by (device type, use); a pair not here runs the captured graph as it is
# (every CPU use: compiling stories260K took ~45 s for 4.6 ms saved a forward, see above, and the CPU
# tests keep their numbers). Measured on the H200, bf16, batch 1 (ms per forward, RESULTS.md):
#   prefill 2k: hybrid eager 78.66, compiled + CUDA graphs 5.53 (teacher 5.87, transformers 22.71)
#   prefill 8k: hybrid eager 95.42, compiled + CUDA graphs with the flags 13.71 (transformers 40.39)
#   prefill 32k: hybrid eager 164.5, compiled + CUDA graphs with the flags 59.4 (transformers 129.8);
#     without the flags the kept layers' masked SDPA took 9.3 ms each
# and compiled bf16 logits were nearer float32 than eager bf16's on real SmolLM2 (teacher: max relative
# gap 0.030 vs 0.046; uncalibrated 75% hybrid: 0.817 vs 0.975; RESULTS, eleventh session). So on CUDA
# the flags are always on and compiling pays once COMPILE_SECONDS of eager forwards were spent: at 2k
# after ~380 forwards, at 32k after ~180. "eval": perplexity and passkey; "prefill": a Decoder's prompt.
# Fifteenth session (RESULTS.md): through this runner the teacher compiled in 31.9 s (2k: 3.56 ms against
# transformers' 19.78), but the 75% hybrid's first compiled call at 2k had not returned after more than
# five minutes (random weights, Triton 3.7.1). Sixteenth session, the hybrid alone in its process: compiled
# in 24.8 s, then 5.13 ms at 2k; its eager graph replayed as a CUDA graph (Route.replay) 7.08 ms after a
# 0.08 s capture, bit-identical to eager (8k: 19.57 ms; 32k: 86.92 ms against transformers' 130.81).
# So on CUDA the default takes the flags and replays from a shape's second call; compiling, which
# would save 2 ms a call at 2k (12,000 calls to win back its 25 s), stays what --compile asks for.
# Fused elementwise work (surgery.decode.fusions: each RMSNorm whole, each residual add with the norm that
# reads it, each SwiGLU product, as one kernel) on the uncompiled routes and in a Decoder's static steps.
# Seventeenth session, H200, random SmolLM2 shapes, 75% GDN, default route with / without (RESULTS.md):
# prefill 32k 67.25 / 83.79 ms (transformers 131.4), 2k 5.10 / 6.73 ms; decode step at 64k, batch 1,
# 1.601 / 2.755 ms (teacher 3.119 / 4.146), batch 16 3.088 / 4.081 ms. Nearer float32 than the traced
# kernels on real SmolLM2 (mean relative logit gap 0.0194 / 0.0213 for the teacher, 0.0213 / 0.0226 for
# the hybrid `surgery apply` wrote), WikiText-2 perplexity unchanged (21.98).
FUSED_BY_DEFAULT = True
ROUTES: dict[tuple[str, str], Route] = {
    ("cuda", "eval"): Route(causal_flags=True, compile_after=None, replay=True, fused=FUSED_BY_DEFAULT),
    ("cuda", "prefill"): Route(causal_flags=True, compile_after=None, replay=True, fused=FUSED_BY_DEFAULT),
}


def inference_route(flag: bool | None, device, use: str) -> Route:
    """The route for `use` on `device`: the table's (ROUTES), or the user's --compile / --no-compile:
    compiled at once (always with the flags: the compiled paths were measured with them), or never."""
    if use not in USES:
        raise ValueError(f"unknown compile use {use!r}; one of {USES}")
    route = ROUTES.get((torch.device(device).type, use), Route())
    if flag is None:
        return route
    return Route(causal_flags=True, compile_after=0.0) if flag else dataclasses.replace(route, compile_after=None)


def compile_default(device, use: str, tokens: int | None = None) -> bool:
    """Whether compiling pays for `use` (one of USES) on `device` when the user did not say;
    `tokens`: a training run's budget (a short one does not win its compile back)."""
    if use not in USES:
        raise ValueError(f"unknown compile use {use!r}; one of {USES}")
    if use == "train" and tokens is not None and tokens < TRAIN_COMPILE_PAYS_AFTER:
        return False
    return (torch.device(device).type, use) in COMPILE_BY_DEFAULT


def resolve_compile(flag: bool | None, device, use: str, tokens: int | None = None) -> bool:
    """A --compile/--no-compile choice, None meaning the default for the device, use and budget."""
    return compile_default(device, use, tokens) if flag is None else bool(flag)


def cache_hits() -> int:
    """Graphs inductor has loaded from its FX graph cache in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["fxgraph_cache_hit"])


def failure_reason(exc: BaseException) -> str:
    """One line on why compiling failed: the root cause (dynamo wraps a backend's error in its own,
    whose first line only names the backend)."""
    while (inner := getattr(exc, "inner_exception", None) or exc.__cause__) is not None:
        exc = inner
    return f"{type(exc).__name__}: {first_line(exc)}"


class CompiledGraph:
    """`module` (a GraphModule, DDP around one, a GDN layer ...) compiled on its first call.

    Calls take the module's arguments. compile_seconds is the first call's time (compiling
    included); `failed` the one-line reason it runs eagerly, if it does. A call whose compiled form
    raises is run eagerly: an error of the eager module itself is raised from there, anything else
    is a compile failure, warned once, after which only the eager module runs."""

    def __init__(self, module, *, label: str = "graph", dynamic: bool | None = None, backend=None,
                 mode: str | None = None, precise_casts: bool = False, report=sys.stderr):
        self.module, self.label, self.report = module, label, report
        self.precise_casts = precise_casts
        self.compile_seconds: float | None = None
        self.failed: str | None = None
        try:
            self.compiled = torch.compile(module, dynamic=dynamic, backend=backend or BACKEND, mode=mode)
        except Exception as exc:
            self.fall_back(exc)

    @property
    def meta(self) -> dict:
        """The wrapped graph's meta (graph_logits reads its extra inputs there)."""
        return getattr(self.module, "meta", {})

    def fall_back(self, exc: BaseException) -> None:
        self.failed = failure_reason(exc)
        warnings.warn(f"Compiling the {self.label} failed ({self.failed}); running it eagerly.", stacklevel=3)

    def __call__(self, *args, **kwargs):
        if self.failed is not None:
            return self.module(*args, **kwargs)
        first = self.compile_seconds is None
        start, hits = time.perf_counter(), cache_hits() if first else 0
        try:
            with self.precision():
                out = self.compiled(*args, **kwargs)
        except Exception as exc:
            out = self.module(*args, **kwargs)  # the module's own errors are raised from here
            self.fall_back(exc)
            return out
        if first:
            self.compile_seconds = time.perf_counter() - start
            if self.report is not None:
                cached = " (inductor cache hit)" if cache_hits() > hits else ""
                print(f"compiled the {self.label} in {self.compile_seconds:.1f} s{cached}", file=self.report, flush=True)
        return out

    def precision(self):
        """inductor rounding each op's result as eager does, when asked (it costs some speed)."""
        if not self.precise_casts:
            return contextlib.nullcontext()
        import torch._inductor.config as inductor_config  # here, not at import: it costs ~2 s to import

        return inductor_config.patch(emulate_precision_casts=True)

    def info(self) -> dict:
        return {"label": self.label, "compile_seconds": self.compile_seconds, "failed": self.failed}


def maybe_compiled(module, flag: bool | None, device, *, use: str, label: str = "graph", prepare=None, **options):
    """`module` itself when compiling is off (its eager numbers untouched), else a CompiledGraph of
    it, or of prepare(module): a rewrite for the compiled path only (surgery.decode.CausalFlags)."""
    if not resolve_compile(flag, device, use):
        return module
    return CompiledGraph(module if prepare is None else prepare(module), label=label, **options)
