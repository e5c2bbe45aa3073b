"""A helper process that compiles the converted layers' GPU kernels while the main process loads,
captures and calibrates (the helper's side: tcal.warm_kernels).

A fresh GPU's first `surgery apply` spent about 11 s of align compiling fla's Triton kernels on one
core (bench/RESULTS.md, twenty-second session). `surgery apply` starts the helper as soon as it knows
the device (KernelWarmup.start): the helper imports fla while this process loads the teacher. Once
replace has put the converted layers in the graph, `send` tells it each distinct layer (its mixer
and constructor config) and how the passes still to run will use it (Pass.layer_runs); it runs them
once on random inputs, so their kernels land in Triton's on-disk cache before the passes ask for them.

The helper's work is never read back: if it fails, is slow or is not started (no CUDA, fla absent,
fewer than MIN_CPUS cores, SURGERY_KERNEL_WARMUP=off) the passes compile as they always did.
`close` stops it (Triton writes a cache entry whole or not at all)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from contextlib import contextmanager

import torch

SWITCH = "SURGERY_KERNEL_WARMUP"  # "off": never start the helper
MIN_CPUS = 4  # the helper's import and compiles want a core of their own, beside the main process's
HELPER = "tcal.warm_kernels"
NOT_LAYERS = ("attention", "split", "swa")  # layer kinds without a layer of their own to warm (graph.layer_kinds)


def warmup_wanted(device) -> bool:
    """Whether a helper would pay: CUDA, Triton and fla installed, cores to spare, not switched off."""
    if torch.device(device).type != "cuda" or os.environ.get(SWITCH, "").lower() in ("off", "0", "false"):
        return False
    if (os.cpu_count() or 1) < MIN_CPUS:
        return False
    return all(importlib.util.find_spec(name) is not None for name in ("triton", "fla"))


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
        if kinds[layer] in NOT_LAYERS or not hasattr(module, "gdn_config"):
            continue
        config = dict(module.gdn_config(), layer_idx=None)
        key = json.dumps([kinds[layer], config], sort_keys=True, default=str)
        jobs.setdefault(key, {"mixer": kinds[layer], "config": config, "uses": uses})
    return list(jobs.values())


class KernelWarmup:
    """The helper process, from start until close; it takes one job (send)."""

    def __init__(self, process: subprocess.Popen):
        self.process, self.sent = process, False

    @classmethod
    def start(cls, device) -> "KernelWarmup | None":
        """The helper for `device`, when one would pay (warmup_wanted); else None."""
        if not warmup_wanted(device):
            return None
        device = torch.device(device)
        index = device.index if device.index is not None else torch.cuda.current_device()
        return cls.spawn(f"cuda:{index}")

    @classmethod
    def spawn(cls, device: str) -> "KernelWarmup | None":
        """The helper on `device`, unconditionally (None if it cannot start); its output is discarded."""
        try:
            process = subprocess.Popen([sys.executable, "-m", HELPER, device], stdin=subprocess.PIPE,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            return None
        return cls(process)

    def send(self, graph, runs: list) -> bool:
        """Give the helper the graph's converted layers and `runs` (PassManager.layer_runs), once:
        False (nothing sent) while the graph has no converted layer to warm or no run is left."""
        if self.sent or not runs:
            return False
        jobs = layer_jobs(graph, runs)
        if not jobs:
            return False
        self.sent = True
        try:
            self.process.stdin.write(json.dumps({"layers": jobs}, default=str) + "\n")
            self.process.stdin.close()
        except (OSError, ValueError):  # the helper already ended: nothing to warm
            pass
        return True

    def close(self) -> None:
        """Stop the helper if it is still running (what it compiled so far stays in the cache)."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.close()


@contextmanager
def kernel_warmup(device, wanted: bool = True):
    """A KernelWarmup for `device` while the block runs (None where none starts, or not `wanted`)."""
    warmup = KernelWarmup.start(device) if wanted else None
    try:
        yield warmup
    finally:
        if warmup is not None:
            warmup.close()
