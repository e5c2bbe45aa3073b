"""`--format kimi_linear`: a KDA hybrid as a native transformers Kimi Linear model (model_type
kimi_linear, KimiLinearForCausalLM, no remote code).

Exact only when the hybrid is what that class computes, which `plan` decides from the graph, the
sites and the recipe before anything is written (qwen3_5_fit reads the blocks, the same decoder form):
  * pre-norm RMSNorm blocks, a dense SwiGLU MLP of one width, bias-free projections, one eps for
    every norm, the KDA output norm's included (Kimi Linear has one rms_norm_eps);
  * every layer converted with replace.mixer=kda in Kimi Linear's parametrisation
    (replace.kimi_form=true: forget gate f_b(f_a(x)) and output gate g_b(g_a(x)) of rank head_dim,
    RMSNorm(o) * w * sigmoid(gate)), v through SiLU (Kimi's convolution activation covers q, k and v),
    one (heads, head_dim) for all of them. Term by term the rest is the same computation: SiLU then
    L2 norm (eps 1e-6) on q and k, scale head_dim**-0.5, beta = sigmoid(b_proj x), decay
    -exp(A_log) * softplus(f + dt_bias) per key channel, the delta rule.
  * a kept attention layer is Kimi Linear's attention (KimiLinearAttention: MLA without RoPE, as
    kimi_linear_mla reads it from the site), written with the teacher's own weights; a GQA or MHA
    teacher's kept attention is not that, and is refused.
Conversions, each exact: a KDA without short convolutions gets identity taps (shorter kernels are
padded with zero taps); A_log [H] is written [1, 1, H, 1]; a tied LM head is written as its own copy
(KimiLinearForCausalLM ties nothing); norms written offset + w.
transformers 5.24's cache cannot hold a model without an attention layer (DynamicCache.get_seq_length
raises), so config.json and generation_config.json say use_cache=false: generate recomputes the prefix.
After writing, the directory is loaded with KimiLinearForCausalLM and compared with the hybrid on a
probe: a safety net behind the named reasons."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy
import torch

from ..core.graph import Graph
from ..errors import ExportError
from ..sites.ops import param_names
from .hf_export import HYBRID_KEY, staged_state, write_model_dir
from .kimi_linear_mla import mla_form
from .kimi_linear_state import kimi_linear_config, kimi_linear_state
from .qwen3_5_export import check_probe, mixers
from .qwen3_5_fit import Layout, read_layout

FIX = "Kimi Linear's class cannot hold this hybrid exactly; use it through surgery (generate, eval, save/load)."
DEFAULT_CONV = 4  # Kimi Linear's own kernel size, given to KDAs built without short convolutions


@dataclass
class KimiPlan:
    layout: Layout
    eps: float
    conv_size: int
    kda: dict      # layer -> {"target", "gdn_config"}
    mla: dict      # kept layer -> kimi_linear_mla.MlaForm


def refuse(reason: str) -> ExportError:
    return ExportError(f"--format kimi_linear does not fit this hybrid: {reason}.", FIX)


def layout_of(graph: Graph) -> Layout:
    """qwen3_5_fit's reading of the decoder (the same block form), its refusals reworded for Kimi Linear."""
    try:
        return read_layout(graph.gm, mixers(graph), param_names(graph.gm))
    except ExportError as exc:
        reason = exc.problem.split("does not fit this hybrid: ", 1)[-1].rstrip(".")
        raise refuse(reason.replace("Qwen3.5", "Kimi Linear")) from None


def kept_forms(graph: Graph) -> dict:
    """layer -> its kept attention as KimiLinearAttention (kimi_linear_mla.MlaForm), or why it is not one."""
    return {l: mla_form(graph, graph.sites[l]) for l, kind in enumerate(graph.layer_kinds) if kind == "attention"}


def layer_refusals(graph: Graph, forms: dict) -> list[str]:
    """Why some layers are neither KDA layers nor Kimi Linear's MLA: kept attention of another form,
    split layers, other mixers."""
    kinds = graph.layer_kinds
    reasons, kept = [], [l for l, form in forms.items() if isinstance(form, str)]
    if kept:
        rope = [l for l in kept if graph.sites[l].rope]
        why = "; ".join(f"layer {l}: {forms[l]}" for l in kept if not graph.sites[l].rope)
        reasons.append(f"layer(s) {', '.join(map(str, kept))} keep the teacher's attention, which is not MLA without RoPE "
                       "(Kimi Linear's KimiLinearAttention: latent KV through kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj)"
                       + (f", and layer(s) {', '.join(map(str, rope))} apply RoPE" if rope else "") + (f" ({why})" if why else ""))
    sizes = {tuple(sorted(form.sizes.items(), key=str)) for form in forms.values() if not isinstance(form, str)}
    if len(sizes) > 1:
        reasons.append("the kept MLA layers differ in their sizes; Kimi Linear has one shape for all")
    split = [l for l, kind in enumerate(kinds) if kind == "split"]
    if split:
        reasons.append(f"layer(s) {', '.join(map(str, split))} keep some heads as attention (select.granularity=head)")
    other = [f"layer {l} ({kind})" for l, kind in enumerate(kinds) if kind not in ("attention", "split", "kda")]
    if other:
        reasons.append(f"{', '.join(other)} are not KDA, Kimi Linear's only linear-attention layer (replace.mixer=kda)")
    return reasons


