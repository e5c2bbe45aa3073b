"""Tokens to a target perplexity read off a curve of evaluations, the rate at the end of a run that
never got there, and issue 30's tables: pure functions of the JSON-line records bench/recovery.py
writes (--init, --recipes), so `--table RESULTS.jsonl` prints the same table on any machine."""
from __future__ import annotations

import math

from surgery.eval.retrieval import TASKS

MULTIPLES = (1.5, 1.3, 1.2)            # the targets issue 30 asks for, multiples of the teacher's perplexity
LADDER = (1.2, 1.3, 1.5, 2.0, 3.0, 5.0)  # the recipe study reads its ratio at the lowest one both inits reach
RATE_POINTS = 3                        # evaluations the end rate is fitted over
INITS = ("baseline", "tcal")
PIPELINES = {"baseline": ["select", "replace"], "tcal": ["select", "replace", "calibrate", "align"]}  # each init's passes by default
RETRIEVAL = TASKS  # the kinds of retrieval rows: one per task
SAME = ("config", "layers", "teacher", "data", "eval", "teacher_ppl")  # what both runs of a table must share


def crossing(curve: list, target: float) -> float | None:
    """Tokens at which the curve first reaches `target`: linear in log-perplexity between the two
    evaluations either side of it; 0 when it starts there, None when it never gets there."""
    before = None
    for tokens, ppl in curve:
        if ppl <= target:
            if before is None:
                return float(tokens)
            t0, p0 = before
            return t0 + (math.log(p0) - math.log(target)) / (math.log(p0) - math.log(ppl)) * (tokens - t0)
        before = (tokens, ppl)
    return None


def end_rate(curve: list, points: int = RATE_POINTS) -> float | None:
    """Perplexity change per 10M tokens at the end: the least-squares slope over the last `points`
    evaluations (None with fewer than two)."""
    tail = [(float(t), float(p)) for t, p in curve[-points:]]
    if len(tail) < 2:
        return None
    mt, mp = sum(t for t, _ in tail) / len(tail), sum(p for _, p in tail) / len(tail)
    spread = sum((t - mt) ** 2 for t, _ in tail)
    return sum((t - mt) * (p - mp) for t, p in tail) / spread * 1e7 if spread else None


def target_rows(curve: list, teacher_ppl: float, multiples=MULTIPLES) -> list[dict]:
    """Per multiple: tokens to it (interpolated), or the tokens trained and the rate at the end."""
    trained, last = curve[-1]
    rate = end_rate(curve)
    rows = []
    for m in multiples:
        tokens = crossing(curve, teacher_ppl * m)
        rows.append({"multiple": m, "target_ppl": teacher_ppl * m, "tokens": tokens, "trained_tokens": trained,
                     "ppl_end": last, "rate_per_10M": None if tokens is not None else rate})
    return rows


def describe(row: dict) -> str:
    """'3.41M', or 'not reached in 65.5M (-0.42 ppl / 10M at 31.2)'."""
    if row["tokens"] is not None:
        return f"{row['tokens'] / 1e6:.3g}M"
    rate = "rate unknown" if row["rate_per_10M"] is None else f"{row['rate_per_10M']:+.3g} ppl / 10M"
    return f"not reached in {row['trained_tokens'] / 1e6:.3g}M ({rate} at {row['ppl_end']:.2f})"


def ratio(base: dict, tc: dict) -> str:
    """Baseline tokens over Taylor-Calibrate tokens; a bound where one of them never got there."""
    b, t = base["tokens"], tc["tokens"]
    if b is not None and t is not None:
        return "both start there" if b == t == 0 else (f"{b / t:.2f}x" if t > 0 else "TC starts there")
    if t is not None:
        return f"> {base['trained_tokens'] / t:.2f}x (baseline not reached)" if t > 0 else "TC starts there; baseline not reached"
    if b is not None:  # a run cut off before its first step (deadline spent on set-up) trained nothing yet
        trained = tc["trained_tokens"]
        return f"< {b / trained:.2f}x (TC not reached)" if trained > 0 else "TC not trained yet"
    return "neither reached"


