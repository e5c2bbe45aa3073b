"""`--format qwen3_5`: a hybrid as a native transformers Qwen3.5 text model (model_type qwen3_5_text,
Qwen3_5ForCausalLM, no remote code), which serving engines that register that class load too.

Exact only when the hybrid is what that class computes, which `plan` decides from the graph, the
sites and the recipe before anything is written (qwen3_5_fit reads the blocks):
  * pre-norm RMSNorm blocks, a SwiGLU MLP, bias-free projections, one eps for every norm;
  * kept attention: per-head q/k RMSNorm, RoPE, causal without a window, scale head_dim**-0.5;
  * GDN layers of Qwen3.5's form: SiLU on q, k and v (its conv activation covers all three),
    the gated norm's eps the teacher's rms_norm_eps, one shape for all of them.
Conversions, each exact in floating point or to one rounding:
  * Qwen3.5's RMSNorm scales by (1 + w): w is written as (offset + w) - 1 (exact for w in [0.5, 2]);
  * a kept layer's q_proj also emits Qwen3.5's output gate: its rows are written 0, so the gate is
    sigmoid(0) = 0.5 exactly, and o_proj is written times 2. Both are powers of two, so every product
    o_proj sees, (2w)(0.5a) = wa, is bit-identical to the teacher's;
  * a GDN without short convolutions gets identity taps (only the current token's tap is 1);
    shorter kernels are padded with zero taps for older tokens.
After writing, the directory is loaded with Qwen3_5ForCausalLM and compared with the hybrid on a
probe: a safety net behind the named reasons."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..core.graph import Graph
from ..core.rewrite import nodes_by_name
from ..decode.plan import plan_decode
from ..errors import DecodeError, ExportError, first_line
from ..sites.ops import param_names
from .hf_export import HYBRID_KEY, gdn_call, refuse_other_mixers, staged_state, write_model_dir
from .qwen3_5_fit import FIX, Layout, Norm, norm_of, read_layout, refuse
from .qwen3_5_state import qwen3_5_config, qwen3_5_state

MODEL_CLASS = "Qwen3_5ForCausalLM"
DEFAULT_CONV = 4  # Qwen3.5's own kernel size, given to GDNs built without short convolutions
PROBE_TOLERANCE = {torch.float32: 1e-3}  # max |difference| / max |logit|; other dtypes: 5e-2


@dataclass
class Qwen35Plan:
    layout: Layout
    kinds: list
    eps: float
    conv_size: int
    rope: tuple                                      # (type, theta, partial_rotary_factor)
    head_order: dict = field(default_factory=dict)   # kept layer -> query heads in Qwen3.5's GQA order
    q_k_norms: dict = field(default_factory=dict)    # kept layer -> (q norm, k norm)
    gdn: dict = field(default_factory=dict)          # GDN layer -> {"target", "gdn_config"}


def mixers(graph: Graph) -> list:
    """(input, output) node of each layer's attention or GDN in graph.gm."""
    nodes, targets = nodes_by_name(graph.gm), graph.gdn_targets()
    found = []
    for site in graph.sites:
        if site.layer in targets:
            call = gdn_call(graph, targets[site.layer])
            found.append((call.args[0], call))
        else:
            found.append((nodes[site.input_node], nodes[site.output_node]))
    return found


def one_eps(layout: Layout, q_k_norms: list[Norm]) -> float:
    block_norms = [norm for block in layout.blocks for norm in (block.input_norm, block.post_norm)]
    values = sorted({norm.eps for norm in [layout.final_norm, *q_k_norms, *block_norms]})
    if len(values) != 1:
        raise refuse(f"the teacher's norms use different eps values {values}; Qwen3.5 has one rms_norm_eps")
    return values[0]


