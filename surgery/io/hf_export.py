"""`--format hf`: a hybrid as an ordinary transformers model directory that loads without surgery.

DIR holds config.json (the teacher's config, `surgery_hybrid` with each converted attention module's
mixer and its config, an auto_map to the modeling file), model.safetensors (the teacher's own parameter
names, each converted layer's under its attention module's path), the tokenizer, generation_config.json,
and the modeling file with tcal's GDN files (GDN_SOURCES) copied verbatim beside it and the other
layer mixers' (MIXER_SOURCES: gla, kda, mamba2) with their package-relative imports made flat: one
source of each mixer's math, and surgery_teacher.py naming the teacher's config class (which the
modeling file's class declares). A sliding-window (swa) layer replaces only the attention op inside
the teacher's module, so the teacher's module stays and the modeling file windows its attention mask
(its weights stay the teacher's; its window is in config.json); a teacher layer that already slides
over a window of its own, and a layer split by heads, are refused by name.
It loads in transformers 4.57 to 5.x: config.json also carries the RoPE keys 4.x reads (legacy_rope),
and the tokenizer is named by a class both know.

The modeling file swaps whole attention modules, so the export is exact only where the region the
replace pass cut is exactly such a module's forward: its input the module's input, its output the
module's output (eval dropout aside), and none of the module's tensors used by what was kept.
`plan` checks that for every converted layer before anything is written."""
from __future__ import annotations

import json
from pathlib import Path

import torch

import tcal.delta_inputs
import tcal.gated_norm
import tcal.gdn
import tcal.chunk_intra
import tcal.chunk_inputs
import tcal.chunk_states
import tcal.pdl
import tcal.kernels
import tcal.mixers.gla
import tcal.mixers.gla_kernels
import tcal.mixers.kda
import tcal.mixers.kda_kernels
import tcal.mixers.mamba2
import tcal.mixers.mamba2_kernels
import tcal.split_state
import tcal.state_pass
import tcal.switches
import tcal.token_step

from ..core.graph import Graph
from ..core.slice_fill import whole_slice
from ..errors import ExportError
from .checkpoint import unique_state, write_weights
from .legacy_rope import keeps_rope, legacy_rope_keys
from .tokenizer_check import check_saved

MODELING_FILE = Path(__file__).parent / "hf_modeling" / "modeling_surgery_hybrid.py"
LAYER_GRAPHS_FILE = MODELING_FILE.parent / "layer_graphs.py"  # the converted layers' one-token CUDA graphs
MODEL_CLASS = "SurgeryHybridForCausalLM"
HYBRID_KEY = "surgery_hybrid"  # the config.json field the modeling file reads
GDN_SOURCES = {"gdn.py": Path(tcal.gdn.__file__), "kernels.py": Path(tcal.kernels.__file__),
               "token_step.py": Path(tcal.token_step.__file__), "delta_inputs.py": Path(tcal.delta_inputs.__file__),
               "gated_norm.py": Path(tcal.gated_norm.__file__), "split_state.py": Path(tcal.split_state.__file__),
               "state_pass.py": Path(tcal.state_pass.__file__), "chunk_intra.py": Path(tcal.chunk_intra.__file__),
               "chunk_states.py": Path(tcal.chunk_states.__file__), "pdl.py": Path(tcal.pdl.__file__),
               "chunk_inputs.py": Path(tcal.chunk_inputs.__file__), "switches.py": Path(tcal.switches.__file__)}
# the other layer mixers, exported beside GDN's files: tcal/mixers/ imports tcal's modules one package up
MIXER_SOURCES = {Path(m.__file__).name: Path(m.__file__) for m in (tcal.mixers.gla, tcal.mixers.gla_kernels, tcal.mixers.kda,
                                                                   tcal.mixers.kda_kernels, tcal.mixers.mamba2, tcal.mixers.mamba2_kernels)}
EXPORTED_MIXERS = ("gdn", "gla", "kda", "mamba2", "swa")  # the modeling file's MIXERS (a whole attention module) and swa (its mask)
WINDOWED = "swa"  # the mixer that keeps the teacher's attention module and windows its mask
# ops that pass a tensor through unchanged in eval mode (an attention module's output dropout)
IDENTITY_OPS = {"aten.dropout.default", "aten.clone.default", "aten.alias.default", "aten.contiguous.default"}
DROPPED_CONFIG = ("_name_or_path", "_model_name_or_path", "architectures", "auto_map", "transformers_version")
TEACHER_FILE = "surgery_teacher.py"
# 5.x names a tokenizer.json-only tokenizer TokenizersBackend, which 4.x lacks; both load it as this class
PORTABLE_TOKENIZER = {"TokenizersBackend": "PreTrainedTokenizerFast"}


