"""The trainer state a checkpoint holds beside its weights: step, stage, optimizer, scheduler, RNG
states, config. Files are data, never pickle: every tensor (optimizer moments, RNG states as uint8
tensors) goes to trainer_state.safetensors, everything else to trainer_state.json, with markers
that rebuild the tuples, integer-keyed dicts and numpy arrays torch and numpy hand back. Reading
one runs no code from the file, so a planted checkpoint cannot execute anything on --resume."""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..errors import DistillError
from ..io.json_safe import read_json

STATE_VERSION = 2
STATE_JSON, STATE_TENSORS = "trainer_state.json", "trainer_state.safetensors"
LEGACY_STATE = "trainer_state.pt"  # version 1: a pickle, never read
TENSOR, TUPLE, ITEMS, ARRAY = "__tensor__", "__tuple__", "__items__", "__ndarray__"


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def encode(value, path: str, tensors: dict):
    """value as JSON data; its tensors move to `tensors` under their path and leave a marker."""
    if isinstance(value, torch.Tensor):
        tensors[path] = value.detach().cpu().contiguous()
        return {TENSOR: path}
    if isinstance(value, np.ndarray):
        return {ARRAY: value.tolist(), "dtype": value.dtype.str}
    if isinstance(value, (list, tuple)):
        items = [encode(v, f"{path}.{i}", tensors) for i, v in enumerate(value)]
        return {TUPLE: items} if isinstance(value, tuple) else items
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {k: encode(v, f"{path}.{k}", tensors) for k, v in value.items()}
        return {ITEMS: [[k, encode(v, f"{path}.{k}", tensors)] for k, v in value.items()]}
    if isinstance(value, np.generic):
        return value.item()
    return value


def decode(value, tensors: dict):
    """The inverse of encode."""
    if isinstance(value, list):
        return [decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if TENSOR in value:
        return tensors[value[TENSOR]]
    if ARRAY in value:
        return np.array(value[ARRAY], dtype=np.dtype(value["dtype"]))
    if TUPLE in value:
        return tuple(decode(v, tensors) for v in value[TUPLE])
    if ITEMS in value:
        return {k: decode(v, tensors) for k, v in value[ITEMS]}
    return {k: decode(v, tensors) for k, v in value.items()}


def write_state(folder: Path, state: dict) -> None:
    tensors: dict = {}
    data = encode({"version": STATE_VERSION, **state}, "state", tensors)
    save_file(tensors, folder / STATE_TENSORS)
    (folder / STATE_JSON).write_text(json.dumps(data))


def has_state(folder: Path) -> bool:
    """Whether folder is a finished checkpoint of this or an older version."""
    return (folder / STATE_JSON).exists() or (folder / LEGACY_STATE).exists()


def read_state(folder: Path) -> dict:
    """The state write_state wrote; a checkpoint of an older version (a pickle) is refused unread."""
    file = folder / STATE_JSON
    if not file.exists():
        raise DistillError(f"The checkpoint '{folder}' was written by an older version of surgery ({LEGACY_STATE}, a pickle); it cannot be resumed safely.",
                           "Start a new run (another --out, or --force); its weights still load with surgery.load.")
    try:
        data = read_json(file, DistillError, "The checkpoint is corrupt; resume from an earlier one (delete this one) or start a new run.")
        tensors = load_file(folder / STATE_TENSORS)
    except (SafetensorError, OSError) as exc:
        raise DistillError(f"The trainer state in '{folder}' cannot be read ({exc}).", "The checkpoint is corrupt; resume from an earlier one (delete this one) or start a new run.") from exc
    if data.get("version") != STATE_VERSION:
        raise DistillError(f"The trainer state in '{folder}' has version {data.get('version')}, this surgery reads version {STATE_VERSION}.",
                           "Resume with the surgery version that wrote it, or start a new run.")
    return decode(data, tensors)
