"""The SURGERY_* switches read one way in every module (tcal.switches)."""
import pytest
import torch

import tcal.chunk_intra as chunk_intra
import tcal.chunk_states as chunk_states
import tcal.pdl as pdl
import tcal.split_state as split_state
from surgery.decode import gdn_blocks, gqa
from tcal.switches import enabled, setting

NAME = "SURGERY_TEST_SWITCH"


@pytest.mark.parametrize("text, want", [("off", "off"), ("0", "off"), ("False", "off"), (" no ", "off"),
                                        ("on", "on"), ("1", "on"), ("TRUE", "on"), ("yes", "on"),
                                        ("auto", "auto"), ("", "auto"), (None, "auto")])
def test_the_words(monkeypatch, text, want):
    if text is None:
        monkeypatch.delenv(NAME, raising=False)
    else:
        monkeypatch.setenv(NAME, text)
    assert setting(NAME) == want
    if want != "auto":
        assert enabled(NAME, True) == enabled(NAME, False) == (want == "on")
    else:
        assert enabled(NAME, True) and not enabled(NAME, False)


def test_numbers_where_the_switch_takes_one(monkeypatch):
    monkeypatch.setenv(NAME, "12")
    assert setting(NAME, numeric=True) == 12
    with pytest.raises(ValueError, match=f"{NAME}='12'.*on, off or auto \\(or unset"):
        setting(NAME)
    monkeypatch.setenv(NAME, "0")
    assert setting(NAME, numeric=True) == setting(NAME) == "off"


def test_a_mistyped_value_is_refused_with_the_variable_named(monkeypatch):
    monkeypatch.setenv(NAME, "of")
    with pytest.raises(ValueError, match=f"{NAME}='of' is not a setting.*on, off or auto"):
        enabled(NAME, True)


def test_every_module_reads_zero_as_off_and_one_as_on(monkeypatch):
    """Before, "0" turned some paths off and left others on (gqa took only "off")."""
    monkeypatch.setenv(gqa.SWITCH, "0")
    assert not gqa.switched_on()
    monkeypatch.setenv(gqa.SWITCH, "1")
    assert gqa.switched_on()
    monkeypatch.setenv(split_state.SWITCH, "no")
    assert split_state.requested_splits(1, 9, 32768, torch.device("cpu")) == 1
    monkeypatch.setenv(gdn_blocks.ENV, "0")  # a switch that takes a number: 0 is off, not zero programs
    assert gdn_blocks.block_programs(torch.device("cpu")) is None
    shapes = torch.zeros(1, 64, 1, 16)
    predicates = {pdl: lambda: pdl.pdl_on(torch.device("cuda")), chunk_intra: lambda: chunk_intra.chunk_intra_takes(*[shapes] * 4),
                  chunk_states: lambda: chunk_states.chunk_states_takes(*[shapes] * 5)}
    for module, predicate in predicates.items():  # each reads its switch before looking at the device or the inputs
        monkeypatch.setenv(module.SWITCH, "0")
        assert not predicate()
        monkeypatch.setenv(module.SWITCH, "oof")
        if module.triton is not None:  # without Triton the predicates answer no before they read the switch
            with pytest.raises(ValueError, match=module.SWITCH):
                predicate()
