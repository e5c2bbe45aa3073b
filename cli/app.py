"""`surgery ...`: parse, call the library, render. Nothing here a Python user could not reach."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import List, Optional

import typer
from rich.table import Table

from surgery.errors import SurgeryError
from surgery.eval.retrieval import TASKS as RETRIEVAL, retrieval_task
from surgery.io import open_model

from surgery.core import progress

from .common import check_device_fits, emit_json, err, guard, model_inputs, more_files, out, placement, choose_offload
from .distill import distill as distill_command
from .export import export as export_command
from .generate import generate as generate_command
from .help import HELP_OPTIONS, Command, Group, examples
from .quiet import quiet_libraries
from .results import render_pass_result, render_passes
from .layer_table import export_info, layer_info, layer_table
from .verify import describe as describe_export, render as render_export, verify_export as verify_command
from .options import CompileOpt, DebugOpt, DeviceOpt, DtypeOpt, JsonOpt, ModelOpt

app = typer.Typer(cls=Group, add_completion=False, no_args_is_help=True, context_settings=HELP_OPTIONS,
                  help="Convert softmax attention to Gated DeltaNet, Taylor-Calibrated.\n\n"
                       "Progress of every long step goes to stderr (a bar on a terminal, a line every 10 s or 5% otherwise); "
                       "--json puts the result alone on stdout.",
                  epilog=examples("surgery inspect -m smollm2", "surgery apply -m smollm2 -o out/hybrid",
                                  "surgery eval -m out/hybrid --text wiki.test.raw", "surgery generate -m out/hybrid -p 'Once upon a time'"))


def command(*names, **settings):
    """app.command with surgery's help (cli/help.py: -h, flags without <bool>)."""
    return app.command(*names, cls=Command, **settings)


def show_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        print(f"surgery {version('surgery')}")
        raise typer.Exit()


@app.callback()
def start(version: bool = typer.Option(False, "--version", help="Print surgery's version and exit.", callback=show_version, is_eager=True),
          verbose: bool = typer.Option(False, "--verbose", help="Show torch's and transformers' warnings and messages too (hidden by default).")):
    """Once per command: library noise filtered (unless --verbose), progress set up on stderr (under
    torchrun from rank 0 only, as everything distill prints)."""
    quiet_libraries(verbose)
    progress.use(progress.auto(err) if int(os.environ.get("RANK", "0")) == 0 else progress.Reporter())


@command(epilog=examples("surgery inspect -m smollm2", "surgery inspect -m out/hybrid --json"))
def inspect(model: str = ModelOpt, as_json: bool = JsonOpt, debug: bool = DebugOpt,
            device: Optional[str] = DeviceOpt, dtype: Optional[str] = DtypeOpt):
    """Show the attention sites found in the model's graph (of an export: its verified manifest and layers)."""
    from surgery.io.export_manifest import is_export

    with guard(debug):
        model_inputs(model)
        dev, dt = placement(device or "cpu", dtype)
        if is_export(model):  # verified, then run by its own code: what its cache keeps per layer
            from surgery.io.exported import open_export

            info = export_info(open_export(model, device=dev, dtype=dt), describe_export(Path(model)))
            render_export(info, as_json)
        else:
            info = layer_info(open_model(model, device=dev, dtype=dt, debug=debug), model)
            if as_json:
                print(json.dumps(info, indent=1))
        if not as_json:
            out.print(layer_table(info))


@command(epilog=examples("surgery diff smollm2 out/hybrid", "surgery diff out/hybrid out/distilled --json"))
def diff(a: str = typer.Argument(..., help="Model or saved hybrid (before)."), b: str = typer.Argument(..., help="Model or saved hybrid (after)."),
         as_json: bool = JsonOpt, debug: bool = DebugOpt):
    """Per-layer differences between two models (e.g. a teacher and its saved hybrid); identical layers share a row."""
    from surgery import diff as graph_diff

    with guard(debug):
        model_inputs(a), model_inputs(b)  # both exist before either loads
        result = graph_diff(open_model(a, debug=debug), open_model(b, debug=debug))
        if as_json:
            print(json.dumps(result, indent=1))
            return
        render_diff(result, f"{a} -> {b}")


