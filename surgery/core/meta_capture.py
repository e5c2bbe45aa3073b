"""Capture a teacher that does not fit the compute device: the model is built and traced on the meta
device (shapes only, no weight bytes), and its weights stay in the teacher's files (WeightFiles for
safetensors, GGUFWeights for a .gguf),
read a layer at a time by the layer-streamed run (surgery.core.streamed).

Only what no file holds is made real: the buffers a model computes in __init__ (RoPE frequencies),
recomputed by transformers' own initialisation as its from_pretrained does after a meta build."""
from __future__ import annotations

from pathlib import Path

import torch

from ..errors import ModelLoadError, first_line
from . import progress
from .capture import export_model, max_positions, to_compute
from .graph import Graph
from .gguf_weights import GGUFWeights
from .load import check_gguf, folder_tokenizer, gguf_adds_bos, one_gguf_parse, resolve
from .weight_files import WeightFiles

META = torch.device("meta")


def meta_model(folder: Path, gguf: str | None = None):
    """The teacher's architecture from its config.json or GGUF metadata (meta_model_of)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(folder, **({"gguf_file": gguf} if gguf else {}))
    except Exception as exc:
        what = f"the GGUF file '{folder / gguf}'" if gguf else f"'{folder}/config.json'"
        raise ModelLoadError(f"transformers cannot read {what}: {first_line(exc)}", "Check that the file holds a complete model.") from exc
    return meta_model_of(config)


def meta_model_of(config, attn_implementation: str = "sdpa"):
    """A causal LM of `config` with every parameter on meta and its computed (non-persistent)
    buffers real on the CPU."""
    from transformers import AutoModelForCausalLM

    with torch.device(META):
        try:
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
        except ValueError:  # a class without SDPA: eager, as load_model falls back
            model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    for key, buffer in list(model.named_non_persistent_buffers()):
        owner, _, name = key.rpartition(".")
        model.get_submodule(owner)._buffers[name] = torch.empty_like(buffer, device="cpu")
    model.initialize_weights()  # parameters on meta cost nothing; the buffers get their values
    return model.eval()


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """name -> every other name of the same parameter object (tied embeddings), both ways."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return {a: b for names in groups.values() for a in names for b in names if a != b}


def retarget(gm: torch.fx.GraphModule, device: torch.device) -> int:
    """Replace the meta device that export baked into arange/to/... by the compute device."""
    moved = 0

    def swap(value):
        nonlocal moved
        if isinstance(value, torch.device) and value.type == "meta":
            moved += 1
            return device
        return value

    for n in gm.graph.nodes:
        n.args = tuple(swap(a) for a in n.args)
        n.kwargs = {k: swap(v) for k, v in n.kwargs.items()}
    gm.recompile()
    return moved


def capture_offloaded(source, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                      max_length: int | None = None, debug: bool = False) -> Graph:
    """A model directory (config.json + safetensors) or a .gguf -> Graph whose parameters are meta
    tensors, read from the files on demand (capture_meta)."""
    path = resolve(source)
    single = _gguf_of(path)
    if single is None and not (path.is_dir() and (path / "config.json").is_file()):
        raise ModelLoadError(f"'{source}' is neither a model directory with config.json nor a .gguf file: layer-by-layer conversion reads one of them.",
                             "Pass the teacher's directory (config.json + *.safetensors) or its .gguf, or drop --offload-layers.")
    folder, gguf = (single.parent, single.name) if single is not None else (path, None)
    reader = check_gguf(single) if single is not None else None
    with progress.task("capture") as bar, one_gguf_parse(single, reader):
        bar.update(info="building the architecture on the meta device")
        model = meta_model(folder, gguf)
        weights = GGUFWeights(single, reader, model, tied_aliases(model)) if gguf else WeightFiles(folder, tied_aliases(model))
        tokenizer = folder_tokenizer(folder, gguf, gguf_adds_bos(reader))
    info = {"kind": "gguf" if gguf else "dir", "path": str(folder.resolve()), "gguf_file": gguf, "name": str(source)}
    return capture_meta(model, weights, device=device, dtype=dtype, max_length=max_length, debug=debug, source=info, tokenizer=tokenizer)


def _gguf_of(path: Path) -> Path | None:
    """The .gguf a path names (the file, or the only one in a directory without config.json)."""
    if path.is_file() and path.suffix == ".gguf":
        return path
    found = sorted(path.glob("*.gguf")) if path.is_dir() and not (path / "config.json").exists() else []
    return found[0] if len(found) == 1 else None


def capture_meta(model, weights, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                 max_length: int | None = None, debug: bool = False, source: dict | None = None, tokenizer=None) -> Graph:
    """A model built on meta (meta_model_of) -> Graph whose parameters stay meta; `weights` (WeightFiles,
    or any source with `in`, stored_name, load(name, device, dtype) and nbytes) serves them, kept in
    graph.cache["weights"]; graph.meta["offload"] records the compute device and dtype."""
    device, dtype = torch.device(device), dtype or torch.float32
    buffers = {k: b.to(device) for k, b in model.named_buffers() if not b.is_meta}  # the computed ones (meta_model_of)
    model = to_compute(model, META, dtype)  # the dtype the graph bakes in; computed buffers keep theirs
    limit = max_length or max_positions(model.config)
    with progress.task("capture") as bar:
        bar.update(info="tracing with torch.export on the meta device")
        gm = export_model(model, limit, debug=debug)
    retarget(gm, device)
    held = dict(gm.named_buffers())
    for key, value in buffers.items():
        owner, _, name = key.rpartition(".")
        if key in held:
            gm.get_submodule(owner)._buffers[name] = value
    graph = Graph(gm=gm, config=model.config, source=source or {"kind": "module", "class": type(model).__name__}, tokenizer=tokenizer)
    graph.meta["capture"] = {"max_length": limit, "dtype": str(dtype).removeprefix("torch.")}
    graph.meta["offload"] = {"device": str(device), "dtype": str(dtype).removeprefix("torch.")}
    graph.cache["weights"] = weights
    return graph
