"""replace: each selected attention site becomes one call to a module of the chosen mixer
(tcal.mixers: gdn, the default; gla; kda; mamba2; swa).

A mixer that replaces the layer (gdn, gla, kda, mamba2): the region from the Q/K/V projections through the attention
op to the output projection is cut out of the graph; the module takes the region's input (the normed
hidden states) and its output replaces the output projection's. Q and O are copied, K and V
GQA-expanded, fused QKV sliced, biases kept; the new parameters keep flash-linear-attention's default
initialisation (the paper's baseline).
A mixer that replaces the op (swa): only the attention op (SDPA, or the eager softmax(QK^T)V region)
is cut; the module takes Q, K, V as the op received them, so projections, RoPE and q/k norms stay
the teacher's and nothing is copied.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from surgery.errors import PassConfigError, PassFailedError
from surgery.core.graph import Graph
from surgery.core.pipeline import Pass, PassConfig, PassResult, register
from surgery.core.rewrite import ancestors, descendants, fork, nodes_by_name, prune, splice_module
from surgery.sites import AttentionSite
from surgery.sites.ops import SDPA_OPS, SOFTMAX_OPS
from tcal.gdn import GatedDeltaNet
from tcal.head_split import HeadSplitLayer
from tcal.kernels import fla_available
from tcal.mixers import MIXERS, get_mixer

from .head_split import build_splits, splice_split, split_target, transfer_split_weights
from .kv_budget import layer_windows
from .op_mixer import op_module_for_site, splice_op_module, verify_op_modules
from .selection import LayerSelection

V_ACTIVATIONS = ("silu", "identity")
BACKENDS = ("auto", "torch", "fla")


@dataclass
class ReplaceConfig(PassConfig):
    """use_short_conv  add fla's depthwise causal convolutions (initialised to identity)
    conv_size          kernel size of those convolutions
    norm_eps           epsilon of the GDN output norm (o_norm)
    v_activation       "identity" (default) keeps the teacher's values linear, as in attention; "silu" is
                       what fla applies without convolutions. Measured: identity aligns to a lower
                       held-out error (bench/RESULTS.md)
    backend            GDN kernel: auto (fla on CUDA when usable, chunked PyTorch otherwise), torch, fla
    seed               seeds the default initialisation of the new parameters
    mixer              what a converted layer becomes: gdn (default), gla, kda, mamba2, swa (tcal.mixers)
    window             swa: the window a layer starts with (the copy-only baseline); calibrate
                       sets each layer's from the teacher (calibrate.window_quantile)
    kimi_form          kda: build the layer in Kimi Linear's parametrisation (forget and output gates of
                       rank head_dim, sigmoid output gate), which `export --format kimi_linear` writes"""

    mixer: str = "gdn"
    window: int = 64
    use_short_conv: bool = False
    conv_size: int = 4
    v_activation: str = "identity"
    backend: str = "auto"
    norm_eps: float = 1e-5
    seed: int = 0
    kimi_form: bool = False

    def validate(self) -> None:
        if self.mixer not in MIXERS:
            raise PassConfigError(f"mixer '{self.mixer}' is not one of {', '.join(MIXERS)}.", "Pick one of them (replace.mixer=gdn is the default).")
        if self.window < 1:
            raise PassConfigError(f"window must be >= 1, got {self.window}.", "Use e.g. 64.")
        if self.v_activation not in V_ACTIVATIONS:
            raise PassConfigError(f"v_activation '{self.v_activation}' is not one of {V_ACTIVATIONS}.", "Pick one of them.")
        if self.backend not in BACKENDS:
            raise PassConfigError(f"backend '{self.backend}' is not one of {BACKENDS}.", "Pick one of them.")
        if self.conv_size < 1:
            raise PassConfigError(f"conv_size must be >= 1, got {self.conv_size}.", "Use e.g. 4.")
        if self.kimi_form and "kimi_form" not in inspect.signature(MIXERS[self.mixer].module.__init__).parameters:
            raise PassConfigError(f"kimi_form is an option of the kda mixer, and replace.mixer is {self.mixer}.",
                                  "Use replace.mixer=kda with it, or leave kimi_form off.")


def gdn_for_site(site: AttentionSite, config: ReplaceConfig) -> GatedDeltaNet:
    """The layer module of the configured mixer (a "layer" mixer: gdn) for this site."""
    return get_mixer(config.mixer).module(
        site.hidden_size, site.num_heads, site.mixer_head_dim,
        q_bias=bool(site.q.bias), k_bias=bool(site.k.bias), v_bias=bool(site.v.bias), o_bias=bool(site.o.bias),
        use_short_conv=config.use_short_conv, conv_size=config.conv_size, norm_eps=config.norm_eps,
        v_activation=config.v_activation, backend=config.backend, layer_idx=site.layer,
        **({"kimi_form": True} if config.kimi_form else {}),
    )


def transfer_weights(gdn: GatedDeltaNet, site: AttentionSite, params: dict, target: str) -> list[str]:
    """Copy the teacher's projections into the GDN; return the `src -> dst` log lines. What is
    written must be exactly the GDN's copied_parameters(): a parameter left out would keep its random
    init unnoticed."""
    log, written = [], []
    expanded = site.kv_map  # query head h reads KV head kv_map[h]: GQA expansion repeats rows
    plan = [("q_proj", site.q, None), ("k_proj", site.k, expanded), ("v_proj", site.v, expanded)]
    width = site.mixer_head_dim
    with torch.no_grad():
        for name, proj, heads in plan:
            w, b = proj.out_matrix(params, heads)
            layer = getattr(gdn, name)
            layer.weight.copy_(pad_heads(w, site.num_heads, width, 0))
            written.append(f"{name}.weight")
            log.append(_log_line(proj, heads, f"{target}.{name}.weight") + padded_text(proj, width))
            if b is not None:
                layer.bias.copy_(pad_heads(b, site.num_heads, width, 0))
                written.append(f"{name}.bias")
                log.append(f"{proj.bias}[{_row_text(proj, heads)}] -> {target}.{name}.bias")
        w, b = site.o.in_matrix(params)
        gdn.o_proj.weight.copy_(pad_heads(w, site.num_heads, width, 1))
        written.append("o_proj.weight")
        log.append(f"{site.o.weight}{'^T' if site.o.transposed else ''}[:, {_span(site.o.rows())}] -> {target}.o_proj.weight")
        if b is not None:
            gdn.o_proj.bias.copy_(b)
            written.append("o_proj.bias")
            log.append(f"{site.o.bias} -> {target}.o_proj.bias")
    expected = [name for name, _ in gdn.copied_parameters()]
    if sorted(written) != sorted(expected):
        raise PassFailedError(f"Layer {site.layer}: replace copied {written} from the teacher, but the GDN's copied parameters are {expected}.",
                              "The site's projections and the GDN's biases disagree; this is a bug, run with --debug and report it.")
    return log


def pad_heads(t: torch.Tensor, heads: int, width: int, dim: int) -> torch.Tensor:
    """t with each head's block along dim (heads * d entries) zero-padded to `width`: the narrower of
    an MLA layer's Q/K and V widths. Zero q/k entries add nothing to q.k; zero v rows (and their o_proj
    columns) carry nothing to the output."""
    d = t.shape[dim] // heads
    if d == width:
        return t
    blocks = t.unflatten(dim, (heads, d))
    pad = list(blocks.shape)
    pad[dim + 1] = width - d
    return torch.cat([blocks, blocks.new_zeros(pad)], dim + 1).flatten(dim, dim + 1)


def padded_text(proj, width: int) -> str:
    d = len(proj.heads[0])
    return f" (each head zero-padded from {d} to {width})" if d != width else ""


def _span(rows: list[int]) -> str:
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return f"{rows[0]}:{rows[0] + len(rows)}"
    return f"{len(rows)} rows from {min(rows)}..{max(rows)}"


def _row_text(proj, heads) -> str:
    text = _span(proj.rows(heads if heads is None else sorted(set(heads))))
    return text + (f", heads repeated {heads}" if heads is not None and len(set(heads)) < len(heads) else "")


def _log_line(proj, heads, dst: str) -> str:
    if proj.folded:
        return f"{proj.source_text()}: rows {_row_text(proj, heads)} -> {dst}"
    return f"{proj.weight}{'^T' if proj.transposed else ''}[{_row_text(proj, heads)}] -> {dst}"


def module_target(gm: torch.fx.GraphModule, site: AttentionSite) -> str:
    """Where the GDN lives: at the attention module's own path when nothing outside the replaced
    region uses that module's tensors, so state_dict names stay familiar (…self_attn.q_proj.weight)."""
    nodes = nodes_by_name(gm)
    x, out = nodes[site.input_node], nodes[site.output_node]
    region = (descendants(x) & ancestors(out)) | {out}
    prefix = site.module_path + "."
    for n in gm.graph.nodes:
        if n.op == "get_attr" and n.target.startswith(prefix) and any(u not in region for u in n.users):
            return site.module_path + "_gdn"
    return site.module_path


