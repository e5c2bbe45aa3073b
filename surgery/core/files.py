"""Small file helpers every writer shares: content digests and atomic replacement of one file."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 4 MiB blocks (weights files can be many GiB)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to a sibling temporary file, then rename it onto `path`: readers see the old
    file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json_atomic(path: Path, data) -> None:
    write_atomic(path, json.dumps(data, indent=1, allow_nan=False))  # JSON has no NaN or Infinity
