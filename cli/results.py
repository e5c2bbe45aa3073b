"""Readable renderings of pass results and of the pass list (the JSON forms are the dicts themselves)."""
from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from .common import err, out

LIST_SHOWN = 12  # items of a list shown before "... (N in all)"


def brief(value) -> str:
    """A value in a few characters: 4 significant digits, lists as '1, 3, 4', a dict as 'k v, ...'."""
    if isinstance(value, bool) or value is None:
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        shown = ", ".join(brief(v) for v in value[:LIST_SHOWN])
        return shown + (f", ... ({len(value)} in all)" if len(value) > LIST_SHOWN else "") if value else "none"
    if isinstance(value, dict):
        return ", ".join(f"{k} {brief(v)}" for k, v in value.items() if not isinstance(v, (dict, list)))
    return str(value)


def pass_summary(name: str, info: dict) -> str:
    """'calibrate: seconds 2.62; mean rel error before 1.873; ...': every field of a pass's result but
    the per-layer scores (select prints them as a table), None fields left out."""
    fields = [f"{key.replace('_', ' ')} {brief(value)}" for key, value in info.items() if key != "scores" and value is not None]
    return f"{name}: {'; '.join(fields) or 'done'}"


def render_pass_result(name: str, info: dict) -> None:
    """One line per pass on stderr as it finishes (the whole result is in apply --json)."""
    err.print(f"[green]✓[/] {escape(pass_summary(name, info))}")


def render_passes(rows: list[dict]) -> None:
    """`surgery passes`: each pass, what it must follow, and a table of its options."""
    for row in rows:
        after = ", ".join(row["runs_after"]) or "nothing"
        out.print(f"\n[bold]{row['name']}[/]  (runs after: {after}; not after: {', '.join(row['not_after']) or 'nothing'})")
        table = Table(show_edge=False, pad_edge=False, box=None, header_style="bold")
        for col in ("option", "type", "default", "description"):
            table.add_column(col, overflow="fold")
        for option in row["options"]:
            table.add_row(f"{row['name']}.{option['name']}", escape(option["type"]), escape(repr(option["default"])), escape(option["help"]))
        out.print(table)
