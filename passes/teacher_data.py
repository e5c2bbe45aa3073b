"""What the teacher's attention does on calibration text, for the passes that read the teacher
(calibrate, align, select's probes): per converted layer its inputs, outputs, contexts and
streaming attention statistics, read at the nodes its site names, and the options that say which
text (TeacherDataConfig)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from surgery.core import progress
from surgery.core.pipeline import PassConfig
from surgery.core.rewrite import ancestors, nodes_by_name
from surgery.core.run import interpret, placeholder_values
from surgery.core.streamed import run_streamed
from surgery.data.windows import calibration_ids
from surgery.errors import CalibrationError, PassConfigError
from tcal.stats import AttentionStats, StatsError


@dataclass
class TeacherDataConfig(PassConfig):
    """calibration  text files (default: the built-in sample); samples x length tokens are used
    samples      calibration windows read
    length       tokens per calibration window
    seed         seeds where the windows are cut from the text
    batch_size   windows per teacher forward"""

    calibration: list[str] | None = None
    samples: int = 16
    length: int = 256
    seed: int = 0
    batch_size: int = 4

    def validate(self) -> None:
        for key in ("samples", "length", "batch_size"):
            if getattr(self, key) < 1:
                raise PassConfigError(f"{key} must be >= 1, got {getattr(self, key)}.", "Use a positive number.")
        if self.length < 2:
            raise PassConfigError("length must be >= 2 tokens.", "Use e.g. 256.")


def check_text(graph, config: TeacherDataConfig) -> None:
    """The calibration text holds at least one window's tokens (a pass's preflight: before any pass
    changes the graph; the tokens are cached, so the pass reads them again at no cost)."""
    calibration_ids(graph, config.calibration, 1, config.length, config.seed)


def teacher_data(graph, config: TeacherDataConfig):
    """Per converted layer: the teacher's attention inputs, outputs, contexts and statistics,
    cached on the graph so calibrate and align read the teacher once (an entry for more layers on
    the same text serves fewer: select's greedy probes read every layer before the pipeline does)."""
    layers = graph.meta["replace"]["layers"]
    text = (tuple(config.calibration or ()), config.samples, config.length, config.seed)
    qkv = op_layers(graph)
    key = ("teacher_data", tuple(layers), *text, tuple(qkv))
    cached = graph.cache.get(key)
    if cached is not None:
        return cached
    for other, data in list(graph.cache.items()):
        if (isinstance(other, tuple) and other[:1] == ("teacher_data",) and other[2:-1] == text and set(layers) <= set(data)
                and set(qkv) <= set(other[-1])):
            return {l: data[l] for l in layers}
    ids = calibration_ids(graph, config.calibration, config.samples, config.length, config.seed)
    data = collect(graph, layers, ids, with_stats=True, batch_size=config.batch_size, qkv_layers=qkv)
    graph.cache[key] = data
    return data


def op_layers(graph) -> list[int]:
    """The converted layers whose mixer replaced only the attention op (swa): their Phase 1 reads the
    Q, K, V the teacher's op received."""
    from tcal.mixers import get_mixer

    modules = graph.meta["replace"]["modules"]
    return [int(l) for l in sorted(modules, key=int) if get_mixer(modules[l].get("mixer", "gdn")).replaces == "op"]


def tap(callbacks: dict):
    """on_value for the interpreters: hands the value of each node named in `callbacks` to its functions."""
    def on_value(n, value):
        for fn in callbacks.get(n.name, ()):
            fn(value)
    return on_value


def run_with_taps(gm, ids: torch.Tensor, callbacks: dict) -> None:
    """Run gm on ids, handing the value of each node named in `callbacks` to its functions."""
    with torch.no_grad():
        interpret(gm, placeholder_values(gm, ids), on_value=tap(callbacks), keep=lambda n: False)


def read_teacher(graph, gm, ids: torch.Tensor, batch_size: int, callbacks: dict, batch: dict) -> None:
    """Run the teacher over ids in mini-batches with the taps; batch["index"] names the mini-batch at
    work. An offloaded teacher (graph.weights) runs layer by layer: each site's layer weights are read
    once for all mini-batches (surgery.core.streamed), and nothing past the last tap is run."""
    starts = range(0, ids.shape[0], batch_size)
    with progress.task("reading the teacher", ids.shape[0], "windows") as bar:
        if graph.weights is None:
            for i, start in enumerate(starts):
                batch["index"] = i
                run_with_taps(gm, ids[start:start + batch_size].to(graph.device), callbacks)
                bar.update(min(start + batch_size, ids.shape[0]))
            return
        nodes = nodes_by_name(gm)
        taps = {nodes[name] for name in callbacks}
        only = set().union(*(ancestors(n) for n in taps)) | taps
        cuts = [nodes[s.output_node] for s in graph.sites if s.output_node in nodes]
        run_streamed(gm, graph.weights, [ids[start:start + batch_size] for start in starts], cuts, device=graph.device,
                     dtype=graph.dtype, on_value=tap(callbacks), on_batch=lambda i: batch.__setitem__("index", i), only=only)
        bar.update(ids.shape[0])


@dataclass
class LayerData:
    """What the teacher's attention at one layer saw and produced on the calibration windows."""

    x: torch.Tensor          # attention input (after the block's norm)   [N, T, hidden]
    target: torch.Tensor     # attention output (after the output proj)  [N, T, hidden]
    ctx: torch.Tensor        # per-head context before the output proj  [N, T, H, D]
    stats: dict | None = None
    qkv: tuple | None = None  # Q, K, V as the attention op received them (layers in qkv_layers)


def collect(graph, layers: list[int], ids: torch.Tensor, *, with_stats: bool, batch_size: int = 4,
            query_chunk: int = 256, qkv_layers=()) -> dict[int, LayerData]:
    """Run the TEACHER graph over ids in mini-batches and gather, per layer, inputs, targets, contexts
    and (optionally) streaming attention statistics. Statistics come from Q/K as the attention op
    receives them (after RoPE), or from the probabilities an eager layer materialises. For the
    layers in qkv_layers, also the op's Q, K, V."""
    gm = graph.teacher_gm
    nodes = nodes_by_name(gm)
    store = {l: {"x": [], "target": [], "ctx": [], "q": [], "k": [], "v": []} for l in layers}
    stats = {l: AttentionStats(graph.sites[l].num_heads) for l in layers} if with_stats else {}
    callbacks: dict = {}
    batch = {"index": 0}

    def add(name, fn):
        if name not in nodes:
            raise CalibrationError(f"The teacher graph has no node '{name}'.", "Capture the teacher again; the graph and its sites disagree.")
        callbacks.setdefault(name, []).append(fn)

    for l in layers:
        s = graph.sites[l]
        add(s.input_node, lambda v, l=l: store[l]["x"].append(v.detach()))
        add(s.output_node, lambda v, l=l: store[l]["target"].append(v.detach()))
        add(s.attn_node, lambda v, l=l: store[l]["ctx"].append(v.detach().transpose(1, 2)))
        if l in qkv_layers:
            for name, node in (("q", s.q_node), ("k", s.k_node), ("v", s.v_node)):
                add(node, lambda v, l=l, name=name: store[l][name].append(v.detach()))
        if with_stats and s.probs_node:
            heads = s.num_heads  # an eager layer may softmax over [B*H, T, T] (XGLM's bmm form)
            add(s.probs_node, lambda v, l=l, h=heads: stats[l].update_from_probs(v.detach().reshape(-1, h, *v.shape[-2:]), query_chunk=query_chunk))
        elif with_stats:  # keyed by mini-batch: a layer-streamed run sees the shared mask of every batch first
            seen = {}
            add(s.q_node, lambda v, seen=seen: seen.__setitem__(("q", batch["index"]), v.detach()))
            if s.mask_node:
                add(s.mask_node, lambda v, seen=seen: seen.__setitem__(("mask", batch["index"]), v.detach()))
            add(s.k_node, lambda v, seen=seen: seen.__setitem__(("k", batch["index"]), v.detach()))

            def on_attn(_, l=l, s=s, seen=seen):
                b = batch["index"]
                stats[l].update_from_qk(seen.pop(("q", b)), seen.pop(("k", b)), scale=s.scale, mask=seen.pop(("mask", b), None),
                                        softcap=s.softcap, query_chunk=query_chunk)

            add(s.attn_node, on_attn)
    read_teacher(graph, gm, ids, batch_size, callbacks, batch)
    out = {}
    for l in layers:
        data = LayerData(*(torch.cat(store[l][k]) for k in ("x", "target", "ctx")))
        if l in qkv_layers:
            data.qkv = tuple(torch.cat(store[l][k]) for k in ("q", "k", "v"))
        if with_stats:
            try:
                data.stats = stats[l].result()
            except StatsError as exc:
                raise CalibrationError(f"Attention statistics of layer {l} are unusable: {exc}", "Check the calibration text and the teacher's weights (NaN?).") from exc
        for name in ("x", "target", "ctx"):
            if not torch.isfinite(getattr(data, name)).all():
                raise CalibrationError(f"The teacher produced NaN/inf {name} at layer {l} on the calibration text.", "Check the teacher's weights and dtype (float16 overflow?).")
        out[l] = data
    return out
