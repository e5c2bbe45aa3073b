"""Census of the copies in one call (issue 29): every dtype conversion (aten._to_copy), copy_ and clone
dispatched, counted per source line that asked for it (the traced graph's op, tcal's, surgery's, fla's,
transformers' line), with its input dtype, output dtype and shape. bench/speed.py's prefill section
prints it for one hybrid forward on the default route with --casts:

    python bench/speed.py --random --sections prefill --no-compiled --shapes 32768x1 --casts   # one H200
    python bench/speed.py --smoke --sections prefill --casts                                     # CPU, stories260K
"""
from __future__ import annotations

import collections
import os
import re
import traceback

from torch.utils._python_dispatch import TorchDispatchMode

COPIES = {"_to_copy", "copy_", "clone"}
OWN_FILES = tuple(os.sep + name + os.sep for name in ("tcal", "surgery", "fla", "transformers")) + ("<eval_with_key",)


def origin() -> str:
    """The innermost frame of ours, fla's, transformers' or the traced graph's code: file:line and its text
    (for the graph: its aten op, since each node has a line of its own)."""
    frames = [f for f in traceback.extract_stack() if any(part in f.filename for part in OWN_FILES)]
    if not frames:
        return "?"
    f = frames[-1]
    if f.filename.startswith("<eval_with_key"):
        return "graph: " + ", ".join(re.findall(r"torch\.ops\.aten\.[\w.]+", f.line or "")[:1])
    return f"{os.path.basename(f.filename)}:{f.lineno} {(f.line or '').strip()[:90]}"


class Census(TorchDispatchMode):
    """Counts (op, dtype in, dtype out, shape, origin) of every copy dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.seen = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in COPIES:
            source = args[1] if name == "copy_" else args[0]
            target = args[0].dtype if name == "copy_" else kwargs.get("dtype") or source.dtype
            self.seen[(name, str(source.dtype).removeprefix("torch."), str(target).removeprefix("torch."),
                       tuple(source.shape), origin())] += 1
        return func(*args, **kwargs)


def copies(fn) -> collections.Counter:
    """The census of one call of fn()."""
    with Census() as census:
        fn()
    return census.seen


def print_copies(seen: collections.Counter, label: str) -> None:
    print(f"\n{label}: {sum(seen.values())} copies\n| count | op | from | to | shape | origin |\n|---:|---|---|---|---|---|")
    for (op, src, dst, shape, where), n in sorted(seen.items(), key=lambda kv: kv[0][-1]):
        print(f"| {n} | {op} | {src} | {dst} | {list(shape)} | {where} |", flush=True)
