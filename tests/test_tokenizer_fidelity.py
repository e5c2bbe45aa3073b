"""A saved hybrid, a distillation checkpoint and an export tokenize exactly as their teacher
(surgery.io.tokenizer_check): the stories260K GGUF tokenizer survives every writer, and a tokenizer
that saves wrongly (the transformers 5.17 Gemma failure: a BPE without merges, one token per
character) is refused by name with nothing written."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import transformers

import surgery
from surgery import PassManager
from surgery.core.versions import REQUIREMENT
from surgery.io.tokenizer_check import PROBE, TokenizerMismatchError, difference, ids, save_tokenizer

pytestmark = pytest.mark.versions


def test_stories_gguf_tokenizer_loads_and_round_trips(stories_teacher, tmp_path):
    teacher = stories_teacher.tokenizer
    assert len(teacher) == 512 and teacher.bos_token_id == 1
    assert ids(teacher, PROBE["ascii"], False)[:4] != ids(teacher, PROBE["ascii"], True)[:4]  # BOS led: the check covers it
    save_tokenizer(teacher, tmp_path / "tok")
    reloaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert difference(reloaded, teacher) is None
    for text in PROBE.values():
        assert ids(reloaded, text, True) == ids(teacher, text, True)
        assert reloaded.decode(ids(reloaded, text, False)) == teacher.decode(ids(teacher, text, False))


def test_saved_hybrid_and_its_export_tokenize_as_the_teacher(stories, tmp_path):
    graph = stories()
    PassManager(["select", "replace"], {"select": {"policy": "convert", "layers": [1]}})(graph)
    saved = surgery.save(graph, tmp_path / "hybrid")
    loaded = surgery.load(saved)
    assert difference(loaded.tokenizer, graph.tokenizer) is None
    out = surgery.export(loaded, tmp_path / "hf")  # the export's tokenizer is checked against the reloaded one
    assert difference(transformers.AutoTokenizer.from_pretrained(out), graph.tokenizer) is None


def edit_saved_json(monkeypatch, tokenizer, edit):
    """Make `tokenizer.save_pretrained` write a tokenizer.json changed by edit(json) (a wrong save)."""
    real = tokenizer.save_pretrained

    def broken(folder, *args, **kwargs):
        written = real(folder, *args, **kwargs)
        file = Path(folder) / "tokenizer.json"
        data = json.loads(file.read_text())
        edit(data)
        file.write_text(json.dumps(data))
        return written

    monkeypatch.setattr(tokenizer, "save_pretrained", broken)


def no_merges(data):
    data["model"]["merges"] = []


def test_a_tokenizer_that_saves_one_token_per_character_is_refused_and_nothing_saved(stories, tmp_path, monkeypatch):
    graph = stories()
    PassManager(["select", "replace"], {"select": {"policy": "convert", "layers": [1]}})(graph)
    edit_saved_json(monkeypatch, graph.tokenizer, no_merges)
    with pytest.raises(TokenizerMismatchError) as caught:
        surgery.save(graph, tmp_path / "hybrid")
    err = caught.value
    assert "'ascii' part" in err.problem and f"transformers {transformers.__version__}" in err.problem
    mine, theirs = map(int, re.search(r"gives (\d+) tokens, the teacher's (\d+)", err.problem).groups())
    assert theirs == len(ids(graph.tokenizer, PROBE["ascii"], False)) and mine > theirs  # characters, not pieces
    assert REQUIREMENT in err.fix and "Nothing was saved" in err.problem
    assert list(tmp_path.iterdir()) == []  # no hybrid, no staging directory left


def test_an_export_whose_tokenizer_saves_wrongly_is_refused(stories, tmp_path, monkeypatch):
    graph = stories()
    PassManager(["select", "replace"], {"select": {"policy": "convert", "layers": [1]}})(graph)
    edit_saved_json(monkeypatch, graph.tokenizer, no_merges)
    with pytest.raises(TokenizerMismatchError, match="'ascii' part"):
        surgery.export(graph, tmp_path / "hf")
    assert list(tmp_path.iterdir()) == []


def test_a_saved_tokenizer_that_drops_bos_is_refused(stories_teacher, tmp_path, monkeypatch):
    teacher = stories_teacher.tokenizer
    edit_saved_json(monkeypatch, teacher, lambda data: data.update(post_processor=None))
    with pytest.raises(TokenizerMismatchError, match=r"special tokens \(BOS/EOS\)' part: the saved tokenizer gives (\d+) tokens"):
        save_tokenizer(teacher, tmp_path / "tok")


def test_a_saved_tokenizer_that_decodes_differently_is_refused(stories_teacher, tmp_path, monkeypatch):
    teacher = stories_teacher.tokenizer
    edit_saved_json(monkeypatch, teacher, lambda data: data.update(decoder=None))
    with pytest.raises(TokenizerMismatchError, match="'ascii' part decodes to different text"):
        save_tokenizer(teacher, tmp_path / "tok")


def test_a_saved_tokenizer_that_does_not_load_is_refused(stories_teacher, tmp_path, monkeypatch):
    teacher = stories_teacher.tokenizer
    edit_saved_json(monkeypatch, teacher, lambda data: data["model"].update(type="NoSuchModel"))
    with pytest.raises(TokenizerMismatchError, match="cannot be loaded back"):
        save_tokenizer(teacher, tmp_path / "tok")
