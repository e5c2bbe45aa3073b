"""Windows start with the tokenizer's BOS when it adds one (surgery.core.bos): perplexity chunks,
calibration and scoring windows, distillation batches, passkey prompts; a GGUF's add_bos_token
metadata decides what its tokenizer does."""
import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from surgery.core.bos import align_leading, lead_windows, leading_token
from surgery.data.cache import token_stream
from surgery.data.corpus import TokenCorpus, WindowOrder
from surgery.data.windows import calibration_ids, held_out_windows
from surgery.eval.passkey import build_trial
from surgery.eval.perplexity import chunk_tokens, perplexity, score_windows

pytestmark = pytest.mark.versions  # transformers versions differ on BOS: repeated at the floor in CI

STORIES_BOS = 1


def word_tokenizer(with_bos: bool):
    """A tokenizers-built word-level tokenizer (always available): BOS '<s>' = 0, added only if asked."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "<unk>": 1, "The": 2, "window": 3, "probe": 4}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    if with_bos:
        core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", unk_token="<unk>")


def test_leading_token_follows_the_tokenizer(stories_teacher):
    assert leading_token(stories_teacher.tokenizer) == STORIES_BOS
    assert leading_token(word_tokenizer(with_bos=False)) is None
    assert leading_token(word_tokenizer(with_bos=True)) == 0
    assert leading_token(None) is None


def test_align_leading_makes_the_tokenizer_agree():
    tok = word_tokenizer(with_bos=False)
    align_leading(tok, True)
    assert leading_token(tok) == 0
    align_leading(tok, False)
    assert leading_token(tok) is None


def test_perplexity_chunks_start_with_bos_and_predict_every_text_token(stories):
    graph = stories()
    ids = token_stream(graph.tokenizer, None)[: 4 * 31]
    result = perplexity(graph, ids, chunk=32)
    assert (result["chunks"], result["chunk_length"], result["tokens"]) == (4, 32, ids.numel())
    windows = torch.cat([torch.full((4, 1), STORIES_BOS), ids.view(4, 31)], dim=1)
    with torch.no_grad():
        logits = graph(windows)
    nll = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), windows[:, 1:].flatten()).item()
    assert result["nll"] == pytest.approx(nll, rel=1e-5)


def test_perplexity_without_bos_keeps_the_old_chunks(stories):
    graph = stories()
    graph.tokenizer = None  # no tokenizer: no BOS, exactly the former protocol
    ids = token_stream(stories().tokenizer, None)[:100]
    result = perplexity(graph, ids, chunk=32)
    assert (result["chunks"], result["chunk_length"], result["tokens"]) == (3, 32, 3 * 31)
    assert torch.equal(lead_windows(chunk_tokens(ids, 32), None), ids[:96].view(3, 32))


def test_calibration_and_scoring_windows_start_with_bos(stories):
    graph = stories()
    ids = token_stream(graph.tokenizer, None)
    cal = calibration_ids(graph, None, 3, 16, 0)
    assert cal.shape == (3, 16) and (cal[:, 0] == STORIES_BOS).all()
    assert all(any(torch.equal(row[1:], ids[s:s + 15]) for s in range(ids.numel() - 14)) for row in cal)
    held = held_out_windows(ids, 2, 16, 0, [(0, 64)], lead=STORIES_BOS)
    assert held.shape == (2, 16) and (held[:, 0] == STORIES_BOS).all()


def test_window_order_batches_start_with_bos(tmp_path, stories_teacher):
    text = Path(tmp_path / "corpus.txt")
    text.write_text("Once upon a time there was a little girl who liked to play in the park. " * 40)
    corpus = TokenCorpus.build([text], stories_teacher.tokenizer)
    order = WindowOrder(corpus, 16, 4, seed=3, lead=leading_token(stories_teacher.tokenizer))
    batch = order.batch(5)
    assert batch.shape == (4, 16) and (batch[:, 0] == STORIES_BOS).all()
    rows = [torch.from_numpy(corpus.window(i * 15, (i + 1) * 15)) for i in order.indices(5)]
    assert torch.equal(batch[:, 1:], torch.stack(rows))
    again = WindowOrder(corpus, 16, 4, seed=3, lead=STORIES_BOS)  # a resumed run: a pure function of step
    assert torch.equal(again.batch(5), batch)


def test_passkey_prompt_starts_with_bos_inside_its_length(stories_teacher):
    tok = stories_teacher.tokenizer
    filler = token_stream(tok, None)
    trial = build_trial(tok, filler, 200, 0.5, "12345", offset=7)
    assert trial.ids[0] == STORIES_BOS and trial.answer_start == 200


def test_gguf_metadata_decides_the_tokenizers_bos(tmp_path, stories_path, monkeypatch):
    """A copy of stories260K's GGUF that says add_bos_token=False loads with a tokenizer that adds
    no BOS, even where transformers ignores that key (simulated: its tokenizer made to add one)."""
    import gguf
    import transformers
    try:
        from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata
    except ImportError:  # gguf < 0.14 (pyproject's floor is 0.11) ships its scripts as a top-level package
        from scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    from surgery.core.load import load_model

    reader = gguf.GGUFReader(stories_path)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()  # .contents() is gguf >= 0.16
    target = tmp_path / "no_bos.gguf"
    writer = gguf.GGUFWriter(target, arch=arch, endianess=getattr(reader, "endianess", gguf.GGUFEndian.LITTLE))  # gguf < 0.16: little
    copy_with_new_metadata(reader, writer, {"tokenizer.ggml.add_bos_token": MetadataDetails(gguf.GGUFValueType.BOOL, False)}, [])
    real = transformers.AutoTokenizer.from_pretrained

    def ignoring_the_key(*args, **kwargs):
        tokenizer = real(*args, **kwargs)
        tokenizer.add_bos_token = True
        return tokenizer

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", ignoring_the_key)
    assert leading_token(ignoring_the_key(tmp_path, gguf_file=target.name)) == STORIES_BOS
    _, tokenizer, _ = load_model(target)
    assert tokenizer.bos_token_id == STORIES_BOS and leading_token(tokenizer) is None


def test_resume_refuses_a_run_whose_sequences_were_led_differently(tmp_path):
    """A run recorded without a BOS lead (made before the protocol, or with another tokenizer) is not
    resumed with BOS-led sequences: it would train on other windows than it started on."""
    from surgery.errors import DistillError
    from surgery.train.run_dir import RunDir

    run = RunDir(tmp_path / "run")
    run.saved = {"corpus": "key", "lead": None}
    run.check_corpus("key", None)  # the same sequences: fine
    with pytest.raises(DistillError, match="start each training sequence with token 1"):
        run.check_corpus("key", STORIES_BOS)


def test_a_non_finite_perplexity_is_said_with_its_first_window():
    """NaN logits (a broken model, or a bf16 overflow) give a warning naming the first window and the
    float32 check, not a silent 'nan'."""
    from types import SimpleNamespace

    def logits(ids):
        out = torch.zeros(*ids.shape, 7)
        out[ids[:, 0] == 2] = float("nan")  # windows led by token 2 go bad
        return out

    model = SimpleNamespace(device=torch.device("cpu"), logits=logits)
    windows = torch.tensor([[1, 3, 4], [1, 4, 5], [2, 3, 4], [1, 5, 6]])
    with pytest.warns(UserWarning, match="from window 2 of 4 the loss is NaN or inf.*float32"):
        result = score_windows(model, windows, label=None)
    assert math.isnan(result["perplexity"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert score_windows(model, windows[:2], label=None)["perplexity"] == pytest.approx(7.0)
