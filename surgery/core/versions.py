"""The transformers versions surgery runs on: the range CI tests (pyproject.toml declares the same).

Below it, things fail quietly rather than loudly: transformers 5.17's GGUF tokenizer splits
Gemma's text into 2.25x the tokens, exports do not load before 5.19, BOS is added only from 5.23,
and the whole suite passes from 5.24 (5.23 captures GPT-J and CodeGen with eager attention).
So `import surgery` refuses any other version at once, in one line, before any work. The version
is read from the installed metadata, which does not import transformers."""
from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, version

from ..errors import SurgeryError

FLOOR, CEILING = "5.24", "6"
REQUIREMENT = f"transformers>={FLOOR},<{CEILING}"
INSTALL = f'pip install "{REQUIREMENT}"'


class UnsupportedVersionError(SurgeryError, ImportError):
    """The installed transformers is outside the range surgery is tested on."""


def release(text: str) -> tuple[int, ...]:
    """'5.23.0' -> (5, 23, 0); '5.24.0.dev0', '6.0.0rc1' -> their release numbers (5, 24, 0), (6, 0, 0)."""
    match = re.match(r"\d+(\.\d+)*", text.strip())
    return tuple(int(n) for n in match.group(0).split(".")) if match else ()


def supported(installed: str) -> bool:
    return release(FLOOR) <= release(installed) < release(CEILING)


def check_transformers(installed: str | None = None) -> None:
    """Raise UnsupportedVersionError (one line: the installed version, the range, the fix) outside the range."""
    if installed is None:
        try:
            installed = version("transformers")
        except PackageNotFoundError:
            raise UnsupportedVersionError(f"transformers is not installed; surgery needs {REQUIREMENT}.", f"Install it: {INSTALL}") from None
    if not supported(installed):
        raise UnsupportedVersionError(f"transformers {installed} is installed; surgery supports {REQUIREMENT}.", f"Install a supported one: {INSTALL}")