def inside(node: torch.fx.Node, path: str) -> bool:
    """Whether the node was traced inside the module at `path` (its nn_module_stack names it)."""
    return any(inside_path(p, path) for p, _ in node.meta.get("nn_module_stack", {}).values())


def gdn_call(graph: Graph, target: str) -> torch.fx.Node:
    call = next((n for n in graph.gm.graph.nodes if n.op == "call_module" and n.target == target), None)
    if call is None:
        raise ExportError(f"The hybrid's graph has no call of its GDN module '{target}'.", "Save the hybrid again with `surgery apply`; its graph and recipe disagree.")
    return call


def passes_through(node: torch.fx.Node) -> bool:
    """An op that returns its input's values; a whole slice too (capture drops them, but a graph edited
    after capture may hold one, e.g. the LM head's logits_to_keep=0 slice)."""
    if whole_slice(node):
        return True
    if str(node.target) not in IDENTITY_OPS:
        return False
    return not (str(node.target) == "aten.dropout.default" and len(node.args) > 2 and node.args[2])


def swap_refusal(graph: Graph, layer: int, target: str) -> str | None:
    """Why the attention module of `layer` cannot be swapped for its GDN exactly, or None."""
    path = graph.sites[layer].module_path
    call = gdn_call(graph, target)
    if inside(call.args[0], path):
        return f"its GDN reads '{call.args[0].name}', computed inside the attention module, not the module's input"
    node = call
    while len(node.users) == 1 and inside(next(iter(node.users)), path):
        node = next(iter(node.users))
        if not passes_through(node):
            return f"the attention module changes the output projection's result ({node.target}) before it returns it"
    kept = sorted({n.target for n in graph.gm.graph.nodes if n.op == "get_attr" and inside_path(n.target, path) and not inside_path(n.target, target)})
    if kept:
        return f"the hybrid still uses the attention module's tensors {kept[:3]}"
    return None


def sliding_cache_windows(graph: Graph) -> dict[int, int]:
    """{layer: window} for each layer whose transformers cache (DynamicCache built from the teacher's
    config, as generate builds it) keeps only a sliding window: an swa layer there cannot be exported,
    since that cache drops keys surgery's swa layer (which replaces the teacher's window) may still read."""
    from transformers import DynamicCache

    layers = DynamicCache(config=graph.config).layers
    return {i: layer.sliding_window for i, layer in enumerate(layers) if getattr(layer, "is_sliding", False)}


def inside_path(name: str, path: str) -> bool:
    return name == path or name.startswith(path + ".")


def refuse_other_mixers(graph: Graph, format: str, allowed: tuple[str, ...] = ("gdn",)) -> None:
    """ExportError naming the layers converted to a mixer outside `allowed` (replace.mixer), or split
    by heads: the format's modeling code has no such layer, and a wrong export must never be written."""
    modules = graph.meta.get("replace", {}).get("modules", {})
    split = sorted(int(l) for l, m in modules.items() if "kept_kv_heads" in m)
    if split:
        raise ExportError(f"--format {format} cannot hold a layer split by heads, and this hybrid keeps some heads of layer(s) "
                          f"{', '.join(map(str, split))} as attention (select.granularity=head): the exported modeling code "
                          "has no layer that runs softmax attention and GDN side by side.",
                          "Use the hybrid through surgery (generate, eval, save/load), or select with granularity=layer to export.")
    other = {l: m.get("mixer", "gdn") for l, m in modules.items() if m.get("mixer", "gdn") not in allowed}
    if other:
        named = ", ".join(f"layer {l} ({mixer})" for l, mixer in sorted(other.items(), key=lambda kv: int(kv[0])))
        held = "GDN layers only" if allowed == ("gdn",) else f"layers of {', '.join(allowed)} only"
        raise ExportError(f"--format {format} exports {held}, and this hybrid converted {named}.",
                          "Use the hybrid through surgery (generate, eval, save/load), or convert with another replace.mixer to export "
                          f"(--format hf takes {', '.join(EXPORTED_MIXERS)}; a hybrid whose every layer is KDA exports with --format kimi_linear).")


