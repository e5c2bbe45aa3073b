"""What each option of a config dataclass means, read from the docstrings that already say it.

The convention (PassConfig subclasses, tcal's option classes): the class docstring lists fields as
`name  description` (two spaces or more between), several names joined by commas sharing one
description, continuation lines indented. A subclass's entry wins over its bases'. `surgery passes`
shows these; tests/test_cli_output.py checks that every option of every pass has one."""
from __future__ import annotations

import dataclasses
import inspect
import re
import typing

ENTRY = re.compile(r"^(\w+(?:\s*,\s*\w+)*)\s{2,}(\S.*)$")


def field_help(cls) -> dict[str, str]:
    """{field name: description} for the dataclass `cls`; fields no docstring describes are absent."""
    names = {f.name for f in dataclasses.fields(cls)}
    found: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        current: list[str] = []
        for line in inspect.cleandoc(klass.__dict__.get("__doc__") or "").splitlines():
            entry = ENTRY.match(line)
            listed = [n.strip() for n in entry.group(1).split(",")] if entry else []
            if listed and all(n in names for n in listed):
                current = listed
                for n in listed:
                    found[n] = entry.group(2).strip()
            elif current and line.startswith(" ") and line.strip():
                for n in current:
                    found[n] += " " + line.strip()
            else:
                current = []
    return found


def describe_fields(cls) -> list[dict]:
    """Each field of `cls` as {name, type, default, help}, in declaration order."""
    hints, helps = typing.get_type_hints(cls), field_help(cls)
    rows = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else (f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        kind = hints.get(f.name, f.type)
        rows.append({"name": f.name, "type": kind.__name__ if isinstance(kind, type) else str(kind).replace("typing.", ""),
                     "default": default, "help": helps.get(f.name, "")})
    return rows
