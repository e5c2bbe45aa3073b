"""Compile a converted layer's kernels before the passes need them, in a helper process.

On a fresh GPU Triton compiles each kernel a layer runs on its first call: fla's chunked forward and
backward cost about 11 s of a cold `surgery apply`'s align on the H200, on one core while the others
idled (bench/RESULTS.md, twenty-first and twenty-second sessions). `surgery apply` starts this module
as a helper process (surgery.core.kernel_warmup) before it loads the teacher; the helper imports fla
(its shipped launch configs pinned, tcal.kernel_configs) while the main process loads and captures,
then runs each distinct converted layer once the way the passes will (the same class, config, batch
shape and dtypes, so the same kernel specialisations) on random inputs. Triton keeps what it compiles
in its on-disk cache, where the main process finds it. Nothing the helper computes is used, so a
helper that fails or is stopped costs the main process nothing.

    python -m tcal.warm_kernels DEVICE   # then one JSON line on stdin:
    {"layers": [{"mixer": "gdn", "config": {...gdn_config...}, "uses": [["train", 16, 256], ["infer", 16, 256, "bfloat16"]]}]}

"train": one step of align's loop (tcal.phase2, float32, forward and backward); "infer": a forward
without gradient in the given dtype (calibrate's)."""
from __future__ import annotations

import json
import sys

import torch

from .kernels import fla_available
from .mixers import get_mixer
from .phase2 import AlignOptions, align_layers

USES = ("train", "infer")
JOB_MIN_FREE = 8 * 2**30  # device bytes free when the job comes (the teacher loaded): below, the passes need them more
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def warm_layer(mixer: str, config: dict, uses: list, device: torch.device) -> None:
    """Run a fresh layer of `mixer` built from `config` once per use, on random inputs (a mixer that
    replaces the attention op, not the layer, runs the teacher's projections and has nothing to warm)."""
    entry = get_mixer(mixer)
    if entry.replaces != "layer":
        return
    layer = entry.module.from_gdn_config(config).to(device)
    for use in uses:
        kind, batch, tokens = use[0], int(use[1]), int(use[2])
        if kind not in USES:
            raise ValueError(f"unknown use {kind!r}; one of {USES}")
        x = torch.randn(batch, tokens, layer.hidden_size, device=device)
        if kind == "train":
            align_layers({0: layer}, {0: (x, torch.zeros_like(x))}, AlignOptions(steps=1))
        else:
            dtype = DTYPES[use[3]]
            with torch.no_grad():
                layer.to(dtype)(x.to(dtype))


def run(job: dict, device: torch.device) -> None:
    for entry in job["layers"]:
        warm_layer(entry["mixer"], entry["config"], entry["uses"], device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # every launch compiled and run before the process ends


def main(argv: list[str]) -> int:
    device = torch.device(argv[0] if argv else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        ones = torch.ones(16, 16, device=device)  # the CUDA context and cuBLAS, loaded (and their files read from disk)
        ones @ ones                                # while the main process is still loading the teacher
        if not fla_available():  # imports fla and pins the shipped launch configs; without it nothing to compile
            return 0
    line = sys.stdin.readline()
    if not line.strip() or not room_for_job(device):  # nothing sent (or the main process ended first); or no memory to spare
        return 0
    run(json.loads(line), device)
    return 0


def room_for_job(device: torch.device) -> bool:
    """Whether the device has JOB_MIN_FREE bytes free (the CPU: always)."""
    return device.type != "cuda" or torch.cuda.mem_get_info(device)[0] >= JOB_MIN_FREE


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