def latest_runs(records: list[dict], kind: str = "run") -> dict[str, dict]:
    """The last record of `kind` per init (a rerun replaces an earlier one)."""
    runs: dict[str, dict] = {}
    for r in records:
        if r.get("kind") == kind:
            runs[r["init"]] = r
    return runs


def differences(runs: dict[str, dict]) -> list[str]:
    """Fields the two runs should share but do not (another seed, data order, layers, teacher)."""
    a, b = (runs[i] for i in INITS)
    return [key for key in SAME if not same(a.get(key), b.get(key))]


def same(x, y) -> bool:
    """Equal, numbers to 1e-3 (the teacher's perplexity measured on two machines differs in the last bits)."""
    if isinstance(x, float) and isinstance(y, float):
        return math.isclose(x, y, rel_tol=1e-3)
    return x == y


def passes_note(run: dict) -> str:
    """' (select, replace, calibrate)' for a Taylor-Calibrate init built without its full pipeline,
    ' (align.lr_gates=1e-3)' for one built with other options (both where both), else ''."""
    passes = run.get("passes")
    notes = [", ".join(passes)] if passes and passes != PIPELINES[run["init"]] else []
    notes += [" ".join(run["set"])] if run.get("set") else []
    return "".join(f" ({note})" for note in notes)


def targets_table(records: list[dict]) -> list[str]:
    """Markdown: tokens to 1.5x / 1.3x / 1.2x per init and their ratio, from the latest runs."""
    runs = latest_runs(records)
    missing = [i for i in INITS if i not in runs]
    if not runs and any(r.get("kind") == "recipe" for r in records):  # a recipe study's records: its own table follows
        return []
    if missing:
        return [f"no run of {', '.join(missing)} in the records yet: run bench/recovery.py --init {missing[0]} with the same --records"]
    lines = [f"teacher perplexity {runs['tcal']['teacher_ppl']:.3f} (eval subset); "
             + "; ".join(f"{i}{passes_note(runs[i])}: {runs[i]['curve'][-1][0] / 1e6:.3g}M tokens trained, stopped by {runs[i]['stopped']}, "
                         f"{runs[i]['tokens_per_s']:,.0f} tokens/s" for i in INITS),
             "| target | baseline tokens | Taylor-Calibrate tokens | ratio |", "|---|---|---|---|"]
    for base, tc in zip(*(target_rows(runs[i]["curve"], runs[i]["teacher_ppl"]) for i in INITS)):
        lines.append(f"| {base['multiple']}x ({tc['target_ppl']:.2f}) | {describe(base)} | {describe(tc)} | {ratio(base, tc)} |")
    differ = differences(runs)
    if differ:
        lines.append(f"warning: the two runs differ in {', '.join(differ)}: the ratios compare different recipes")
    return lines


def passkey_table(records: list[dict], kind: str = "passkey") -> list[str]:
    """Markdown: a retrieval task's accuracy per length (passkey; multikey, vartrack) for the teacher
    and each init at each point."""
    rows = {}
    runs = latest_runs(records)
    for r in records:
        if r.get("kind") == kind and (r["model"] == "teacher" or r.get("run_id") == runs.get(r["model"], {}).get("run_id")):
            rows[(r["model"], r["point"])] = r  # the latest per (model, point)
    if not rows:
        return []
    lengths = sorted({int(x) for r in rows.values() for x in r["by_length"]})
    lines = [f"| {kind}: model | point | tokens | " + " | ".join(str(x) for x in lengths) + " |", "|---|---|---|" + "---|" * len(lengths)]
    for (model, point), r in rows.items():
        cells = [f"{r['by_length'][str(x)]:.0%}" if str(x) in r["by_length"] else "-" for x in lengths]
        tokens = "-" if r.get("tokens") is None else f"{r['tokens'] / 1e6:.3g}M"
        lines.append(f"| {model} | {point} | {tokens} | " + " | ".join(cells) + " |")
    return lines


def retrieval_tables(records: list[dict]) -> list[str]:
    """passkey_table for each retrieval task the records hold, a blank line after each."""
    tables = [passkey_table(records, kind) for kind in RETRIEVAL]
    return [line for table in tables if table for line in (*table, "")]