def float32(eps: float) -> str:
    """eps as the float32 every norm adds it in: 1e-05 for a GGUF's 9.999999747378752e-06."""
    return str(numpy.float32(eps))


def kda_refusals(configs: list[dict], eps: float) -> tuple[list[str], list[str]]:
    """(reasons, the --set options that fix them) of the KDA layers' form."""
    reasons, fixes = [], []
    if not all(c.get("kimi_form") for c in configs):
        reasons.append("the KDA's forget and output gates are not Kimi Linear's (rank head_dim, sigmoid output gate)")
        fixes.append("--set replace.kimi_form=true")
    if any(c["v_activation"] != "silu" for c in configs):
        reasons.append("the KDA's v has no SiLU, and Kimi Linear's convolution activation covers v")
        fixes.append("--set replace.v_activation=silu")
    if any(float32(c["norm_eps"]) != float32(eps) for c in configs):  # the same float32: the same sums
        reasons.append(f"the KDA's output norm eps is not the teacher's rms_norm_eps {float32(eps)}")
        fixes.append(f"--set replace.norm_eps={float32(eps)}")
    if len({(c["num_heads"], c["head_dim"]) for c in configs}) > 1:
        reasons.append("the KDA layers differ in heads or head_dim; Kimi Linear has one shape for all")
    if any(c.get(b) for c in configs for b in ("q_bias", "k_bias", "v_bias", "o_bias")):
        reasons.append("the KDA layers copied the teacher's projection biases; Kimi Linear's projections have none")
    return reasons, fixes


def one_eps(layout: Layout) -> float:
    values = sorted({n.eps for n in [layout.final_norm, *(x for b in layout.blocks for x in (b.input_norm, b.post_norm))]})
    if len(values) != 1:
        raise refuse(f"the teacher's norms use different eps values {values}; Kimi Linear has one rms_norm_eps")
    return values[0]


def plan(graph: Graph) -> KimiPlan:
    """Everything the export writes, read from the graph, the sites and the recipe; ExportError
    naming each reason the hybrid is not exactly a Kimi Linear model (before anything is written)."""
    targets = graph.gdn_targets()
    if not targets:
        raise ExportError("The model has no converted layer: it is the teacher itself.", "Export a hybrid (surgery apply).")
    forms = kept_forms(graph)
    reasons = layer_refusals(graph, forms)
    if reasons:
        every = ",".join(map(str, range(graph.num_layers)))
        raise ExportError("--format kimi_linear does not fit this hybrid: " + "; ".join(reasons) + ".",
                          f"Convert every layer to KDA (--set select.policy=convert --set select.layers={every} "
                          "--set replace.mixer=kda --set replace.kimi_form=true --set replace.v_activation=silu), "
                          "or use the hybrid through surgery.")
    layout = layout_of(graph)
    if len({tuple(graph.gm.get_parameter(b.gate.weight).shape) for b in layout.blocks}) > 1:
        raise refuse("the MLPs differ in width; Kimi Linear's dense MLP has one intermediate_size")
    eps = one_eps(layout)
    modules = graph.meta["replace"]["modules"]
    kda = {l: {"target": t, "gdn_config": modules[str(l)]["gdn_config"]} for l, t in targets.items()}
    configs = [entry["gdn_config"] for entry in kda.values()]
    reasons, fixes = kda_refusals(configs, eps)
    if reasons:
        fix = f"Convert with {' '.join(fixes)} to build KDAs of Kimi Linear's form." if len(fixes) == len(reasons) else FIX
        raise ExportError("--format kimi_linear does not fit this hybrid: " + "; ".join(reasons) + ".", fix)
    conv = max((c["conv_size"] for c in configs if c["use_short_conv"]), default=DEFAULT_CONV)
    return KimiPlan(layout, eps, conv, kda, forms)


def write_kimi_linear(graph: Graph, folder: Path, *, dtype: torch.dtype | None = None, shard_bytes: int) -> None:
    """Everything of DIR into `folder` (export stages it and renames it into place)."""
    from transformers.models.kimi_linear import KimiLinearForCausalLM

    found = plan(graph)
    state = staged_state(kimi_linear_state(graph, found), dtype)
    config = kimi_linear_config(graph, found, dtype or graph.dtype)
    config[HYBRID_KEY] = {"format": "kimi_linear", "layer_kinds": graph.layer_kinds, "passes": [e["pass"] for e in graph.history]}
    write_model_dir(graph, folder, state, config, shard_bytes)
    generation = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**generation, "use_cache": False}, indent=2, sort_keys=True) + "\n")
    check_probe(graph, folder, KimiLinearForCausalLM)
