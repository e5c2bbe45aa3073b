"""surgery: trace a decoder LM into torch.fx, rewrite attention layers into Gated DeltaNet, and
initialise them with Taylor-Calibrate.

    graph = capture("smollm2-135m-instruct")          # or a directory, a .gguf, a loaded model
    sites = graph.sites                                  # find_sites(graph) recomputes them
    PassManager(["select", "replace", "calibrate", "align"])(graph)
    save(graph, "out/hybrid");  hybrid = load("out/hybrid")
"""
from .capture import capture
from .checkpoint import load, save
from .diff import diff
from .errors import SurgeryError
from .graph import Graph
from .pass_base import Pass, PassConfig, PassManager, PassResult, get_pass, known_passes, register
from .sites import AttentionSite, find_sites

__all__ = [
    "capture", "load", "save", "diff", "SurgeryError", "Graph", "Pass", "PassConfig", "PassManager",
    "PassResult", "get_pass", "known_passes", "register", "AttentionSite", "find_sites",
]
