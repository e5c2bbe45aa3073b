"""Speed of the paths users run, each section in one run with its anchor beside it (issue 29):

  prefill   ms of one forward: transformers' teacher forward (anchor), the captured teacher's
            graph.logits, and the saved hybrid loaded with surgery.load: eager graph.logits, the public
            default path surgery.fast_logits, and fast_logits(compile=True), for teacher and hybrid
  generate  time to first token: surgery.generate with the Decoder `surgery generate` builds, on the
            loaded hybrid, against transformers' generate of the teacher (max_new_tokens=1)
  decode    ms a step at --decode-context: the hybrid's Decoder against the teacher graph's Decoder
            (the same runtime) and transformers' generate of the teacher
  export    the hybrid's `surgery export --format hf` loaded by transformers (trust_remote_code) in
            its own generate against the teacher there: prefill ms and decode tokens/s
  distill   surgery.distill tokens/s of the 50% hybrid at --distill-shape, compiled against eager
  host      us of host time a replayed fast-route call takes before its kernels start, teacher and hybrid
            (on the CPU, the route's host work with the replay stubbed)
  registers tcal's GDN prefill kernels compiled for sm_90a (any machine with Triton, no GPU): registers and
            spill bytes at SmolLM2's GDN shapes (bench/kernel_registers.py)
  apply     `surgery apply` wall seconds with empty kernel caches (cold) against the same again (warm)
  fsdp      surgery.distill of a --fsdp-shape pair (Llama-3-8B's shapes by default, random weights) per
            mode: plain (no sharding), fsdp (FSDP2), fsdp_offload (shards, gradients and AdamW states
            in CPU memory), fsdp_teacher (fsdp with the teacher sharded too, its full weights released): tokens/s and peak GPU and CPU memory per batch of
            --fsdp-batches, each mode and batch in a process of its own (an out-of-memory one leaves the
            others standing), and per mode the largest batch that fits (issue 32); with --fsdp-procs 1,2
            each row also runs under torchrun on 2 processes (one GPU each; gloo on the CPU), anchored
            to the same mode and batch on one (the 2-GPU scaling target: >= 1.8x)
  offload   a teacher larger than the device (issue 32): capture on meta + select/replace/calibrate/align
            of --offload-layers layers of a Llama-70B-shaped random teacher whose layers are streamed to
            the device (surgery.core.meta_capture); peak memory per device against the full 80-layer
            teacher's bytes, seconds per layer (offloaded_conversion)
  step_attention, floors, state_splits, gdn_forward   CUDA only, one kernel at a time: the decode step's
            split-KV attention against SDPA; one kernel's cost in a CUDA graph (bench/kernel_floors.py); the GDN
            chunk forward with its state pass cut along the sequence against the unsplit one
            (bench/state_splits_bench.py); fla's GDN forward stage by stage per launch config (bench/gdn_forward_bench.py)

Only public API (surgery.capture/save/load/export/generate/distill, Decoder, graph.logits, the CLI),
so it measures whatever the library's default paths are. Rows: bench.harness.Rows.

    python bench/speed.py --random --sections prefill --json speed.jsonl     # one H200; one section per run fits a call
    python bench/speed.py --model /root/m/SmolLM2-135M-Instruct.Q4_1.gguf --sections apply --json speed.jsonl
    python bench/speed.py --random --sections prefill --profile                # + the top CUDA kernels of one hybrid eager forward
    python bench/speed.py --sections step_attention --decode-context 65536 --decode-batches 1,16   # split-KV against SDPA
    python bench/speed.py --sections state_splits --split-shapes 2048x1,32768x1   # the GDN state pass cut in pieces
    python bench/speed.py --sections gdn_forward --split-shapes 2048x1,2048x8     # fla's GDN forward per stage, per launch config
    python bench/speed.py --random --sections prefill --casts                  # + its copies and dtype conversions (bench/casts.py)
    python bench/speed.py --random --sections prefill --shapes 2048x1 --prefill-off SURGERY_CHUNK_INTRA   # + the default without a kernel, same process
    python bench/speed.py --random --sections prefill --shapes 2048x1 --prefill-off SURGERY_CHUNK_STATES=on  # + with a kernel not on by default
    python bench/speed.py --random --sections decode --decode-batches 1 --decode-off SURGERY_GDN_BLOCKS  # + the hybrid with a switch set
    python bench/speed.py --sections fsdp --fsdp-modes fsdp_offload,plain --fsdp-batches 4,8,16,32 --fsdp-micro 4 --json fsdp.jsonl
    python bench/speed.py --sections fsdp --fsdp-shape smollm2 --keep-ratio 0.5 --fsdp-batches 16 --fsdp-lr-rest 7e-6
    python bench/speed.py --sections fsdp --fsdp-modes fsdp,fsdp_teacher --fsdp-procs 1,2 --fsdp-batches 8,16 --json fsdp2.jsonl   # 2 GPUs
    python bench/speed.py --smoke --sections prefill,generate,decode,export,distill,apply,fsdp   # CPU, stories260K, tiny sizes

A section that outlives one device call goes in the background: bench/gpu.sh start / wait. The distill
section needs Triton >= 3.7.1 on Hopper for fla's backward (bench/gpu.sh pack --triton); with Triton
3.6 the library trains through its PyTorch backward, slower.

fsdp: stage kl (the whole student trained unless --fsdp-lr-rest 0 freezes what is outside the GDN
layers), float32 master weights, bf16 autocast on CUDA, no compile, no evaluation, no checkpoint
written (an 8B student's with its AdamW states is ~96 GB); tokens/s is the median of the steps after
the first. On the 1-GPU machine (128 GiB of CPU memory) an 8B student with every parameter trained
does not fit offloaded (16 bytes a float32 parameter with its gradient and AdamW states: 128 GB),
hence --fsdp-lr-rest 0 there (its default: only the GDN layers train).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.casts import copies, print_copies  # noqa: E402
from bench.harness import (SMOLLM2_SHAPE, STORIES, SAMPLE, Rows, check_names, common_args, env_setting, median_ms, parse,  # noqa: E402
                           placement, random_smollm2, surgery_cli, sync, transformers_teacher)
from surgery import Decoder, DistillConfig, PassManager, capture, distill, export, fast_logits, generate, load, save  # noqa: E402
import surgery.core.compiled as compiled_routes  # noqa: E402
from surgery.core.run import run_graph  # noqa: E402
from surgery.decode.fast import FastGraph  # noqa: E402
from surgery.decode.gdn_block import STEP_ROWS  # noqa: E402
from surgery.decode.gdn_blocks import ENV as BLOCKS_ENV  # noqa: E402
from surgery.decode.gdn_tail import ENV as TAIL_ENV  # noqa: E402
from surgery.decode.gdn_tail import MAX_ROWS as TAIL_ROWS  # noqa: E402
from surgery.decode.row_linear import SWITCH as ROW_LINEAR_ENV  # noqa: E402
from surgery.errors import SurgeryError  # noqa: E402
from surgery.train.placement import local_device  # noqa: E402

SECTIONS = ("prefill", "generate", "decode", "export", "distill", "apply", "fsdp", "offload", "step_attention", "floors",
            "state_splits", "gdn_forward", "host", "registers")
CUDA_ONLY = {"step_attention", "floors", "state_splits", "gdn_forward"}  # one kernel timed on the GPU: no teacher, no CPU fallback
OWN_TEACHERS = {"offload", "fsdp", "registers", *CUDA_ONLY}  # sections that build their own teachers (or need none)
FSDP_SHAPES = {  # transformers LlamaConfig fields of the random pairs the fsdp section trains ("stories": the real tiny teacher)
    "smollm2": SMOLLM2_SHAPE,
    "llama8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False),
}
FSDP_MODES = ("plain", "fsdp", "fsdp_offload", "fsdp_teacher")
WARM_STEPS = 256  # untimed decode steps the harness's warm-up may take before the timed ones (a cache position each)
LOGITS_BUDGET = 4 << 30  # bytes of logits one Decoder.prefill call may return (a 64k x 16 prompt is prefilled in pieces)
# the caches a cold `surgery apply` starts without: Triton's kernels (fla's autotuning too), Inductor's, surgery's tokens
COLD_CACHES = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "SURGERY_CACHE")
SMOKE = {"shapes": "48x1,48x2", "generate_lengths": "48", "decode_context": 40, "decode_batches": "1,2", "decode_steps": 3,
         "export_contexts": "32", "new_tokens": 4, "distill_shape": "2x64", "distill_steps": 4, "repeats": 2,
         "apply_args": "--set align.steps=2 --set calibrate.samples=2 --set align.samples=2",
         "offload_shape": "128x256x4x2x512x80", "offload_layers": 2, "offload_text": "2x32", "offload_steps": 2,
         "fsdp_shape": "stories", "fsdp_batches": "2,4", "fsdp_seq_len": 64, "fsdp_steps": 3}


def arguments(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_args(ap)
    ap.add_argument("--random", action="store_true", help="SmolLM2-135M's shapes, random weights (speed does not depend on them)")
    ap.add_argument("--sections", default="prefill,generate,decode,export,distill", help=f"comma-separated, of: {','.join(SECTIONS)}")
    ap.add_argument("--keep-ratio", type=float, default=0.25, help="attention layers the hybrid keeps (0.25: 75%% GDN)")
    ap.add_argument("--shapes", default="2048x1,2048x8,8192x1,32768x1", help="prefill: LENGTHxBATCH,...")
    ap.add_argument("--generate-lengths", default="32768", help="generate: prompt lengths")
    ap.add_argument("--decode-context", type=int, default=65536)
    ap.add_argument("--decode-batches", default="1,16")
    ap.add_argument("--decode-steps", type=int, default=32, help="timed steps (and transformers' new tokens)")
    ap.add_argument("--decode-mixers", default="", help="decode: other replace.mixer values timed too (e.g. gla,kda,mamba2,swa), "
                    "with their cache bytes")
    ap.add_argument("--decode-compile", default="on", choices=("on", "off", "default"), help="the Decoders' compile flag")
    ap.add_argument("--split-shapes", default="2048x1,8192x1,32768x1,2048x8,8192x2",
                    help="state_splits, gdn_forward: LENGTHxBATCH,... of the sweep")
    ap.add_argument("--gdn-forward-stages", default="cumsum,intra,state,output", help="gdn_forward: the stages timed and swept")
    ap.add_argument("--gdn-forward-shipped", action="store_true", help="gdn_forward: time each stage's shipped configs only "
                    "(no sweep of fla's autotuned kernels)")
    ap.add_argument("--export-contexts", default="4096,32768")
    ap.add_argument("--new-tokens", type=int, default=32, help="export: tokens generated after the prompt")
    ap.add_argument("--distill-shape", default="128x512", help="BATCHxSEQ_LEN")
    ap.add_argument("--distill-steps", type=int, default=20)
    ap.add_argument("--distill-modes", default="eager,compiled")
    ap.add_argument("--apply-args", default="", help="more `surgery apply` options, e.g. '--set align.steps=60'")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--registers-pdl", action="store_true", help="registers: the kernels as tcal.pdl launches them")
    ap.add_argument("--no-compiled", action="store_true", help="prefill: leave out the compiled rows (a compile per shape and model)")
    ap.add_argument("--prefill-off", default="", help="prefill: switches (e.g. SURGERY_CHUNK_INTRA,SURGERY_STATE_PASS) each set "
                    "to off (or NAME=value: to that value, e.g. SURGERY_CHUNK_STATES=on; A=on+B=on: both in one row) for one "
                    "more hybrid default-route row in the same process (its own replay graph), beside the default")
    ap.add_argument("--decode-off", default="", help="decode: switches, as --prefill-off takes them (e.g. "
                    "SURGERY_GDN_BLOCKS=off), each one more hybrid Decoder row in the same process, beside the default")
    ap.add_argument("--profile", action="store_true", help="prefill: torch.profiler on one hybrid eager forward per shape; "
                    "decode: on a few static steps of teacher and hybrid, not replayed; "
                    "the top 15 CUDA kernels (CPU ops on the CPU) by total time; export: cProfile on one generate "
                    "of teacher and export, the top functions by own time")
    ap.add_argument("--step-attention-sweep", action="store_true", help="step_attention: also time the split-KV kernels' "
                    "untuned constants (bench/step_attention_bench.py)")
    ap.add_argument("--casts", action="store_true", help="prefill: the copies (dtype conversions, copy_, clone) of one hybrid "
                    "eager forward per shape on the default route, per source line (bench/casts.py)")
    ap.add_argument("--fsdp-shape", choices=["stories", *FSDP_SHAPES], default="llama8b", help="fsdp: the random pair's shapes")
    ap.add_argument("--fsdp-modes", default="plain,fsdp,fsdp_offload", help=f"fsdp: of {','.join(FSDP_MODES)} (plain runs first: the anchor)")
    ap.add_argument("--fsdp-batches", default="8,16", help="fsdp: global batches, ascending; a mode stops at its first that does not fit")
    ap.add_argument("--fsdp-micro", type=int, default=None, help="fsdp: sequences per forward (default: the whole batch)")
    ap.add_argument("--fsdp-seq-len", type=int, default=512)
    ap.add_argument("--fsdp-steps", type=int, default=4)
    ap.add_argument("--fsdp-lr-rest", type=float, default=0.0, help="fsdp: learning rate outside the GDN layers (0: frozen)")
    ap.add_argument("--fsdp-checkpoint", action="store_true", help="fsdp: per-layer activation checkpointing")
    ap.add_argument("--fsdp-timeout", type=float, default=560, help="fsdp: seconds one mode and batch may take")
    ap.add_argument("--fsdp-procs", default="1", help="fsdp: process counts, ascending (more than 1: under torchrun, a GPU each; "
                    "each row anchored to the same mode and batch on the first count)")
    ap.add_argument("--fsdp-one", default=None, help=argparse.SUPPRESS)  # a JSON spec: the child process of one fsdp row
    ap.add_argument("--offload-shape", default="8192x28672x64x8x128256x80",
                    help="offload: HIDDENxINTERMEDIATExHEADSxKV_HEADSxVOCABxLAYERS of the Llama-shaped teacher (default: Llama-3-70B)")
    ap.add_argument("--offload-layers", type=int, default=4, help="offload: decoder layers built and converted")
    ap.add_argument("--offload-text", default="16x256", help="offload: calibration SAMPLESxLENGTH")
    ap.add_argument("--offload-steps", type=int, default=20, help="offload: align steps")
    args = parse(ap, argv, {"model": str(STORIES), **SMOKE})
    if args.fsdp_one:
        return args
    if args.smoke:
        import surgery.core.compiled

        surgery.core.compiled.BACKEND = "aot_eager"  # as the tests compile: inductor's C++ builds take minutes on the CPU
    check_names(ap, args.sections, SECTIONS, "section(s)")
    check_names(ap, args.fsdp_modes, FSDP_MODES, "fsdp mode(s)")
    counts = args.fsdp_procs.split(",")
    if not all(c.isdigit() and int(c) > 0 for c in counts):
        ap.error(f"--fsdp-procs takes positive process counts, e.g. 1,2 (got {args.fsdp_procs!r})")
    gpus = torch.cuda.device_count()
    if gpus and max(int(c) for c in counts) > gpus and "fsdp" in args.sections.split(","):
        ap.error(f"--fsdp-procs {args.fsdp_procs} needs a GPU per process; this machine has {gpus}")
    sections = set(args.sections.split(","))
    if sections & CUDA_ONLY and not torch.cuda.is_available():
        ap.error(f"section(s) {', '.join(sorted(sections & CUDA_ONLY))} time CUDA kernels; this machine has no CUDA device")
    if not args.model and not args.random and sections - OWN_TEACHERS:
        ap.error("name a teacher with --model, or pass --random (SmolLM2-135M's shapes, random weights)")
    return args


def pairs(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in item.split("x")) for item in text.split(",") if item]


class Setup:
    """The teacher in transformers and as a captured graph, and the hybrid (select + replace at
    --keep-ratio) saved and loaded back with surgery.load, as a user gets it. Built once, on first use."""

    def __init__(self, args, work: Path):
        self.args, self.work = args, work
        self.device, self.dtype = placement(args)
        self.limit = max([l for l, _ in pairs(args.shapes)] + [int(x) + 2 for x in args.generate_lengths.split(",")]
                         + [args.decode_context + step_positions(args)]
                         + [int(x) + args.new_tokens + 2 for x in args.export_contexts.split(",")]
                         + [pairs(args.distill_shape)[0][1]])
        source = random_smollm2(self.limit) if args.random else args.model
        self.model = transformers_teacher(source, self.device, self.dtype)
        start = time.perf_counter()
        self.teacher = capture(self.model if args.random else args.model, device=self.device, dtype=self.dtype, max_length=self.limit)
        if args.random:  # random weights have no tokenizer; stories260K's reads the text (its ids fit the vocabulary)
            from surgery.core.load import load_model
            self.teacher.tokenizer = load_model(str(STORIES))[1]
        print(f"# teacher captured in {time.perf_counter() - start:.1f} s (max_length {self.limit})", flush=True)
        self._hybrid = self._applied = None

    @property
    def vocab(self) -> int:
        return self.teacher.config.vocab_size

    @property
    def hybrid(self):
        if self._hybrid is None:
            self._hybrid = self.hybrid_of("gdn")
        return self._hybrid

    def hybrid_of(self, mixer: str):
        """select + replace (replace.mixer = mixer) at --keep-ratio, saved and loaded with surgery.load."""
        graph = self.teacher.branch()
        PassManager(["select", "replace"], {"select": {"keep_ratio": self.args.keep_ratio}, "replace": {"mixer": mixer}})(graph)
        save(graph, self.work / f"hybrid_{mixer}", force=True)
        del graph
        return load(self.work / f"hybrid_{mixer}", device=self.device, dtype=self.dtype)

    @property
    def applied(self):
        """The same hybrid as `surgery apply --passes select,replace` (the CLI, a subprocess) saves it,
        loaded back with surgery.load (--random: the random teacher saved first, as a folder the CLI reads)."""
        if self._applied is None:
            source = self.args.model
            if self.args.random:
                source = self.work / "teacher_hf"
                self.model.save_pretrained(source)
                self.teacher.tokenizer.save_pretrained(source)
            dtype = str(self.dtype).removeprefix("torch.")
            surgery_cli("apply", "--model", str(source), "--passes", "select,replace", "--keep-ratio", str(self.args.keep_ratio),
                        "--out", str(self.work / "applied"), "--force", "--dtype", dtype, "--device", str(self.device))
            self._applied = load(self.work / "applied", device=self.device, dtype=self.dtype)
        return self._applied

    def ids(self, batch: int, length: int) -> torch.Tensor:
        return torch.randint(0, self.vocab, (batch, length), generator=torch.Generator().manual_seed(length + batch)).to(self.device)

    def label(self) -> str:
        return f"hybrid {100 - 100 * self.args.keep_ratio:.0f}% GDN"


def free(device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def prefill(s: Setup, rows: Rows) -> None:
    """transformers' forward (anchor); the eager graph.logits (the reference every check uses); the
    public default path surgery.fast_logits (on CUDA: causal flags, the eager graph replayed as a CUDA
    graph from a shape's second call, compiling once eager calls paid for it) and the same with
    compile=True, for teacher and hybrid; the hybrid `surgery apply` saved, on the default path, beside
    the one surgery.save wrote. --profile: the top kernels of one teacher and one hybrid forward per shape,
    on the default route's eager graph (fused, not replayed: the profiler sees each kernel)."""
    a = s.args
    for length, batch in pairs(a.shapes):
        ids, config = s.ids(batch, length), f"{length} x {batch}"
        with torch.no_grad():
            time_of = lambda fn: median_ms(fn, s.device, a.repeats, warmup=3)  # noqa: E731
            hf = time_of(lambda: s.model(input_ids=ids).logits)
            rows.add("transformers forward (teacher)", config, "prefill", hf, "ms")
            anchor = ("transformers", hf)
            rows.add("teacher graph.logits (eager)", config, "prefill", time_of(lambda: s.teacher.logits(ids)), "ms", anchor)
            rows.add("teacher fast_logits (default)", config, "prefill", time_of(lambda: fast_logits(s.teacher, ids)), "ms", anchor)
            if not a.no_compiled:
                teacher_c = time_of(lambda: fast_logits(s.teacher, ids, compile=True))
                rows.add("teacher fast_logits, compiled", config, "prefill", teacher_c, "ms", anchor)
            rows.add(f"{s.label()}: surgery.load -> graph.logits (eager)", config, "prefill", time_of(lambda: s.hybrid.logits(ids)), "ms", anchor)
            default = time_of(lambda: fast_logits(s.hybrid, ids))
            rows.add(f"{s.label()}: fast_logits (default)", config, "prefill", default, "ms", anchor)
            if not a.no_compiled:  # issue 29: the public default path at least matches the compiled teacher
                rows.add(f"{s.label()}: fast_logits (default)", config, "prefill", default, "ms", ("compiled teacher", teacher_c))
            for label, graph in (("teacher", s.teacher), (s.label(), s.hybrid)):
                unfused = unfused_runner(graph)
                rows.add(f"{label}: default route without the fusions", config, "prefill", time_of(lambda: unfused(ids)), "ms", anchor)
            if not a.no_compiled:
                hybrid_c = time_of(lambda: fast_logits(s.hybrid, ids, compile=True))
                rows.add(f"{s.label()}: fast_logits, compiled", config, "prefill", hybrid_c, "ms", anchor)
                rows.add(f"{s.label()}: fast_logits, compiled", config, "prefill", hybrid_c, "ms", ("compiled teacher", teacher_c))
            applied_default(s, rows, ids, config, default)
            reference = fast_logits(s.hybrid, ids).float() if a.prefill_off else None
            for settings in switch_settings(a.prefill_off):
                setting = settings_label(settings)
                runner = switched_runner(s.hybrid, settings)
                try:  # a switch's kernels may fail on a device they never ran on: the other rows still come
                    agreement = logits_agreement(runner(ids).float(), reference)
                    off = time_of(lambda: runner(ids))
                except Exception as exc:  # noqa: BLE001 (any failure of the switched route is this row's result)
                    rows.note(f"{setting} at {config}: failed, {type(exc).__name__}: {str(exc)[:400]}")
                    continue
                rows.note(f"{setting} at {config} against the default's logits: {agreement}")
                rows.add(f"{s.label()}: fast_logits (default), {setting}", config, "prefill", off, "ms",
                         ("compiled teacher", teacher_c) if not a.no_compiled else anchor)
                rows.add(f"{s.label()}: fast_logits (default)", config, "prefill", default, "ms", (setting, off))
            if a.profile:
                for label, graph in (("teacher", s.teacher), (s.label(), s.hybrid)):
                    eager = default_eager_runner(graph)
                    eager(ids)  # the bucket's first call builds its graph (the causal-flag proof runs the masks): not profiled
                    top_kernels(lambda: eager(ids), s.device, f"{label} default route, eager (not replayed), {config}", top=25)
            if a.casts:
                eager = default_eager_runner(s.hybrid)
                eager(ids)  # the graph built (and fla's autotuning done) before the census
                print_copies(copies(lambda: eager(ids)), f"{s.label()} default route, eager (not replayed), {config}")
        del ids
        free(s.device)


def host_cost(s: Setup, rows: Rows) -> None:
    """us of host time a call of the default route's replayed forward takes, teacher and hybrid, at --shapes: on
    CUDA the call until it returns (the replay launched, not finished; the GPU synchronised between calls), so
    what the host adds before a replay's kernels start; on the CPU (no CUDA graphs) the route's own host work
    with the graph replay stubbed out (flags, fused copies and replay on, as CUDA's default route has them)."""
    class Launched:  # the CPU's stand-in for a captured graph: replaying it launches nothing
        def replay(self):
            pass

    def stub_capture(run):
        out = run()
        return Launched(), out, out

    for length, batch in pairs(s.args.shapes):
        ids, config = s.ids(batch, length), f"{length} x {batch}"
        for label, graph in (("teacher", s.teacher), (s.label(), s.hybrid)):
            if s.device.type == "cuda":
                fast = own_route(graph, f"{label} (host cost)")
            else:  # built under CUDA's route, as FastGraph builds it there (its Replays included), replay stubbed
                kept = dict(compiled_routes.ROUTES)
                compiled_routes.ROUTES[(s.device.type, "eval")] = compiled_routes.ROUTES[("cuda", "eval")]
                try:
                    fast = own_route(graph, f"{label} (host cost)")
                finally:
                    compiled_routes.ROUTES.clear(), compiled_routes.ROUTES.update(kept)
                fast.replays.devices, fast.replays.capture = (s.device.type,), stub_capture
            times = []
            with torch.no_grad():
                for call in range(3 + 10 * s.args.repeats):
                    sync(s.device)
                    start = time.perf_counter()
                    run_graph(graph, ids, fast)
                    if call >= 3:  # the first calls run eagerly, then capture
                        times.append(time.perf_counter() - start)
            sync(s.device)
            rows.add(f"{label}: fast-route call, host time (replay {'launched' if s.device.type == 'cuda' else 'stubbed'})",
                     config, "host", 1e6 * statistics.median(times), "us")


def own_route(graph, label: str, **changes):
    """A FastGraph of graph's default route of its own (its own replay graph), with `changes` to the route."""
    fast = FastGraph(graph.gm, graph.device, "eval", None, limit=graph.max_length, label=label)
    fast.route = dataclasses.replace(fast.route, **changes)
    return fast


def default_eager_runner(graph):
    """ids -> logits on the default route with replay off: the kernels a replay would run, one by one."""
    fast = own_route(graph, "graph, not replayed", replay=False)
    fast.replays = None
    return lambda ids: run_graph(graph, ids, fast)


def switch_settings(text: str) -> list[dict]:
    """--prefill-off / --decode-off: each comma-separated item as {switch: value} ("NAME" is NAME=off; A=on+B=on
    sets both)."""
    items = filter(None, (x.strip() for x in text.split(",")))
    return [dict((part if "=" in part else f"{part}=off").split("=", 1) for part in item.split("+")) for item in items]


def settings_label(settings: dict) -> str:
    return "+".join(f"{k}={v}" for k, v in settings.items())


@contextlib.contextmanager
def env_settings(settings: dict):
    """Every switch of `settings` set to its value inside the block."""
    with contextlib.ExitStack() as stack:
        for switch, value in settings.items():
            stack.enter_context(env_setting(switch, value))
        yield


def switched_runner(graph, settings: dict):
    """ids -> logits on the default route (its own replay graph) with each environment switch of `settings`
    set to its value around each call: the route with those kernel choices, timed in the same process as the default."""
    fast = own_route(graph, "graph, " + settings_label(settings))

    def run(ids):
        with env_settings(settings):
            return run_graph(graph, ids, fast)
    return run


def logits_agreement(logits: torch.Tensor, reference: torch.Tensor) -> str:
    """How far a switched route's logits are from the default route's: max |diff| and argmax agreement."""
    same = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
    return f"max |diff| {(logits - reference).abs().max().item():.4g}, argmax agrees on {same:.1%} of positions"


def unfused_runner(graph):
    """ids -> logits on the default route without its elementwise fusions (surgery.decode.fusions; on
    by default, compiled.FUSED_BY_DEFAULT): what the fusions save."""
    fast = own_route(graph, "graph without fusions", fused=False)
    return lambda ids: run_graph(graph, ids, fast)


def applied_default(s: Setup, rows: Rows, ids: torch.Tensor, config: str, saved_ms: float) -> None:
    """The `surgery apply` hybrid on the default path, anchored to the surgery.save one's time."""
    if ids.shape[1] > s.applied.max_length:
        rows.note(f"surgery apply's hybrid: skipped at {config} (its position limit is {s.applied.max_length}; `surgery apply` has no --max-length)")
        return
    ms = median_ms(lambda: fast_logits(s.applied, ids), s.device, s.args.repeats, warmup=3)
    rows.add(f"{s.label()}: surgery apply -> surgery.load, fast_logits (default)", config, "prefill", ms, "ms", ("surgery.save -> load", saved_ms))


def top_kernels(fn, device: torch.device, label: str, top: int = 15) -> None:
    """torch.profiler on one call of fn (already warm): the `top` CUDA kernels by total time (on the
    CPU: the top ops by self time), printed as name | calls | ms."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        fn()
        sync(device)
    if cuda:
        events = [e for e in prof.key_averages() if getattr(e, "device_type", None) == DeviceType.CUDA]
        total = lambda e: e.self_device_time_total  # noqa: E731  (a kernel's own time: microseconds)
    else:
        events, total = list(prof.key_averages()), lambda e: e.self_cpu_time_total  # noqa: E731
    events.sort(key=total, reverse=True)
    all_ms = sum(total(e) for e in events) / 1000
    print(f"\n{label}: top {top} {'CUDA kernels' if cuda else 'CPU ops'} of {len(events)}, {sum(e.count for e in events)} calls, "
          f"{all_ms:.2f} ms in all\n"
          "| kernel | calls | ms |\n|---|---:|---:|", flush=True)
    for e in events[:top]:
        print(f"| {e.key[:120]} | {e.count} | {total(e) / 1000:.3f} |", flush=True)


def decoder_of(graph, compile_flag: str, fuse: bool | None = None) -> Decoder:
    """A Decoder as `surgery generate` builds one; if its self-check refuses (bf16 rounding of random
    weights can exceed its tolerance), one without the check: speed does not depend on it."""
    flag = {"on": True, "off": False, "default": None}[compile_flag]
    try:
        return Decoder(graph, compile=flag, fuse_elementwise=fuse)
    except SurgeryError as exc:
        print(f"# Decoder self-check refused ({str(exc).splitlines()[0]}); timing without it", flush=True)
        return Decoder(graph, verify=False, compile=flag, fuse_elementwise=fuse)


def time_to_first_token(s: Setup, rows: Rows) -> None:
    a = s.args
    decoder = decoder_of(s.hybrid, "default")
    for length in (int(x) for x in a.generate_lengths.split(",")):
        ids = s.ids(1, length)
        prompt = ids[0].tolist()  # token ids as `surgery generate` hands them over
        with torch.no_grad():
            hf = median_ms(lambda: s.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                                                    pad_token_id=0), s.device, a.repeats, warmup=1)
            rows.add("transformers generate (teacher)", f"prompt {length}", "time to first token", hf, "ms")
            ours = median_ms(lambda: generate(decoder, [prompt], 1, eos_token_id=None), s.device, a.repeats, warmup=1)
            rows.add(f"{s.label()}: surgery.generate (surgery.load)", f"prompt {length}", "time to first token", ours, "ms",
                     ("transformers", hf))
        del ids
        free(s.device)


class Stamps:
    """A transformers logits processor that records when each generation step reaches it (synchronised)."""

    def __init__(self, device):
        self.device, self.times = device, []

    def __call__(self, input_ids, scores):
        sync(self.device)
        self.times.append(time.perf_counter())
        return scores


def hf_generate(model, ids, new_tokens: int) -> tuple[float, float]:
    """transformers' generate: (prefill ms = start to the first step's logits, ms per decode step after it)."""
    from transformers import LogitsProcessorList

    stamps = Stamps(ids.device)
    with torch.no_grad():
        sync(ids.device)
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([stamps]))
        sync(ids.device)
        end = time.perf_counter()
    t = stamps.times
    return 1000 * (t[0] - start), 1000 * (end - t[0]) / max(len(t) - 1, 1)


def host_profile(fn, label: str, top: int = 25) -> None:
    """cProfile on one call of fn: the `top` functions by own time, printed as name | calls | ms (where
    a host-bound decode spends its Python time)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(fn)
    stats = pstats.Stats(profiler).stats
    rows = sorted(((tt, nc, f"{Path(f).name}:{line} {name}") for (f, line, name), (_, nc, tt, _, _) in stats.items()), reverse=True)
    print(f"\n{label}: host profile, top {top} functions by own time of {sum(r[0] for r in rows) * 1000:.1f} ms\n"
          "| function | calls | ms |\n|---|---:|---:|", flush=True)
    for tt, nc, name in rows[:top]:
        print(f"| {name[:120]} | {nc} | {tt * 1000:.2f} |", flush=True)


