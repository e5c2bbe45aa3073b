"""Tuned launch configs for fla's Triton kernels, shipped per GPU, so a fresh machine does not autotune.

fla decorates most of its kernels with Triton's autotuner: the first call of each kernel for a new key (head counts,
head sizes, chunk size, dtypes; not the sequence length) compiles and times every candidate config. On a fresh H200
that is most of the first `surgery apply`'s time (bench/RESULTS.md, fifteenth session). The winners depend on the
GPU, Triton and fla, not on the weights: recorded once on a GPU (`python -m tcal.kernel_configs record OUT.json -m
surgery.cli.app apply ...`) and shipped in kernel_configs/<GPU>-triton-<version>.json (table_name; NVIDIA_H200's for
Triton 3.7.1: SmolLM2's 20 keys of 13 kernels, recorded from a cold `surgery apply` of SmolLM2; with it the same
cold run took 55.4 s against 201-216 s, bench/RESULTS.md, sixteenth session; NVIDIA_H100_80GB_HBM3's for 3.7.1: the
same run's 18 keys recorded on an H100, whose first `surgery apply` took 41.3 s with it, 46.0 s with the H200's
table and 164.2 s autotuning, bench/RESULTS.md, fifty-sixth session; and its table for Triton 3.9.0, what `pip install
torch` 2.15 brings, whose winners differ from 3.7.1's for 11 of the 18 keys: 48.5 s against 227.4 s, fifty-seventh
session), they are put into each autotuner's cache when
fla is first imported, so a kernel whose key was recorded compiles one config and runs it. A GPU with no table of
its own takes the winners recorded on another GPU of the same compute capability (an H100 the H200's: the same
instructions and shared memory the configs were chosen within), its own table first where both hold a key. A Triton
no table was recorded with (`pip install torch` 2.14 brings 3.8, 2.12 3.7.0, 2.11 3.6) borrows the winners recorded
with the nearest one, where fla offers that config under this Triton too; a borrowed config this Triton cannot build
(a compile error, before anything runs) makes that kernel autotune instead of failing (borrow_guard). Not yet timed on a
GPU: how far a borrowed winner is from this Triton's own. Anything else (another architecture or fla, a key not
recorded) autotunes as before.
SURGERY_KERNEL_CONFIGS=off turns this off.
The keys hold head counts and sizes, so each teacher shape is recorded once: `record` into the shipped
file adds that run's keys to the ones there. NVIDIA_H200's 3.7.1 table also holds Gemma-3-270M's (4 heads of 256,
27 keys recorded from a Taylor-Calibrate init and its distillation): its `surgery apply` with empty Triton
and Inductor caches took 97.0 s where building the same init while autotuning took 393.5 s
(bench/RESULTS.md, twenty-fourth session), and the kda, mamba2 and gla mixers' kernels at SmolLM2's
shapes (43 keys recorded from the mixers ablation, whose first alignments autotuned for 127-329 s;
twenty-sixth session), and a Llama-3-8B-shaped hybrid's GDN layers (32 heads of 128; 14 keys recorded from
its first distillation steps, which autotuned for about 2 min 50 s; twenty-seventh session), and the split
state pass's kernels at SmolLM2's shapes (tcal/split_state.py: fla's pre-scan and merge, and its state pass
from given states, with and without a final state; recorded from `bench/speed.py --sections state_splits`,
thirty-first session).
"""
from __future__ import annotations

import json
import os
import re
import runpy
import sys
from pathlib import Path

import torch

from .kernels import version_tuple
from .switches import enabled

DIRECTORY = Path(__file__).with_name("kernel_configs")
SWITCH = "SURGERY_KERNEL_CONFIGS"  # "off": let every kernel autotune
PREFIX = "fla."


def gpu_label() -> str:
    """The GPU's name as a file name (fla's own sanitising: 'NVIDIA H200' -> 'NVIDIA_H200')."""
    return re.sub(r"[^0-9A-Za-z]+", "_", torch.cuda.get_device_name(0)).strip("_") or "unknown_gpu"


def capability() -> str:
    """The GPU's compute capability, '9.0' for an H100 or H200: what decides whether a config compiles and fits."""
    major, minor = torch.cuda.get_device_capability(0)
    return f"{major}.{minor}"


def versions() -> dict:
    import importlib.metadata as metadata

    return {name: metadata.version(dist) for name, dist in (("triton", "triton"), ("fla", "fla-core"))}