def plan(graph: Graph) -> dict:
    """module path -> {"layer", "gdn_config", "target"} for every converted layer; ExportError
    naming each layer that cannot be swapped exactly (checked before anything is written)."""
    modules = graph.meta.get("replace", {}).get("modules", {})
    if not modules:
        raise ExportError("The model has no converted layer: it is the teacher itself.", "Export a hybrid (surgery apply), or use the teacher's own directory.")
    refuse_other_mixers(graph, "hf", EXPORTED_MIXERS)
    refused, layers = [], {}
    windowed = [l for l, m in modules.items() if m.get("mixer") == WINDOWED]
    sliding = sliding_cache_windows(graph) if windowed else {}
    for layer, target in graph.gdn_targets().items():
        if str(layer) in windowed:
            reason = (f"the teacher's attention there already slides over {sliding[layer]} tokens, and transformers keeps that "
                      "layer's cache to its window, where surgery's swa layer replaces it") if layer in sliding else None
        else:
            reason = swap_refusal(graph, layer, target)
        if reason:
            refused.append(f"layer {layer} ('{graph.sites[layer].module_path}'): {reason}")
        entry = modules[str(layer)]
        layers[graph.sites[layer].module_path] = {"layer": layer, "mixer": entry.get("mixer", "gdn"), "gdn_config": entry["gdn_config"],
                                                  "target": target}
    if refused:
        raise ExportError("--format hf swaps whole attention modules (or windows a kept one's mask, for swa), and these cannot be "
                          "exported exactly: " + "; ".join(refused) + ".",
                          "Keep those layers as attention (select) to export: where this teacher's attention does not end where its module "
                          "does, or, for swa, where the teacher already slides the layer over a window.")
    return layers


def hf_state(graph: Graph, layers: dict, dtype: torch.dtype | None) -> dict:
    """The hybrid's tensors under the names the transformers model has: a GDN placed beside its
    attention module (<path>_gdn) moves to the module's own path; tied copies are left to the
    config's tie_word_embeddings, as transformers saves them."""
    state, _ = unique_state(graph.gm)
    moves = {e["target"] + ".": path + "." for path, e in layers.items() if e["target"] != path and e["mixer"] != WINDOWED}
    windows = tuple(e["target"] + "." for e in layers.values() if e["mixer"] == WINDOWED)  # its window is in config.json
    named = {}
    for name, tensor in state.items():
        if name.startswith(windows):
            continue
        prefix = next((p for p in moves if name.startswith(p)), None)
        name = moves[prefix] + name[len(prefix):] if prefix else name
        named[name] = tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
    return named


def legacy_names(graph: Graph, names) -> dict:
    """{name: the name transformers 4.x gives that tensor} where they differ (GPT-NeoX's lm_head is 4.x's
    embed_out): the installed transformers' own save-time renaming, asked one tensor at a time of the
    teacher's class built on the meta device. The modeling file passes it to 4.x as key_mapping."""
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    with torch.device("meta"):
        teacher = AutoModelForCausalLM.from_config(graph.config)
    renamed = {}
    for name, tensor in names.items():
        try:  # each tensor at its own shape: a converter that splits fused experts reads the dims
            renamed[name] = list(revert_weight_conversion(teacher, {name: torch.empty_like(tensor, device="meta")}))
        except (IndexError, ValueError, RuntimeError, KeyError):
            continue  # a conversion that needs its sibling tensors: no one-to-one 4.x name to record
    return {name: new[0] for name, new in renamed.items() if len(new) == 1 and new[0] != name}


