"""Joining the processes of a run started by hand (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set per
process, as a cluster script does): every rank checks in at rank 0's store before the process group
forms, so a rank that never starts is named (torch's own init waits 30 minutes, then fails with a
store timeout that names no rank). Under torchrun its agent has gathered every rank already."""
from __future__ import annotations

import os
import time
from datetime import timedelta

import torch.distributed as dist

from ..errors import DistillError, first_line

JOIN_TIMEOUT = "SURGERY_JOIN_TIMEOUT"  # seconds every rank waits for the others (default 600)


def join_timeout() -> float:
    text = os.environ.get(JOIN_TIMEOUT, "600")
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise DistillError(f"{JOIN_TIMEOUT}={text!r} is not a positive number of seconds.", f"Set e.g. {JOIN_TIMEOUT}=600.")
    return seconds


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def missing_ranks(store, world: int) -> list[int]:
    return [r for r in range(world) if not store.check([f"surgery/joined/{r}"])]


def join(backend: str, rank: int, world: int) -> None:
    """init_process_group for this rank, after every rank has checked in (DistillError naming the
    ranks that did not within join_timeout())."""
    if under_torchrun():
        dist.init_process_group(backend=backend)
        return
    timeout = join_timeout()
    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), os.environ.get("MASTER_PORT", "29500")
    launch = f"every rank 0..{world - 1} with WORLD_SIZE={world} MASTER_ADDR={host} MASTER_PORT={port}"
    try:
        store = dist.TCPStore(host, int(port), world, is_master=rank == 0, timeout=timedelta(seconds=timeout), wait_for_workers=False)
    except (RuntimeError, ValueError) as exc:  # DistStoreError is a RuntimeError
        who = "could not listen" if rank == 0 else "never heard from rank 0"
        raise DistillError(f"Rank {rank} of {world} {who} at {host}:{port} within {timeout:g} s ({first_line(exc)}).",
                           f"Start {launch} (rank 0 first, on a free port), or raise {JOIN_TIMEOUT}.") from exc
    store.set(f"surgery/joined/{rank}", "1")
    deadline = time.monotonic() + timeout
    while missing_ranks(store, world):
        if time.monotonic() > deadline:
            missing = missing_ranks(store, world)
            raise DistillError(f"Rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of {world} did not join within {timeout:g} s.",
                               f"Start {launch}, or set WORLD_SIZE to the number of processes you start; {JOIN_TIMEOUT} sets the wait.")
        time.sleep(0.05)
    dist.init_process_group(backend=backend, store=dist.PrefixStore("group", store), rank=rank, world_size=world)