def render_diff(result: dict, title: str) -> None:
    """The diff as `surgery diff` and `surgery apply` print it: one row per group of identical layers."""
    table = Table(title=title, caption=f"parameters compared by {result['compared']} (~: changed)")
    for col in ("layers", "before", "after", "summary"):
        table.add_column(col, overflow="fold")
    for g in result["groups"]:
        table.add_row(g["label"], g["before"], g["after"], g["summary"])
    out.print(table)
    if result["unchanged_layers"]:
        from surgery.eval.diff import layer_ranges

        out.print(f"unchanged: {layer_ranges(result['unchanged_layers'])}")


def render_head_scores(info: dict) -> None:
    """select's per-KV-head scores (granularity head), best first."""
    kept = {(int(l), h) for l, heads in (info.get("kept_heads") or {}).items() for h in heads}
    table = Table(title=f"select {info['policy']} by KV heads on {info['tokens']:,} tokens", caption=info["metric"])
    for col in ("rank", "layer", "KV head", "score", "decision"):
        table.add_column(col, justify="right" if col != "decision" else "left")
    for r in sorted(info["scores"], key=lambda r: r["rank"]):
        keep = r["layer"] in info["keep"] or (r["layer"], r["kv_head"]) in kept
        table.add_row(str(r["rank"]), str(r["layer"]), str(r["kv_head"]), f"{r['score']:.4g}", "keep" if keep else "convert")
    out.print(table)


def render_scores(info: dict) -> None:
    """select's per-layer scores (ar, retrieval, greedy), best first."""
    if info.get("granularity") == "head":
        return render_head_scores(info)
    rows = sorted(info["scores"], key=lambda r: r["rank"])
    measured = [c for c in ("perplexity", "answer_nll", "increase") if c in rows[0]]
    table = Table(title=f"select {info['policy']} on {info['tokens']:,} tokens", caption=info["metric"])
    for col in ("rank", "layer", *measured, "decision"):
        table.add_column(col, justify="right" if col != "decision" else "left")
    for r in rows:
        table.add_row(str(r["rank"]), str(r["layer"]), *[f"{r[c]:.4g}" for c in measured],
                      "keep" if r["layer"] in info["keep"] else "convert")
    out.print(table)


def pass_names(passes: str) -> list[str]:
    """--passes as a list; a pass named twice is refused here (each pass runs once per pipeline)."""
    names = [p.strip() for p in passes.split(",") if p.strip()]
    twice = [n for n in dict.fromkeys(names) if names.count(n) > 1]
    if twice:
        raise SurgeryError(f"--passes names {', '.join(repr(n) for n in twice)} more than once ('{passes}').",
                           "Name each pass once, e.g. --passes select,replace,calibrate,align.")
    return names


def select_options(sel: dict, layers, keep_ratio, select_policy, keep_count, calibration) -> None:
    """apply's layer options into select's config; an empty --layers or a zero --keep-ratio (every
    layer converted) is refused rather than read as the default."""
    if layers is not None and select_policy:
        raise SurgeryError("--layers and --select-policy both choose the layers.", "Drop one of them.")
    if layers is not None and not [x for x in layers.split(",") if x.strip()]:
        raise SurgeryError(f"--layers '{layers}' names no layer.", "Name the layers to convert, e.g. --layers 1,3,5, or drop --layers for the default selection.")
    if keep_ratio == 0 and layers is None and keep_count is None:
        raise SurgeryError("--keep-ratio 0 keeps no attention layer: every layer would become GDN.",
                           "Use a ratio in (0, 1), e.g. --keep-ratio 0.25; to convert every layer on purpose, pass --keep-count 0.")
    if layers is not None:
        sel.update(policy="convert", layers=layers)
    elif keep_ratio is not None:
        sel.update(policy=select_policy or "uniform", keep_ratio=keep_ratio)
    elif select_policy:
        sel["policy"] = select_policy
    if keep_count is not None and layers is None:
        sel["keep_count"] = keep_count
    if calibration and sel.get("policy") in ("ar", "retrieval", "greedy"):
        sel["calibration"] = [str(p) for p in calibration]


DEFAULT_PASSES = "select,replace,calibrate,align"


@command(epilog=examples("surgery apply -m smollm2 -o out/hybrid",
                         "surgery apply -m smollm2 -o out/hybrid --keep-ratio 0.25 --calibration my_text.txt --set align.steps=300",
                         "surgery apply -m smollm2 -o out/copy-only --passes select,replace --layers 1,3 --json"))
