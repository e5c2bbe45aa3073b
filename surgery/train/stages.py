"""The two stages as (module to train, loss of a micro-batch, FLOPs per token): stage l2 fits each
GDN layer to the teacher's attention output at its site (teacher-forced), stage kl the whole
student to the teacher's logits. Also which parameters each stage trains, and at what rate."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..core.compiled import maybe_compiled
from ..core.graph import Graph
from ..core.rewrite import graph_module, prune
from ..core.run import graph_logits, placeholder_values
from ..errors import DistillError
from ..passes.head_split import split_columns as head_split_columns
from .losses import chunk_terms, kl_divergence
from .placement import Placement

KINDS = ("new", "copied", "rest")  # the AdamW groups, in this order


def parameter_kinds(graph: Graph) -> dict[int, str]:
    """id(parameter) -> "copied" (filled from the teacher) or "new" for every GDN parameter, as the
    GDN modules name them (copied_parameters, param_groups); absent ids are "rest"."""
    kinds: dict[int, str] = {}
    for module in graph.gdn_modules().values():
        for _, p in module.copied_parameters():
            kinds[id(p)] = "copied"
        for items in module.param_groups().values():
            for _, p in items:
                kinds.setdefault(id(p), "new")
    return kinds


def gate_parameters(graph: Graph) -> list[torch.nn.Parameter]:
    """The GDN layers' gate parameters, as their modules file them (tcal's "gates" role): what
    DistillConfig.freeze_gates_steps holds still at the start of a run."""
    return [p for module in graph.gdn_modules().values() for _, p in module.param_groups().get("gates", [])]


def param_groups(graph: Graph, lrs: dict[str, float], weight_decay: float, trained: dict | None = None) -> list[dict]:
    """AdamW groups per kind (new / copied / rest) with lr > 0; 1-D tensors and parameters marked
    _no_weight_decay (A_log, dt_bias) get no weight decay. Order follows named_parameters, which a
    reloaded hybrid reproduces, so optimizer states line up on resume. trained: name -> the tensor
    that trains the graph's parameter of that name (a sharded copy, surgery.train.sharding); a name
    it lacks is not trained."""
    kinds = parameter_kinds(graph)
    buckets: dict[tuple[str, bool], list] = {}
    for name, p in graph.gm.named_parameters():
        kind = kinds.get(id(p), "rest")
        if trained is not None:
            if name not in trained:
                continue
            p = trained[name]
        if lrs[kind] > 0 and p.is_floating_point():
            decay = p.ndim >= 2 and not getattr(p, "_no_weight_decay", False)
            buckets.setdefault((kind, decay), []).append(p)
    return [{"params": ps, "lr": lrs[kind], "weight_decay": weight_decay if decay else 0.0, "kind": kind}
            for kind in KINDS for decay in (True, False) if (ps := buckets.get((kind, decay)))]


def tap_module(gm: torch.fx.GraphModule, names: list[str]) -> torch.fx.GraphModule:
    """A copy of gm's graph that returns the named nodes' values and stops there: what only feeds
    later layers and the LM head is pruned, so stage 1 never computes it. It shares gm's tensors and
    takes placeholder_values(gm, ids) positionally."""
    graph = torch.fx.Graph()
    env: dict = {}
    graph.graph_copy(gm.graph, env)
    by_name = {n.name: env[n] for n in gm.graph.nodes if n in env}
    missing = [n for n in names if n not in by_name]
    if missing:
        raise DistillError(f"The teacher graph has no node(s) {missing}.", "The teacher and its attention sites disagree; capture the teacher again.")
    graph.output(tuple(by_name[n] for n in names))
    tapped = graph_module(gm, graph)
    tapped.meta = dict(getattr(gm, "meta", {}))
    prune(tapped)
    tapped.recompile()
    return tapped


LOOKUPS = (torch.ops.aten.embedding.default,)


def forward_params(gm: torch.nn.Module) -> int:
    """Parameters a forward pass multiplies with (a training step costs about 6 FLOPs per such
    parameter and token); a table used only for embedding lookups costs none and is left out."""
    named = dict(gm.named_parameters(remove_duplicate=False))
    lookup_only: dict[int, bool] = {}
    if isinstance(gm, torch.fx.GraphModule):
        for n in gm.graph.nodes:
            if n.op == "get_attr" and n.target in named:
                only = bool(n.users) and all(u.op == "call_function" and u.target in LOOKUPS for u in n.users)
                key = id(named[n.target])
                lookup_only[key] = lookup_only.get(key, True) and only
    unique = {id(p): p for p in gm.parameters()}
    return sum(p.numel() for key, p in unique.items() if not lookup_only.get(key, False))


def split_columns(graph: Graph) -> dict[int, torch.Tensor]:
    """For each layer split by heads (select.granularity=head), the o_proj columns that read its converted
    heads (the align pass's, copied: float32, no gradient): stage l2 fits those heads' share of the layer
    output through them, as align does (tcal.head_split), since the kept heads are exact."""
    return {l: head_split_columns(graph, l).detach().float().clone() for l, kind in enumerate(graph.layer_kinds) if kind == "split"}


class Layers(torch.nn.Module):
    """The GDN modules as one module, so DDP sees exactly stage 1's trainable parameters. A head split
    (a layer in `columns`) gives its converted heads' share of the layer output through those columns."""

    def __init__(self, modules: dict[int, torch.nn.Module], columns: dict[int, torch.Tensor] | None = None):
        super().__init__()
        self.layers = torch.nn.ModuleDict({str(l): m for l, m in modules.items()})
        self.split = [str(l) for l in (columns or {})]
        for l, w in (columns or {}).items():
            self.register_buffer(f"columns_{l}", w, persistent=False)

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [m(x, self.get_buffer(f"columns_{key}")) if key in self.split else m(x)
                for (key, m), x in zip(self.layers.items(), xs)]


def checkpointed_forward(module, *args):
    return torch.utils.checkpoint.checkpoint(type(module).forward, module, *args, use_reentrant=False)


def recomputed(module: torch.nn.Module) -> torch.nn.Module:
    """What gradient checkpointing wraps of a converted layer: its GDN; a head split's graph calls its
    parts (the kept heads' attention, the GDN, the merge), and only the GDN has internals worth dropping."""
    return getattr(module, "recomputed", lambda: module)()


@contextlib.contextmanager
def gradient_checkpointing(modules, enabled: bool):
    """Recompute each GDN layer in backward instead of keeping its internals (chunk matrices,
    gates): the layer's activations are the large part of its memory, its FLOPs a small part."""
    patched = []
    try:
        if enabled:
            for m in map(recomputed, modules):
                m.forward = lambda *args, m=m: checkpointed_forward(m, *args)
                patched.append(m)
        yield
    finally:
        for m in patched:
            del m.forward


@dataclass
class Stage:
    """module: what DDP wraps (its no_sync skips gradient averaging between micro-batches);
    loss(ids): the micro-batch's loss; flops_per_token: model FLOPs of one trained token."""

    module: torch.nn.Module
    loss: Callable[[torch.Tensor], torch.Tensor]
    flops_per_token: int


def stage_l2(student: Graph, teacher: Graph, place: Placement, autocast: Callable, compile: bool = False,
             prepare=None, wrapped=None) -> Stage:
    """MSE between each GDN layer's output and the teacher's attention output at its site, the
    layer fed the teacher's input there; the teacher runs only up to the last GDN site. prepare: a
    graph rewrite for the compiled path only (surgery.decode.CausalFlags). wrapped: what trains the
    GDN layers (default: Layers of them, under DDP with several processes)."""
    gdn = student.gdn_modules()
    sites = teacher.sites
    columns = split_columns(student)
    # a head split's target is its converted heads' share: the teacher's per-head context there (the attention op's output)
    names = [n for l in gdn for n in (sites[l].input_node, sites[l].attn_node if l in columns else sites[l].output_node)]
    taps = tap_module(teacher.gm, names)
    wrapped = wrapped if wrapped is not None else place.wrap(Layers(gdn, columns))
    run_taps = maybe_compiled(taps, compile, place.device, use="train", label="teacher up to the last GDN site", prepare=prepare)
    run_layers = maybe_compiled(wrapped, compile, place.device, use="train", label="GDN layers")

    def target(layer, out):
        if layer not in columns:
            return out
        w = columns[layer]
        return gdn[layer].converted_target(out.transpose(1, 2).float(), w.to(out.device))

    def loss(ids):
        with torch.no_grad(), autocast():
            outs = run_taps(*placeholder_values(taps, ids))
            targets = [target(l, out) for l, out in zip(gdn, outs[1::2])]
        with autocast():
            preds = run_layers(list(outs[0::2]))
        return torch.stack([F.mse_loss(p.float(), t.float()) for p, t in zip(preds, targets)]).mean()

    gdn_params = sum(p.numel() for m in gdn.values() for p in m.parameters())
    return Stage(wrapped, loss, 6 * gdn_params + 2 * forward_params(taps))


def stage_kl(student: Graph, teacher: Graph, place: Placement, autocast: Callable, temperature: float,
             compile: bool = False, prepare=None, wrapped=None, teacher_module=None) -> Stage:
    """KL(teacher || student) over the logits, the whole student trained. prepare: a graph rewrite
    for the compiled path only; the student's shares its parameters, so training it trains the student.
    wrapped: what computes the student's logits (default: its graph, under DDP with several processes);
    teacher_module: what computes the teacher's (default: its graph; a sharded one: fsdp_teacher)."""
    if wrapped is None:
        wrapped = place.wrap(prepare(student.gm) if compile and prepare is not None else student.gm)
    extra = student.gm.meta.get("extra_inputs", {})
    run_teacher = maybe_compiled(teacher.gm if teacher_module is None else teacher_module, compile, place.device, use="train",
                                 label="teacher graph", prepare=prepare)
    run_student = maybe_compiled(wrapped, compile, place.device, use="train", label="student graph")
    terms = maybe_compiled(chunk_terms, compile, place.device, use="train", label="KL loss chunk", dynamic=False)

    def loss(ids):
        with torch.no_grad(), autocast():
            target = graph_logits(run_teacher, ids)
        with autocast():
            logits = graph_logits(run_student, ids, extra)
        return kl_divergence(logits, target, temperature, terms=terms)

    return Stage(wrapped, loss, 6 * forward_params(student.gm) + 2 * forward_params(teacher.gm))
