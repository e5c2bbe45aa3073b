"""Issue 30's recipe study (`bench/recovery.py --recipes FILE.json`): why the baseline catches up.

FILE.json is a list of recipes, each a dict of DistillConfig fields (and an optional "name"), e.g.
    [{"name": "default"},
     {"name": "copied lr / 3", "lr_kl_copied": 3.3e-5},
     {"name": "cosine", "schedule": "cosine"},
     {"name": "l2 first", "stage": "both", "l2_tokens": 1000000},
     {"name": "gates held 200 steps", "freeze_gates_steps": 200}]
Both inits are built once; every recipe then distils each of them for the same --tokens (on top of
the command line's recipe: seq-len, batch, schedule, lr), evaluating every --eval-every tokens. A
recipe whose two runs would not fit in what is left of --deadline-s (timed on the runs before it)
is skipped and said so. Each run appends a "recipe" record to --records; the table gives per recipe
the token ratio at the lowest target both inits reached, and both final perplexities.
"""
from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

from bench.recovery import median_rate, read_curve
from bench.recovery_one import Records, add_all, build_init, log, retrieval_rows, run_config
from bench.recovery_points import INITS, recipe_point, recipe_table
from surgery import capture, load
from surgery.cli.common import placement
from surgery.data.cache import text_ids
from surgery.eval.perplexity import perplexity
from surgery.train import distill
from surgery.train.config import DistillConfig


def read_recipes(path: str) -> list[tuple[str, dict]]:
    """[(name, DistillConfig fields)]; a file that is not such a list ends the run with one line."""
    try:
        recipes = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"--recipes {path}: not a readable JSON file ({exc}); give a JSON list of DistillConfig field dicts")
    if not isinstance(recipes, list) or not recipes or not all(isinstance(r, dict) for r in recipes):
        raise SystemExit(f"--recipes {path}: expected a non-empty JSON list of objects, e.g. [{{\"name\": \"cosine\", \"schedule\": \"cosine\"}}]")
    named = []
    known = set(DistillConfig.__dataclass_fields__)
    for i, recipe in enumerate(recipes):
        fields = {k: v for k, v in recipe.items() if k != "name"}
        unknown = sorted(set(fields) - known) + (["tokens"] if "tokens" in fields else [])
        if unknown:
            raise SystemExit(f"--recipes {path}: recipe {i} sets {', '.join(unknown)}: not a DistillConfig field, or "
                             "tokens (every recipe runs --tokens: equal tokens)")
        named.append((str(recipe.get("name") or ", ".join(f"{k}={v}" for k, v in fields.items()) or "command line"), fields))
    return named


def chosen(recipes: list[tuple[str, dict]], indices: str | None, path: str) -> list[tuple[int, str, dict]]:
    """[(index in the file, name, fields)] of --recipe-indices (all without it); a bad index ends the run with one line."""
    if indices is None:
        return [(i, name, fields) for i, (name, fields) in enumerate(recipes)]
    try:
        picked = [int(x) for x in indices.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--recipe-indices {indices}: not a comma-separated list of integers, e.g. 0,4")
    bad = [i for i in picked if not 0 <= i < len(recipes)]
    if bad or not picked or len(set(picked)) != len(picked):
        raise SystemExit(f"--recipe-indices {indices}: {path} holds recipes 0..{len(recipes) - 1}; give each at most once")
    return [(i, *recipes[i]) for i in picked]


def saved_perplexity(checkpoint: Path, eval_text: str) -> float:
    """The run's final weights as a user gets them (the checkpoint loaded from disk, CUDA and bf16 where
    there is a GPU, as `surgery eval` does) on the whole --eval file: the through-save figure beside the
    in-memory curve, which scores the first --eval-tokens only."""
    device, dtype = placement(None, None)
    graph = load(checkpoint, device=device, dtype=dtype)
    return perplexity(graph, text_ids(eval_text, graph.tokenizer))["perplexity"]


def study(args, began: float) -> None:
    recipes = chosen(read_recipes(args.recipes), args.recipe_indices, args.recipes)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = Records(Path(args.records or out / "recovery.jsonl"), f"recipes-{uuid.uuid4().hex[:8]}")
    for _, _, fields in recipes:  # every recipe checked before anything is built
        run_config(args, 0.0, **fields)
    device, dtype = placement(None, None)  # as the CLI places a model: CUDA and bf16 where there is a GPU
    teacher = capture(args.model, device=device, dtype=dtype)
    inits, select = {}, None
    for init in INITS:  # the layers chosen once, for both
        args.init = init
        inits[init], select = build_init(args, teacher, out, select)
    longest = 0.0
    for position, (index, name, fields) in enumerate(recipes):
        left = args.deadline_s - (time.time() - began) if args.deadline_s else float("inf")
        if left < 2 * longest:
            log(f"skipped (deadline): {', '.join(n for _, n, _ in recipes[position:])}")
            break
        for init in INITS:
            longest = max(longest, run_recipe(args, records, teacher, inits[init], out / f"recipe-{index}-{init}", name, fields,
                                              init, left - 10.0 if args.deadline_s else 0.0))
            left = args.deadline_s - (time.time() - began) if args.deadline_s else float("inf")
    for line in ["", *recipe_table(records.read())]:
        print(line, flush=True)


def run_recipe(args, records: Records, teacher, init_dir: Path, run_out: Path, name: str, fields: dict, init: str,
               time_limit: float) -> float:
    """One recipe on one init, recorded; -> its seconds."""
    config = run_config(args, max(time_limit, 0.0), **({"save_every": 0} | fields))  # a checkpoint at the end only
    t = time.perf_counter()
    trained = []
    summary = distill(str(init_dir), args.data, run_out, config, teacher=teacher, force=True, progress=False, on_open=trained.append)
    seconds = time.perf_counter() - t
    curve = read_curve(run_out)
    teacher_ppl = json.loads((run_out / "log.jsonl").read_text().splitlines()[0])["teacher_ppl"]
    stopped = "deadline" if summary.get("stopped") == "time_limit" else "budget"
    saved = saved_perplexity(Path(summary["checkpoint"]), args.eval)
    records.add({"kind": "recipe", "recipe": name, "init": init, "fields": fields, "curve": curve, "teacher_ppl": teacher_ppl,
                 "stopped": stopped, "tokens_per_s": median_rate(run_out, "tokens_per_s"), "seconds": seconds, "saved_ppl": saved})
    log(f"recipe {name!r}, {init}: {curve[-1][0]:,} tokens in {seconds:.0f} s, perplexity {curve[0][1]:.3f} -> {curve[-1][1]:.3f}"
        f" (teacher {teacher_ppl:.3f}); the saved checkpoint on the whole --eval text: {saved:.3f}")
    if args.recipe_retrieval and trained:  # the graph distill trained in place: its weights are the run's last
        add_all(records, retrieval_rows(trained[0], args, init, recipe_point(name), curve[-1][0]))
    return seconds
