"""Checkpoints in another sharding layout than the one surgery reads and writes. Every checkpoint
surgery writes is gathered (model.safetensors + recipe.json, the trainer state unsharded), whatever
the world size or --fsdp of the run, and resumes at any world size. A directory of per-rank shards
(torch.distributed.checkpoint's .distcp files, as FSDP trainers write them) is named, with what its
layout is and how to get from it to one surgery reads, instead of failing as "no recipe.json"."""
from __future__ import annotations

import re
from pathlib import Path

from ..errors import CheckpointError

DCP_SHARD = re.compile(r"__(\d+)_(\d+)\.distcp$")
GATHERED = "gathered safetensors (model.safetensors + recipe.json, any world size)"


def sharded_layout(folder: Path) -> str | None:
    """A description of the per-rank shards in `folder`, or None."""
    if not folder.is_dir():
        return None
    ranks = {int(m.group(1)) for f in folder.glob("*.distcp") if (m := DCP_SHARD.search(f.name))}
    if not ranks:
        return None
    return f"a torch.distributed.checkpoint sharded over {max(ranks) + 1} rank{'s' if max(ranks) else ''} (__R_0.distcp files)"


def refuse_sharded(path, what: str = "checkpoint") -> None:
    """CheckpointError naming the layout `path` has and the one surgery reads, when it holds shards."""
    layout = sharded_layout(Path(path))
    if layout is not None:
        raise CheckpointError(
            f"The {what} '{path}' is {layout}; surgery reads {GATHERED}.",
            "Gather it on one process (torch.distributed.checkpoint.state_dict_loader into a state dict) and write it with "
            "safetensors.torch.save_file as model.safetensors beside the hybrid's recipe.json; surgery distill resumes its own "
            "runs (their checkpoint-N/ directories) at any world size, with or without --fsdp.")
