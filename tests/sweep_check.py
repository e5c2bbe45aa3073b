"""The conversion sweep's check of one tiny architecture (tests/archs.py), shared by the opt-in test
(tests/test_sweep.py, marker `sweep`) and the bench script (bench/sweep.py), so both judge alike:

  capture (conftest.get_tiny) -> select, replace, calibrate, align with small options on the built-in
  calibration sample -> the hybrid's logits are finite -> surgery.decode.Decoder (its construction
  self-check) -> prefill + 4 steps equal graph.logits on a 12-token probe (float32, the decoder's
  tolerance) -> the round trip: surgery.save -> surgery.load (logits equal to the in-memory
  hybrid's) -> surgery.generate (4 greedy tokens equal to the in-memory hybrid's) -> surgery.io's
  export (the directory loads with AutoModelForCausalLM.from_pretrained(trust_remote_code=True),
  logits within 1e-4 of surgery.load's); a DecodeError or ExportError there is a refusal by name.

The tiny models have no tokenizer, so the sample is read through BytesTokenizer (UTF-8 bytes modulo
the vocabulary): calibration needs text, not any particular tokenizer."""
from __future__ import annotations

import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import surgery
from conftest import get_tiny
from surgery import PassManager
from surgery.decode import DecodeError, Decoder, generate
from surgery.decode.agreement import close
from surgery.errors import ExportError, first_line
from surgery.io import export

PIPELINE = ["select", "replace", "calibrate", "align"]
TEXT = {"samples": 2, "length": 32}
CONFIGS = {"select": {"keep_ratio": 0.5}, "calibrate": TEXT, "align": {**TEXT, "steps": 3, "progress": False}}
PROBE = 12   # tokens of the explicit incremental-vs-full comparison
STEPS = 4    # of them fed one at a time after the prefill
EXPORT_ATOL = 1e-4  # the export's logits against surgery.load's


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
    why: the error's first line, the DecodeError's problem, or the logit difference.
    round_trip: save, load, generate, export: "exact" | "refused" (a stage refused by name) | "wrong"
    | "error" | "-" (not reached); round_trip_why: the stage and what it said or how far it was off."""

    architecture: str
    converts: str = "error"
    decodes: str = "-"
    why: str = ""
    max_diff: float | None = None
    round_trip: str = "-"
    round_trip_why: str = ""
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
        result.round_trip, result.round_trip_why = round_trip(graph, ids)
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


def round_trip(graph, ids: torch.Tensor) -> tuple[str, str]:
    """(status, why) of save -> load -> generate -> export for a converted graph (see SweepResult)."""
    stage = "save"
    try:
        with tempfile.TemporaryDirectory(prefix="sweep-") as tmp:
            tokenizer, graph.tokenizer = graph.tokenizer, None  # BytesTokenizer is the sweep's, not the model's
            try:
                surgery.save(graph, Path(tmp) / "hybrid")
            finally:
                graph.tokenizer = tokenizer
            stage = "load"
            loaded = surgery.load(Path(tmp) / "hybrid")
            with torch.no_grad():
                mine, theirs = loaded.logits(ids), graph.logits(ids)
            if not torch.equal(mine, theirs):
                return "wrong", f"load: logits differ from the in-memory hybrid's by {(mine - theirs).abs().max().item():.3g}"
            stage = "generate"
            refused = []
            try:
                got, want = (generate(g, ids[:, :PROBE - STEPS], STEPS, eos_token_id=None) for g in (loaded, graph))
                if got != want:
                    return "wrong", f"generate: {got} after load, {want} in memory"
            except DecodeError as exc:
                refused.append(f"generate: {exc.problem.rstrip('.')}")
            stage = "export"
            try:
                export(loaded, Path(tmp) / "export")
            except ExportError as exc:
                refused.append(f"export: {exc.problem.rstrip('.')}")
            else:
                stage = "the export in transformers"
                diff = export_difference(Path(tmp) / "export", loaded, ids)
                if diff > EXPORT_ATOL:
                    return "wrong", f"{stage}: its logits differ from surgery.load's by {diff:.3g}"
            return ("refused", "; ".join(refused)) if refused else ("exact", "")
    except Exception as exc:  # a stage's failure is this row's, not the sweep's end
        return "error", f"{stage}: {type(exc).__name__}: {first_line(exc)}"


def export_difference(out: Path, loaded, ids: torch.Tensor) -> float:
    """The export loaded by plain transformers (remote code): its largest logit difference from surgery.load's."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs, mine = model(input_ids=ids).logits, loaded.logits(ids)
    return (theirs.float() - mine.float()).abs().max().item()
