"""The conversion sweep's check of one tiny architecture (tests/archs.py), shared by the opt-in test
(tests/test_sweep.py, marker `sweep`) and the bench script (bench/sweep.py), so both judge alike:

  capture (conftest.get_tiny) -> select, replace, calibrate, align with small options on the built-in
  calibration sample -> the hybrid's logits are finite -> surgery.decode.Decoder (its construction
  self-check) -> prefill + 4 steps equal graph.logits on a 12-token probe (float32, the decoder's
  tolerance).

The tiny models have no tokenizer, so the sample is read through BytesTokenizer (UTF-8 bytes modulo
the vocabulary): calibration needs text, not any particular tokenizer."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from conftest import get_tiny
from surgery import PassManager
from surgery.decode import DecodeError, Decoder
from surgery.decode.agreement import close
from surgery.errors import first_line

PIPELINE = ["select", "replace", "calibrate", "align"]
TEXT = {"samples": 2, "length": 32}
CONFIGS = {"select": {"keep_ratio": 0.5}, "calibrate": TEXT, "align": {**TEXT, "steps": 3, "progress": False}}
PROBE = 12   # tokens of the explicit incremental-vs-full comparison
STEPS = 4    # of them fed one at a time after the prefill


class BytesTokenizer:
    """A tokenizer for models built from a config: id = UTF-8 byte modulo the vocabulary size."""

    eos_token_id = None

    def __init__(self, vocab: int):
        self.vocab = vocab

    def __call__(self, text: str, add_special_tokens: bool = False, return_attention_mask: bool = False) -> dict:
        return {"input_ids": [b % self.vocab for b in text.encode("utf-8")]}

    def get_vocab(self) -> dict:
        return {f"<{i}>": i for i in range(self.vocab)}

    def __len__(self) -> int:
        return self.vocab


@dataclass
class SweepResult:
    """converts: "yes" | "error";  decodes: "exact" | "refused" | "wrong" | "error" | "-" (not reached);
    why: the error's first line, the DecodeError's problem, or the logit difference."""

    architecture: str
    converts: str = "error"
    decodes: str = "-"
    why: str = ""
    max_diff: float | None = None
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def convert(name: str):
    """The tiny architecture captured (sites found) and converted by the four passes."""
    tiny = get_tiny(name)
    for stage, error in (("capture", tiny.capture_error), ("site discovery", tiny.sites_error)):
        if error is not None:
            raise RuntimeError(f"{stage} failed: {type(error).__name__}: {first_line(error)}") from error
    graph = tiny.graph.branch()
    graph.tokenizer = BytesTokenizer(vocab_of(graph))
    PassManager(PIPELINE, CONFIGS)(graph)
    return graph


def vocab_of(graph) -> int:
    with torch.no_grad():
        return int(graph.logits(torch.zeros(1, 1, dtype=torch.long)).shape[-1])


def probe_ids(vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (1, PROBE), generator=torch.Generator().manual_seed(1))


def incremental_vs_full(decoder: Decoder, graph, ids: torch.Tensor) -> tuple[bool, float]:
    """Prefill all but the last STEPS tokens, step through those, compare with graph.logits."""
    first = ids.shape[1] - STEPS
    decoder.reset(1, ids.shape[1])
    with torch.no_grad():
        full = graph.logits(ids)
        got = [decoder.prefill(ids[:, :first])] + [decoder.step(ids[:, t:t + 1]) for t in range(first, ids.shape[1])]
    decoder.reset()
    return close(torch.cat(got, dim=1), full)


def check(name: str) -> SweepResult:
    """Convert and decode one architecture; every failure is recorded, never raised."""
    result, start = SweepResult(name), time.perf_counter()
    try:
        graph = convert(name)
        ids = probe_ids(vocab_of(graph))
        with torch.no_grad():
            finite = bool(torch.isfinite(graph.logits(ids)).all())
        if not finite:
            raise RuntimeError("the hybrid's logits are not finite")
        result.converts = "yes"
        decode(result, graph, ids)
    except Exception as exc:  # one architecture's failure is its row, not the sweep's end
        result.why = f"{type(exc).__name__}: {first_line(exc)}"
    result.seconds = round(time.perf_counter() - start, 2)
    return result


def decode(result: SweepResult, graph, ids: torch.Tensor) -> None:
    """Refused: a DecodeError (named reason). Any other exception: "error", a decoder bug."""
    try:
        decoder = Decoder(graph)
    except DecodeError as exc:
        result.decodes, result.why = "refused", exc.problem
        return
    except Exception as exc:
        result.decodes, result.why = "error", f"{type(exc).__name__}: {first_line(exc)}"
        return
    ok, diff = incremental_vs_full(decoder, graph, ids)
    result.max_diff = diff
    result.decodes = "exact" if ok else "wrong"
    result.why = "" if ok else f"prefill + {STEPS} steps differ from full recomputation by {diff:.3g}"
