"""Quality tables: perplexity of hybrids built by chosen passes, each row scored in memory AND through
the user's path (surgery.save -> `surgery eval`), since a figure counts only through that path.

One teacher capture; for each keep ratio, selection policy and row, a fresh branch runs the row's
passes (ROWS: the ablation of Taylor-Calibrate's phases; --policies: uniform, ar, retrieval, greedy selection).
The teacher is scored in memory and by `surgery eval` on its source; --cli-apply adds `surgery apply`
(README's defaults) -> `surgery eval`. Every text is scored on each path (WikiText-2 protocol,
surgery.eval.perplexity and the CLI, same --chunk and --batch-size). Calibration text: the files of
--calibration, never the evaluation texts. Rows: bench.harness.Rows; the in-memory row's anchor is
the copy-only baseline of its keep ratio and policy, the through-save row's is its in-memory figure.

    # the ablation table (one H200; SmolLM2-135M)
    python bench/quality.py --model /root/m/smol.gguf --calibration D/austen.txt.xz D/shakespeare.txt.xz D/kjv.txt.xz \
        --eval D/wiki.test.raw --rows baseline,zero-gate,phase1-ref,phase1,phase2,phase1+2 --cli-apply --json quality.jsonl
    # per-head against per-layer selection at equal KV bytes (kv_bytes_32k in each row)
    python bench/quality.py --model ... --rows baseline,phase1+2 --policies uniform,head:distance,head:entropy,head:output ...
    # selection policies, and Gemma-3-270M's table (uniform and ar, a held-out text)
    python bench/quality.py --model ... --rows phase1+2 --policies uniform,ar,greedy ...
    python bench/quality.py --model /root/m/gemma.gguf --rows baseline,zero-gate,phase1,phase2,phase1+2 --policies uniform,ar \
        --set align.steps=200 --held-out D/python-docs.txt.xz --held-out-chars 300000 ...
    # issue 31's ablation per mixer (replace.mixer): copy-only, Phase 1, Phase 1+2 and the ratio
    # baseline / Phase 1+2 (the anchor column), each converted block's error against the teacher's on
    # held-out tokens, and the decode state bytes; --cli-apply adds `surgery apply --set replace.mixer=M`
    python bench/quality.py --model /root/m/smol.gguf --calibration D/austen.txt.xz D/shakespeare.txt.xz D/kjv.txt.xz \
        --eval D/wiki.test.raw --mixers gdn,swa,gla,kda --cli-apply --json mixers.jsonl
    python bench/quality.py --smoke --mixers gdn,swa,gla,kda   # the same on the CPU, stories260K
    # --retrieval passkey,multikey,vartrack adds each graph's long-range rows beside its perplexity (a 96-token
    # copy-only swa beats calibrated gdn on 2k-window perplexity at equal state: RESULTS, 2026-12-03)
    python bench/quality.py --kernel-check           # CUDA: fla's gla/kda/mamba2 kernels against the PyTorch references, the
                                                     # fusion kernels, tcal.delta_inputs' and tcal.gated_norm's against theirs
    python bench/quality.py --kernel-check ours      # only the project's own kernels (fusions, GDN inputs, gated norm): under
                                                     # a minute, where fla's autotuned gla/kda rows took over 4 (2026-12-03)
    python bench/quality.py --decode-agreement gla,kda,mamba2   # a mixer's Decoder self-check: float32, bf16, bf16 drift
    python bench/quality.py --smoke                  # CPU, stories260K, tiny settings
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.harness import SAMPLE, STORIES, Rows, check_names, common_args, parse, placement, surgery_cli, timed_s  # noqa: E402
from bench.recovery_one import passkey_lengths  # noqa: E402
from surgery import Decoder, PassManager, capture, load, save  # noqa: E402
from surgery.core.pipeline import parse_options  # noqa: E402
from surgery.core.run import interpret, placeholder_values  # noqa: E402
from surgery.data.cache import text_ids  # noqa: E402
from surgery.eval.retrieval import TASKS as RETRIEVAL, retrieval_task  # noqa: E402
from surgery.eval.perplexity import perplexity  # noqa: E402
from surgery.passes.kv_budget import kv_report  # noqa: E402
from surgery.passes.select import Select  # noqa: E402
from tcal.mixers import MIXERS, get_mixer  # noqa: E402

ZERO_GATE = {"gate": "zero", "decay": False, "write_gate": False, "value_scale": False}
REFERENCE = {"gate": "reference", "concentration": "minmax"}
ROWS = {  # name: (passes, pass options); every row starts with select + replace
    "baseline": (["select", "replace"], {}),
    "baseline-silu": (["select", "replace"], {"replace": {"v_activation": "silu"}}),
    "zero-gate": (["select", "replace", "calibrate"], {"calibrate": ZERO_GATE}),
    "phase1-ref": (["select", "replace", "calibrate"], {"calibrate": REFERENCE}),
    "phase1": (["select", "replace", "calibrate"], {}),
    "phase2": (["select", "replace", "align"], {}),
    "phase1+2": (["select", "replace", "calibrate", "align"], {}),
}
TEXT_PASSES = ("calibrate", "align")
ALL_ROWS = "baseline,zero-gate,phase1-ref,phase1,phase2,phase1+2"
MIXER_ROWS = "baseline,phase1,phase1+2"  # issue 31's ablation (zero-gate and phase1-ref are GDN's options)
KERNEL_TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 3e-2}  # largest relative error of fla against the PyTorch reference
SMOKE = {"rows": "baseline,phase1,phase1+2", "chunk": 128, "max_chars": 6000, "keep_ratios": "0.5", "block_tokens": "2x128",
         "state_context": 256}
SMOKE_SETS = ["align.steps=2", "calibrate.samples=2", "align.samples=2", "calibrate.length=64", "align.length=64"]  # before --set's


def arguments(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_args(ap)
    ap.add_argument("--calibration", nargs="+", default=None, help="calibration text files (default: the built-in sample)")
    ap.add_argument("--eval", default=None, help="the evaluation text (WikiText-2 test)")
    ap.add_argument("--held-out", default=None, help="a second evaluation text, not among --calibration")
    ap.add_argument("--held-out-chars", type=int, default=0, help="score only the held-out file's first N characters (0: all)")
    ap.add_argument("--max-chars", type=int, default=0, help="score only the eval file's first N characters (0: all)")
    ap.add_argument("--rows", default=None, help=f"of: {','.join(ROWS)} (default: {ALL_ROWS}; with --mixers: {MIXER_ROWS})")
    ap.add_argument("--keep-ratios", default="0.5")
    ap.add_argument("--policies", default="uniform", help="select policies: uniform, ar, retrieval, greedy; head:distance, head:entropy, head:output keep KV "
                    "heads instead of layers (select.granularity=head) up to the KV bytes uniform keeps at the same ratio")
    ap.add_argument("--set", nargs="*", action="extend", default=None, help="pass.key=value for every row that runs the pass "
                    "(--set A B and --set A --set B alike)")
    ap.add_argument("--cli-apply", action="store_true", help="also `surgery apply` (default passes at the first keep ratio, --set) "
                    "-> `surgery eval`, anchored to the phase1+2 row built in memory")
    ap.add_argument("--mixers", default=None, help=f"a table per replace.mixer, of: {','.join(MIXERS)}; each row adds its "
                    "converted blocks' error against the teacher's and its decode state bytes")
    ap.add_argument("--block-tokens", default="2x256", help="--mixers: BATCHxLENGTH tokens of the held-out text (else --eval) "
                    "on which each converted block's output is compared with the teacher's")
    ap.add_argument("--state-context", type=int, default=65536, help="--mixers: the context (capped at the teacher's "
                    "position limit) at which a Decoder's cache bytes are counted")
    ap.add_argument("--retrieval", default=None, metavar="TASKS", help="also each graph's long-range retrieval, comma-separated "
                    "of passkey, multikey, vartrack (surgery.eval), at --retrieval-lengths with --retrieval-trials per length "
                    "(5 depths), the filler from --calibration: a row per task and length, anchored to the teacher's")
    ap.add_argument("--retrieval-lengths", default="1024,2048,4096", help="--retrieval: prompt lengths, each clipped to what "
                    "the teacher holds with its answer")
    ap.add_argument("--retrieval-trials", type=int, default=10, help="--retrieval: trials per length (a multiple of 5)")
    ap.add_argument("--kernel-check", nargs="?", const="all", default=None, choices=("all", "ours", "fusions"),
                    help="only fla's gla/kda kernels against their PyTorch references on CUDA (forward, final state, gradients; "
                    "float32 and bfloat16), then the project's own kernels: the fast route's fusions, GDN inputs, gated norm "
                    "('ours': those alone; 'fusions': the fusions alone); exits 1 past the tolerance")
    ap.add_argument("--agreement", nargs="+", metavar="MODEL", default=None, help="only: each model (a teacher, or a saved "
                    "hybrid's directory) in bf16 on the first --chunk tokens of --eval: eager, compiled and the default route "
                    "against float32 (surgery.decode.precision; issue 29)")
    ap.add_argument("--decode-agreement", default=None, metavar="MIXERS", help="only: per replace.mixer (comma-separated), "
                    "a random SmolLM2-shaped hybrid's Decoder self-check in float32 and bf16 and its bf16 logit drift "
                    "(bench/mixer_agreement.py; issue 31)")
    ap.add_argument("--rounding-seeds", default="", help="--decode-agreement: also the bf16 self-check with stochastically "
                    "rounded matmuls in the incremental pass, once per seed (comma-separated)")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=1)
    args = parse(ap, argv, {"model": str(STORIES), "eval": str(SAMPLE), **SMOKE})
    if args.agreement and not args.eval:
        ap.error("--agreement scores the first --chunk tokens of --eval: pass --eval")
    if args.decode_agreement:
        check_names(ap, args.decode_agreement, MIXERS, "mixer(s)")
    if not args.kernel_check and not args.agreement and not args.decode_agreement and (not args.model or not args.eval):
        ap.error("pass --model (the teacher) and --eval (the text to score), or --smoke")
    args.set = (SMOKE_SETS if args.smoke else []) + (args.set or [])
    args.rows = args.rows or (MIXER_ROWS if args.mixers else ALL_ROWS)
    check_names(ap, args.rows, ROWS, "row(s)")
    if args.mixers:
        check_names(ap, args.mixers, MIXERS, "mixer(s)")
    if args.retrieval:
        check_names(ap, args.retrieval, RETRIEVAL, "retrieval task(s)")
    if args.held_out and os.path.abspath(args.held_out) in {os.path.abspath(p) for p in args.calibration or []}:
        ap.error("--held-out must not be one of the --calibration files")
    if args.held_out and Path(args.held_out).name == Path(args.eval).name:
        ap.error("--held-out and --eval have the same file name; rows name each text by it: rename one")
    return args


def cut(path: str, chars: int, work: Path) -> str:
    """The file itself, or its first `chars` characters in a file of `work` (both paths score the same text)."""
    if not chars:
        return path
    out = work / f"{Path(path).name}.first{chars}.txt"
    from surgery.data.text import read_text

    out.write_text(read_text(path)[:chars], encoding="utf-8")
    return str(out)


class Scorer:
    """Scores a graph on every text, in memory and through save -> `surgery eval`, as rows."""

    def __init__(self, args, texts: dict[str, str], dtype: torch.dtype, work: Path, rows: Rows):
        self.args, self.texts, self.work, self.rows = args, texts, work, rows
        self.dtype = str(dtype).removeprefix("torch.")
        self.teacher_retrieval: dict[tuple[str, str], float] = {}

    def cli_eval(self, model: str, text: str) -> dict:
        a = self.args
        return surgery_cli("eval", "--model", model, "--text", text, "--chunk", str(a.chunk), "--batch-size", str(a.batch_size),
                           "--dtype", self.dtype, "--json", *(["--device", a.device] if a.device else []))

    def in_memory(self, graph, name: str, config: str, anchors: dict, **extra) -> dict:
        """Each text's in-memory perplexity as a row (anchor: anchors[text], when given); the values."""
        got = {}
        for label, path in self.texts.items():
            ids = text_ids(path, graph.tokenizer)
            with torch.no_grad():
                result = perplexity(graph, ids, chunk=self.args.chunk, batch_size=self.args.batch_size)
            got[label] = result["perplexity"]
            anchor = anchors.get(label)
            self.rows.add(name, config, f"{label} ppl, in memory", got[label], "ppl", anchor, tokens=result["tokens"], **extra)
        return got

    def retrieval(self, graph, name: str, config: str) -> None:
        """--retrieval: each task's accuracy per length as a row, anchored to the teacher's (scored first:
        its figures are the anchors; a length the teacher never answers has none)."""
        a = self.args
        lengths = passkey_lengths(graph, [int(x) for x in a.retrieval_lengths.split(",")])
        for task in a.retrieval.split(","):
            run = retrieval_task(task)
            with torch.no_grad():
                result = run(graph, a.calibration, lengths, 5, max(a.retrieval_trials // 5, 1), 0, batch_size=4)
            for length, accuracy in result["by_length"].items():
                key = (task, length)
                if name == "teacher":
                    self.teacher_retrieval[key] = accuracy
                teacher = self.teacher_retrieval.get(key)
                anchor = ("teacher", 100 * teacher) if name != "teacher" and teacher else None
                self.rows.add(name, config, f"{task} at {length}", 100 * accuracy, "% correct", anchor,
                              trials=result["trials"] // len(lengths))

    def through_cli(self, model: str, name: str, config: str, memory: dict, path: str) -> None:
        for label, text in self.texts.items():
            got = self.cli_eval(model, text)
            anchor = ("in memory", memory[label]) if label in memory else None
            self.rows.add(name, config, f"{label} ppl, {path}", got["perplexity"], "ppl", anchor, tokens=got["tokens"])

    def through_save(self, graph, name: str, config: str, memory: dict) -> None:
        folder = self.work / "saved"
        save(graph, folder, force=True)
        self.through_cli(str(folder), name, config, memory, "surgery.save -> surgery eval")


class BlockProbe:
    """--mixers: what a converted graph's rows add beside perplexity. block error: the mean over
    converted layers of ||block output - teacher's||^2 / ||teacher's||^2 on held-out tokens (the
    mixer module's output where it replaced the block, the output projection's where it replaced only
    the op). state: the bytes a Decoder's caches hold at `context` tokens, batch 1 (KV of the kept
    and swa layers, the recurrent states), anchored to the teacher's."""

    def __init__(self, args, teacher, text: str, rows: Rows):
        batch, length = (int(x) for x in args.block_tokens.split("x"))
        ids = text_ids(text, teacher.tokenizer)
        if ids.numel() < batch * length:
            raise SystemExit(f"--block-tokens {args.block_tokens} needs {batch * length} tokens; {text} has {ids.numel()}: ask for fewer")
        self.teacher, self.rows, self.ids = teacher, rows, ids[:batch * length].reshape(batch, length).to(teacher.device)
        self.context = min(args.state_context, teacher.max_length)
        self.teacher_mib = self.state_mib(teacher)

    def values(self, gm, names: set) -> dict:
        with torch.no_grad():
            found = interpret(gm, placeholder_values(gm, self.ids), keep=lambda n: n.name in names)
        return {n.name: v.float() for n, v in found.items() if n.name in names}

    def block_error(self, graph) -> float:
        layers, names = graph.meta["select"].convert, {}
        for layer in layers:
            entry = graph.meta["replace"]["modules"][str(layer)]
            if get_mixer(entry["mixer"]).replaces == "op":
                names[layer] = graph.sites[layer].output_node
            else:
                names[layer] = next(n.name for n in graph.gm.graph.nodes if n.op == "call_module" and n.target == entry["target"])
        got = self.values(graph.gm, set(names.values()))
        want = self.values(self.teacher.gm, {graph.sites[layer].output_node for layer in layers})
        errors = [float((got[names[l]] - want[graph.sites[l].output_node]).pow(2).sum() / want[graph.sites[l].output_node].pow(2).sum())
                  for l in layers]
        return sum(errors) / len(errors)

    def state_mib(self, graph) -> float:
        decoder = Decoder(graph, verify=False).reset(1, self.context)
        with torch.no_grad():
            decoder.prefill(self.ids[:1, :1])  # recurrent states exist once a token went in
        return decoder.cache_bytes()["total"] / 2**20

    def measure(self, graph, name: str, config: str, baseline: float | None) -> float:
        """The graph's two rows (block error anchored to the copy-only baseline's); its block error."""
        error = self.block_error(graph)
        anchor = ("baseline", baseline) if baseline is not None else None
        self.rows.add(name, config, f"block error, {self.ids.shape[0]} x {self.ids.shape[1]} tokens", error, "rel sq err", anchor)
        self.rows.add(name, config, f"decode state, context {self.context}", self.state_mib(graph), "MiB", ("teacher", self.teacher_mib))
        return error


def kernel_case(run, mixer: str, t: int, dtype, seed: int = 0) -> dict:
    """fla's kernel against the PyTorch reference on one random case (b 2, h 9, d 64, an initial
    state): relative errors of the output, the final state and (the largest over inputs) the gradients."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    b, h, d = 2, 9, 64
    rand = lambda *shape: torch.randn(*shape, generator=gen, device="cuda")  # noqa: E731
    q, k, v = rand(b, t, h, d), torch.nn.functional.normalize(rand(b, t, h, d), dim=-1), rand(b, t, h, d)
    g = -torch.rand(b, t, h, d, generator=gen, device="cuda") * 0.5
    beta = torch.rand(b, t, h, generator=gen, device="cuda")
    s0 = rand(b, h, d, d) * 0.1
    inputs = [x.to(dtype) for x in (q, k, v)] + [g] + ([beta] if mixer == "kda" else [])
    out = {}
    for backend in ("fla", "torch"):
        leaves = [x.detach().clone().requires_grad_() for x in inputs]
        o, s = run(*leaves, initial_state=s0, output_final_state=True, backend=backend)
        (o.float().pow(2).mean() + s.float().pow(2).mean()).backward()
        out[backend] = (o, s, [x.grad for x in leaves])
    (o1, s1, g1), (o2, s2, g2) = out["fla"], out["torch"]
    rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))  # noqa: E731
    return {"output": rel(o1, o2), "final state": rel(s1, s2), "gradients": max(rel(a, b) for a, b in zip(g1, g2))}


def decode_case(run, mixer: str, prefill: int, dtype, steps: int = 4, device: str = "cuda") -> dict:
    """What a Decoder asks of fla (no gradient, so fla's recurrent kernel up to 64 tokens, its chunked one
    past them): a prefill, then `steps` one-token calls each given the last final state, against the
    float64 PyTorch reference of the whole sequence (b 2, h 9, d 64, the random case's inputs)."""
    gen = torch.Generator(device=device).manual_seed(1)
    b, h, d, t = 2, 9, 64, prefill + steps
    rand = lambda *shape: torch.randn(*shape, generator=gen, device=device)  # noqa: E731
    q, k, v = rand(b, t, h, d), torch.nn.functional.normalize(rand(b, t, h, d), dim=-1), rand(b, t, h, d)
    g = -torch.rand(*((b, t, h) if mixer == "mamba2" else (b, t, h, d)), generator=gen, device=device) * 0.5
    x = [q, k, v, g] + ([torch.rand(b, t, h, generator=gen, device=device)] if mixer == "kda" else [])
    want, want_state = run(*[a.double() for a in x], output_final_state=True, backend="torch")
    x = [a.to(dtype) if i < 3 else a for i, a in enumerate(x)]
    with torch.no_grad():
        o, state = run(*[a[:, :prefill] for a in x], output_final_state=True, backend="fla")
        outs = [o]
        for i in range(prefill, t):
            o, state = run(*[a[:, i:i + 1] for a in x], initial_state=state, output_final_state=True, backend="fla")
            outs.append(o)
    rel = lambda a, b: float((a.double() - b).norm() / b.norm().clamp_min(1e-30))  # noqa: E731
    got = torch.cat(outs, 1)
    return {"decode output": rel(got, want), "decode steps' output": rel(got[:, prefill:], want[:, prefill:]),
            "decode final state": rel(state, want_state)}


def kernel_check(rows: Rows) -> bool:
    """fla's gla and kda kernels against the PyTorch references (tcal.mixers), forward at chunked
    and short/recurrent lengths and backward, in float32 and bfloat16, then gla's, kda's and mamba2's
    as a Decoder calls them (decode_case): a row per error, anchored to its tolerance (ratio >= 1
    passes). True when every one is within it."""
    from tcal.mixers.gla_kernels import gla
    from tcal.mixers.kda_kernels import kda
    from tcal.mixers.mamba2_kernels import ssd

    ok = True
    cases = [(mixer, f"T={t}", lambda dtype, run=run, mixer=mixer, t=t: kernel_case(run, mixer, t, dtype))
             for mixer, run in (("gla", gla), ("kda", kda)) for t in (1, 40, 300)]
    cases += [(mixer, f"prefill {p} + steps", lambda dtype, run=run, mixer=mixer, p=p: decode_case(run, mixer, p, dtype))
              for mixer, run in (("gla", gla), ("kda", kda), ("mamba2", ssd)) for p in (8, 100)]
    for mixer, config, case in cases:
        for dtype in KERNEL_TOLERANCE:
            for what, error in case(dtype).items():
                tolerance = KERNEL_TOLERANCE[dtype]
                rows.add(f"{mixer}: fla against PyTorch", f"{str(dtype).removeprefix('torch.')}, {config}", what, error, "rel err",
                         ("tolerance", tolerance))
                ok = ok and error <= tolerance
    return own_kernels_check(rows) and ok


def own_kernels_check(rows: Rows) -> bool:
    """The project's own Triton kernels (no fla autotuning, so quick): the fast route's fusions, the GDN
    inputs and the gated norm, each against its reference. True when every row is within tolerance."""
    return all([fusion_kernels_check(rows), delta_inputs_check(rows), gated_norm_check(rows)])


def delta_inputs_check(rows: Rows) -> bool:
    """tcal.delta_inputs' kernel (a GDN layer's q, k, v, g, beta from its projections) against the float64
    reference, on bf16 slices of one projection as the layer has them: q and k within the composition's
    own error (tcal.gdn's SiLU then fla's l2norm, anchor); v within one bf16 rounding to nearest (2^-9
    relative), g and beta within float32's."""
    import torch.nn.functional as F

    from tcal.delta_inputs import delta_inputs_torch, delta_inputs_triton
    from tcal.gdn import l2norm

    ok, heads, dim = True, 9, 64
    rel = lambda got, want: float((got.double() - want).norm() / want.norm().clamp_min(1e-30))  # noqa: E731
    for batch, length in ((1, 1), (1, 4096), (1, 32768), (16, 64)):
        g = torch.Generator("cuda").manual_seed(length)
        proj = torch.randn(batch, length, 3 * heads * dim + 2 * heads, device="cuda", generator=g).bfloat16()
        q, k, v, a, b = proj.split([heads * dim] * 3 + [heads] * 2, dim=-1)
        q, k, v = (x.unflatten(-1, (heads, dim)) for x in (q, k, v))
        A_log, dt_bias = torch.randn(heads, device="cuda", generator=g), torch.randn(heads, device="cuda", generator=g) - 4
        got = delta_inputs_triton(q, k, v, a, b, A_log, dt_bias, True)
        exact = delta_inputs_torch(*(x.double() for x in (q, k, v, a, b, A_log, dt_bias)), True)
        composed = {"q": l2norm(F.silu(q), backend="auto"), "k": l2norm(F.silu(k), backend="auto")}
        for name, x, want in zip(("q", "k", "v", "g", "beta"), got, exact):
            error = rel(x, want)
            anchor = ("composition", rel(composed[name], want)) if name in composed else ("tolerance", 2**-9 if name == "v" else 1e-5)
            rows.add("GDN inputs: Triton against float64", f"bfloat16, [{batch}, {length}, {heads}, {dim}], {name}", "rel err", error,
                     "rel err", anchor)
            ok = ok and error <= anchor[1]
    return ok


def gated_norm_check(rows: Rows) -> bool:
    """tcal.gated_norm's kernel against the float64 reference, the gate a bf16 slice of a wider projection:
    the same float32 math and one rounding as fla's FusedRMSNormGated, so within 10% of its error."""
    from fla.modules.norm.fused_norm_gate import rms_norm_gated

    from tcal.gated_norm import gated_rms_norm_torch, gated_rms_norm_triton

    ok, heads, dim = True, 9, 64
    rel = lambda got, want: float((got.double() - want).norm() / want.norm())  # noqa: E731
    for batch, length in ((1, 1), (1, 32768), (16, 64)):
        g = torch.Generator("cuda").manual_seed(length)
        x = torch.randn(batch, length, heads, dim, device="cuda", generator=g).bfloat16()
        gate = torch.randn(batch, length, 4 * heads * dim, device="cuda", generator=g).bfloat16()[..., heads * dim:2 * heads * dim]
        gate = gate.unflatten(-1, (heads, dim))
        weight = (torch.rand(dim, device="cuda", generator=g) + 0.5).bfloat16()
        for activation, fla_name in (("silu", "swish"), ("sigmoid", "sigmoid")):
            exact = gated_rms_norm_torch(x.double(), gate.double(), weight.double(), 1e-5, activation)
            error = rel(gated_rms_norm_triton(x, gate, weight, 1e-5, activation), exact)
            fla = rel(rms_norm_gated(x, gate, weight, None, activation=fla_name, eps=1e-5), exact)
            rows.add("gated RMSNorm: Triton against float64", f"bfloat16, [{batch}, {length}, {heads}, {dim}], {activation}",
                     "rel err", error, "rel err", ("fla's kernel's x 1.1", 1.1 * fla))
            ok = ok and error <= 1.1 * fla
    return ok


def fusion_kernels_check(rows: Rows) -> bool:
    """The fast route's fusion kernels (surgery.decode.fusions) and the static step's split-KV attention,
    each against its reference: every check runs."""
    return all([check(rows) for check in (swiglu_check, residual_norm_check, rope_check, step_attention_check)])


def swiglu_check(rows: Rows) -> bool:
    """The fast route's SwiGLU kernel (surgery.decode.swiglu) against float32 silu(a) * b: contiguous
    inputs and the two halves of one fused projection (strided views), decode and prefill sizes. The
    kernel rounds once, so its error is at most the traced bf16 form's (anchor: that error)."""
    import torch.nn.functional as F

    from surgery.decode.swiglu import silu_mul_torch, silu_mul_triton

    ok = True
    for rows_, width in ((1, 1536), (4096, 1536), (3, 1000)):
        both = torch.randn(rows_, 2 * width, device="cuda", generator=torch.Generator("cuda").manual_seed(rows_)).bfloat16()
        for layout, (a, b) in (("contiguous", (both[:, :width].contiguous(), both[:, width:].contiguous())),
                               ("strided", both.split(width, dim=-1))):
            exact = F.silu(a.float()) * b.float()
            err = lambda got: float((got.float() - exact).abs().max())  # noqa: E731
            kernel, traced = err(silu_mul_triton(a, b)), err(silu_mul_torch(a, b))
            rows.add("swiglu: Triton against float32", f"bfloat16, {rows_} x {width}, {layout}", "max abs err", kernel, "abs err",
                     ("traced bf16 form", traced))
            ok = ok and kernel <= traced
    return ok


def residual_norm_check(rows: Rows) -> bool:
    """surgery.decode.residual_norm's kernel against its reference (the add, then aten._fused_rms_norm):
    the sum bit for bit, the norm within bf16 rounding (its max error over its largest entry; anchor: 1/64,
    two bf16 steps)."""
    from surgery.decode.residual_norm import add_rms_norm_torch, add_rms_norm_triton

    ok = True
    for rows_, width in ((1, 576), (32768, 576), (5, 2304)):
        g = torch.Generator("cuda").manual_seed(width)
        a, b = (torch.randn(rows_, width, device="cuda", generator=g).bfloat16() for _ in range(2))
        weight = (torch.rand(width, device="cuda", generator=g) + 0.5).bfloat16()
        (h, n), (h0, n0) = add_rms_norm_triton(a, b, weight, 1e-5), add_rms_norm_torch(a, b, weight, 1e-5)
        same_sum = bool(torch.equal(h, h0))
        err = float((n.float() - n0.float()).abs().max() / n0.float().abs().max())
        rows.add("add + RMSNorm: Triton against add, fused_rms_norm", f"bfloat16, {rows_} x {width}, sum equal: {same_sum}",
                 "max err / max entry", err, "rel", ("tolerance", 1 / 64))
        ok = ok and same_sum and err <= 1 / 64
    return ok


def rope_check(rows: Rows) -> bool:
    """surgery.decode.rope's kernel against float32 x * cos + rotate_half(x) * sin, x a transposed view
    as q and k are: one rounding, so its error is at most the traced bf16 form's (anchor)."""
    from surgery.decode.rope import kernel_takes, rope_torch, rope_triton

    ok = True
    for batch, heads, length in ((1, 9, 1), (1, 9, 4096), (16, 3, 1)):
        g = torch.Generator("cuda").manual_seed(length)
        x = torch.randn(batch, length, heads, 64, device="cuda", generator=g).bfloat16().transpose(1, 2)
        cos, sin = (torch.randn(1, 1, length, 64, device="cuda", generator=g).bfloat16() for _ in range(2))
        exact = rope_torch(x.float(), cos.float(), sin.float())
        kernel = float((rope_triton(x, cos, sin).float() - exact).abs().max())
        traced = float((rope_torch(x, cos, sin).float() - exact).abs().max())
        rows.add("rope: Triton against float32", f"bfloat16, [{batch}, {heads}, {length}, 64], taken: {kernel_takes(x, cos, sin)}",
                 "max abs err", kernel, "abs err", ("traced bf16 form", traced))
        ok = ok and kernel <= traced and kernel_takes(x, cos, sin)
    return ok


def step_attention_check(rows: Rows) -> bool:
    """surgery.decode.step_attention's split-KV kernels against float64 softmax attention over the valid
    slots of a max-length cache (slots past the index hold NaN, which must not leak), bf16, GQA and MHA,
    with and without softcap: within the existing path's (SDPA under a mask) error, or 1/256 (anchor)."""
    from surgery.decode.caches import attend
    from surgery.decode.step_attention import kernel_takes, step_attention_reference, step_attention_triton

    ok = True
    for batch, heads, kv_heads, size, at, softcap in ((1, 9, 3, 65536, 65535, None), (1, 9, 3, 65536, 700, None),
                                                      (16, 9, 3, 8192, 5000, None), (1, 8, 8, 4096, 4000, 50.0)):
        g = torch.Generator("cuda").manual_seed(size + at)
        q = torch.randn(batch, 1, heads, 64, device="cuda", generator=g).bfloat16().transpose(1, 2)
        k, v = (torch.randn(batch, kv_heads, size, 64, device="cuda", generator=g).bfloat16() for _ in range(2))
        index = torch.tensor([at], device="cuda")
        exact = step_attention_reference(q, k, v, index, scale=0.125, softcap=softcap)
        allowed = torch.arange(size, device="cuda")[None, :] <= index[:, None]
        existing = attend(q, k, v, allowed, scale=0.125, softcap=softcap, k_map=None, v_map=None)
        k[:, :, at + 1:], v[:, :, at + 1:] = float("nan"), float("nan")
        kernel = float((step_attention_triton(q, k, v, index, scale=0.125, softcap=softcap).double() - exact).abs().max())
        traced = float((existing.double() - exact).abs().max())
        taken = kernel_takes(q, k, v)
        rows.add("step attention: split-KV Triton against float64",
                 f"bfloat16, B={batch}, heads {heads}/{kv_heads}, cache {size}, index {at}, softcap {softcap}, taken: {taken}",
                 "max abs err", kernel, "abs err", ("SDPA path / 1/256", traced))
        ok = ok and taken and kernel <= max(traced, 1 / 256)
    return ok


def row_configs(args, row: str, ratio: float, policy: str, mixer: str | None = None,
                kv_bytes: int | None = None) -> tuple[list[str], dict]:
    """The row's passes and their options: the row's own, the mixer, the calibration text, then --set. A
    "head:" policy keeps KV heads by that score up to kv_bytes (the KV cache uniform layer selection keeps
    at ratio)."""
    passes, base = ROWS[row]
    configs = {name: dict(base.get(name, {})) for name in passes}
    granularity, _, named = policy.rpartition(":")
    configs["select"] |= {"keep_ratio": ratio, "policy": named} | ({"granularity": granularity, "kv_bytes": kv_bytes} if granularity else {})
    if mixer:
        configs["replace"]["mixer"] = mixer
    for name in [*TEXT_PASSES, "select"]:
        if name in passes and args.calibration and (name != "select" or policy != "uniform"):
            configs[name]["calibration"] = args.calibration
    overrides = parse_options(args.set)
    return passes, {name: options | overrides.get(name, {}) for name, options in configs.items()}


def table_label(ratio: float, policy: str, mixer: str | None) -> str:
    return f"keep {ratio:.2f}, {policy}" + (f", {mixer}" if mixer else "")


def ablation(args, teacher, scorer: Scorer, probe: BlockProbe | None) -> dict:
    """Every (keep ratio, policy, mixer) table; returns the in-memory figures of each phase1+2 row."""
    full = {}
    for ratio in (float(r) for r in args.keep_ratios.split(",")):
        for policy in args.policies.split(","):
            for mixer in args.mixers.split(",") if args.mixers else [None]:
                full[table_label(ratio, policy, mixer)] = table(args, teacher, scorer, probe, (ratio, policy, mixer))
    return full


def table(args, teacher, scorer: Scorer, probe: BlockProbe | None, key: tuple) -> dict | None:
    """One table's rows, each a fresh branch; the in-memory anchor of every row is the table's
    copy-only baseline. Returns the phase1+2 row's in-memory figures (None without that row)."""
    config, baseline, baseline_error, full = table_label(*key), {}, None, None
    kept = Select(keep_ratio=key[0]).decide(teacher.num_layers)  # per-head rows: the KV bytes of this selection
    for row in args.rows.split(","):
        passes, configs = row_configs(args, row, *key, kv_bytes=kv_report(teacher, kept)["kv_bytes"])
        graph = teacher.branch()
        result, seconds = timed_s(lambda: PassManager(passes, configs)(graph), teacher.device)
        split = graph.meta["select"].split_layers()
        extra = {"passes_s": seconds, "converted": graph.meta["select"].convert, "kept_kv_heads": split or None,
                 "kv_bytes_32k": kv_report(graph, graph.meta["select"].convert, kept_heads=split)["kv_bytes"],
                 "calibrate_s": graph.meta.get("calibrate", {}).get("seconds"),
                 "align_s": graph.meta.get("align", {}).get("seconds"),
                 "align_best_loss": result.info.get("align", {}).get("mean_best_loss")}
        anchors = {label: ("baseline", value) for label, value in baseline.items()}
        got = scorer.in_memory(graph, row, config, anchors, **extra)
        error = probe.measure(graph, row, config, baseline_error) if probe else None
        if args.retrieval:
            scorer.retrieval(graph, row, config)
        if row == "baseline":
            baseline, baseline_error = got, error
        full = got if row == "phase1+2" else full
        scorer.through_save(graph, row, config, got)
        del graph
        if teacher.device.type == "cuda":
            torch.cuda.empty_cache()
    return full


def cli_apply(args, scorer: Scorer, work: Path, full: dict) -> None:
    """`surgery apply` (default passes at the first keep ratio, --set; per mixer with --mixers) ->
    `surgery eval`, anchored to the phase1+2 row built in memory."""
    sets = [x for option in args.set for x in ("--set", option)]
    calibration = ["--calibration", *args.calibration] if args.calibration else []
    ratio = float(args.keep_ratios.split(",")[0])
    for mixer in args.mixers.split(",") if args.mixers else [None]:
        applied = work / f"applied_{mixer or 'default'}"
        mixer_set = ["--set", f"replace.mixer={mixer}"] if mixer else []
        surgery_cli("apply", "--model", args.model, "--out", str(applied), "--force", "--dtype", scorer.dtype, "--keep-ratio", str(ratio),
                    *mixer_set, *sets, *calibration, *(["--device", args.device] if args.device else []))
        config = table_label(ratio, "uniform", mixer)
        scorer.through_cli(str(applied), "phase1+2", config, full.get(config) or {}, "surgery apply -> surgery eval")


def agreement(args, device, rows: Rows) -> Rows:
    """--agreement: each model's bf16 logits (eager, compiled, the default route) against float32."""
    from surgery.decode.precision import float32_gaps

    for model in args.agreement:
        saved = (Path(model) / "recipe.json").exists()
        graph = load(model, device=device, dtype=torch.bfloat16) if saved else capture(model, device=device, dtype=torch.bfloat16)
        ids = text_ids(args.eval, graph.tokenizer)[: args.chunk].view(1, -1)
        found = float32_gaps(graph, ids)
        for run in ("eager", "compiled", "default", "compiled_vs_eager"):
            for what, value in found[run].items():
                rows.add(f"{Path(model).name}: {run.replace('_', ' ')}", f"bf16, {ids.shape[1]} tokens of {Path(args.eval).name}",
                         what, value, "", ("eager", found["eager"][what]) if run in ("compiled", "default") else None)
        del graph
    return rows


def main(argv=None) -> Rows:
    args = arguments(argv)
    device, dtype = placement(args)
    rows = Rows(args.json)
    if args.kernel_check:
        if device.type != "cuda":
            raise SystemExit("--kernel-check compares fla's CUDA kernels: run it where CUDA is (not with --smoke or --device cpu)")
        checks = {"all": kernel_check, "ours": own_kernels_check, "fusions": fusion_kernels_check}[args.kernel_check]
        if not checks(rows):
            raise SystemExit("a kernel is past its tolerance (the rows with a ratio below 1.00x)")
        return rows
    if args.agreement:
        return agreement(args, device, rows)
    if args.decode_agreement:
        from bench.mixer_agreement import decode_agreement

        seeds = [int(x) for x in args.rounding_seeds.split(",") if x]
        return decode_agreement(rows, args.decode_agreement.split(","), device, seeds)
    with tempfile.TemporaryDirectory(prefix="bench_quality.") as folder:
        work = Path(folder)
        texts = {Path(args.eval).name: cut(args.eval, args.max_chars, work)}  # rows name each text by its file
        if args.held_out:
            texts[Path(args.held_out).name] = cut(args.held_out, args.held_out_chars, work)
        scorer = Scorer(args, texts, dtype, work, rows)
        start = time.perf_counter()
        teacher = capture(args.model, device=device, dtype=dtype)
        rows.note(f"captured {args.model} in {time.perf_counter() - start:.1f} s: {teacher.num_layers} attention layers")
        memory = scorer.in_memory(teacher, "teacher", "-", {})
        scorer.through_cli(args.model, "teacher", "-", memory, "surgery eval")
        if args.retrieval:
            scorer.retrieval(teacher, "teacher", "-")
        probe = BlockProbe(args, teacher, list(texts.values())[-1], rows) if args.mixers else None
        full = ablation(args, teacher, scorer, probe)
        if args.cli_apply:
            cli_apply(args, scorer, work, full)
    return rows


if __name__ == "__main__":
    main()