def step_positions(args) -> int:
    """Cache positions a timed decode takes past its prompt: the warm-up's steps (at most WARM_STEPS of
    harness.WARM_SECONDS), the timed ones and a margin."""
    return 3 + WARM_STEPS + args.decode_steps + 8


def prefilled(s: Setup, decoder: Decoder, batch: int, ids: torch.Tensor) -> Decoder:
    """decoder reset for the prompt and the timed steps, the prompt prefilled in pieces whose logits fit."""
    decoder.reset(batch, ids.shape[1] + step_positions(s.args))
    chunk = max(256, LOGITS_BUDGET // (batch * s.vocab * 2))
    with torch.no_grad():
        for start in range(0, ids.shape[1], chunk):
            decoder.prefill(ids[:, start:start + chunk])
    return decoder


def decoder_step_ms(s: Setup, graph, batch: int, ids: torch.Tensor, fuse: bool | None = None, state: dict | None = None) -> float:
    """ms of one Decoder.step at the prompt's length; `state`, if given, gets the Decoder's cache bytes
    at that length ("total")."""
    a = s.args
    decoder = prefilled(s, decoder_of(graph, a.decode_compile, fuse), batch, ids)
    token = ids[:, :1]
    with torch.no_grad():
        ms = median_ms(lambda: decoder.step(token), s.device, a.decode_steps, warmup=3, warm_calls=WARM_STEPS)
    if state is not None:
        state.update(decoder.cache_bytes())
    decoder.reset()
    return ms


def decode(s: Setup, rows: Rows) -> None:
    a = s.args
    for batch in (int(x) for x in a.decode_batches.split(",")):
        ids, config = s.ids(batch, a.decode_context), f"context {a.decode_context} x {batch}, compile {a.decode_compile}"
        hf_generate(s.model, ids[:, :256], 4)  # warm-up: this batch's kernels chosen before the timed run
        hf = hf_generate(s.model, ids, a.decode_steps)[1]
        rows.add("transformers generate (teacher)", config, "decode step", hf, "ms")
        free(s.device)
        teacher_state = {}
        teacher = decoder_step_ms(s, s.teacher, batch, ids, state=teacher_state)
        rows.add("teacher graph: Decoder", config, "decode step", teacher, "ms", ("transformers", hf))
        free(s.device)
        hybrid = decoder_step_ms(s, s.hybrid, batch, ids)
        rows.add(f"{s.label()}: Decoder (surgery.load)", config, "decode step", hybrid, "ms", ("teacher Decoder", teacher))
        rows.add(f"{s.label()}: Decoder (surgery.load)", config, "decode step", hybrid, "ms", ("transformers", hf))
        free(s.device)
        for settings in switch_settings(a.decode_off):  # the hybrid with other kernel choices, in the same process
            with env_settings(settings):
                switched = decoder_step_ms(s, s.hybrid, batch, ids)
            rows.add(f"{s.label()}: Decoder, {settings_label(settings)}", config, "decode step", switched, "ms", ("default", hybrid))
            rows.add(f"{s.label()}: Decoder, {settings_label(settings)}", config, "decode step", switched, "ms", ("teacher Decoder", teacher))
            free(s.device)
        if batch <= STEP_ROWS and s.device.type == "cuda":  # the one-kernel GDN layers (surgery.decode.gdn_blocks) against the eight
            with env_setting(BLOCKS_ENV, "off"), env_setting(TAIL_ENV, "off"):
                separate = decoder_step_ms(s, s.hybrid, batch, ids)
            rows.add(f"{s.label()}: Decoder, {BLOCKS_ENV}=off {TAIL_ENV}=off", config, "decode step", separate, "ms", ("default", hybrid))
            free(s.device)
        if STEP_ROWS < batch <= TAIL_ROWS and s.device.type == "cuda":  # the GDN layers' tail kernel (surgery.decode.gdn_tail) against none
            with env_setting(TAIL_ENV, "off"):
                composed = decoder_step_ms(s, s.hybrid, batch, ids)
            rows.add(f"{s.label()}: Decoder, {TAIL_ENV}=off", config, "decode step", composed, "ms", ("default", hybrid))
            rows.add(f"{s.label()}: Decoder, {TAIL_ENV}=off", config, "decode step", composed, "ms", ("teacher Decoder", teacher))
            free(s.device)
        if s.device.type == "cuda":  # the few-row linears (surgery.decode.row_linear) against cuBLAS's, both models
            row_linear_off(s, rows, batch, ids, config, teacher, hybrid)
        if a.profile:
            for label, graph in (("teacher graph", s.teacher), (s.label(), s.hybrid)):
                step_profile(s, graph, batch, ids, f"{label}: {PROFILED_STEPS} static decode steps (not replayed), {config}")
        for label, graph, anchor in (("teacher graph", s.teacher, teacher), (s.label(), s.hybrid, hybrid)):  # what the fusions save
            unfused = decoder_step_ms(s, graph, batch, ids, fuse=False)
            rows.add(f"{label}: Decoder without the fusions", config, "decode step", unfused, "ms", ("default", anchor))
            free(s.device)
        mixer_decode(s, rows, batch, ids, config, teacher, teacher_state["total"])
        del ids
        free(s.device)


def row_linear_off(s: Setup, rows: Rows, batch: int, ids: torch.Tensor, config: str, teacher: float, hybrid: float) -> None:
    """The teacher's and the hybrid's Decoder with every linear on cuBLAS (ROW_LINEAR_ENV=off)."""
    with env_setting(ROW_LINEAR_ENV, "off"):
        t_off = decoder_step_ms(s, s.teacher, batch, ids)
        free(s.device)
        h_off = decoder_step_ms(s, s.hybrid, batch, ids)
        free(s.device)
    rows.add(f"teacher graph: Decoder, {ROW_LINEAR_ENV}=off", config, "decode step", t_off, "ms", ("default", teacher))
    rows.add(f"{s.label()}: Decoder, {ROW_LINEAR_ENV}=off", config, "decode step", h_off, "ms", ("default", hybrid))
    rows.add(f"{s.label()}: Decoder, {ROW_LINEAR_ENV}=off", config, "decode step", h_off, "ms", (f"teacher, {ROW_LINEAR_ENV}=off", t_off))


PROFILED_STEPS = 4


def step_profile(s: Setup, graph, batch: int, ids: torch.Tensor, label: str) -> None:
    """--profile: the kernels of a few static steps run without the CUDA graph (the profiler sees each
    launch; a replay runs the same kernels back to back): calls / PROFILED_STEPS is the launches per step."""
    decoder = prefilled(s, Decoder(graph, verify=False, step_mode="static", compile=False), batch, ids)
    token = ids[:, :1]
    with torch.no_grad():
        for _ in range(3):
            decoder.step(token)  # warm: kernels compiled, tables and fused weights built
        top_kernels(lambda: [decoder.step(token) for _ in range(PROFILED_STEPS)], s.device, label, top=25)
    decoder.reset()
    free(s.device)


def mixer_decode(s: Setup, rows: Rows, batch: int, ids: torch.Tensor, config: str, teacher_ms: float, teacher_bytes: int) -> None:
    """--decode-mixers: the same hybrid with each other replace.mixer (issue 31): its Decoder step and
    the bytes its caches hold at the context, against the teacher's (KV cache) and its step."""
    if not s.args.decode_mixers:
        return
    for mixer in s.args.decode_mixers.split(","):
        graph, state = s.hybrid_of(mixer), {}
        ms = decoder_step_ms(s, graph, batch, ids, state=state)
        label = f"hybrid {100 - 100 * s.args.keep_ratio:.0f}% {mixer}"
        rows.add(f"{label}: Decoder (surgery.load)", config, "decode step", ms, "ms", ("teacher Decoder", teacher_ms))
        rows.add(f"{label}: Decoder caches", config, "cache bytes", state["total"] / 2**30, "GiB", ("teacher", teacher_bytes / 2**30))
        del graph
        free(s.device)


def exported(s: Setup, rows: Rows) -> None:
    """The hf export in transformers' own generate against the teacher there, at each context."""
    from transformers import AutoModelForCausalLM

    a = s.args
    folder = export(s.hybrid, s.work / "export", format="hf", force=True)
    model = AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=True, dtype=s.dtype).to(s.device).eval()
    model.generation_config.max_length = None
    for context in (int(x) for x in a.export_contexts.split(",")):
        ids, config = s.ids(1, context), f"prompt {context}, {a.new_tokens} new"
        results = {}
        # the export as users get it (its converted layers' one-token CUDA graphs on), then with them off
        for label, m, graphs in (("teacher", s.model, None), ("export", model, True), ("export, layer graphs off", model, False)):
            if graphs is not None:
                m.surgery_step_graphs.enabled = graphs
            hf_generate(m, ids, 3)  # warm-up at this shape: kernels compile and autotune, layer graphs are captured and checked
            runs = [hf_generate(m, ids, a.new_tokens) for _ in range(max(1, a.repeats // 2))]
            results[label] = (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs))
            if a.profile and label != "export, layer graphs off":
                host_profile(lambda: hf_generate(m, ids, a.new_tokens), f"{label}: transformers generate, {config}")
            free(s.device)
        model.surgery_step_graphs.enabled = True
        teacher_prefill, teacher_step = results["teacher"]
        rows.add("teacher, transformers generate", config, "prefill", teacher_prefill, "ms")
        rows.add("teacher, transformers generate", config, "decode", 1000 / teacher_step, "tokens/s")
        for label in ("export", "export, layer graphs off"):
            name = f"{s.label()}: hf {label}, transformers generate"
            rows.add(name, config, "prefill", results[label][0], "ms", ("teacher", teacher_prefill))
            rows.add(name, config, "decode", 1000 / results[label][1], "tokens/s", ("teacher", 1000 / teacher_step))
        del ids
    del model
    free(s.device)


def steady_tokens_per_s(run_dir: Path, skip: int) -> float | None:
    """Median tokens/s of the logged steps after the first `skip` (compiling and warm-up left out)."""
    records = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines() if line.strip()]
    rates = [r["tokens_per_s"] for r in records if r.get("tokens_per_s")][skip:]
    return statistics.median(rates) if rates else None


def distillation(s: Setup, rows: Rows) -> None:
    """surgery.distill (stage kl) of the 50% hybrid for --distill-steps steps, eager and compiled."""
    a = s.args
    batch, seq_len = pairs(a.distill_shape)[0]
    config_text, eager = f"{batch} x {seq_len}, {a.distill_steps} steps", None
    for mode in a.distill_modes.split(","):
        student = s.teacher.branch()
        PassManager(["select", "replace"], {"select": {"keep_ratio": 0.5}})(student)
        student.gm.float()
        config = DistillConfig(tokens=a.distill_steps * seq_len * batch, seq_len=seq_len, global_batch=batch, warmup=0.0,
                               compile=mode == "compiled")
        run = s.work / f"distill_{mode}"
        distill(student, [str(SAMPLE)], run, config, teacher=s.teacher, device=s.device, progress=False)
        rate = steady_tokens_per_s(run, skip=min(3, a.distill_steps - 2))
        rows.add("hybrid 50% GDN: surgery.distill", f"{config_text}, {mode}", "training", rate, "tokens/s",
                 ("eager", eager) if mode != "eager" and eager else None)
        eager = rate if mode == "eager" else eager
        del student
        torch._dynamo.reset()
        free(s.device)


def apply_wall(args, work: Path, rows: Rows) -> None:
    """`surgery apply` (README's defaults and --apply-args) with every kernel and token cache empty,
    then the same command again with the caches the first run filled."""
    if not args.model:
        rows.note("apply: skipped (it needs --model: a teacher file the CLI reads)")
        return
    env = {variable: str(work / "caches" / variable.lower()) for variable in COLD_CACHES}
    command = ["apply", "--model", args.model, "--out", str(work / "applied"), "--force", *shlex.split(args.apply_args)]
    if args.device:
        command += ["--device", args.device]
    cold = surgery_cli(*command, env=env)["seconds"]
    rows.add("surgery apply", "empty caches (cold)", "wall", cold, "s")
    warm = surgery_cli(*command, env=env)["seconds"]
    rows.add("surgery apply", "caches filled (warm)", "wall", warm, "s")
    rows.add("surgery apply", "cold against warm", "wall", cold, "s", ("warm", warm))


def fsdp_teacher(shape: str, device: torch.device, seq_len: int):
    """The fsdp section's teacher graph: stories260K, or a random-weight Llama of FSDP_SHAPES built on
    the device in its dtype (an 8B one would take 32 GB of float32 on the CPU first)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if shape == "stories":
        return capture(STORIES, device=device, dtype=dtype, max_length=seq_len)
    torch.manual_seed(0)
    with torch.device(device):
        config = LlamaConfig(**(FSDP_SHAPES[shape] | {"max_position_embeddings": seq_len}))
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
    graph = capture(model, device=device, dtype=dtype, max_length=seq_len)
    from surgery.core.load import load_model
    graph.tokenizer = load_model(str(STORIES))[1]  # ids below 512: any vocabulary takes them
    return graph


def fsdp_one(spec: dict) -> dict:
    """One fsdp row in this process: build the pair, distill, measure (the child of fsdp_section)."""
    from unittest import mock

    from surgery.train.trainer import Trainer

    with mock.patch.object(Trainer, "save", lambda self, *a, **k: None):  # training measured, not checkpoint writes
        return measured_fsdp_row(spec)


def measured_fsdp_row(spec: dict) -> dict:
    device = local_device()  # cuda:LOCAL_RANK under torchrun, as distill's own placement
    out = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "rank": int(os.environ.get("RANK", "0"))}
    start = time.perf_counter()
    teacher = fsdp_teacher(spec["shape"], device, spec["seq_len"])
    student = teacher.branch()
    PassManager(["select", "replace"], {"select": {"keep_ratio": spec["keep_ratio"]}})(student)
    student.gm.float()
    out["build_s"] = round(time.perf_counter() - start, 1)
    if device.type == "cuda":
        torch.cuda.synchronize()
        out["resident_gib"] = torch.cuda.memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
    batch, seq_len, mode = spec["batch"], spec["seq_len"], spec["mode"]
    config = DistillConfig(tokens=spec["steps"] * batch * seq_len, stage="kl", seq_len=seq_len, global_batch=batch, micro_batch=spec["micro"],
                           warmup=0.0, compile=False, lr_kl_rest=spec["lr_rest"], grad_checkpoint=spec["checkpoint"],
                           fsdp=mode != "plain", fsdp_offload=mode == "fsdp_offload", fsdp_teacher=mode == "fsdp_teacher")
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        try:
            result = distill(student, [str(SAMPLE)], Path(folder) / "run", config, teacher=teacher, device=device, progress=True,
                             release_teacher=True)
            if result["rank"] == 0:  # rank 0 logs the steps (tokens/s of the global batch)
                out.update(tokens_per_s=steady_tokens_per_s(Path(folder) / "run", skip=1), tokens_per_s_all=result["tokens_per_s"], loss=result["loss"],
                           world=result["world"])
        except (SurgeryError, torch.OutOfMemoryError) as exc:
            out["oom" if "memory" in str(exc).lower() else "error"] = str(exc).splitlines()[0][:300]
        out["train_s"] = round(time.perf_counter() - start, 1)
    if device.type == "cuda":
        out["peak_alloc_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return out


def fsdp_child(args, spec: dict) -> dict:
    """fsdp_one in a process of its own (its peak memory is its own; an out-of-memory kill ends only it),
    or in spec["procs"] processes under torchrun (rank 0's row, with each peak the largest of any rank).
    Its stderr (capture, kernel autotuning, distill's step lines) passes through as it comes, so a row
    that runs out of --fsdp-timeout still shows where its time went (an 8B row printed nothing in 290 s
    when the child's stderr was held until it ended); a timeout kills the child's whole session, so no
    torchrun worker outlives it."""
    script = [str(Path(__file__).resolve()), "--sections", "fsdp", "--fsdp-one", json.dumps(spec)]
    procs = spec.get("procs", 1)
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs)] if procs > 1 else []
    print(f"fsdp: {spec['mode']}, batch {spec['batch']}, {procs} process(es): at most {args.fsdp_timeout:g} s", file=sys.stderr, flush=True)
    with subprocess.Popen([sys.executable, *launcher, *script], stdout=subprocess.PIPE, text=True, start_new_session=True) as child:
        try:
            stdout = child.communicate(timeout=args.fsdp_timeout)[0]
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.communicate()
            return {"error": f"timed out after {args.fsdp_timeout:g} s (its stderr above)"}
    ranks = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    if len(ranks) < procs:
        return {"error": f"exit {child.returncode}: {len(ranks)} of {procs} processes reported (their stderr above)"}
    return merged_ranks(ranks)


def merged_ranks(ranks: list[dict]) -> dict:
    """Rank 0's row (the global batch's tokens/s), each peak memory the largest of any rank, and any
    rank's out-of-memory or error."""
    row = dict(next(r for r in ranks if r.get("rank", 0) == 0))
    for key in ("peak_alloc_gib", "peak_reserved_gib", "peak_rss_gib"):
        if any(key in r for r in ranks):
            row[key] = max(r[key] for r in ranks if key in r)
    for key in ("oom", "error"):
        found = [r[key] for r in ranks if key in r]
        if found:
            row.setdefault(key, found[0])
    return row


def fsdp_section(args, rows: Rows) -> None:
    """Per process count, each mode (plain first: the anchor) at each batch, ascending, until one does
    not fit; then the mode's largest batch that fit, anchored to plain's. On more processes than the
    first count, a row's anchor is the same mode and batch on the first count (the scaling)."""
    modes = sorted(args.fsdp_modes.split(","), key=lambda m: m != "plain")
    batches = sorted(int(b) for b in args.fsdp_batches.split(","))
    counts = sorted(int(p) for p in args.fsdp_procs.split(","))
    name = f"{args.fsdp_shape} pair, keep {args.keep_ratio:g}: surgery.distill"
    first = {}  # (mode, batch) -> the row on counts[0] processes
    for procs in counts:
        on = "" if procs == 1 else f" on {procs} processes"
        plain, largest = {}, {}
        for mode in modes:
            for batch in batches:
                spec = {"mode": mode, "batch": batch, "shape": args.fsdp_shape, "keep_ratio": args.keep_ratio, "seq_len": args.fsdp_seq_len,
                        "micro": args.fsdp_micro, "steps": args.fsdp_steps, "lr_rest": args.fsdp_lr_rest, "checkpoint": args.fsdp_checkpoint,
                        "procs": procs}
                got = fsdp_child(args, spec)
                config, base = f"{mode}{on}, {batch} x {args.fsdp_seq_len}", plain.get(batch, {})
                if procs == counts[0]:
                    first[mode, batch] = got
                    anchor = lambda key: ("plain", base[key]) if mode != "plain" and base.get(key) else None  # noqa: E731
                else:
                    one, label = first.get((mode, batch), {}), f"{counts[0]} process(es)"
                    anchor = lambda key: (label, one[key]) if one.get(key) else None  # noqa: E731
                rows.add(name, config, "training", got.get("tokens_per_s"), "tokens/s", anchor("tokens_per_s"), **spec, **got)
                if "peak_alloc_gib" in got:
                    rows.add(name, config, "peak GPU memory (allocated)", got["peak_alloc_gib"], "GiB", anchor("peak_alloc_gib"))
                if "peak_rss_gib" in got:
                    rows.add(name, config, "peak CPU memory (RSS)", got["peak_rss_gib"], "GiB", anchor("peak_rss_gib"))
                plain[batch] = got if mode == "plain" else base
                if got.get("tokens_per_s") is None:
                    break  # a larger batch will not fit either
                largest[mode] = batch
            anchor = ("plain", largest["plain"]) if mode != "plain" and largest.get("plain") else None
            rows.add(name, f"{mode}{on}, batches {args.fsdp_batches} x {args.fsdp_seq_len}", "largest batch that fits", largest.get(mode),
                     "sequences", anchor)
# ---- offload (issue 32): a teacher larger than one device, converted layer by layer -------------------

def offloaded_conversion(args, rows: Rows) -> None:
    """Capture on meta and convert every one of --offload-layers layers of a random teacher of
    --offload-shape, its weights drawn on the device a layer at a time (RandomWeights: no files).
    Peak memory on each device (CUDA: the allocator's peak; the CPU: bytes of tensors alive, LiveTensors)
    against the whole teacher at its real depth in the same dtype."""
    from transformers import LlamaConfig

    from surgery.core.live_tensors import LiveTensors
    from surgery.core.load import load_model
    from surgery.core.meta_capture import capture_meta, meta_model_of
    from surgery.core.weight_files import RandomWeights
    from surgery.sites import find_sites

    device, dtype = placement(args)
    hidden, inter, heads, kv, vocab, depth = (int(x) for x in args.offload_shape.split("x"))
    samples, length = (int(x) for x in args.offload_text.split("x"))
    shape = dict(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                 max_position_embeddings=max(length, 8192), rope_theta=500000.0, tie_word_embeddings=False)
    whole = RandomWeights(meta_model_of(LlamaConfig(**shape, num_hidden_layers=depth))).nbytes(dtype)
    model = meta_model_of(LlamaConfig(**shape, num_hidden_layers=args.offload_layers))
    label = f"Llama {args.offload_shape}, {args.offload_layers} layers, {str(dtype).removeprefix('torch.')}"
    live = LiveTensors() if device.type == "cpu" else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    weights = RandomWeights(model)
    if live is not None:
        weights.load = lambda *a, read=weights.load, **k: live.track(read(*a, **k))
        live.__enter__()
    try:
        start = time.perf_counter()
        graph = capture_meta(model, weights, device=device, dtype=dtype, max_length=max(length, 64))
        graph.sites = find_sites(graph)
        rows.add("offloaded conversion", label, "capture on meta + sites", time.perf_counter() - start, "s")
        peaks = {"capture + sites": peak_bytes(device, live)}  # the teacher alone: a layer (or the embedding) at a time
        graph.tokenizer = load_model(str(STORIES))[1]  # random weights have no tokenizer; stories260K's ids fit the vocabulary
        text = {"samples": samples, "length": length, "batch_size": 4}
        results = PassManager(["select", "replace", "calibrate", "align"], {
            "select": {"policy": "convert", "layers": list(range(args.offload_layers))}, "calibrate": text,
            "align": {**text, "steps": args.offload_steps, "progress": False}})(graph)
    finally:
        if live is not None:
            live.__exit__(None, None, None)
    for name in ("calibrate", "align"):
        rows.add("offloaded conversion", label, f"{name} per layer", results.info[name]["seconds"] / args.offload_layers, "s")
    peaks["select .. align"] = peak_bytes(device, live)  # plus the GDN layers, their teacher data and align's optimizer
    for phase, peak in peaks.items():
        rows.add("offloaded conversion", label, f"peak memory on {device}, {phase}", peak / 2**30, "GiB",
                 (f"whole {depth}-layer teacher's weights", whole / 2**30))


def peak_bytes(device, live) -> int:
    """The peak since the last call (CUDA: the allocator's; the CPU: LiveTensors'), then reset."""
    if live is not None:
        peak, live.peak = live.peak, live.now
        return peak
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    return peak


def main(argv=None) -> Rows:
    args = arguments(argv)
    if args.fsdp_one:
        row = json.dumps(fsdp_one(json.loads(args.fsdp_one))) + "\n"  # one write: torchrun's workers share the pipe, and print
        sys.stdout.write(row)                                             # writes the newline apart (two rows on one line, seen in CI)
        sys.stdout.flush()
        return Rows()
    rows = Rows(args.json)
    sections = args.sections.split(",")
    with tempfile.TemporaryDirectory(prefix="bench_speed.") as folder:
        work = Path(folder)
        runs = {"prefill": prefill, "generate": time_to_first_token, "decode": decode, "export": exported, "distill": distillation,
                "host": host_cost}
        setup = Setup(args, work) if set(sections) & set(runs) else None
        for section in sections:
            start = time.perf_counter()
            if section == "apply":
                apply_wall(args, work, rows)
            elif section == "offload":
                offloaded_conversion(args, rows)
            elif section == "fsdp":
                fsdp_section(args, rows)
            elif section == "step_attention":  # the kept-attention op of a static step alone: needs only torch and Triton
                from bench.step_attention_bench import run as step_attention
                step_attention(args.decode_context, args.decode_batches, sweep_constants=args.step_attention_sweep)
            elif section == "floors":  # one kernel's cost in a CUDA graph at decode shapes: needs only torch and Triton
                from bench.kernel_floors import run as kernel_floors
                kernel_floors(rows)
            elif section == "state_splits":  # the GDN chunk forward's state pass cut along the sequence: torch, Triton, fla
                from bench.state_splits_bench import run as state_splits
                state_splits(rows, args.split_shapes)
            elif section == "registers":  # tcal's GDN prefill kernels compiled for sm_90a: needs Triton, no GPU
                from bench.kernel_registers import run as kernel_registers
                kernel_registers(rows, pdl=args.registers_pdl)
            elif section == "gdn_forward":  # fla's GDN forward stage by stage under each launch config of a sweep
                from bench.gdn_forward_bench import run as gdn_forward
                gdn_forward(rows, args.split_shapes, args.gdn_forward_stages, sweep=not args.gdn_forward_shipped)
            else:
                runs[section](setup, rows)
            print(f"# {section}: {time.perf_counter() - start:.1f} s", flush=True)
    return rows


if __name__ == "__main__":
    main()