def attention_refusals(graph: Graph, kept: list[int], params: set[str]) -> tuple[list[str], dict, dict]:
    """(reasons, head order, q/k norms) of the kept attention layers."""
    reasons, order, norms = [], {}, {}
    windows = attention_windows(graph) if kept else {}
    for layer in kept:
        site = graph.sites[layer]
        found = [norm_of(graph.gm, names[0], params) if len(names) == 1 else None for names in (site.q_norm, site.k_norm)]
        if not site.q_norm or not site.k_norm:
            reasons.append(f"layer {layer}: the teacher's attention has no q/k norm")
        elif None in found or any(tuple(graph.gm.get_parameter(n.weight).shape) != (site.head_dim,) for n in found):
            reasons.append(f"layer {layer}: the q/k norms are not per-head RMSNorms over head_dim {site.head_dim}")
        else:
            norms[layer] = tuple(found)
        if site.q.folded or site.k.folded or site.v.folded:
            reasons.append(f"layer {layer}: the attention is MLA (Q/K/V through a low-rank latent), which Qwen3.5's attention is not")
        if not math.isclose(site.scale, site.head_dim ** -0.5, rel_tol=1e-6):
            reasons.append(f"layer {layer}: the attention scale {site.scale:.6g} is not head_dim**-0.5")
        if site.softcap is not None:
            reasons.append(f"layer {layer}: the attention softcaps its scores")
        if not site.rope:
            reasons.append(f"layer {layer}: the attention has no RoPE")
        if windows.get(layer) is not None:
            reasons.append(f"layer {layer}: the attention has a sliding window of {windows[layer]}")
        group = site.num_heads // site.num_kv_heads
        order[layer] = sorted(range(site.num_heads), key=lambda h: site.kv_map[h])
        if [site.kv_map[h] for h in order[layer]] != [h // group for h in range(site.num_heads)]:
            reasons.append(f"layer {layer}: its query heads do not share KV heads in equal groups")
    shapes = {(graph.sites[l].num_heads, graph.sites[l].num_kv_heads, graph.sites[l].head_dim) for l in kept}
    if len(shapes) > 1:
        reasons.append(f"the kept attention layers differ in (heads, KV heads, head_dim): {sorted(shapes)}")
    return reasons, order, norms


def attention_windows(graph: Graph) -> dict:
    try:
        return {layer: p.window for layer, p in plan_decode(graph).attention.items()}
    except DecodeError as exc:
        raise refuse(f"the kept attention is not plain causal attention ({first_line(exc)})") from exc


def gdn_refusals(graph: Graph, eps: float) -> tuple[list[str], list[str], int]:
    """(reasons, the --set options that fix them, conv size) of the GDN layers."""
    modules = graph.meta["replace"]["modules"]
    configs = {layer: modules[str(layer)]["gdn_config"] for layer in graph.gdn_targets()}
    reasons, fixes = [], []
    if any(c["v_activation"] != "silu" for c in configs.values()):
        reasons.append("the GDN's v has no SiLU, and Qwen3.5's convolution activation covers v")
        fixes.append("--set replace.v_activation=silu")
    if any(c["norm_eps"] != eps for c in configs.values()):
        reasons.append(f"the GDN's output norm eps is not the teacher's rms_norm_eps {eps!r}")
        fixes.append(f"--set replace.norm_eps={eps!r}")
    if len({(c["hidden_size"], c["num_heads"], c["head_dim"]) for c in configs.values()}) > 1:
        reasons.append("the GDN layers differ in heads or head_dim; Qwen3.5 has one shape for all")
    sizes = {c["conv_size"] for c in configs.values() if c["use_short_conv"]}
    return reasons, fixes, max(sizes, default=DEFAULT_CONV)


def plan(graph: Graph) -> Qwen35Plan:
    """Everything the export writes, read from the graph, the sites and the recipe; ExportError
    naming each reason the hybrid is not exactly a Qwen3.5 model (before anything is written)."""
    targets = graph.gdn_targets()
    if not targets:
        raise ExportError("The model has no converted layer: it is the teacher itself.", "Export a hybrid (surgery apply).")
    refuse_other_mixers(graph, "qwen3_5")
    params = param_names(graph.gm)
    layout = read_layout(graph.gm, mixers(graph), params)
    kept = [l for l, kind in enumerate(graph.layer_kinds) if kind == "attention"]
    reasons, order, q_k_norms = attention_refusals(graph, kept, params)
    if any(site.q.bias or site.k.bias or site.v.bias or site.o.bias for site in graph.sites):  # the GDNs copy them too
        reasons.append("the teacher's attention has projection biases; Qwen3.5's have none")
    if len({tuple(graph.gm.get_parameter(b.gate.weight).shape) for b in layout.blocks}) > 1:
        reasons.append("the MLPs differ in width; Qwen3.5 has one intermediate_size")
    if kept and rope_of(graph.config)[0] != "default":
        reasons.append(f"the RoPE type '{rope_of(graph.config)[0]}' is not the default one")
    eps = one_eps(layout, [n for pair in q_k_norms.values() for n in pair])
    gdn_reasons, fixes, conv_size = gdn_refusals(graph, eps)
    if reasons or gdn_reasons:
        fix = f"Convert with {' '.join(fixes)} to build GDNs of Qwen3.5's form." if len(fixes) == len(gdn_reasons) and not reasons else FIX
        raise ExportError("--format qwen3_5 does not fit this hybrid: " + "; ".join(reasons + gdn_reasons) + ".", fix)
    modules = graph.meta["replace"]["modules"]
    gdn = {l: {"target": t, "gdn_config": modules[str(l)]["gdn_config"]} for l, t in targets.items()}
    return Qwen35Plan(layout, graph.layer_kinds, eps, conv_size, rope_of(graph.config), order, q_k_norms, gdn)


def rope_of(config) -> tuple[str, float, float]:
    """(rope_type, theta, partial_rotary_factor) of the teacher's config."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    partial = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
    return rope.get("rope_type", "default"), float(theta), float(partial)


def write_qwen3_5(graph: Graph, folder: Path, *, dtype: torch.dtype | None = None, shard_bytes: int) -> None:
    """Everything of DIR into `folder` (export stages it and renames it into place)."""
    found = plan(graph)
    state = staged_state(qwen3_5_state(graph, found), dtype)
    config = qwen3_5_config(graph, found, dtype or graph.dtype)
    config[HYBRID_KEY] = {"format": "qwen3_5", "layer_kinds": graph.layer_kinds, "passes": [e["pass"] for e in graph.history]}
    write_model_dir(graph, folder, state, config, shard_bytes)
    check_probe(graph, folder)


def check_probe(graph: Graph, folder: Path, model_class=None) -> None:
    """Load `folder` as transformers will (as model_class: Qwen3_5ForCausalLM unless given) and compare
    its logits with the hybrid's on a probe."""
    if model_class is None:
        from transformers.models.qwen3_5 import Qwen3_5ForCausalLM as model_class

    name = model_class.__name__
    model, info = model_class.from_pretrained(folder, dtype=graph.dtype, output_loading_info=True)
    wrong = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if wrong:
        raise ExportError(f"{name} does not load the written weights exactly: {wrong}.", "Please report this hybrid.")
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, 16), generator=torch.Generator().manual_seed(0)).to(graph.device)
    # on the hybrid's device: transformers' linear-attention layers take fla's Triton kernels whenever fla
    # imports, which CPU tensors cannot run
    model = model.to(graph.device)
    with torch.no_grad():
        expected = graph.logits(ids).float().cpu()
        try:
            got = model.eval()(ids).logits.float().cpu()
        except Exception as exc:
            raise ExportError(f"transformers' {name} could not run the probe on {graph.device} ({first_line(exc)}).",
                              "Export where transformers' own model runs on the hybrid's device: with fla and Triton "
                              "installed it takes their CUDA kernels, so export a hybrid loaded on CUDA "
                              "(surgery.export(surgery.load(DIR, device='cuda'), OUT, format=...)), or export without Triton.") from exc
    error = ((got - expected).abs().max() / expected.abs().max().clamp_min(1e-12)).item()
    if not error <= PROBE_TOLERANCE.get(graph.dtype, 5e-2):
        raise ExportError(f"{name} on the export differs from the hybrid on a probe (relative error {error:.3g}).",
                          "Something in this hybrid is not what its graph was read as; please report it (--format hf writes GDN hybrids exactly).")
