"""`surgery distill`: parse, call surgery.train.distill, render. Under torchrun every process runs the same
command; only rank 0 prints."""
from __future__ import annotations

import signal
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import List, Optional

import typer

from surgery.errors import SurgeryError
from surgery.train.interrupt import Aborted, exit_code

from .common import emit_json, err, guard, out, parse_device, parse_dtype
from .options import CompileOpt, DebugOpt

_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "b": 10**9}


def count(text: str, option: str) -> int:
    """'100M', '1.5k', '4096' -> an integer number of tokens."""
    raw = str(text).strip().replace("_", "").replace(",", "")
    scale = _SUFFIXES.get(raw[-1:].lower(), 1)
    try:  # Decimal: '16.1k' is exactly 16100 (a float product is 16100.000000000002)
        value = Decimal(raw[:-1] if scale != 1 else raw) * scale
    except InvalidOperation:
        raise SurgeryError(f"{option} '{text}' is not a number of tokens.", f"Write e.g. {option} 100M, 2.5k or 4096.") from None
    if not value.is_finite() or value != value.to_integral_value():
        raise SurgeryError(f"{option} '{text}' is not a whole number of tokens.", f"Write e.g. {option} 100M.")
    return int(value)


def distill(
    model: Path = typer.Option(..., "--model", "-m", help="Saved hybrid directory (from `surgery apply --out`)."),
    data: List[Path] = typer.Option(..., "--data", "-d", help="Training text file(s): --data a.txt b.txt (or repeat --data)."),
    more_data: Optional[List[Path]] = typer.Argument(None, help="More training text files.", show_default=False),
    tokens: str = typer.Option(..., "--tokens", "-n", help="Training tokens over all stages, e.g. 100M."),
    out_dir: Path = typer.Option(..., "--out", "-o", help="Run directory: checkpoint-*/ (loadable hybrids), log.jsonl, distill.json."),
    teacher: Optional[str] = typer.Option(None, "--teacher", "-t", help="Teacher source (default: the one in the hybrid's recipe)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --out from its last checkpoint."),
    force: bool = typer.Option(False, "--force", help="Replace an existing --out."),
    stage: Optional[str] = typer.Option(None, "--stage", help="l2 (per-layer, teacher-forced), kl (end-to-end logits), or both (default: both, with an l2 stage of tokens / 7 first, where that is at least one optimizer step; else kl)."),
    l2_tokens: Optional[str] = typer.Option(None, "--l2-tokens", help="With --stage both: tokens of the l2 stage (default: tokens / 7)."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="Tokens per sequence (default 512)."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="Sequences per optimizer step over all processes: the global batch (default 8)."),
    micro_batch: Optional[int] = typer.Option(None, "--micro-batch", help="Sequences per forward on one process (default: its whole share)."),
    lr: Optional[float] = typer.Option(None, "--lr", help="Learning rate of the GDN layers (new and copied parameters) in every stage run (default: l2 1e-3, kl 1e-4)."),
    lr_rest: Optional[float] = typer.Option(None, "--lr-rest", help="Learning rate outside the GDN layers in stage kl (default 7e-6; 0 freezes them)."),
    warmup: Optional[float] = typer.Option(None, "--warmup", help="Warmup as a fraction of each stage's steps (default 0.01)."),
    schedule: Optional[str] = typer.Option(None, "--schedule", help="cosine (default) or constant."),
    freeze_gates_steps: Optional[int] = typer.Option(None, "--freeze-gates-steps", help="Hold the GDN gates (a/b/g_proj, A_log, dt_bias) still for the first N optimizer steps (default 0)."),
    eval_text: Optional[Path] = typer.Option(None, "--eval-text", help="Text file scored (perplexity) at the start, every --eval-every tokens and at the end."),
    eval_every: Optional[str] = typer.Option(None, "--eval-every", help="Evaluate every N tokens (default 0: at the start and the end only)."),
    eval_tokens: Optional[str] = typer.Option(None, "--eval-tokens", help="Tokens of --eval-text scored (default 32k)."),
    save_every: Optional[str] = typer.Option(None, "--save-every", help="Checkpoint every N tokens (default 0: at the end only)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seeds the data order (default 0)."),
    grad_checkpoint: bool = typer.Option(False, "--grad-checkpoint", help="Recompute GDN layers in backward (less memory; with --fsdp: each decoder layer)."),
    fsdp: bool = typer.Option(False, "--fsdp", help="Shard weights, gradients and optimizer states over the processes with FSDP2 (one unit per layer)."),
    fsdp_offload: bool = typer.Option(False, "--fsdp-offload", help="With --fsdp: keep shards, gradients and optimizer states in CPU memory."),
    time_limit: Optional[float] = typer.Option(None, "--time-limit", help="Seconds of training in this call; then a checkpoint and a clean stop (--resume continues)."),
    options: Optional[List[str]] = typer.Option(None, "--set", help="Any DistillConfig field, key=value (repeatable), e.g. --set temperature=2."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu, cuda, cuda:1 ... (default: cuda when available; cuda:LOCAL_RANK under torchrun)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Dtype of the trained weights (default float32; CUDA computes under bf16 autocast)."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
    compile: Optional[bool] = CompileOpt,
    debug: bool = DebugOpt,
):
    """Continue training a saved hybrid against its teacher (stage l2, kl, or both)."""

    from surgery.data.corpus import check_files
    from surgery.data.text import check_text_file
    from surgery.train import DistillConfig
    from surgery.train import distill as run_distill

    with guard(debug):
        given = {"stage": stage, "seq_len": seq_len, "global_batch": batch_size, "micro_batch": micro_batch, "warmup": warmup,
                 "schedule": schedule, "seed": seed, "eval_text": str(eval_text) if eval_text else None, "time_limit": time_limit,
                 "tokens": count(tokens, "--tokens"), "grad_checkpoint": grad_checkpoint, "compile": compile,
                 "fsdp": fsdp, "fsdp_offload": fsdp_offload, "freeze_gates_steps": freeze_gates_steps}
        counts = {"l2_tokens": (l2_tokens, "--l2-tokens"), "eval_every": (eval_every, "--eval-every"),
                  "eval_tokens": (eval_tokens, "--eval-tokens"), "save_every": (save_every, "--save-every")}
        config = DistillConfig.from_dict(settings(given, counts, lr, lr_rest, options))
        check_seq_len(config.seq_len, model, teacher)
        weights_dtype = parse_dtype(dtype) if dtype is not None else None
        files = [str(p) for p in [*data, *(more_data or [])]]
        for path in check_files(files):  # before any model loads: a typo or a binary file costs seconds
            check_text_file(path, "Training data file")
        if eval_text is not None:
            check_text_file(eval_text, "Evaluation text")
        if device is not None:
            parse_device(device)
        result = interruptible(lambda: run_distill(str(model), files, out_dir, config, teacher=teacher, resume=resume, force=force,
                                                   device=device, dtype=weights_dtype), out_dir)  # progress on stderr, --json or not
        if result["rank"] == 0:
            render(result, as_json)
        if (result.get("stopped") or "").startswith("SIG"):  # a checkpoint was written: exit as the signal says (130, 143)
            raise typer.Exit(exit_code(signal.Signals[result["stopped"]]))


def interruptible(run, out_dir) -> dict:
    """run(); a second Ctrl-C (Aborted) or one before training began ends the command with a line
    that says what was kept, and exit 130 (143 for SIGTERM)."""
    try:
        return run()
    except Aborted as exc:  # a second signal: nothing more written
        err.print(f"aborted by a second {exc}: no checkpoint written since the last one in {out_dir}; --resume continues from it")
        raise typer.Exit(exit_code(exc.signum)) from None
    except KeyboardInterrupt:  # before training began: there was nothing to keep
        err.print(f"interrupted before training began: {out_dir} holds no new checkpoint")
        raise typer.Exit(exit_code(signal.SIGINT)) from None


def check_seq_len(seq_len: int, model, teacher) -> None:
    """--seq-len within the position limit the model's (and a given teacher's) files state, before
    either loads (surgery.train checks the loaded graphs again)."""
    from surgery.io.limits import position_limit

    for who, source in (("model", model), ("teacher", teacher)):
        limit = position_limit(source) if source is not None else None
        if limit is not None and seq_len > limit:
            raise SurgeryError(f"--seq-len {seq_len} exceeds what the {who} '{source}' takes ({limit} positions).", f"Use --seq-len {limit} or less.")


def settings(given: dict, counts: dict, lr, lr_rest, options) -> dict:
    """DistillConfig fields from the options given (None: not given); counts: field -> (text, option)
    for token counts; --set key=value pairs last, so they win."""
    fields = {k: v for k, v in given.items() if v is not None}
    for key, (text, option) in counts.items():
        if text is not None:
            fields[key] = count(text, option)
    if lr is not None:
        fields.update(lr_l2_new=lr, lr_l2_copied=lr, lr_kl_new=lr, lr_kl_copied=lr)
    if lr_rest is not None:
        fields["lr_kl_rest"] = lr_rest
    for item in options or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise SurgeryError(f"Option '{item}' is not of the form key=value.", "Write e.g. --set temperature=2.")
        fields[key.strip()] = value
    return fields


def render(result: dict, as_json: bool) -> None:
    if as_json:
        return emit_json(result)
    if result.get("stopped") == "time_limit":  # (a signal's stop was noted by the trainer as it happened)
        err.print(f"stopped by --time-limit after {result['tokens']:,} tokens; run the same command with --resume to continue")
    rate = f"{result['tokens_per_s']:,.0f} tokens/s, {result['flops_per_s'] / 1e12:.3g} model TFLOP/s" if result["tokens_per_s"] else "nothing left to train"
    ppl = f", eval perplexity {result['eval_ppl']:.4g}" if result.get("eval_ppl") is not None else ""
    out.print(f"distilled {result['tokens']:,} tokens in {result['steps']} steps ({rate}); loss {result['loss'] if result['loss'] is None else format(result['loss'], '.4g')}{ppl}")
    err.print(f"checkpoint: {result['checkpoint']}")
