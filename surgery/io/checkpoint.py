"""Save a hybrid to a directory and load it back from its recipe and the teacher's config alone.

DIR/model.safetensors (or model-0000i-of-0000n.safetensors + model.safetensors.index.json past the
shard limit), DIR/recipe.json, DIR/tokenizer/. Written into a temporary sibling directory and renamed
into place, so an interrupted save never leaves a half-written DIR or destroys an old one."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..core.files import sha256_file
from ..core.graph import Graph
from ..errors import CheckpointError
from . import recipe as recipes

DEFAULT_SHARD_BYTES = 2 * 1024**3
INDEX = "model.safetensors.index.json"


def unique_state(gm: torch.nn.Module) -> tuple[dict, dict]:
    """(state, aliases): one entry per distinct tensor (tied embeddings are stored once)."""
    state, aliases, seen = {}, {}, {}
    for name, tensor in gm.state_dict(keep_vars=False).items():
        key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride()) if tensor.numel() else None
        if key is not None and key in seen:
            aliases[name] = seen[key]
            continue
        if key is not None:
            seen[key] = name
        state[name] = tensor.detach().contiguous().cpu()
    return state, aliases


def _shards(state: dict, limit: int) -> list[dict]:
    shards, current, size = [], {}, 0
    for name, t in state.items():
        n = t.numel() * t.element_size()
        if current and size + n > limit:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += n
    return shards + [current] if current or not shards else shards


def save(graph: Graph, out: str | Path, *, force: bool = False, shard_bytes: int = DEFAULT_SHARD_BYTES,
         extra: Callable[[Path], None] | None = None) -> Path:
    """extra(staging_dir) writes further files (e.g. a training state) that appear with the
    checkpoint in the same final rename."""
    out = Path(out)
    if out.exists() and not force:
        raise CheckpointError(f"'{out}' already exists.", "Choose another --out, or pass --force to replace it.")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        state, aliases = unique_state(graph.gm)
        shards = _shards(state, shard_bytes)
        files = {}
        if len(shards) == 1:
            save_file(shards[0], tmp / "model.safetensors", metadata={"format": "pt"})
            files["model.safetensors"] = sha256_file(tmp / "model.safetensors")
        else:
            index = {}
            for i, shard in enumerate(shards, 1):
                name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, tmp / name, metadata={"format": "pt"})
                files[name] = sha256_file(tmp / name)
                index.update({k: name for k in shard})
            (tmp / INDEX).write_text(json.dumps({"weight_map": index}, indent=1))
        weights = {"files": files, "aliases": aliases, "tensors": len(state)}
        (tmp / "recipe.json").write_text(json.dumps(recipes.build(graph, weights), indent=1))
        if graph.tokenizer is not None:
            graph.tokenizer.save_pretrained(tmp / "tokenizer")
        if extra is not None:
            extra(tmp)
        _swap_in(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _swap_in(tmp: Path, out: Path) -> None:
    """Rename tmp onto out; an existing out is moved aside first and deleted only after."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def read_recipe(path: str | Path) -> dict:
    path = Path(path)
    file = path / "recipe.json"
    if not file.exists():
        raise CheckpointError(f"'{path}' has no recipe.json.", "Point at a directory written by `surgery apply --out`.")
    try:
        recipe = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"'{file}' is not valid JSON ({exc.msg} at line {exc.lineno}).", "The checkpoint is corrupt; write it again.") from exc
    recipes.check(recipe, str(path))
    return recipe


def _load_weights(path: Path, recipe: dict, verify: bool) -> dict:
    state = {}
    for name, digest in recipe["weights"]["files"].items():
        file = path / name
        if not file.exists():
            raise CheckpointError(f"Weights file '{file}' is missing.", "The checkpoint is incomplete; write it again.")
        if verify and sha256_file(file) != digest:
            raise CheckpointError(f"Weights file '{file}' does not match the sha256 in recipe.json (truncated or modified).", "Write the checkpoint again.")
        try:
            state.update(load_file(file))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"Weights file '{file}' cannot be read: {exc}.", "The file is corrupt; write the checkpoint again.") from exc
    for alias, name in recipe["weights"].get("aliases", {}).items():
        state[alias] = state[name]
    return state


def teacher_config(recipe: dict):
    from transformers import AutoConfig

    config = dict(recipe["config"])
    model_type = config.pop("model_type", recipe.get("model_type"))
    try:
        return AutoConfig.for_model(model_type, **config)
    except Exception as exc:
        raise CheckpointError(f"transformers cannot rebuild a '{model_type}' config from the recipe: {exc}.", "Use the transformers version in recipe.json's versions.") from exc


def load(path: str | Path, *, device=None, dtype: torch.dtype | None = None, verify: bool = True) -> Graph:
    """Rebuild the hybrid: teacher architecture from its config (random weights), capture, replay the
    structural passes from the recipe's decisions, then load the saved weights (strictly)."""
    from transformers import AutoModelForCausalLM

    from ..core.capture import capture_graph
    from ..core.pipeline import get_pass, lint
    from ..sites import find_sites

    path = Path(path)
    recipe = read_recipe(path)
    state = _load_weights(path, recipe, verify)
    config = teacher_config(recipe)
    saved_dtype = getattr(torch, recipe["capture"].get("dtype", "float32"))
    dtype = dtype or saved_dtype
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=config._attn_implementation or "sdpa").eval()
    graph = capture_graph(model, max_length=recipe["capture"].get("max_length"), device=device, dtype=dtype)
    graph.sites = find_sites(graph)
    graph.source = recipe["source"]
    if len(graph.sites) != len(recipe["sites"]):
        raise CheckpointError(f"The rebuilt teacher has {len(graph.sites)} attention layers, the recipe {len(recipe['sites'])}.", "The transformers version differs too much from the one that wrote it.")
    for entry in recipe["passes"]:
        decisions = recipe["decisions"].get(entry["pass"])
        if decisions is not None:
            get_pass(entry["pass"], entry["config"]).replay(graph, decisions)
            lint(graph)
    graph.history = list(recipe["passes"])
    graph.meta.update(recipe.get("results", {}))
    missing, unexpected = _compare_keys(graph.gm, state)
    if missing or unexpected:
        raise CheckpointError(
            f"The weights in '{path}' do not match the rebuilt hybrid: {len(missing)} missing (e.g. {missing[:3]}), {len(unexpected)} unexpected (e.g. {unexpected[:3]}).",
            "The checkpoint and its recipe disagree; write it again.",
        )
    with torch.no_grad():
        graph.gm.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}, strict=True)
    tok = path / "tokenizer"
    if tok.exists():
        from transformers import AutoTokenizer

        graph.tokenizer = AutoTokenizer.from_pretrained(tok)
    graph.teacher = None  # the teacher's weights are not in a checkpoint
    return graph


def _compare_keys(gm, state: dict) -> tuple[list, list]:
    expected = set(gm.state_dict().keys())
    return sorted(expected - set(state)), sorted(set(state) - expected)
