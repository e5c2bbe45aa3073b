"""Conversion across the registry, on the CPU: for every architecture that captures (tests/archs.py,
ARCHS + EXTRA_ARCHS), capture, select + replace + calibrate + align with small options, check that
the hybrid's logits are finite, that incremental decoding equals full recomputation, and that the
hybrid survives save -> load -> generate -> export (or a stage refuses by name). The check of one
architecture is tests/sweep_check.py (shared with `pytest -m sweep`); this script runs it over the
registry, prints a markdown table and writes JSON.

    python bench/sweep.py --out bench/results/sweep_cpu.json --table /tmp/sweep_table.md
    python bench/sweep.py --only llama,bloom --jobs 2 --timeout 300

With --jobs > 1 or --timeout every architecture runs in its own child process (so one that hangs
or crashes becomes a row, not the end of the sweep); otherwise all run in this process."""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # archs.py, conftest.py's builders, sweep_check.py

import torch  # noqa: E402

from archs import ARCHS, EXTRA_ARCHS  # noqa: E402

COLUMNS = ("architecture", "converts", "decodes", "why", "round_trip", "round_trip_why")
NOT_REACHED = {"converts": "error", "decodes": "-", "max_diff": None, "round_trip": "-", "round_trip_why": ""}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="", help="comma-separated architectures (default: all that capture)")
    p.add_argument("--jobs", type=int, default=1, help="architectures checked at once (child processes)")
    p.add_argument("--timeout", type=float, default=0, help="seconds per architecture (child processes); 0: none")
    p.add_argument("--threads", type=int, default=1, help="torch threads per architecture")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "sweep_cpu.json"))
    p.add_argument("--table", default="", help="also write the markdown table to this file")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)  # child: check one, print its JSON
    return p.parse_args(argv)


def names(only: str) -> list[str]:
    registry = [*ARCHS, *EXTRA_ARCHS]
    if not only:
        return registry
    wanted = [n.strip() for n in only.split(",") if n.strip()]
    unknown = sorted(set(wanted) - set(registry))
    if unknown:
        sys.exit(f"unknown architecture(s): {', '.join(unknown)}; known: {', '.join(registry)}")
    return wanted


def in_child(name: str, args: argparse.Namespace) -> dict:
    """One architecture in a child process, bounded by --timeout."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--threads", str(args.threads)]
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout or None)
    except subprocess.TimeoutExpired:
        return {"architecture": name, **NOT_REACHED, "why": f"timed out after {args.timeout:g} s", "seconds": round(time.perf_counter() - start, 2)}
    lines = done.stdout.strip().splitlines()
    if done.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return {"architecture": name, **NOT_REACHED, "why": f"child exited {done.returncode}: {tail}", "seconds": round(time.perf_counter() - start, 2)}


def in_process(name: str) -> dict:
    from sweep_check import check

    return check(name).as_dict()


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        lines.append("| " + " | ".join(str(r[c]).replace("|", "\\|") for c in COLUMNS) + " |")
    counts = summary(rows)
    lines.append("")
    lines.append(f"{counts['architectures']} architectures: {counts['converts']} convert, {counts['exact']} convert and decode"
                 f" exactly, {counts['refused']} refuse to decode (named reason), {counts['wrong']} decode wrongly,"
                 f" {counts['errors']} fail. Round trip (save, load, generate, export): {counts['round_trip_exact']} exact,"
                 f" {counts['round_trip_refused']} refused by name, {counts['round_trip_wrong']} wrong, {counts['round_trip_errors']} fail.")
    return "\n".join(lines) + "\n"


def summary(rows: list[dict]) -> dict:
    return {"architectures": len(rows), "converts": sum(r["converts"] == "yes" for r in rows),
            "exact": sum(r["decodes"] == "exact" for r in rows), "refused": sum(r["decodes"] == "refused" for r in rows),
            "wrong": sum(r["decodes"] == "wrong" for r in rows),
            "errors": sum(r["converts"] != "yes" or r["decodes"] == "error" for r in rows),
            **{f"round_trip_{key}": sum(r["round_trip"] == value for r in rows)
               for key, value in (("exact", "exact"), ("refused", "refused"), ("wrong", "wrong"), ("errors", "error"))}}


def sweep(args: argparse.Namespace) -> list[dict]:
    todo = names(args.only)
    children = args.jobs > 1 or args.timeout > 0
    run = (lambda n: in_child(n, args)) if children else in_process
    rows = []
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        for row in pool.map(run, todo):
            print(f"{row['architecture']:>20}  {row['converts']:>5}  {row['decodes']:>7}  {row['round_trip']:>7}  {row['seconds']:7.1f} s"
                  f"  {row['why']}  {row['round_trip_why']}",
                  file=sys.stderr, flush=True)
            rows.append(row)
    return rows


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("SURGERY_CACHE", tempfile.mkdtemp(prefix="surgery-sweep-"))  # keep the user's cache clean
    if args.worker:
        print(json.dumps(in_process(args.worker)))
        return
    start = time.perf_counter()
    rows = sweep(args)
    text = table(rows)
    print(text)
    out = {"machine": f"{platform.node()} ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
           "torch": torch.__version__, "threads": args.threads, "jobs": args.jobs,
           "wall_seconds": round(time.perf_counter() - start, 1), "summary": summary(rows), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    if args.table:
        Path(args.table).write_text(text)


if __name__ == "__main__":
    main()