def apply(
    model: str = ModelOpt,
    passes: str = typer.Option(DEFAULT_PASSES, "--passes", "-p", help="Comma-separated pass names, in order (see `surgery passes`)."),
    out_dir: Path = typer.Option(..., "--out", "-o", help="Directory for the hybrid (written atomically)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing --out."),
    keep_ratio: Optional[float] = typer.Option(None, "--keep-ratio", help="Fraction of attention layers kept (uniform selection)."),
    layers: Optional[str] = typer.Option(None, "--layers", help="Layers to convert, e.g. 1,3,5 (overrides --keep-ratio)."),
    select_policy: Optional[str] = typer.Option(None, "--select-policy", help="uniform, ar (attention removal), retrieval (attention removal scored on passkey prompts) or greedy (GA-S2): which layers stay attention."),
    keep_count: Optional[int] = typer.Option(None, "--keep-count", help="Number of attention layers kept (overrides --keep-ratio)."),
    calibration: Optional[List[Path]] = typer.Option(None, "--calibration", help="Calibration text file(s): --calibration a.txt b.txt (or repeat the flag); default: the built-in sample."),
    more_calibration: Optional[List[Path]] = typer.Argument(None, help="More calibration files (after --calibration).", show_default=False),
    options: Optional[List[str]] = typer.Option(None, "--set", help="Pass option pass.key=value (repeatable), e.g. align.steps=100 (see `surgery passes`)."),
    device: Optional[str] = DeviceOpt, dtype: Optional[str] = DtypeOpt, debug: bool = DebugOpt, compile: Optional[bool] = CompileOpt,
    as_json: bool = typer.Option(False, "--json", help="Print the result (the passes' results, where the hybrid was saved) as JSON on stdout."),
    offload_layers: Optional[bool] = typer.Option(
        None, "--offload-layers/--no-offload-layers",
        help="Capture on the meta device and read the teacher's files (safetensors or GGUF) a layer at a time (a teacher larger "
             "than the device); default: when a model directory's safetensors exceed the device's free memory."),
):
    """Run passes on a model and save the hybrid."""
    from surgery import PassManager, capture, diff as graph_diff, save
    from surgery.core.kernel_warmup import kernel_warmup
    from surgery.core.pipeline import parse_options
    from surgery.data.text import check_text_file
    from surgery.io.lock import output_lock
    from surgery.io.outdir import check_replaceable

    with guard(debug), output_lock(out_dir):  # one writer per --out, from before any check to the final rename
        calibration = more_files(calibration, more_calibration, "--calibration")
        names = pass_names(passes)
        configs = parse_options(options)
        if "select" in names:
            select_options(configs.setdefault("select", {}), layers, keep_ratio, select_policy, keep_count, calibration)
        for name in ("calibrate", "align"):
            if name in names and calibration:
                configs.setdefault(name, {})["calibration"] = [str(p) for p in calibration]
        if "align" in names and compile is not None:
            configs.setdefault("align", {})["compile"] = compile
        manager = PassManager(names, configs)
        manager.validate()
        for file in calibration or []:
            check_text_file(file, "Calibration file")
        paths = model_inputs(model, memory=offload_layers is not True)
        check_replaceable(out_dir, force=force, inputs=[model, *paths, *(calibration or [])])
        dev, dt = placement(device, dtype)
        offload = choose_offload(paths[0], dev, dt, offload_layers)  # else the teacher must fit the device (checked)
        err.print(f"{'capturing on the meta device' if offload else 'loading and capturing'} {model} {'for' if offload else 'on'} {dev} ({str(dt).removeprefix('torch.')})")
        reads_text = any(p.name in ("calibrate", "align") for p in manager.passes)  # run the converted layers on text
        if dev.type == "cuda" and reads_text:
            from tcal.kernel_configs import missing_note

            if (note := missing_note()) is not None:  # a first run autotunes fla's kernels for minutes: say why
                err.print(note)
        with kernel_warmup(dev, [] if offload else manager.layer_runs()) as warmup:  # compiles while we load
            graph = capture(model, device=dev, dtype=dt, debug=debug, offload=offload)
            err.print(f"found {graph.num_layers} attention layers")
            if reads_text and not calibration:
                err.print("no --calibration given: using the built-in calibration sample")

            def report(name, result):
                if warmup is not None:  # the converted layers exist once replace ran: their kernels can compile
                    warmup.send(graph, manager.layer_runs(after=name))
                render_pass_result(name, result.info)
                if name == "select" and result.info.get("scores") and not as_json:
                    render_scores(result.info)

            before = graph.branch() if any(p.structural for p in manager.passes) else None
            results = manager(graph, progress=report)
        if before is not None and not as_json:
            render_diff(graph_diff(before, graph), f"{model} -> {out_dir}")  # what `surgery diff MODEL OUT` prints
        save(graph, out_dir, force=force)
        err.print(f"saved to {out_dir}")
        if as_json:
            emit_json({"model": model, "out": str(out_dir), "passes": results.info, "layer_kinds": graph.layer_kinds})


