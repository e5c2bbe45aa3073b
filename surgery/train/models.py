"""The two models of a run: the hybrid to train (the student) and the teacher it learns from, each
a Graph with its own weights, checked to belong together."""
from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import torch

from ..core.graph import Graph
from ..errors import DistillError
from ..io.open import capture, is_hybrid, open_model
from .stages import parameter_kinds


def open_student(model, device, dtype) -> tuple[Graph, str]:
    """The hybrid to train: a Graph, or a directory written by `surgery apply` / checkpoint.save."""
    if isinstance(model, Graph):
        graph, name = model, "<in-memory hybrid>"
    else:
        path = Path(model)
        if not path.exists():
            raise DistillError(f"Model '{path}' does not exist.", "Pass the directory of a saved hybrid (`surgery apply --out DIR`) with --model.")
        if not is_hybrid(path):
            raise DistillError(f"'{path}' is not a saved hybrid (no recipe.json).", "Convert the teacher first (`surgery apply --model M --out DIR`), then distill DIR.")
        graph, name = open_model(path, device=device, dtype=dtype), str(path.resolve())
    if not graph.gdn_targets():
        raise DistillError(f"'{name}' has no GDN layers: its recipe converts nothing.", "Run `surgery apply` with select and replace first.")
    windowed = [l for l, m in graph.gdn_modules().items() if not m.param_groups()]
    if windowed:
        raise DistillError(f"'{name}' converted layers {windowed} to a mixer with nothing to train (swa): distill trains converted layers.",
                           "Use the hybrid as it is, or convert with replace.mixer=gdn (or gla) to distill.")
    return graph, name


def teacher_path(source: dict) -> Path | None:
    """Where a recipe's source says the teacher lives, when it is a file or directory."""
    if source.get("kind") == "gguf" and source.get("path") and source.get("gguf_file"):
        return Path(source["path"]) / source["gguf_file"]
    if source.get("kind") == "dir" and source.get("path"):
        return Path(source["path"])
    return None


def describe_source(source) -> str:
    path = Path(str(source)).expanduser()
    return str(path.resolve()) if path.exists() else str(source)


def find_teacher(student: Graph, teacher, device, dtype) -> tuple[Graph, str]:
    """An explicit source (or Graph), else the hybrid's in-memory teacher, else the recipe's source."""
    if isinstance(teacher, Graph):
        return teacher, f"<in-memory teacher {teacher.source.get('name', teacher.source.get('kind', ''))}>".replace(" >", ">")
    if teacher is not None:
        return capture(teacher, device=device, dtype=dtype), describe_source(teacher)
    if student.teacher is not None:
        graph = Graph(gm=student.teacher, config=student.config, source=student.source, tokenizer=student.tokenizer,
                      sites=student.sites, meta={"capture": dict(student.meta.get("capture", {}))})
        return graph, "<the hybrid's in-memory teacher>"
    path = teacher_path(student.source or {})
    if path is None:
        raise DistillError(f"The hybrid's recipe does not say where its teacher is (source: {student.source}).", "Pass the teacher with --teacher (a model directory, .gguf file or short name).")
    if not path.exists():
        raise DistillError(f"The hybrid's teacher '{path}' (named in its recipe) does not exist here.", "Pass the teacher with --teacher.")
    return capture(path, device=device, dtype=dtype), str(path.resolve())


def open_teacher(student: Graph, teacher, device, dtype) -> tuple[Graph, str, bool]:
    """The teacher as a Graph with its own weights, its name, and whether its weights are this run's
    own (captured or copied here; not a caller's Graph, which the run must leave as it found it).
    Weights it shares with the student (an in-memory teacher after `replace`) are copied, so
    training the student never moves the teacher."""
    graph, name = find_teacher(student, teacher, device, dtype)
    owned = not isinstance(teacher, Graph) and (teacher is not None or student.teacher is None)
    gm = graph.teacher_gm
    student_tensors = {p.data_ptr() for p in student.gm.parameters()}
    if any(p.data_ptr() in student_tensors for p in gm.parameters()):
        gm, owned = copy.deepcopy(gm), True
    graph = dataclasses.replace(graph, gm=gm, teacher=None, cache={})
    check_teacher(student, graph, name)
    return graph, name, owned


def check_teacher(student: Graph, teacher: Graph, name: str) -> None:
    """The teacher has the hybrid's layers and, outside the GDN layers, its parameter names and shapes."""
    if len(teacher.sites) != len(student.sites):
        raise DistillError(f"The teacher {name} has {len(teacher.sites)} attention layers, the hybrid {len(student.sites)}.", "Pass the teacher the hybrid was converted from (--teacher).")
    kinds = parameter_kinds(student)
    mine = {n: p for n, p in student.gm.named_parameters() if id(p) not in kinds}
    theirs = dict(teacher.gm.named_parameters())
    common = set(mine) & set(theirs)
    wrong = sorted(n for n in common if mine[n].shape != theirs[n].shape)
    if not common or wrong:
        raise DistillError(f"The teacher {name} does not match the hybrid ({len(common)} shared parameter names, {len(wrong)} of other shapes, e.g. {wrong[:2]}).",
                           "Pass the teacher the hybrid was converted from (--teacher).")


def check_lengths(seq_len: int, student: Graph, teacher: Graph) -> None:
    for g, who in ((student, "hybrid"), (teacher, "teacher")):
        if seq_len > g.max_length:
            raise DistillError(f"seq_len {seq_len} exceeds what the {who} graph takes ({g.max_length} tokens).", f"Use --seq-len {g.max_length} or less.")


def teacher_dtype(student: Graph, autocast: bool, device: torch.device) -> torch.dtype:
    """bf16 for a teacher captured here when CUDA computes under autocast, else the student's dtype."""
    return torch.bfloat16 if autocast and device.type == "cuda" else student.dtype
