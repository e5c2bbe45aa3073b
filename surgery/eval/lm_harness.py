"""lm-evaluation-harness (PyPI lm-eval) on a teacher or a hybrid, offline, on the shipped local tasks.

A hybrid (a Graph, a saved hybrid, a distillation run) is exported (`--format hf`) into a temporary
directory first, then loaded by lm-eval's "hf" model with trust_remote_code=True: exactly what
`lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True --tasks surgery_next_sentence
--include_path surgery/eval/tasks` does. A teacher is handed to lm-eval as its directory or GGUF file
(model_args gguf_file=...). lm_eval is imported only here, when a run asks for it (it pulls datasets,
evaluate, ... and takes seconds), and is no dependency of surgery itself: the `eval` extra installs it."""
from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path

from ..core import progress
from ..core.graph import Graph
from ..core.load import resolve
from ..errors import EvalTaskError
from ..io.export import export
from ..io.export_manifest import is_export, verify_export
from ..io.open import is_hybrid
from ..io.outdir import RUN_FILE
from .choice_task import TASK, TASKS_DIR

METRICS = ("acc", "acc_norm")
EVAL_INSTALL = 'pip install "surgery[eval]" (from a checkout: pip install -e ".[eval]")'


def require_lm_eval() -> None:
    """Refuse, before any model loads, when lm-eval (the `eval` extra) is not installed."""
    if importlib.util.find_spec("lm_eval") is None:
        raise EvalTaskError("--task lm-eval needs lm-eval, which is not installed (it is an optional extra of surgery).",
                            f"Install it: {EVAL_INSTALL}.")


def shipped_tasks() -> list[str]:
    """The task names under surgery/eval/tasks (a folder per task, named after it, with its YAML)."""
    return sorted(p.parent.name for p in TASKS_DIR.glob("*/*.yaml") if p.stem == p.parent.name)


def check_tasks(tasks) -> list[str]:
    """The task names, each a shipped task, and lm-eval installed (checked before any model loads)."""
    require_lm_eval()
    names = [t.strip() for t in (tasks.split(",") if isinstance(tasks, str) else tasks) if t.strip()]
    known = shipped_tasks()
    unknown = [t for t in names if t not in known]
    if not names or unknown:
        raise EvalTaskError(f"Unknown lm-eval task {', '.join(repr(t) for t in unknown) or '(none named)'}.",
                            f"The shipped local tasks are: {', '.join(known)} (e.g. --tasks {TASK}).")
    return names


def needs_export(model) -> bool:
    if isinstance(model, Graph):
        return bool(model.meta.get("replace", {}).get("modules"))
    return isinstance(model, (str, Path)) and (is_hybrid(model) or (Path(model) / RUN_FILE).is_file())


def teacher_args(model) -> dict:
    """lm-eval's pretrained (and gguf_file) for a teacher: a path, a short name or a teacher Graph."""
    if isinstance(model, Graph):
        if model.source.get("kind") not in ("gguf", "dir"):
            raise EvalTaskError("lm-eval loads a teacher from disk; this graph's teacher was a module in memory.",
                                "Pass the teacher's directory or .gguf file.")
        gguf = model.source.get("gguf_file")
        return {"pretrained": model.source["path"], **({"gguf_file": gguf} if gguf else {})}
    path = resolve(model)
    if is_export(path):
        verify_export(path)  # lm-eval runs its code (trust_remote_code): only what surgery wrote
    ggufs = sorted(path.glob("*.gguf")) if path.is_dir() and not (path / "config.json").exists() else []
    if path.suffix == ".gguf" or len(ggufs) == 1:
        gguf = path if path.suffix == ".gguf" else ggufs[0]
        return {"pretrained": str(gguf.parent), "gguf_file": gguf.name}
    return {"pretrained": str(path)}


def run_tasks(model_args: dict, tasks: list[str], *, limit, device: str, dtype: str, batch_size, log_samples: bool) -> dict:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError as exc:
        raise EvalTaskError(f"lm-eval cannot be imported ({exc}).", f"Install it: {EVAL_INSTALL}.") from exc
    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    args = {**model_args, "trust_remote_code": True, "dtype": dtype}
    return lm_eval.simple_evaluate(model="hf", model_args=args, tasks=tasks, task_manager=manager, limit=limit, device=device,
                                   batch_size=batch_size, bootstrap_iters=0, log_samples=log_samples)


def evaluate(model, tasks=(TASK,), *, limit: int | None = None, device: str = "cpu", dtype: str = "float32",
             batch_size: int | str = 1, log_samples: bool = False) -> dict:
    """lm-eval's acc and acc_norm of `model` on shipped tasks: {"tasks": {name: {"acc", "acc_norm",
    "items"}}, "exported": whether it went through a temporary export}; with log_samples, lm-eval's per-item samples under "samples"."""
    names = check_tasks(tasks)
    if limit is not None and limit < 1:
        raise EvalTaskError(f"--limit must be at least 1, got {limit}.", "Pass e.g. --limit 100, or drop it to score every item.")
    with tempfile.TemporaryDirectory(prefix="surgery-lm-eval-") as tmp:
        model_args = {"pretrained": str(export(model, Path(tmp) / "hf"))} if needs_export(model) else teacher_args(model)
        with progress.task("lm-eval") as bar:  # lm-eval counts its requests itself: a line each interval says it runs
            bar.update(info=f"{', '.join(names)}" + (f", {limit} items each" if limit else ""))
            raw = run_tasks(model_args, names, limit=limit, device=device, dtype=dtype, batch_size=batch_size, log_samples=log_samples)
    results = {name: {m: raw["results"][name][f"{m},none"] for m in METRICS} | {"items": raw["results"][name]["sample_len"]} for name in names}
    out = {"tasks": results, "exported": needs_export(model)}
    if log_samples:
        out["samples"] = raw["samples"]
    return out
