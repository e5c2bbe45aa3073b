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

from ..core import progress
from ..core.files import apply_umask, sha256_file
from ..core.graph import Graph
from ..core.rewrite import computed_buffers
from ..errors import CheckpointError, SurgeryError, first_line
from . import recipe as recipes
from .json_safe import read_json
from .layouts import refuse_sharded
from .lock import holds_output
from .pinned import read_one_version
from .outdir import EXTRA_FILES, check_replaceable, clean_stale_staging, describe_os_error, hybrid_leftovers, staging_prefix
from .tokenizer_check import save_tokenizer

DEFAULT_SHARD_BYTES = 2 * 1024**3
INDEX = "model.safetensors.index.json"


def unique_state(gm: torch.nn.Module, weights=None) -> tuple[dict, dict]:
    """(state, aliases): one entry per distinct tensor (tied embeddings are stored once). With the
    files of an offloaded teacher (Graph.weights), its meta tensors stay meta (write_weights reads
    them a shard at a time) and are told apart by the tensor the files hold."""
    state, aliases, seen = {}, {}, {}
    for name, tensor in gm.state_dict(keep_vars=False).items():
        if tensor.device.type == "meta" and weights is None:
            raise CheckpointError(f"The tensor '{name}' has no values here (a teacher converted layer by layer keeps its weights in its files).",
                                  "Save the hybrid with surgery.save (it reads them from the files) and export or load the saved directory.")
        if tensor.device.type == "meta":
            key = ("file", weights.stored_name(name))
        else:
            key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride()) if tensor.numel() else None
        if key is not None and key in seen:
            aliases[name] = seen[key]
            continue
        if key is not None:
            seen[key] = name
        state[name] = tensor.detach() if tensor.device.type == "meta" else tensor.detach().contiguous().cpu()
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


@holds_output("out")  # one writer per output directory (surgery.io.lock), for the whole save
def save(graph: Graph, out: str | Path, *, force: bool = False, shard_bytes: int = DEFAULT_SHARD_BYTES,
         extra: Callable[[Path], None] | None = None) -> Path:
    """extra(staging_dir) writes further files (e.g. a training state) that appear with the
    checkpoint in the same final rename. force replaces only a hybrid or run directory surgery
    wrote, never one that holds the graph's own source (outdir.check_replaceable)."""
    out = Path(out)
    check_replaceable(out, force=force, inputs=source_paths(graph.source))

    def write(tmp: Path) -> None:
        write_hybrid(graph, tmp, shard_bytes)
        if extra is not None:
            extra(tmp)
            record_extra_files(tmp)

    with progress.task("save"):  # no count: a line each interval while a large model's weights are written
        return write_staged(out, write)


def write_staged(out: Path, write: Callable[[Path], None], what: str = "Saving the hybrid") -> Path:
    """write(staging_dir) fills a temporary sibling of `out`, which is then renamed onto `out` (an
    old `out` is moved aside first and deleted only after): an interrupted writer never leaves a
    half-written `out` nor destroys the old one. OS errors become one CheckpointError naming `what`.
    What is published has the modes the user's umask gives (0755/0644 under umask 022)."""
    clean_stale_staging(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=staging_prefix(out), dir=out.parent))
    except OSError as exc:
        raise write_error(exc, out, what) from exc
    try:
        write(tmp)
        apply_umask(tmp)  # mkdtemp made it 0700 (and safetensors writes 0600): published with the user's umask
        _swap_in(tmp, out)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if (isinstance(exc, OSError) and exc.errno is not None) or isinstance(exc, SafetensorError):
            raise write_error(exc, out, what) from exc
        raise
    return out


