"""Conversion across the registry (tests/sweep_check.py, also run by bench/sweep.py): every
architecture that captures converts (select, replace, calibrate, align), gives finite logits,
either decodes incrementally exactly as full recomputation or refuses with a named reason, and
survives save -> load -> generate -> export exactly, a stage refusing by name at most.

The whole registry is opt-in (`python -m pytest tests/test_sweep.py -m sweep`, ~10 min on 2 cores);
the default suite runs SUBSET: the full pipeline on attention forms that test_generate (select +
replace only) and test_calibrate (stories260K, a Llama) do not convert through calibrate and align."""
from __future__ import annotations

import pytest

from archs import ARCHS, EXTRA_ARCHS
from sweep_check import check

# Conv1D fused qkv without rope; fused qkv_proj; eager softmax with softcap and sliding windows; MQA
# with fused query_key_value; ALiBi (converts, refuses to decode); attention sinks (the same); an eager
# softmax over [B*H, T, T] (xglm); a baddbmm whose bias is zeros (gpt_neox_japanese: decodes); multi-head
# latent attention (deepseek_v3: K and V through a low-rank latent and a norm, a shared rope key).
SUBSET = ["gpt2", "phi3", "gemma2", "falcon", "bloom", "gpt_oss", "xglm", "gpt_neox_japanese", "deepseek_v3"]
# decoding refuses these with a named reason (words of DecodeError.problem)
REFUSES = {"bloom": "ALiBi", "mpt": "position bias", "falcon_alibi": "position bias",
           "gpt_oss": "attention sinks", "flint": "attention sinks", "granite_swa": "attention sinks"}
# known not to convert (bench/results/sweep_cpu.json): strict, so a fix shows up as a failure to update this
KNOWN_FAILURES: dict[str, str] = {}  # name -> why (none today: the MLA families convert since MLA capture)
# round trips known to fail (bench/results/sweep_cpu.json), the export's to fix: checked to fail with
# these words, so a fix shows up as a failure to update this. openai-gpt: the exported GDN returns a
# tuple where OpenAIGPT's block concatenates its attention's list output.
ROUND_TRIP_FAILURES: dict[str, str] = {}  # name -> the failure it must show (none today)


def assert_converts_and_decodes(name: str) -> None:
    result = check(name)
    assert result.converts == "yes", f"{name}: {result.why}"
    if name in REFUSES:
        assert result.decodes == "refused" and REFUSES[name] in result.why, f"{name}: {result.decodes}: {result.why}"
    else:
        assert result.decodes == "exact", f"{name}: {result.decodes}: {result.why}"
    assert_round_trip(name, result)


def assert_round_trip(name: str, result) -> None:
    """save -> load -> generate -> export exact, or refused by name: generate exactly where decoding
    refuses (the same reason), export with its ExportError."""
    if name in ROUND_TRIP_FAILURES:
        assert result.round_trip == "error" and ROUND_TRIP_FAILURES[name] in result.round_trip_why, f"{name}: {result.round_trip_why}"
        return
    stages = result.round_trip_why.split("; ") if result.round_trip_why else []
    assert result.round_trip in ("exact", "refused"), f"{name}: round trip {result.round_trip}: {result.round_trip_why}"
    assert (result.round_trip == "refused") == bool(stages), f"{name}: round trip {result.round_trip}: {result.round_trip_why}"
    assert any(s.startswith("generate: ") for s in stages) == (name in REFUSES), f"{name}: {result.round_trip_why}"
    assert all(s.startswith(("generate: ", "export: ")) for s in stages), f"{name}: {result.round_trip_why}"


@pytest.mark.parametrize("name", SUBSET)
def test_representative_architectures_convert_decode_and_round_trip(name):
    assert_converts_and_decodes(name)


@pytest.mark.sweep
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(reason=KNOWN_FAILURES[n], strict=True))
                                  if n in KNOWN_FAILURES else n for n in [*ARCHS, *EXTRA_ARCHS]])
def test_every_capturing_architecture_converts_decodes_and_round_trips(name):
    assert_converts_and_decodes(name)
