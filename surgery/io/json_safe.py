"""The one reader for JSON a user's directory hands us (recipe.json, trainer_state.json, distill.json,
a teacher's config.json): nesting deeper than MAX_DEPTH is refused before json.loads (whose
recursion a 100,000-deep array overflows), and so is any NaN or ±Infinity (Python's json reads the
literals NaN/Infinity and numbers like 1e400 as non-finite floats; JSON has neither), named by
where it sits, e.g. `config.rms_norm_eps`."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

from ..errors import SurgeryError

MAX_DEPTH = 64  # the deepest file surgery writes nests 6 levels (trainer_state.json's optimizer state)
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKETS = re.compile(r"[\[\]{}]")


def nesting_depth(text: str) -> int:
    """How deep arrays and objects nest in JSON text (brackets inside strings do not count)."""
    depth = deepest = 0
    for bracket in _BRACKETS.findall(_STRINGS.sub('""', text)):
        depth += 1 if bracket in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def non_finite(value, path: str = ""):
    """(path, value) of the first NaN or ±inf in parsed JSON, or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return path or "(the whole document)", value
    if isinstance(value, dict):
        items = ((f"{path}.{key}" if path else str(key), item) for key, item in value.items())
    elif isinstance(value, list):
        items = ((f"{path}[{i}]", item) for i, item in enumerate(value))
    else:
        return None
    for where, item in items:
        found = non_finite(item, where)
        if found is not None:
            return found
    return None


def loads(text: str, name: str, error: type[SurgeryError] = SurgeryError, fix: str = "The file is damaged; write it again.", finite: bool = True):
    """Parse `text` (from the file called `name`) or raise `error` naming what is wrong with it.
    finite=False lets NaN through (a log line may record a loss that diverged)."""
    depth = nesting_depth(text)
    if depth > MAX_DEPTH:
        raise error(f"'{name}' nests arrays or objects {depth} levels deep; surgery reads at most {MAX_DEPTH}.", fix)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"'{name}' is not valid JSON ({exc.msg} at line {exc.lineno}).", fix) from exc
    found = non_finite(data) if finite else None
    if found is not None:
        raise error(f"'{name}': {found[0]} = {found[1]} is not a finite number (JSON has no NaN or Infinity).", fix)
    return data


def read_json(path: str | Path, error: type[SurgeryError] = SurgeryError, fix: str = "The file is damaged; write it again.",
              name: str | Path | None = None):
    """The parsed JSON file at `path` (UTF-8), checked as loads() checks it; messages call it
    `name` (default: path; a reader of a pinned directory reads /proc/self/fd/N/..., names the file)."""
    path = Path(path)
    name = str(name or path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"'{name}' is not text (byte {exc.start} is not UTF-8).", fix) from exc
    except OSError as exc:
        raise error(f"'{name}' cannot be read: {exc.strerror or exc}.", fix) from exc
    return loads(text, name, error, fix)