def write_hybrid(graph: Graph, folder: Path, shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
    """The weights (sharded past shard_bytes), recipe.json and tokenizer/ into `folder`."""
    state, aliases = unique_state(graph.gm, graph.weights)
    read = (lambda name: graph.weights.load(name, "cpu", graph.dtype)) if graph.weights is not None else None
    files = write_weights(state, folder, shard_bytes, read=read)
    weights = {"files": files, "aliases": aliases, "tensors": len(state)}
    (folder / "recipe.json").write_text(json.dumps(recipes.build(graph, weights), indent=1, allow_nan=False))
    if graph.tokenizer is not None:
        save_tokenizer(graph.tokenizer, folder / "tokenizer")  # reloaded and compared: a mismatch saves nothing


def write_weights(state: dict, folder: Path, shard_bytes: int = DEFAULT_SHARD_BYTES, index_metadata: dict | None = None,
                  read: Callable[[str], torch.Tensor] | None = None) -> dict:
    """model.safetensors, or shards and their index past shard_bytes; returns {file: sha256}.
    read(name) gives the values of meta tensors, one shard's at a time (an offloaded teacher)."""
    shards = _shards(state, shard_bytes)

    def fill(shard: dict) -> dict:
        return shard if read is None else {k: read(k) if t.device.type == "meta" else t for k, t in shard.items()}

    files = {}
    if len(shards) == 1:
        save_file(fill(shards[0]), folder / "model.safetensors", metadata={"format": "pt"})
        files["model.safetensors"] = sha256_file(folder / "model.safetensors")
        return files
    index = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(fill(shard), folder / name, metadata={"format": "pt"})
        files[name] = sha256_file(folder / name)
        index.update({k: name for k in shard})
    head = {"metadata": index_metadata} if index_metadata is not None else {}
    (folder / INDEX).write_text(json.dumps({**head, "weight_map": index}, indent=1))
    return files


def record_extra_files(folder: Path) -> None:
    """Name in recipe.json what save's `extra` added, so a later --force knows them as the project's."""
    added = hybrid_leftovers(folder)
    if added:
        recipe = json.loads((folder / "recipe.json").read_text())
        recipe[EXTRA_FILES] = [name.rstrip("/") for name in added]
        (folder / "recipe.json").write_text(json.dumps(recipe, indent=1))


def source_paths(source) -> list[Path]:
    """The files a graph was captured from (its recipe's source), which save must never replace."""
    if not isinstance(source, dict) or not source.get("path"):
        return []
    folder = Path(source["path"])
    return [folder / source["gguf_file"]] if source.get("gguf_file") else [folder]


def write_error(exc: Exception, out: Path, what: str = "Saving the hybrid") -> CheckpointError:
    """A full disk, a read-only or unwritable --out during save: one paragraph, not a traceback."""
    reason = describe_os_error(exc, out) if isinstance(exc, OSError) else f"'{out}': {first_line(exc)}"
    return CheckpointError(f"{what} failed: {reason}.", "Free space or choose a writable --out; nothing was replaced and no partial output is left.")


def _swap_in(tmp: Path, out: Path) -> None:
    """Rename tmp onto out; an existing out is moved aside first and deleted only after."""
    old = None
    if os.path.lexists(out):
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def read_recipe(path: str | Path, folder: Path | None = None) -> dict:
    """path/recipe.json, checked; read from `folder` when given (surgery.io.pinned's handle on path)."""
    path = Path(path)
    file, shown = Path(folder or path) / "recipe.json", path / "recipe.json"
    if not file.exists():
        refuse_sharded(path)
        raise CheckpointError(f"'{path}' has no recipe.json.", "Point at a directory written by `surgery apply --out`.")
    recipe = read_json(file, CheckpointError, "The checkpoint is corrupt; write it again.", name=shown)
    recipes.check(recipe, str(path))
    return recipe


def _load_weights(path: Path, recipe: dict, verify: bool, folder: Path | None = None) -> dict:
    state = {}
    for name, digest in recipe["weights"]["files"].items():
        file, shown = Path(folder or path) / name, path / name
        if not file.exists():
            raise CheckpointError(f"Weights file '{shown}' is missing.", "The checkpoint is incomplete; write it again.")
        if verify and sha256_file(file) != digest:
            raise CheckpointError(f"Weights file '{shown}' does not match the sha256 in recipe.json (truncated or modified).", "Write the checkpoint again.")
        try:
            state.update(load_file(file))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"Weights file '{shown}' cannot be read: {exc}.", "The file is corrupt; write the checkpoint again.") from exc
    for alias, name in recipe["weights"].get("aliases", {}).items():
        if name not in state:
            raise CheckpointError(f"{path}/recipe.json: weights.aliases[{alias!r}] = {name!r} names no stored tensor.", recipes.RECIPE_FIX)
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
    path = Path(path)
    with progress.task("load") as bar:  # no count: a line each interval says which stage runs
        bar.update(info=f"reading {path}")
        recipe, state, tokenizer = read_hybrid(path, verify)
        bar.update(info="rebuilding the hybrid from its recipe")
        return rebuild(path, recipe, state, tokenizer, device, dtype)


