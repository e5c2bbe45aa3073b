"""Quality tables: perplexity of hybrids built by chosen passes, each row scored in memory AND through
the user's path (surgery.save -> `surgery eval`), since a figure counts only through that path.

One teacher capture; for each keep ratio, selection policy and row, a fresh branch runs the row's
passes (ROWS: the ablation of Taylor-Calibrate's phases; --policies: uniform, ar, greedy selection).
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
from surgery import PassManager, capture, save  # noqa: E402
from surgery.core.pipeline import parse_options  # noqa: E402
from surgery.data.cache import text_ids  # noqa: E402
from surgery.eval.perplexity import perplexity  # noqa: E402
from surgery.passes.kv_budget import kv_report  # noqa: E402
from surgery.passes.select import Select  # noqa: E402

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
SMOKE = {"rows": "baseline,phase1,phase1+2", "chunk": 128, "max_chars": 6000, "keep_ratios": "0.5",
         "set": ["align.steps=2", "calibrate.samples=2", "align.samples=2", "calibrate.length=64", "align.length=64"]}


def arguments(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_args(ap)
    ap.add_argument("--calibration", nargs="+", default=None, help="calibration text files (default: the built-in sample)")
    ap.add_argument("--eval", default=None, help="the evaluation text (WikiText-2 test)")
    ap.add_argument("--held-out", default=None, help="a second evaluation text, not among --calibration")
    ap.add_argument("--held-out-chars", type=int, default=0, help="score only the held-out file's first N characters (0: all)")
    ap.add_argument("--max-chars", type=int, default=0, help="score only the eval file's first N characters (0: all)")
    ap.add_argument("--rows", default="baseline,zero-gate,phase1-ref,phase1,phase2,phase1+2", help=f"of: {','.join(ROWS)}")
    ap.add_argument("--keep-ratios", default="0.5")
    ap.add_argument("--policies", default="uniform", help="select policies: uniform, ar, greedy; head:distance, head:entropy, head:output keep KV "
                    "heads instead of layers (select.granularity=head) up to the KV bytes uniform keeps at the same ratio")
    ap.add_argument("--set", nargs="*", default=[], help="pass.key=value for every row that runs the pass")
    ap.add_argument("--cli-apply", action="store_true", help="also `surgery apply` (default passes at the first keep ratio, --set) "
                    "-> `surgery eval`, anchored to the phase1+2 row built in memory")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=1)
    args = parse(ap, argv, {"model": str(STORIES), "eval": str(SAMPLE), **SMOKE})
    if not args.model or not args.eval:
        ap.error("pass --model (the teacher) and --eval (the text to score), or --smoke")
    check_names(ap, args.rows, ROWS, "row(s)")
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

    def through_cli(self, model: str, name: str, config: str, memory: dict, path: str) -> None:
        for label, text in self.texts.items():
            got = self.cli_eval(model, text)
            anchor = ("in memory", memory[label]) if label in memory else None
            self.rows.add(name, config, f"{label} ppl, {path}", got["perplexity"], "ppl", anchor, tokens=got["tokens"])

    def through_save(self, graph, name: str, config: str, memory: dict) -> None:
        folder = self.work / "saved"
        save(graph, folder, force=True)
        self.through_cli(str(folder), name, config, memory, "surgery.save -> surgery eval")


def row_configs(args, row: str, ratio: float, policy: str, kv_bytes: int | None = None) -> tuple[list[str], dict]:
    """The row's passes and their options: the row's own, the calibration text, then --set. A "head:"
    policy keeps KV heads by that score up to kv_bytes (the KV cache uniform layer selection keeps at ratio)."""
    passes, base = ROWS[row]
    configs = {name: dict(base.get(name, {})) for name in passes}
    granularity, _, named = policy.rpartition(":")
    configs["select"] |= {"keep_ratio": ratio, "policy": named} | ({"granularity": granularity, "kv_bytes": kv_bytes} if granularity else {})
    for name in [*TEXT_PASSES, "select"]:
        if name in passes and args.calibration and (name != "select" or policy != "uniform"):
            configs[name]["calibration"] = args.calibration
    overrides = parse_options(args.set)
    return passes, {name: options | overrides.get(name, {}) for name, options in configs.items()}


def ablation(args, teacher, scorer: Scorer) -> dict:
    """Every (keep ratio, policy, row); returns the in-memory figures of each phase1+2 row."""
    full = {}
    for ratio in (float(r) for r in args.keep_ratios.split(",")):
        for policy in args.policies.split(","):
            config, baseline = f"keep {ratio:.2f}, {policy}", {}
            for row in args.rows.split(","):
                layers = Select(keep_ratio=ratio).decide(teacher.num_layers)  # per-head rows: this selection's KV bytes
                passes, configs = row_configs(args, row, ratio, policy, kv_report(teacher, layers)["kv_bytes"])
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
                baseline = got if row == "baseline" else baseline
                full[config] = got if row == "phase1+2" else full.get(config)
                scorer.through_save(graph, row, config, got)
                del graph
                if teacher.device.type == "cuda":
                    torch.cuda.empty_cache()
    return full


def main(argv=None) -> Rows:
    args = arguments(argv)
    device, dtype = placement(args)
    rows = Rows(args.json)
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
        full = ablation(args, teacher, scorer)
        if args.cli_apply:
            sets = [x for option in args.set for x in ("--set", option)]
            calibration = ["--calibration", *args.calibration] if args.calibration else []
            applied, ratio = work / "applied", float(args.keep_ratios.split(",")[0])
            surgery_cli("apply", "--model", args.model, "--out", str(applied), "--force", "--dtype", scorer.dtype, "--keep-ratio", str(ratio),
                        *sets, *calibration, *(["--device", args.device] if args.device else []))
            reference = full.get(f"keep {ratio:.2f}, uniform") or {}  # its anchor: the phase1+2 row built in memory
            scorer.through_cli(str(applied), "phase1+2", f"keep {ratio:.2f}, uniform", reference, "surgery apply -> surgery eval")
    return rows


if __name__ == "__main__":
    main()
