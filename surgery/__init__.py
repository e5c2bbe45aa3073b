"""surgery: trace a decoder LM into torch.fx, rewrite attention layers into Gated DeltaNet, and
initialise them with Taylor-Calibrate.

    graph = capture("smollm2-135m-instruct")          # or a directory, a .gguf, a loaded model
    sites = graph.sites                                  # find_sites(graph) recomputes them
    PassManager(["select", "replace", "calibrate", "align"])(graph)
    save(graph, "out/hybrid");  hybrid = load("out/hybrid")
    generate(hybrid, [prompt_ids], max_new_tokens=32)   # incremental decoding (Decoder)
    fast_logits(hybrid, ids)                             # a forward on the device's fast route
    distill("out/hybrid", ["corpus.txt"], "out/distilled", DistillConfig(tokens=10_000_000))
"""
from .core.versions import check_transformers

check_transformers()  # first: outside the tested transformers range, refuse before anything loads

from .core.graph import Graph  # noqa: E402
from .core.pipeline import Pass, PassConfig, PassManager, PassResult, get_pass, known_passes, register
from .decode import Decoder, fast_logits, generate
from .errors import SurgeryError
from .eval import diff
from .io import capture, export, load, open_model, save
from .sites import AttentionSite, find_sites
from .train import DistillConfig, distill
from . import passes  # noqa: E402,F401  (last: importing the passes registers them by name in core.pipeline)

__all__ = [
    "capture", "load", "save", "open_model", "export", "diff", "SurgeryError", "Graph", "Pass", "PassConfig", "PassManager",
    "PassResult", "get_pass", "known_passes", "register", "AttentionSite", "find_sites", "Decoder", "generate", "fast_logits",
    "DistillConfig", "distill",
]
