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


def current_umask() -> int:
    """The process's umask, read without changing it where Linux shows it (/proc/self/status), else
    by setting and restoring it."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(folder: Path) -> None:
    """Give `folder` and everything under it the modes a plain mkdir/open would have (0755/0644
    under umask 022): staging directories (tempfile.mkdtemp) and some writers (safetensors writes
    through a temporary file) create 0700/0600, which would keep another account or a serving
    process from reading what was published. Executable files keep their x bits (masked the same way)."""
    mask = current_umask()
    for root, dirs, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, (0o777 if os.stat(path).st_mode & 0o111 else 0o666) & ~mask)
        for name in dirs:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, 0o777 & ~mask)
    os.chmod(folder, 0o777 & ~mask)
