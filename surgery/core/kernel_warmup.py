"""Helper processes that compile the converted layers' GPU kernels while the main process loads,
captures and calibrates (the helpers' side: tcal.warm_kernels).

A fresh GPU's first `surgery apply` spent about 11 s of align compiling fla's Triton kernels on one
core (bench/RESULTS.md, twenty-second session). `surgery apply` starts the helpers as soon as it knows
the device (kernel_warmup): they import fla while this process loads the teacher. Once replace has
put the converted layers in the graph, `send` tells them each distinct layer (its mixer and
constructor config) and how the passes still to run will use it (Pass.layer_runs); they run them once
on random inputs, so the kernels land in Triton's on-disk cache before the passes ask for them. With
one helper, align's first step on a fresh H200 took 2 s instead of 10 s (RESULTS, twenty-eighth session).

The helpers' work is never read back: if one fails, is slow or is not started (no CUDA, fla absent,
fewer than MIN_CPUS cores or MIN_FREE device bytes free, SURGERY_KERNEL_WARMUP=off) the passes compile
as they always did; a helper also leaves its job undone where the loaded teacher left little memory free
(tcal.warm_kernels.JOB_MIN_FREE).
`close` stops them (Triton writes a cache entry whole or not at all)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from contextlib import contextmanager

import torch

from tcal.switches import enabled

SWITCH = "SURGERY_KERNEL_WARMUP"  # "off": never start the helpers
MIN_CPUS = 4  # the helpers' imports and compiles want cores of their own, beside the main process's
MIN_FREE = 16 * 2**30  # device bytes free at the start: each helper holds a CUDA context while the teacher loads
HELPER = "tcal.warm_kernels"
MAX_HELPERS = 2  # one per kind of run (tcal.warm_kernels.USES)
NOT_MIXERS = ("attention", "split")  # graph.layer_kinds that name no mixer (the helper skips mixers without a layer)


def warmup_wanted(device) -> bool:
    """Whether helpers would pay: CUDA, Triton and fla installed, cores and device memory to spare, not switched off."""
    if torch.device(device).type != "cuda" or not enabled(SWITCH, True):
        return False
    if (os.cpu_count() or 1) < MIN_CPUS:
        return False
    if not all(importlib.util.find_spec(name) is not None for name in ("triton", "fla")):
        return False
    return torch.cuda.mem_get_info(torch.device(device))[0] >= MIN_FREE  # never compete for a large teacher's memory


def layer_jobs(graph, runs: list) -> list[dict]:
    """One entry per distinct converted layer of `graph` (mixer and config, layer index aside): the
    runs the passes will make of it, training first (its kernels cost most to compile), and for an
    inference run the graph's dtype."""
    dtype = str(graph.dtype).removeprefix("torch.")
    ordered = sorted({tuple(run) for run in runs}, key=lambda run: run[0] != "train")
    uses = [[kind, batch, tokens] + ([] if kind == "train" else [dtype]) for kind, batch, tokens in ordered]
    jobs: dict[str, dict] = {}
    kinds = graph.layer_kinds
    for layer, module in graph.gdn_modules().items():
        if kinds[layer] in NOT_MIXERS or not hasattr(module, "gdn_config"):
            continue
        config = dict(module.gdn_config(), layer_idx=None)
        key = json.dumps([kinds[layer], config], sort_keys=True, default=str)
        jobs.setdefault(key, {"mixer": kinds[layer], "config": config, "uses": uses})
    return list(jobs.values())


def shares(jobs: list[dict], helpers: int) -> list[list[dict]]:
    """The jobs spread over `helpers` processes by use, round robin in the jobs' order (training
    first): each helper compiles its own share at the same time as the others."""
    split = [[dict(job, uses=job["uses"][i::helpers]) for job in jobs] for i in range(helpers)]
    return [[job for job in share if job["uses"]] for share in split]


class KernelWarmup:
    """The helper processes, from start until close; they take one job (send), each a share of it.
    One helper per kind of run the passes will make (calibrate's forward, align's training step):
    compiling is serial within a process, so the two sets of kernels compile side by side."""

    def __init__(self, processes: list[subprocess.Popen]):
        self.processes, self.sent = processes, False

    @classmethod
    def start(cls, device, helpers: int = 1) -> "KernelWarmup | None":
        """`helpers` helpers (at most MAX_HELPERS) for `device`, when they would pay (warmup_wanted); else None."""
        if not warmup_wanted(device):
            return None
        device = torch.device(device)
        index = device.index if device.index is not None else torch.cuda.current_device()
        return cls.spawn(f"cuda:{index}", min(max(1, helpers), MAX_HELPERS))

    @classmethod
    def spawn(cls, device: str, helpers: int = 1) -> "KernelWarmup | None":
        """`helpers` helpers on `device`, unconditionally (None if none can start); their output is discarded."""
        processes = []
        for _ in range(helpers):
            try:
                processes.append(subprocess.Popen([sys.executable, "-m", HELPER, device], stdin=subprocess.PIPE,
                                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True))
            except OSError:
                break
        return cls(processes) if processes else None

    def send(self, graph, runs: list) -> bool:
        """Give the helpers the graph's converted layers and `runs` (PassManager.layer_runs), once:
        False (nothing sent) while the graph has no converted layer to warm or no run is left."""
        if self.sent or not runs:
            return False
        jobs = layer_jobs(graph, runs)
        if not jobs:
            return False
        self.sent = True
        for process, share in zip(self.processes, shares(jobs, len(self.processes))):
            try:
                if share:
                    process.stdin.write(json.dumps({"layers": share}, default=str) + "\n")
                process.stdin.close()  # a helper without a share ends
            except (OSError, ValueError):  # that helper already ended: nothing to warm there
                pass
        return True

    def close(self) -> None:
        """Stop the helpers still running (what they compiled so far stays in the cache)."""
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait()
            if process.stdin is not None and not process.stdin.closed:
                process.stdin.close()


@contextmanager
def kernel_warmup(device, runs: list):
    """KernelWarmup for `device` while the block runs, one helper per kind of run in `runs` (the
    pipeline's PassManager.layer_runs); None where none starts (no runs, no CUDA, ...)."""
    kinds = {run[0] for run in runs}
    warmup = KernelWarmup.start(device, helpers=len(kinds)) if kinds else None
    try:
        yield warmup
    finally:
        if warmup is not None:
            warmup.close()