def attention_left(gm: torch.fx.GraphModule, site: AttentionSite, call: torch.fx.Node, op_only: bool = False) -> list[str]:
    """What of a replaced site's attention is still in gm: its attention op, softmax and Q/K/V/O
    projection nodes (op_only: the op and softmax) by the names the site gives them, and any SDPA or
    softmax op between the layer's input and the module call."""
    nodes = nodes_by_name(gm)
    named = [site.attn_node, site.probs_node] + ([] if op_only else [site.q.node, site.k.node, site.v.node, site.o.node])
    left = [name for name in dict.fromkeys(named) if name and name in nodes]
    region = descendants(nodes[site.input_node]) & ancestors(call) if site.input_node in nodes else set()
    return left + [n.name for n in region if n.op == "call_function" and n.target in SDPA_OPS | SOFTMAX_OPS and n.name not in left]


@register
class Replace(Pass):
    name = "replace"
    config_cls = ReplaceConfig
    runs_after = ("select",)
    not_after = ("replace",)
    structural = True

    def preflight(self, graph: Graph) -> None:
        """backend=fla where fla's kernels cannot run is refused before the pipeline's first pass."""
        if self.config.backend == "fla" and not (graph.device.type == "cuda" and fla_available()):
            where = f"this graph is on {graph.device}" + ("" if fla_available() else " and fla's kernels do not import here")
            raise PassConfigError(f"backend 'fla' runs fla's Triton kernels on a CUDA device only; {where}.",
                                  "Use replace.backend=auto (fla where it runs, PyTorch elsewhere) or replace.backend=torch.")

    def check(self, graph: Graph) -> None:
        selection = graph.meta.get("select")
        if not isinstance(selection, LayerSelection):
            raise PassConfigError(f"graph.meta['select'] is {type(selection).__name__}, not the LayerSelection select records.", "Run select before replace.")
        if not selection.convert:
            raise PassConfigError("select chose no layer to convert.", "Run select with a policy that converts at least one layer.")
        wide = [str(layer) for layer in selection.split_layers() if graph.sites[layer].v_head_dim]
        if wide:
            raise PassConfigError(f"select kept some heads of layer(s) {', '.join(wide)}, whose values and queries differ in width per head "
                                  "(MLA); a head split keeps one width.", "Use select.granularity=layer for this model.")
        if selection.split_layers() and self.config.mixer != "gdn":
            raise PassConfigError(f"select kept some heads of layers {sorted(selection.split_layers())} (granularity head), whose other heads "
                                  f"become GDN; replace.mixer={self.config.mixer} converts whole layers only.",
                                  "Use replace.mixer=gdn, or select.granularity=layer.")

    def run(self, graph: Graph) -> PassResult:
        convert, split = graph.meta["select"].convert, graph.meta["select"].split_layers()
        teacher = graph.gm
        device, dtype = graph.device, graph.dtype
        # an offloaded teacher (surgery.core.meta_capture): each copied projection is read from its files
        params = graph.weights.params(device, dtype) if graph.weights is not None else dict(teacher.named_parameters(remove_duplicate=False))
        mixer = get_mixer(self.config.mixer)
        hybrid = fork(teacher)
        modules, copies = {}, []
        if mixer.replaces == "op":
            verify_op_modules(graph, convert, self.config)  # every layer checked before any is changed
        torch.manual_seed(self.config.seed)
        splits = build_splits(graph, split, self.config, layer_windows(graph)) if split else {}
        for layer in convert:
            site = graph.sites[layer]
            if layer in splits:
                target, module = split_target(site), splits[layer].to(device=device, dtype=dtype)
                copies += transfer_split_weights(module, site, params, target)
                splice_split(hybrid, site, module, target)
                modules[str(layer)] = {"target": target, "gdn_config": module.gdn_config(), "mixer": mixer.name, "kept_kv_heads": module.kept_kv}
                continue
            if mixer.replaces == "op":
                module = op_module_for_site(site, self.config).to(device=device)
                target = splice_op_module(hybrid, site, module, mixer.name)
            else:
                target = module_target(teacher, site)
                module = gdn_for_site(site, self.config).to(device=device, dtype=dtype)
                copies += transfer_weights(module, site, params, target)
                self._splice(hybrid, site, target, module)
            modules[str(layer)] = {"target": target, "gdn_config": module.gdn_config(), "mixer": mixer.name}
        removed = prune(hybrid)
        graph.teacher, graph.gm = teacher, hybrid
        graph.meta["replace"] = {"layers": list(convert), "modules": modules, "copies": copies, "config": self.config.to_dict()}
        return PassResult(graph, modified=True, info={"layers": list(convert), "mixer": mixer.name, "nodes_removed": removed, "copies": len(copies)})

    def ensures(self, graph: Graph) -> None:
        """Every converted layer is one call of its mixer's module, and none of its attention is left
        (of a mixer that replaces only the op: no attention op or softmax)."""
        calls = {n.target: n for n in graph.gm.graph.nodes if n.op == "call_module"}
        targets = graph.gdn_targets()
        if sorted(targets) != sorted(graph.meta["replace"]["layers"]):
            raise self.broken(f"GDN modules sit at layers {sorted(targets)}, but layers {graph.meta['replace']['layers']} were converted.")
        for layer, target in targets.items():
            entry = graph.meta["replace"]["modules"][str(layer)]
            if "kept_kv_heads" in entry:
                self.split_ensured(graph, layer, target, calls)
                continue
            mixer = get_mixer(entry.get("mixer", "gdn"))
            module = graph.gm.get_submodule(target) if target in calls else None
            if type(module) is not mixer.module:
                raise self.broken(f"layer {layer} is not a {mixer.module.__name__} call at '{target}' in the hybrid graph.")
            left = attention_left(graph.gm, graph.sites[layer], calls[target], op_only=mixer.replaces == "op")
            if left:
                raise self.broken(f"layer {layer} still holds attention nodes {left} after its GDN at '{target}' replaced them.")

    def split_ensured(self, graph: Graph, layer: int, target: str, calls: dict) -> None:
        """A split layer: a HeadSplitLayer whose parts are called, and no attention op of its own left."""
        module = graph.gm.get_submodule(target)
        parts = [f"{target}.{p}" for p in ("select_q", "select_k", "select_v", "kept", "gdn", "merge")]
        if type(module) is not HeadSplitLayer or any(p not in calls for p in parts):
            raise self.broken(f"layer {layer} is not a called HeadSplitLayer at '{target}' in the hybrid graph.")
        left = [n for n in (graph.sites[layer].attn_node, graph.sites[layer].probs_node) if n and n in nodes_by_name(graph.gm)]
        if left:
            raise self.broken(f"layer {layer} still holds attention nodes {left} beside its head split at '{target}'.")

    @staticmethod
    def _splice(gm, site: AttentionSite, target: str, gdn: GatedDeltaNet) -> None:
        nodes = nodes_by_name(gm)
        splice_module(gm, target, gdn, [nodes[site.input_node]], nodes[site.output_node])

    def replay(self, graph: Graph, decisions: dict) -> None:
        """Rebuild the GDN modules (weights are loaded afterwards) and rewrite the graph the same way."""
        hybrid = fork(graph.gm)
        for layer in decisions["layers"]:
            entry = decisions["modules"][str(layer)]
            if "kept_kv_heads" in entry:
                splice_split(hybrid, graph.sites[layer], HeadSplitLayer.from_gdn_config(entry["gdn_config"]).to(device=graph.device, dtype=graph.dtype), entry["target"])
                continue
            mixer = get_mixer(entry.get("mixer", "gdn"))  # recipes before the mixer choice hold GDNs
            if mixer.replaces == "op":
                splice_op_module(hybrid, graph.sites[layer], mixer.module.from_gdn_config(entry["gdn_config"]).to(device=graph.device), mixer.name)
                continue
            gdn = mixer.module.from_gdn_config(entry["gdn_config"]).to(device=graph.device, dtype=graph.dtype)
            self._splice(hybrid, graph.sites[layer], entry["target"], gdn)
        prune(hybrid)
        graph.teacher, graph.gm = graph.gm, hybrid
        graph.meta["replace"] = decisions
