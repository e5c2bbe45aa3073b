"""surgery: trace a decoder LM into torch.fx, rewrite attention layers into Gated DeltaNet, and
initialise them with Taylor-Calibrate.

    graph = capture("smollm2-135m-instruct")          # or a directory, a .gguf, a loaded model
    sites = graph.sites                                  # find_sites(graph) recomputes them
    PassManager(["select", "replace", "calibrate", "align"])(graph)
    save(graph, "out/hybrid");  hybrid = load("out/hybrid")
    generate(hybrid, [prompt_ids], max_new_tokens=32)   # incremental decoding (Decoder)
    distill("out/hybrid", ["corpus.txt"], "out/distilled", DistillConfig(tokens=10_000_000))
"""
from .capture import capture
from .checkpoint import load, save
from .decode import Decoder, generate
from .diff import diff
from .distill import DistillConfig, distill
from .errors import SurgeryError
from .graph import Graph
from .pass_base import Pass, PassConfig, PassManager, PassResult, get_pass, known_passes, register
from .sites import AttentionSite, find_sites

__all__ = [
    "capture", "load", "save", "diff", "SurgeryError", "Graph", "Pass", "PassConfig", "PassManager",
    "PassResult", "get_pass", "known_passes", "register", "AttentionSite", "find_sites", "Decoder", "generate",
    "DistillConfig", "distill",
]