def autotuners():
    """(qualified kernel name, Autotuner) for every autotuned kernel in the loaded fla modules."""
    from triton.runtime.autotuner import Autotuner

    seen = set()
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith(PREFIX) or module is None:
            continue
        for value in list(vars(module).values()):
            tuner = value
            while tuner is not None and not isinstance(tuner, Autotuner):  # @triton.heuristics wraps the tuner
                tuner = getattr(tuner, "fn", None)
            if tuner is None or id(tuner) in seen:
                continue
            seen.add(id(tuner))
            fn = tuner.fn
            while hasattr(fn, "fn"):
                fn = fn.fn
            yield f"{fn.__module__}.{fn.__name__}", tuner


def config_record(config) -> dict:
    return {"kwargs": dict(config.kwargs), "num_warps": config.num_warps, "num_stages": config.num_stages,
            "num_ctas": getattr(config, "num_ctas", 1), "maxnreg": getattr(config, "maxnreg", None)}


def recorded() -> dict:
    """What this process's autotuners chose, keyed by kernel: [{key, config}]."""
    kernels = {}
    for name, tuner in autotuners():
        entries = [{"key": list(key), "config": config_record(config)} for key, config in tuner.cache.items()]
        if entries:
            kernels[name] = entries
    return kernels


def write(path: Path) -> int:
    """Write this process's choices for this GPU into `path`, keeping the keys an existing table for
    the same GPU, Triton and fla holds (a table grows one teacher's shapes at a time: SmolLM2's
    head size 64, Gemma-3's 256); returns how many (kernel, key) pairs this process recorded."""
    kernels = recorded()
    table = {"gpu": gpu_label(), "capability": capability(), **versions(), "kernels": {}}
    path = Path(path)
    if path.exists():
        old = json.loads(path.read_text())
        if all(old.get(k) == v for k, v in table.items() if k != "kernels"):
            table["kernels"] = old.get("kernels", {})
    for name, entries in kernels.items():
        fresh = {json.dumps(e["key"]) for e in entries}
        table["kernels"][name] = [e for e in table["kernels"].get(name, []) if json.dumps(e["key"]) not in fresh] + entries
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)
    return sum(len(entries) for entries in kernels.values())


def table_name(table: dict) -> str:
    """A shipped table's file name: one per GPU and Triton version (fla's is pinned by pyproject)."""
    return f"{table['gpu']}-triton-{table['triton']}.json"


def all_tables() -> list[dict]:
    """Every shipped table of this GPU's compute capability and this fla (any GPU name, any Triton version); none
    where the switch is off or there is no GPU."""
    if not enabled(SWITCH, True) or not torch.cuda.is_available():
        return []
    wanted = {"fla": versions()["fla"], "capability": capability()}
    tables = [json.loads(path.read_text()) for path in sorted(DIRECTORY.glob("*.json"))]
    return [t for t in tables if all(t.get(k) == v for k, v in wanted.items())]


def shipped_tables() -> list[dict]:
    """The shipped tables for this GPU's architecture, Triton and fla, this GPU's own first, then those recorded
    on other GPUs of the same compute capability (by name); none where the switch is off or there is no GPU."""
    here = versions()["triton"]
    return sorted((t for t in all_tables() if t.get("triton") == here), key=lambda t: t.get("gpu") != gpu_label())


def borrowed_tables() -> list[dict]:
    """Tables of this compute capability and fla recorded under other Triton versions, the nearest release first
    (this GPU's own first within one): what serves a Triton no table was recorded with (pin_tuned_configs)."""
    here = versions()["triton"]
    mine = version_tuple(here) + (0, 0, 0)

    def nearness(table):  # the distance in major, then minor, then patch release; this GPU's own table first
        there = version_tuple(table["triton"]) + (0, 0, 0)
        return [abs(a - b) for a, b in zip(mine[:3], there[:3])], table.get("gpu") != gpu_label()

    return sorted((t for t in all_tables() if t.get("triton") != here), key=nearness)