def hf_config(graph: Graph, layers: dict, dtype: torch.dtype, names: dict | None = None) -> dict:
    """The teacher's config.json plus the hybrid: which modules are GDN and how they are built."""
    config = {k: v for k, v in graph.config.to_dict().items() if k not in DROPPED_CONFIG}
    legacy = {k: v for k, v in legacy_rope_keys(graph.config).items() if k not in config}
    if legacy and keeps_rope(type(graph.config), config, legacy, config.get("rope_parameters")):
        config.update(legacy)
    if (config.get("quantization_config") or {}).get("quant_method") == "gguf":
        config.pop("quantization_config")  # the weights are written dequantized
    config["dtype"] = str(dtype).removeprefix("torch.")
    config["architectures"] = [MODEL_CLASS]
    config["auto_map"] = {"AutoModelForCausalLM": f"{MODELING_FILE.stem}.{MODEL_CLASS}"}
    config[HYBRID_KEY] = {
        "gdn_layers": {path: {"layer": e["layer"], "mixer": e["mixer"], "gdn_config": e["gdn_config"]} for path, e in layers.items()},
        "layer_kinds": graph.layer_kinds,
        "passes": [entry["pass"] for entry in graph.history],
        "legacy_names": legacy_names(graph, names or {}),
    }
    return config


def staged_state(state: dict, dtype: torch.dtype | None) -> dict:
    """A native format's tensors as written: floating ones in `dtype` (if given), on the CPU, contiguous."""
    return {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().cpu().contiguous()
            for k, v in state.items()}


def write_model_dir(graph: Graph, folder: Path, state: dict, config: dict, shard_bytes: int) -> None:
    """What every export format writes: the weights (sharded when large), config.json, the
    generation config and the tokenizer."""
    from transformers import GenerationConfig

    write_weights(state, folder, shard_bytes, index_metadata={"total_size": sum(t.numel() * t.element_size() for t in state.values())})
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    GenerationConfig.from_model_config(graph.config).save_pretrained(folder)
    if graph.tokenizer is not None:
        graph.tokenizer.save_pretrained(folder)
        portable_tokenizer_class(folder / "tokenizer_config.json")
        check_saved(graph.tokenizer, folder)  # what is written, renamed class included, encodes as the teacher's


def portable_tokenizer_class(path: Path) -> None:
    """Name the tokenizer by a class every supported transformers has (same tokenizer.json, same ids)."""
    if not path.exists():
        return
    settings = json.loads(path.read_text())
    if settings.get("tokenizer_class") in PORTABLE_TOKENIZER:
        settings["tokenizer_class"] = PORTABLE_TOKENIZER[settings["tokenizer_class"]]
        path.write_text(json.dumps(settings, indent=2, sort_keys=True))


def write_hf(graph: Graph, folder: Path, *, dtype: torch.dtype | None = None, shard_bytes: int) -> None:
    """Everything of DIR into `folder` (export stages it and renames it into place)."""

    layers = plan(graph)
    state = hf_state(graph, layers, dtype)
    write_model_dir(graph, folder, state, hf_config(graph, layers, dtype or graph.dtype, state), shard_bytes)
    for name, code in exported_code(type(graph.config).__name__).items():
        (folder / name).write_bytes(code)


def exported_code(config_class: str) -> dict[str, bytes]:
    """Every .py file an hf export holds, by name (written by write_hf, checked by verify_export)."""
    code = {MODELING_FILE.name: MODELING_FILE.read_bytes(), LAYER_GRAPHS_FILE.name: LAYER_GRAPHS_FILE.read_bytes(),
            TEACHER_FILE: teacher_source(config_class).encode()}
    code |= {name: source.read_bytes() for name, source in GDN_SOURCES.items()}
    return code | {name: flat_imports(source.read_text()).encode() for name, source in MIXER_SOURCES.items()}


def flat_imports(source: str) -> str:
    """A tcal/mixers/ file for the export's one flat folder: `from ..gdn import` -> `from .gdn import`
    (transformers copies a remote module's relative imports from its own folder only). Every relative
    import must then name a file the export holds."""
    lines = [line.replace("from ..", "from .", 1) if line.startswith("from ..") else line for line in source.splitlines(keepends=True)]
    held = {Path(n).stem for n in (*GDN_SOURCES, *MIXER_SOURCES)}
    for line in lines:
        if line.startswith("from .") and line.split()[1][1:].split(".")[0] not in held:
            raise ExportError(f"An exported mixer file imports '{line.split()[1]}', which the export does not hold.",
                              "This is a bug in surgery's export: report it with the mixer's name.")
    return "".join(lines)


def teacher_source(config_class: str) -> str:
    """surgery_teacher.py: the one line of the export's code that depends on the teacher."""
    return f'"""Written by surgery export: the teacher\'s transformers config class."""\nTEACHER_CONFIG = {config_class!r}\n'