EVAL_COUNTS = {"chunk": (2, 2048), "batch_size": (1, 1), "depths": (1, 5), "trials": (1, 2)}  # (least, example)


def check_eval_options(task: str, text, lengths: str, **counts: int) -> list[int]:
    """eval's options, before the model loads: the task, its text files (text, readable), the
    passkey lengths, and counts in range (a --chunk below 2 predicts no token). -> the lengths."""
    from surgery.data.text import check_text_file

    if task not in ("perplexity", *RETRIEVAL, "lm-eval"):
        raise SurgeryError(f"Unknown task '{task}'.", "Use --task perplexity, passkey, multikey, vartrack or lm-eval.")
    if task == "perplexity" and len(text or []) != 1:
        raise SurgeryError("Perplexity scores exactly one text file.", "Pass it with --text FILE.")
    for file in text or []:
        check_text_file(file)
    for name, value in counts.items():
        least, example = EVAL_COUNTS[name]
        if value < least:
            option = "--" + name.replace("_", "-")
            raise SurgeryError(f"{option} must be at least {least}, got {value}.", f"Pass e.g. {option} {example}.")
    try:
        length_list = [int(x) for x in lengths.split(",") if x.strip()]
    except ValueError:
        raise SurgeryError(f"--lengths must be comma-separated integers, got '{lengths}'.", "e.g. --lengths 1024,2048,4096") from None
    if task in RETRIEVAL and (not length_list or min(length_list) < 1):
        raise SurgeryError(f"--lengths must name positive prompt lengths, got '{lengths}'.", "e.g. --lengths 1024,2048,4096")
    return length_list


@command("eval", epilog=examples("surgery eval -m out/hybrid --text wiki.test.raw", "surgery eval -m smollm2 --text wiki.test.raw --json",
                                 "surgery eval -m out/hybrid --task passkey --lengths 1024,2048 --depths 3",
                                 "surgery eval -m out/hybrid --task lm-eval --limit 100"))
def evaluate(model: str = ModelOpt,
             text: Optional[List[Path]] = typer.Option(None, "--text", "-t", metavar="FILE",
                                                       help="perplexity: the one text file to score; passkey: corpus text for the filler, "
                                                            "--text again for more files (default: the built-in sample)."),
             task: str = typer.Option("perplexity", "--task", help="perplexity, passkey, multikey (several keys, one asked), vartrack (a chain of assignments) or lm-eval."),
             tasks: str = typer.Option("surgery_next_sentence", "--tasks", help="lm-eval: shipped task name(s), comma-separated."),
             limit: Optional[int] = typer.Option(None, "--limit", help="lm-eval: score only the first N items of each task."),
             as_json: bool = JsonOpt,
             chunk: int = typer.Option(2048, "--chunk", help="perplexity: tokens per scored window (the model's context if shorter)."),
             batch_size: int = typer.Option(1, "--batch-size", help="Windows (perplexity), prompts (passkey) or items (lm-eval) per forward."),
             lengths: str = typer.Option("1024,2048,4096", "--lengths", help="passkey, multikey, vartrack: prompt lengths in tokens."),
             depths: int = typer.Option(5, "--depths", help="passkey, multikey, vartrack: evenly spaced needle depths per length."),
             trials: int = typer.Option(2, "--trials", help="passkey, multikey, vartrack: keys per (length, depth)."),
             seed: int = typer.Option(0, "--seed", help="passkey, multikey, vartrack: keys and filler offsets."),
             device: Optional[str] = DeviceOpt, dtype: Optional[str] = DtypeOpt, debug: bool = DebugOpt,
             compile: Optional[bool] = CompileOpt):
    """Perplexity on a text file (WikiText-2 protocol) or passkey retrieval, for a teacher or a saved hybrid."""
    from surgery.data.cache import text_ids
    from surgery.eval.perplexity import perplexity
    from surgery.io.exported import open_runnable

    with guard(debug):
        length_list = check_eval_options(task, text, lengths, chunk=chunk, batch_size=batch_size, depths=depths, trials=trials)
        paths = model_inputs(model)
        if task == "lm-eval":
            return lm_eval_task(model, tasks, limit, device, dtype, batch_size, as_json)
        dev, dt = placement(device, dtype)
        check_device_fits(paths[0], dev, dt)
        graph = open_runnable(model, device=dev, dtype=dt, debug=debug, compile=compile)  # an export: verified, run by its own code
        if task in RETRIEVAL:
            result = retrieval_task(task)(graph, text, length_list, depths, trials, seed, batch_size=batch_size) | {"model": model}
            return emit_json(result) if as_json else render_passkey(result)
        ids = text_ids(text[0], graph.tokenizer)  # the WikiText-2 protocol: the whole file in one call, cached
        result = perplexity(graph, ids, chunk=chunk, batch_size=batch_size, compile=compile)  # progress: surgery.core.progress, on stderr
        result |= {"model": model, "text": str(text[0])}
        if as_json:
            emit_json(result)
        else:
            out.print(f"perplexity {result['perplexity']:.3f} over {result['tokens']:,} predicted tokens ({result['chunks']} chunks of {result['chunk_length']})")