def missing_note() -> str | None:
    """A line for the user whose run will not take the shipped launch configs as recorded: fla and a GPU are here
    but no table serves this Triton (the configs of the nearest one serve, or every kernel autotunes); None where
    one does, the switch is off, or there is no GPU, Triton or fla."""
    if not enabled(SWITCH, True) or not torch.cuda.is_available():
        return None
    try:
        found = versions()
    except ImportError:  # importlib.metadata.PackageNotFoundError: no Triton or fla here, so no fla kernels
        return None
    if shipped_tables():
        return None
    where = f"{gpu_label()} (compute capability {capability()}) with Triton {found['triton']} and fla {found['fla']}"
    if borrowed := borrowed_tables():
        nearest = ", ".join(dict.fromkeys(t["triton"] for t in borrowed))
        return (f"no launch configs for fla's kernels were recorded on {where}: the winners recorded with the nearest "
                f"Triton serve instead ({nearest}, in that order; a kernel whose config this Triton cannot build autotunes)")
    return (f"no launch configs for fla's kernels ship for {where}: each kernel autotunes on its first use (a first "
            "`surgery apply` of SmolLM2 took 164 s on an H100 so, 41 s with a table); fla keeps the winners for later runs")


def as_key(value):
    """A recorded key back as the autotuner's hashable tuple (JSON turned its tuples into lists)."""
    return tuple(as_key(v) for v in value) if isinstance(value, list) else value


def as_config(record: dict):
    """A recorded config back as a triton.Config."""
    import triton

    extra = {"maxnreg": record["maxnreg"]} if record.get("maxnreg") is not None else {}
    return triton.Config(record["kwargs"], num_warps=record["num_warps"], num_stages=record["num_stages"],
                         num_ctas=record.get("num_ctas", 1), **extra)


def pin_tuned_configs() -> int:
    """Put the shipped winners into fla's autotuner caches (idempotent; a key already there, or pinned from a
    table earlier in shipped_tables' order, stays). Where no table holds a key for this Triton, the winner
    recorded under the nearest Triton (borrowed_tables) is pinned if it is one of this kernel's candidates here
    (a config fla does not offer under this Triton is never pinned), guarded: a borrowed config this Triton cannot
    build (shared memory, registers) drops the kernel's borrowed keys and the call autotunes (borrow_guard).
    Returns how many were pinned."""
    tables, borrowed = shipped_tables(), borrowed_tables()
    if not tables and not borrowed:
        return 0
    if borrowed:
        import triton.errors  # noqa: F401  (borrow_guard's; a Triton without it fails here, before any cache changes)
    pinned = 0
    for name, tuner in autotuners():
        for entry in (e for table in tables for e in table["kernels"].get(name, [])):
            config = as_config(entry["config"])
            if tuner.cache.setdefault(as_key(entry["key"]), config) is config:
                pinned += 1
        lent = {}
        candidates = [config_record(c) for c in getattr(tuner, "configs", [])]
        for entry in (e for table in borrowed for e in table["kernels"].get(name, [])):
            config = as_config(entry["config"])
            if config_record(config) in candidates and tuner.cache.setdefault(as_key(entry["key"]), config) is config:
                lent[as_key(entry["key"])] = config
        if lent:
            borrow_guard(tuner, lent)
            pinned += len(lent)
    return pinned


def borrow_guard(tuner, lent: dict) -> None:
    """Make `tuner` survive a borrowed config (key -> config in its cache) that this Triton cannot build: Triton
    raises before anything runs, so the borrowed keys still in the cache are dropped and the call repeated, which
    autotunes as a kernel without a table does."""
    from triton.errors import TritonError

    run = tuner.run

    def guarded(*args, **kwargs):
        try:
            return run(*args, **kwargs)
        except TritonError:
            if not lent:
                raise
            for key, config in lent.items():
                if tuner.cache.get(key) is config:
                    del tuner.cache[key]
            lent.clear()
            return run(*args, **kwargs)

    tuner.run = guarded


def main(argv: list[str]) -> None:
    """record OUT.json -m MODULE ARGS...: run MODULE as a script in this process, then write its choices."""
    if len(argv) < 4 or argv[0] != "record" or argv[2] != "-m":
        raise SystemExit("usage: python -m tcal.kernel_configs record OUT.json -m MODULE [ARGS...]")
    out, module = Path(argv[1]), argv[3]
    os.environ[SWITCH] = "off"  # record what Triton's autotuner chooses, not what was shipped
    sys.argv = [module, *argv[4:]]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
    print(f"recorded {write(out)} tuned kernel configs for {gpu_label()} into {out}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
