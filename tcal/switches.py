"""The SURGERY_* environment switches, read one way everywhere.

Each fast path that can be turned off (or a slower one turned on) is named by an environment variable.
They used to be read module by module, and disagreed: "0" turned some off and left others on, and a
mistyped value was read as on by some and as off by others. Here "off", "0", "false" and "no" mean off;
"on", "1", "true" and "yes" mean on; "auto" or nothing leaves the module its default; a switch that
takes a number (programs, pieces) reads digits other than 0 as that number; anything else raises, naming the
variable and what it takes. Copied beside the export's modeling file, so it imports only the stdlib.
"""
from __future__ import annotations

import os

OFF_WORDS = ("off", "0", "false", "no")
ON_WORDS = ("on", "1", "true", "yes")
AUTO = "auto"


def setting(name: str, numeric: bool = False) -> str | int:
    """The switch `name` as "on", "off", "auto" (unset or empty too), or, where `numeric`, a number."""
    raw = os.environ.get(name, "")
    text = raw.strip().lower() or AUTO
    if numeric and text.isdigit() and int(text) > 0:  # "0" is off, for these switches too
        return int(text)
    if text in OFF_WORDS:
        return "off"
    if text in ON_WORDS:
        return "on"
    if text == AUTO:
        return AUTO
    words = "on, off or auto" + (", or a number" if numeric else "")
    raise ValueError(f"{name}={raw!r} is not a setting this switch takes: use {words} (or unset it).")


def enabled(name: str, default: bool) -> bool:
    """Whether the path `name` switches is on: `default` unless the variable says on or off."""
    value = setting(name)
    return default if value == AUTO else value == "on"
