"""An export's manifest (surgery_export.json) and its check, `surgery verify-export`.

from_pretrained(DIR, trust_remote_code=True) runs whatever Python DIR's config.json points at. The
manifest lists the sha256 of every file the export wrote and the auto_map it wrote; `verify_export`
says whether DIR is still exactly that: every listed file present and unchanged, nothing added (no
extra .py, no link), auto_map naming only modules inside DIR and equal to the manifest's, and every
.py file the very code this surgery writes (so a directory re-hashed by someone else is refused too)."""
from __future__ import annotations

import json
import os
from pathlib import Path

from ..core.files import sha256_file as sha256
from ..errors import ExportError
from . import hf_export

MANIFEST = "surgery_export.json"
KIND = "surgery_export"  # the manifest's version field
VERSION = 1
CODE_SUFFIXES = (".py", ".pyc", ".so", ".pyd")


def listed_files(folder: Path) -> list[str]:
    """Every entry under `folder` (relative, '/'-separated), the manifest excepted; links as files."""
    names = []
    for root, dirs, files in os.walk(folder):
        rel = Path(root).relative_to(folder)
        names += [(rel / name).as_posix() for name in files + [d for d in dirs if (Path(root) / d).is_symlink()]]
    return sorted(n for n in names if n != MANIFEST)


def write_manifest(folder: Path, *, format: str, source: str | None, teacher_config: str | None) -> dict:
    """Hash what the export wrote into `folder` (the last file it writes)."""
    config = json.loads((folder / "config.json").read_text())
    manifest = {KIND: VERSION, "format": format, "source": source, "teacher_config": teacher_config,
                "auto_map": config.get("auto_map"), "files": {name: sha256(folder / name) for name in listed_files(folder)}}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return manifest


def is_export(path) -> bool:
    """Whether `path` is a directory an export wrote (a manifest, or config.json's surgery_hybrid without recipe.json)."""
    path = Path(path)
    if not path.is_dir() or (path / "recipe.json").exists():
        return False
    if (path / MANIFEST).exists():
        return True
    try:
        return hf_export.HYBRID_KEY in json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return False


def read_manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    if not path.is_file() or path.is_symlink():
        raise ExportError(f"'{folder}' has no {MANIFEST}: nothing says which files surgery wrote there.",
                          "Export the hybrid again with this surgery (surgery export), or do not load this directory with trust_remote_code.")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ExportError(f"'{path}' is not readable JSON ({exc}).", "Export the hybrid again (surgery export).") from exc
    if not (isinstance(manifest, dict) and manifest.get(KIND) == VERSION and isinstance(manifest.get("files"), dict)):
        raise ExportError(f"'{path}' is not a surgery export manifest (version {VERSION}).", "Export the hybrid again with this surgery.")
    return manifest


def auto_map_problems(folder: Path, name: str, auto_map, modules: set[str]) -> list[str]:
    """Each auto_map entry of the file `name` that names code outside `folder` or a module not listed."""
    if auto_map is None:
        return []
    if not isinstance(auto_map, dict):
        return [f"{name}'s auto_map is not a mapping"]
    problems = []
    for key, refs in auto_map.items():
        for ref in refs if isinstance(refs, list) else [refs]:
            if ref is None:
                continue
            module = str(ref).rpartition(".")[0]
            if "--" in str(ref) or not module or "/" in module or module not in modules:
                problems.append(f"{name}'s auto_map {key} = '{ref}' names code outside the directory")
    return problems


def expected_code(manifest: dict) -> dict[str, bytes]:
    """The .py files this surgery writes into an export of the manifest's format."""
    if manifest.get("format") != "hf":
        return {}
    teacher = manifest.get("teacher_config")
    if not (isinstance(teacher, str) and teacher.isidentifier()):
        return {}
    return hf_export.exported_code(teacher)


def export_problems(folder: Path, manifest: dict) -> list[str]:
    files, problems = manifest["files"], []
    present = listed_files(folder)
    for name in sorted(files):
        path = folder / name
        if name not in present:
            problems.append(f"{name} is missing")
        elif path.is_symlink():
            problems.append(f"{name} is a link")
        elif sha256(path) != files[name]:
            problems.append(f"{name} was changed")
    for name in present:
        if name not in files:
            code = name.endswith(CODE_SUFFIXES)
            problems.append(f"{name} was added{' (Python code)' if code else ''}")
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return problems + ["config.json is not readable JSON"]
    modules = {n[:-3] for n in files if n.endswith(".py") and "/" not in n}
    if config.get("auto_map") != manifest.get("auto_map"):
        problems.append("config.json's auto_map differs from the manifest's")
    for name in [n for n in present if n.endswith(".json")]:
        try:
            data = json.loads((folder / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            problems += auto_map_problems(folder, name, data.get("auto_map"), modules)
    code = expected_code(manifest)
    for name in sorted(n for n in files if n.endswith(CODE_SUFFIXES)):
        if code.get(name) is None or (name in present and not (folder / name).is_symlink() and (folder / name).read_bytes() != code[name]):
            problems.append(f"{name} is not the code this surgery writes")
    return problems


VERIFIED: dict[str, tuple] = {}  # resolved directory -> (its files' stat signature, manifest) when last verified in this process


def stat_signature(folder: Path) -> tuple:
    """Name, size, mtime, inode and mode of every entry under `folder`, the manifest included: what
    changes when a file is rewritten, replaced, added or removed."""
    entries = []
    for name in listed_files(folder) + [MANIFEST]:
        try:
            st = os.lstat(folder / name)
        except OSError:
            return ()
        entries.append((name, st.st_size, st.st_mtime_ns, st.st_ino, st.st_mode))
    return tuple(entries)


def verify_export(path) -> dict:
    """The manifest of the export at `path` when the directory is exactly what surgery wrote;
    ExportError naming every difference otherwise. Hashed once per process: a directory verified
    earlier whose files' sizes, times and inodes are all unchanged is not hashed again (a command
    checks its inputs first and verifies again just before it loads them)."""
    folder = Path(path)
    if not folder.is_dir():
        raise ExportError(f"'{folder}' is not a directory.", "Pass the directory `surgery export --out` wrote.")
    key, signature = str(folder.resolve()), stat_signature(folder)
    if signature and VERIFIED.get(key, ((), None))[0] == signature:
        return json.loads(json.dumps(VERIFIED[key][1]))  # a copy: callers may change theirs
    manifest = read_manifest(folder)
    problems = export_problems(folder, manifest)
    if problems:
        raise ExportError(f"'{folder}' is not the export surgery wrote: {'; '.join(problems)}.",
                          "Do not load it with trust_remote_code=True; export the hybrid again (surgery export --force).")
    if signature and signature == stat_signature(folder):  # nothing changed while it was hashed
        VERIFIED[key] = (signature, manifest)
    return manifest


def export_refusal(path) -> ExportError:
    """What a surgery command that runs graphs says when handed an export directory."""
    source = None
    try:
        source = json.loads((Path(path) / MANIFEST).read_text(encoding="utf-8")).get("source")
    except (OSError, ValueError, AttributeError):
        pass
    came_from = f" (it was exported from '{source}')" if isinstance(source, str) and Path(source).exists() else ""
    return ExportError(f"'{path}' is a surgery export (a transformers directory with remote code), not a saved hybrid{came_from}.",
                       f"Open the hybrid it came from{', ' + repr(source) if came_from else ''}; or check it with `surgery verify-export {path}` "
                       "and load it in transformers: AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True).")