def recipe_point(name: str) -> str:
    """The `point` of a recipe run's retrieval rows (--recipe-retrieval): one per recipe in the tables."""
    return f"recipe: {name}"


def end_retrieval(records: list[dict], name: str, init: str) -> str:
    """'x% passkey, y% multikey': each task's hits at a recipe run's end, averaged over the lengths."""
    rows = {r["kind"]: r for r in records if r.get("kind") in RETRIEVAL and r.get("point") == recipe_point(name) and r.get("model") == init}
    return ", ".join(f"{100 * sum(r['by_length'].values()) / len(r['by_length']):.0f}% {kind}" for kind, r in rows.items())


def saved_cell(run: dict) -> str:
    """A recipe run's final checkpoint, loaded from disk, on the whole eval text ('-' in records from before it was measured)."""
    return "-" if run.get("saved_ppl") is None else f"{run['saved_ppl']:.3f}"


def at_baseline_end(runs: dict[str, dict]) -> str:
    """'0.61M (13.8x)': the tokens Taylor-Calibrate took to reach the perplexity the baseline ended at, and
    the baseline's tokens over them: the saving at equal quality at the end of a short study, where no
    target of LADDER below the TC init's start is reached by both."""
    (trained, ppl), curve = runs["baseline"]["curve"][-1], runs["tcal"]["curve"]
    tokens = crossing(curve, ppl)
    if tokens is None:
        return f"not reached ({curve[-1][1]:.2f} > {ppl:.2f})"
    return f"{tokens / 1e6:.3g}M (TC starts there)" if tokens == 0 else f"{tokens / 1e6:.3g}M ({trained / tokens:.1f}x)"


def recipe_table(records: list[dict]) -> list[str]:
    """Markdown: per recipe, the ratio at the lowest target of LADDER both inits reached, the final
    perplexity of each on the curve's eval tokens and, through the saved checkpoint, on the whole eval
    text (the records of the latest study per recipe name); with --recipe-retrieval
    rows, each init's retrieval at the end, averaged over the lengths."""
    by_recipe: dict[str, dict[str, dict]] = {}
    for r in records:
        if r.get("kind") == "recipe":
            by_recipe.setdefault(r["recipe"], {})[r["init"]] = r
    if not by_recipe:
        return []
    retrieval = any(str(r.get("point", "")).startswith(recipe_point("")) for r in records)
    lines = ["| recipe | target | baseline tokens | TC tokens | ratio | final ppl baseline | final ppl TC | "
             "TC tokens to the baseline's final ppl (ratio) | saved, whole eval text: baseline | TC |"
             + (" retrieval at the end, baseline | TC |" if retrieval else ""), "|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if retrieval else "")]
    for name, runs in by_recipe.items():
        label = name
        if any(i not in runs for i in INITS):
            lines.append(f"| {name} | only {', '.join(runs)} ran | | | | | | | | |" + (" | |" if retrieval else ""))
            continue
        teacher = runs["tcal"]["teacher_ppl"]
        rows = {i: target_rows(runs[i]["curve"], teacher, LADDER) for i in INITS}
        reached = [(b, t) for b, t in zip(rows["baseline"], rows["tcal"]) if b["tokens"] is not None and t["tokens"] is not None]
        closest = reached[0] if reached else (rows["baseline"][-1], rows["tcal"][-1])
        b, t = closest
        cut = [i for i in INITS if runs[i].get("stopped") == "deadline"]
        name += f" (cut short by the deadline: {', '.join(cut)})" if cut else ""
        found = f" {end_retrieval(records, label, 'baseline')} | {end_retrieval(records, label, 'tcal')} |" if retrieval else ""
        lines.append(f"| {name} | {b['multiple']}x ({b['target_ppl']:.2f}) | {describe(b)} | {describe(t)} | {ratio(b, t)} | "
                     f"{runs['baseline']['curve'][-1][1]:.3f} | {runs['tcal']['curve'][-1][1]:.3f} | {at_baseline_end(runs)} | {saved_cell(runs['baseline'])} | "
                     f"{saved_cell(runs['tcal'])} |{found}")
    return lines