def render_passkey(result: dict) -> None:
    """Accuracy per length, then each trial: the key and what greedy decoding answered."""
    table = Table(title=f"{result['task']} retrieval")
    table.add_column("length")
    table.add_column("accuracy")
    per_length = result["trials"] // len(result["by_length"])
    for length, acc in result["by_length"].items():
        table.add_row(length, f"{acc:.0%} of {per_length}")
    table.add_row("all", f"{result['accuracy']:.0%} of {result['trials']}")
    out.print(table)
    trials = Table(title="answers (greedy, up to the first wrong token)")
    for col in ("length", "depth", "key", "answered", ""):
        trials.add_column(col)
    for a in result["answers"]:
        trials.add_row(str(a["length"]), f"{a['depth']:.2f}", a["expected"], a["answered"], "✓" if a["correct"] else "✗")
    out.print(trials)


def lm_eval_task(model, tasks, limit, device, dtype, batch_size, as_json) -> None:
    """eval --task lm-eval: lm-evaluation-harness on the shipped local task(s), the model exported if a hybrid."""
    from surgery.eval.lm_harness import check_tasks, evaluate as lm_evaluate

    names = check_tasks(tasks)
    dev, dt = placement(device, dtype)
    result = lm_evaluate(model, names, limit=limit, device=str(dev), dtype=str(dt).removeprefix("torch."), batch_size=batch_size)
    if as_json:
        return emit_json(result | {"model": model})
    for name, r in result["tasks"].items():
        out.print(f"{name}: acc {r['acc']:.4f}, acc_norm {r['acc_norm']:.4f} over {r['items']} items (lm-eval)")


@command("passes", epilog=examples("surgery passes", "surgery passes --json"))
def list_passes(as_json: bool = JsonOpt):
    """List the passes in pipeline order (select, replace, calibrate, align, then the others) with each option's type, default and meaning."""
    from surgery.core.field_help import describe_fields
    from surgery.core.pipeline import REGISTRY, known_passes

    pipeline = DEFAULT_PASSES.split(",")
    names = sorted(known_passes(), key=lambda n: (pipeline.index(n) if n in pipeline else len(pipeline), n))
    rows = [{"name": n, "runs_after": list(REGISTRY[n].runs_after), "not_after": list(REGISTRY[n].not_after),
             "options": describe_fields(REGISTRY[n].config_cls)} for n in names]
    if as_json:
        return emit_json({"default_pipeline": pipeline, "passes": rows})
    render_passes(rows)


command("distill", epilog=examples("surgery distill -m out/hybrid -d corpus.txt -n 10M -o out/distilled --eval-text held_out.txt",
                                   "surgery distill -m out/hybrid -d corpus.txt -n 10M -o out/distilled --resume"))(distill_command)
command("generate", epilog=examples("surgery generate -m out/hybrid -p 'Once upon a time' -n 64",
                                    "surgery generate -m smollm2 -p 'The capital of France is' --json"))(generate_command)
command("export", epilog=examples("surgery export -m out/hybrid -o out/hf", "surgery export -m out/hybrid -o out/q35 --format qwen3_5 --json"))(export_command)
command("verify-export", epilog=examples("surgery verify-export out/hf", "surgery verify-export out/hf --json"))(verify_command)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