def rebuild(path: Path, recipe: dict, state: dict, tokenizer, device, dtype) -> Graph:
    """The hybrid `recipe` describes, with the weights in `state` (load's second half)."""
    from ..core.capture import capture_graph
    from ..sites import find_sites

    config = teacher_config(recipe)
    saved_dtype = getattr(torch, recipe["capture"].get("dtype", "float32"))  # one of recipes.DTYPES (checked)
    dtype = dtype or saved_dtype
    model = build_teacher(config, dtype, recipe["capture"].get(recipes.ATTN_FIELD), path)
    graph = capture_graph(model, max_length=recipe["capture"].get("max_length"), device=device, dtype=dtype)
    graph.sites = find_sites(graph)
    graph.source = recipe["source"]
    if len(graph.sites) != len(recipe["sites"]):
        raise CheckpointError(f"The rebuilt teacher has {len(graph.sites)} attention layers, the recipe {len(recipe['sites'])}.", "The transformers version differs too much from the one that wrote it.")
    replay_passes(graph, recipe, path)
    graph.history = list(recipe["passes"])
    graph.meta.update(recipe.get("results", {}))
    computed = computed_buffers(graph.gm)  # torch 2.11-2.13 wrote them (surgery.core.rewrite.graph_module): the rebuilt value stays
    state = {k: v for k, v in state.items() if k not in computed}
    missing, unexpected = _compare_keys(graph.gm, state)
    if missing or unexpected:
        raise CheckpointError(
            f"The weights in '{path}' do not match the rebuilt hybrid: {len(missing)} missing (e.g. {missing[:3]}), {len(unexpected)} unexpected (e.g. {unexpected[:3]}).",
            "The checkpoint and its recipe disagree; write it again.",
        )
    check_shapes(graph.gm, state, recipe, path)
    with torch.no_grad():
        graph.gm.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}, strict=True)
    graph.tokenizer = tokenizer
    graph.teacher = None  # the teacher's weights are not in a checkpoint
    return graph


def build_teacher(config, dtype: torch.dtype, attn_implementation: str | None, path: Path):
    """The teacher's architecture with random weights, in the attention implementation it was
    captured with; None (a recipe from before it was recorded): transformers' own choice, SDPA where
    the model class supports it, else eager. transformers' refusals become one CheckpointError."""
    from transformers import AutoModelForCausalLM

    impl = f"attention implementation {attn_implementation!r}" if attn_implementation else "its default attention implementation"
    try:
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation).eval()
    except Exception as exc:  # ValueError (unsupported implementation), ImportError (flash-attn missing), ...
        raise CheckpointError(
            f"transformers {transformers_version()} cannot build the '{config.model_type}' teacher of '{path}' with {impl}: {first_line(exc)}",
            "Load it where that attention implementation is available (recipe.json's capture.attn_implementation and versions say what wrote it).",
        ) from exc


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def read_hybrid(path: str | Path, verify: bool = True) -> tuple:
    """(recipe, weights, tokenizer or None) of the hybrid at `path`, all of one version of it
    (surgery.io.pinned): a save that replaces `path` meanwhile is never mixed in."""
    path = Path(path)
    return read_one_version(path, lambda folder: read_files(path, folder, verify))


def read_files(path: Path, folder: Path, verify: bool) -> tuple:
    """read_hybrid's files, read from `folder` (a handle on one version of `path`, which messages name)."""
    recipe = read_recipe(path, folder)
    state = _load_weights(path, recipe, verify, folder)
    tokenizer = None
    if (Path(folder) / "tokenizer").exists():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(Path(folder) / "tokenizer")
        tokenizer.name_or_path = str(path / "tokenizer")
    return recipe, state, tokenizer


def _compare_keys(gm, state: dict) -> tuple[list, list]:
    expected = set(gm.state_dict().keys())
    return sorted(expected - set(state)), sorted(set(state) - expected)


def replay_passes(graph: Graph, recipe: dict, path: Path) -> None:
    """The structural passes of the recipe, in order, from their decisions; a recipe whose pass,
    config or decisions cannot be replayed is a damaged checkpoint, named by its field."""
    from ..core.pipeline import get_pass, lint

    for i, entry in enumerate(recipe["passes"]):
        decisions = recipe["decisions"].get(entry["pass"])
        if decisions is None:
            continue
        try:
            step = get_pass(entry["pass"], entry.get("config"))
        except SurgeryError as exc:
            raise CheckpointError(f"{path}/recipe.json: passes[{i}] ({entry['pass']!r}): {exc.problem}", recipes.RECIPE_FIX) from exc
        try:
            step.replay(graph, decisions)
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}/recipe.json: decisions.{entry['pass']} cannot be replayed ({type(exc).__name__}: {first_line(exc)}).",
                                  recipes.RECIPE_FIX) from exc
        lint(graph)


def check_shapes(gm: torch.nn.Module, state: dict, recipe: dict, path: Path) -> None:
    """Every stored tensor has the shape the rebuilt hybrid expects; a GDN's is named by its
    recipe field (decisions.replace.modules[...].gdn_config)."""
    modules = recipe["decisions"].get("replace", {}).get("modules", {})
    for name, expected in gm.state_dict().items():
        stored = state[name]
        if tuple(stored.shape) == tuple(expected.shape):
            continue
        owner = [k for k, m in modules.items() if name.startswith(m["target"] + ".")]
        field = f"decisions.replace.modules[{owner[0]!r}].gdn_config" if owner else "config"
        raise CheckpointError(
            f"{path}/recipe.json: {field} builds '{name}' with shape {list(expected.shape)}, the weights hold {list(stored.shape)}.",
            recipes.RECIPE_FIX)
