"""Perplexity with the WikiText-2 protocol: the whole file tokenised once (read as text, so CRLF
becomes LF), cut into non-overlapping chunks of 2048 tokens (or the model's context if shorter), the
trailing partial chunk dropped, mean NLL over every predicted token. When the tokenizer puts a BOS
first (Gemma; not SmolLM2), each chunk is BOS + 2047 text tokens and every text token is predicted. On SmolLM2-135M-Instruct and
data/wikitext-2-raw/wiki.test.raw this predicts 300,909 tokens, as the reference benchmark does."""
from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F

from ..core import progress as report
from ..core.bos import lead_windows, leading_token, text_length
from ..core.graph import Graph
from ..decode.fast import fast_runner
from ..errors import CalibrationError

DEFAULT_CHUNK = 2048


def chunk_tokens(ids: torch.Tensor, length: int) -> torch.Tensor:
    """[n_chunks, length]; the trailing partial chunk is dropped (a short file keeps one chunk)."""
    n = ids.numel() // length
    if n == 0:
        if ids.numel() < 2:
            raise CalibrationError(f"The text holds {ids.numel()} token(s); at least 2 are needed.", "Use a longer text.")
        return ids[None]
    return ids[: n * length].view(n, length)


@torch.no_grad()
def score_windows(graph, windows: torch.Tensor, *, batch_size: int = 1, progress=None, compile: bool | None = None,
                  label: str | None = "perplexity") -> dict:
    """Mean NLL of tokens 1..T-1 of each window [N, T], every window scored on its own (a window
    that starts with BOS has all its text tokens predicted). Reported as task `label`
    (surgery.core.progress; None: silent, for a caller that reports its own loop) and to
    progress(done, total) when given."""
    run = fast_runner(graph, compile, label="graph for perplexity") if isinstance(graph, Graph) else graph.logits  # an export
    total, count, first_bad = 0.0, 0, None
    device = graph.device
    with report.task(label or "", windows.shape[0], "windows", enabled=label is not None) as bar:
        for start in range(0, windows.shape[0], batch_size):
            batch = windows[start:start + batch_size].to(device)
            logits = run(batch)
            nll = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum")
            total += nll.item()
            count += batch[:, 1:].numel()
            if first_bad is None and not math.isfinite(total):
                first_bad = start
            done = min(start + batch_size, windows.shape[0])
            bar.update(done, info=f"perplexity so far {math.exp(total / count):.4g}")
            if progress is not None:
                progress(done, windows.shape[0])
    mean = total / count
    if first_bad is not None:  # said, not raised: a training run's evaluation must not cost it its step
        warnings.warn(f"The perplexity is not finite: from window {first_bad} of {windows.shape[0]} the loss is NaN or inf "
                      "(the model's logits hold NaN or inf there). Evaluate in float32 (--dtype float32) to tell an "
                      "overflow from a broken model.", stacklevel=2)
    return {"perplexity": math.exp(mean), "nll": mean, "tokens": count, "chunks": int(windows.shape[0]), "chunk_length": int(windows.shape[1])}


def perplexity(graph, ids: torch.Tensor, *, chunk: int = DEFAULT_CHUNK, batch_size: int = 1, progress=None,
               compile: bool | None = None) -> dict:
    """Mean NLL over predicted tokens of `ids` (1-D) in non-overlapping chunks, each led by the
    tokenizer's BOS when it adds one (surgery.core.bos), through the fast runner (surgery.decode.fast);
    compile: True compiles at once, False never, None: the device's route (surgery.core.compiled.ROUTES)."""
    lead = leading_token(graph.tokenizer)
    length = text_length(min(chunk, graph.max_length), lead)
    chunks = lead_windows(chunk_tokens(ids, length), lead)
    return score_windows(graph, chunks, batch_size=batch_size, progress=progress, compile=compile)
