"""select's data-driven policies on stories260K, each checked against a brute-force recomputation on
the eager transformers model: ar (attention removal) with a hook that zeroes one layer's attention
output, greedy (GA-S2) with hooks that swap every other layer's attention for its GDN."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

import surgery
from surgery import PassManager
from surgery.eval.ablation import window_perplexity
from surgery.data.windows import held_out_windows
from surgery.cli.app import app
from surgery.errors import CalibrationError, PassConfigError
from surgery.passes.select import SelectConfig
from surgery.passes.selection import LayerSelection

TEXT = (
    "Once upon a time, there was a little girl named Mia. She had a red ball that she loved very much. "
    "One day, Mia went to the park with her dad. She threw the ball high in the sky and it fell into the pond. "
    "Mia was sad. A big duck swam to the ball and pushed it back to her with its beak. Mia laughed and said, "
    "\"Thank you, duck!\" Then she gave the duck some bread. They were friends from that day on.\n\n"
    "Tom had a small dog called Max. Max liked to run and jump in the grass. One morning, Max found a big "
    "stick. He brought it to Tom and wagged his tail. Tom threw the stick and Max ran fast to get it. They "
    "played all day until the sun went down. Tom was tired but happy, and Max slept next to his bed.\n"
)
CALIBRATE = {"calibration": None, "samples": 2, "length": 64}  # the probes fit on the built-in sample: few, short windows


@pytest.fixture(scope="module")
def story(tmp_path_factory, stories_teacher):
    """(path, token ids): the scoring text, scored as ONE window holding all of it (led by the
    tokenizer's BOS, as every scoring window is: surgery.core.bos)."""
    path = tmp_path_factory.mktemp("text") / "story.txt"
    path.write_text(TEXT)
    ids = torch.tensor(stories_teacher.tokenizer(TEXT, add_special_tokens=True)["input_ids"])
    assert ids.numel() <= stories_teacher.max_length
    return path, ids


def scoring(story, **select):
    path, ids = story
    return {"calibration": [str(path)], "samples": 1, "length": ids.numel(), **select}


@torch.no_grad()
def eager_perplexity(model, ids, hooks: dict) -> float:
    """Perplexity of the eager model on ids, with forward hooks {layer: hook} on the attention modules."""
    handles = [model.model.layers[l].self_attn.register_forward_hook(h, with_kwargs=True) for l, h in hooks.items()]
    try:
        logits = model(ids[None]).logits[0]
    finally:
        for h in handles:
            h.remove()
    return math.exp(F.cross_entropy(logits[:-1].float(), ids[1:]).item())


def top(scores: dict, k: int, highest: bool) -> list[int]:
    """The k best layers; the gap to the next one must be real, or the comparison proves nothing."""
    order = sorted(scores, key=lambda l: -scores[l] if highest else scores[l])
    assert abs(scores[order[k - 1]] - scores[order[k]]) > 1e-2 * scores[order[k]], scores
    return sorted(order[:k])


def test_ar_keeps_the_layers_whose_removal_hurts_most(stories, stories_eager, story):
    g = stories()
    PassManager(["select"], {"select": scoring(story, policy="ar", keep_count=2)})(g)
    sel = g.meta["select"]

    def zero(module, args, kwargs, out):
        return (torch.zeros_like(out[0]), *out[1:])

    ids = story[1]
    teacher = eager_perplexity(stories_eager, ids, {})
    brute = {l: eager_perplexity(stories_eager, ids, {l: zero}) for l in range(5)}
    assert sel.teacher_perplexity == pytest.approx(teacher, rel=1e-4)
    assert {r["layer"]: r["perplexity"] for r in sel.scores} == pytest.approx(brute, rel=1e-4)
    assert all(r["increase"] == pytest.approx(brute[r["layer"]] - teacher, rel=1e-3) for r in sel.scores)
    assert sel.keep == top(brute, 2, highest=True)
    assert sel.convert == [l for l in range(5) if l not in sel.keep]
    assert sel.tokens == ids.numel()


@torch.no_grad()
def eager_answer_nll(model, trials, hooks: dict) -> float:
    """The passkey key's NLL (summed over its tokens), mean over trials, from the eager model with hooks."""
    handles = [model.model.layers[l].self_attn.register_forward_hook(h, with_kwargs=True) for l, h in hooks.items()]
    try:
        total = 0.0
        for t in trials:
            logp = F.log_softmax(model(t.ids[None]).logits[0].double(), -1)
            total -= sum(logp[i - 1, t.ids[i]].item() for i in range(t.answer_start, t.ids.numel()))
    finally:
        for h in handles:
            h.remove()
    return total / len(trials)


def test_retrieval_keeps_the_layers_whose_removal_hurts_the_passkey_answer_most(stories, stories_eager):
    """select.policy=retrieval: attention removal scored by the passkey key's NLL on prompts cut from the
    calibration text (the built-in sample here), against the eager model with one layer's attention zeroed."""
    from surgery.eval.passkey import make_trials
    from surgery.passes.select import PROMPT_STREAM

    g = stories()
    PassManager(["select"], {"select": {"policy": "retrieval", "keep_count": 2, "samples": 3, "retrieval_length": 300}})(g)
    sel = g.meta["select"]
    trials = make_trials(g.tokenizer, None, [300], 3, 1, PROMPT_STREAM)  # select.seed 0

    def zero(module, args, kwargs, out):
        return (torch.zeros_like(out[0]), *out[1:])

    teacher = eager_answer_nll(stories_eager, trials, {})
    brute = {l: eager_answer_nll(stories_eager, trials, {l: zero}) for l in range(5)}
    assert sel.teacher_answer_nll == pytest.approx(teacher, rel=1e-4) and "passkey answer NLL" in sel.metric
    assert {r["layer"]: r["answer_nll"] for r in sel.scores} == pytest.approx(brute, rel=1e-4)
    assert sel.keep == top(brute, 2, highest=True) and sel.convert == [l for l in range(5) if l not in sel.keep]
    assert sel.tokens == sum(t.ids.numel() for t in trials)


def test_retrieval_refuses_what_cannot_make_its_prompts(stories):
    """No tokenizer, or prompts too short for the task's own text: a named error before any pass runs."""
    g = stories()
    g.tokenizer = None
    with pytest.raises(PassConfigError, match="need the model's tokenizer"):
        PassManager(["select", "replace"], {"select": {"policy": "retrieval", "keep_count": 2}})(g)
    g = stories()
    with pytest.raises(PassConfigError, match="retrieval_length") as info:
        PassManager(["select", "replace"], {"select": {"policy": "retrieval", "keep_count": 2, "retrieval_length": 40}})(g)
    assert "no room for filler" in info.value.problem and "select" not in g.meta and g.history == []


def test_greedy_keeps_the_layers_whose_single_layer_probe_is_best(stories, stories_eager, story, gdn_at):
    g = stories()
    config = scoring(story, policy="greedy", keep_ratio=0.4, init=["calibrate"], init_configs={"calibrate": CALIBRATE})
    PassManager(["select"], {"select": config})(g)
    sel = g.meta["select"]
    assert sel.init == ["replace", "calibrate"] and sel.keep_count == 2

    # the same init, through the public pipeline, for all five layers; then each probe by hand
    ref = stories()
    PassManager(["select", "replace", "calibrate"], {"select": {"policy": "convert", "layers": list(range(5))}, "calibrate": CALIBRATE})(ref)

    def swap(gdn):
        return lambda module, args, kwargs, out: (gdn(kwargs["hidden_states"]), None)

    ids = story[1]
    brute = {i: eager_perplexity(stories_eager, ids, {l: swap(gdn_at(ref, l)) for l in range(5) if l != i}) for i in range(5)}
    assert {r["layer"]: r["perplexity"] for r in sel.scores} == pytest.approx(brute, rel=1e-4)
    assert sel.keep == top(brute, 2, highest=False)

    # a probe built from scratch (select keep [i] -> replace -> calibrate) differs only by replace's random draws
    for i in (0, 2):
        scratch = stories()
        PassManager(["select", "replace", "calibrate"], {"select": {"policy": "keep", "layers": [i]}, "calibrate": CALIBRATE})(scratch)
        assert window_perplexity(scratch, ids[None]) == pytest.approx(brute[i], rel=2e-2)


def test_greedy_probes_with_the_pipelines_init_by_default():
    manager = PassManager(["select", "replace", "calibrate", "align"],
                          {"select": {"policy": "greedy"}, "calibrate": {"gate": "reference"}, "align": {"steps": 7}})
    config = manager.passes[0].config
    assert config.init == ["calibrate", "align"]
    assert config.init_configs["calibrate"]["gate"] == "reference" and config.init_configs["align"]["steps"] == 7
    phase1 = PassManager(["select", "replace", "calibrate"], {"select": {"policy": "greedy", "init_configs": {"calibrate": {"gate": "zero"}}}})
    assert phase1.passes[0].config.init == ["calibrate"]
    assert phase1.passes[0].config.init_configs["calibrate"]["gate"] == "zero"  # explicit options win
    assert surgery.get_pass("select", {"policy": "greedy"}).init_passes() == ["calibrate", "align"]  # no pipeline: Phase 1 + 2


def test_scores_survive_save_and_load_without_rescoring(stories, story, tmp_path, monkeypatch):
    g = stories()
    PassManager(["select", "replace"], {"select": scoring(story, policy="ar", keep_count=2)})(g)
    surgery.save(g, tmp_path / "hybrid")
    recipe = json.loads((tmp_path / "hybrid" / "recipe.json").read_text())
    assert recipe["decisions"]["select"]["scores"] == g.meta["select"].scores

    import surgery.passes.select as select_module

    def no_scoring(*args, **kwargs):
        raise AssertionError("load must replay the recorded selection, not score again")

    monkeypatch.setattr(select_module, "removal_scores", no_scoring)
    loaded = surgery.load(tmp_path / "hybrid")
    assert isinstance(loaded.meta["select"], LayerSelection)  # replay rebuilds the typed decision
    assert loaded.meta["select"] == LayerSelection.from_dict(json.loads(json.dumps(g.meta["select"].to_dict())))
    assert loaded.layer_kinds == g.layer_kinds == ["gdn" if l in g.meta["select"].convert else "attention" for l in range(5)]


def test_held_out_windows_avoid_the_fitted_text():
    ids = torch.arange(1000)
    avoid = [(100, 300), (500, 520)]
    picked = held_out_windows(ids, 5, 50, seed=3, avoid=avoid)
    assert picked.shape == (5, 50) and torch.equal(picked, held_out_windows(ids, 5, 50, seed=3, avoid=avoid))
    for w in picked.tolist():
        assert w == list(range(w[0], w[0] + 50)) and not any(w[0] < e and s < w[-1] + 1 for s, e in avoid)
    assert held_out_windows(ids, 15, 50, seed=0, avoid=avoid).shape == (15, 50)  # 2 + 4 + 9 tiles fit
    with pytest.raises(CalibrationError, match="held-out"):
        held_out_windows(ids, 16, 50, seed=0, avoid=avoid)


@pytest.mark.parametrize("bad", [{"policy": "best"}, {"policy": "ar", "keep_count": -1}, {"policy": "ar", "keep_ratio": 1.0},
                                 {"policy": "greedy", "init": ["align", "calibrate"]}, {"policy": "greedy", "init": ["distill"]},
                                 {"policy": "greedy", "init_configs": {"calibrate": {"gate": "nope"}}},
                                 {"policy": "greedy", "init_configs": {"quantize": {}}}, {"policy": "ar", "samples": 0},
                                 {"policy": "retrieval", "retrieval_length": 1}])
def test_bad_select_configs_are_config_errors(bad):
    with pytest.raises(PassConfigError) as info:
        SelectConfig.from_dict(bad)
    assert info.value.problem and info.value.fix


@pytest.mark.parametrize("count, words", [(5, "converts no layer"), (7, "more than the 5")])
def test_keep_count_out_of_range(stories, count, words):
    g = stories()
    with pytest.raises(PassConfigError, match=words):
        PassManager(["select"], {"select": {"policy": "ar", "keep_count": count}})(g)
    assert "select" not in g.meta and g.history == []


def test_too_little_calibration_text(stories, story, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("Once upon a time.")
    with pytest.raises(CalibrationError, match="tokens"):
        PassManager(["select"], {"select": {"policy": "ar", "calibration": [str(short)], "keep_count": 1}})(stories())
    # greedy: the probes' Phase 1 covers the story, nothing is left to score on
    g = stories()
    shared = {"calibration": [str(story[0])], "samples": 2, "length": 128}
    with pytest.raises(CalibrationError, match="held-out"):
        PassManager(["select"], {"select": {"policy": "greedy", "keep_count": 1, **shared, "init": ["calibrate"],
                                            "init_configs": {"calibrate": shared}}})(g)
    assert "select" not in g.meta and g.history == []


def test_cli_prints_the_scores_and_refuses_bad_input(stories_path, story, tmp_path):
    runner, env = CliRunner(), {"COLUMNS": "240", "TERM": "dumb"}
    args = ["apply", "--model", str(stories_path), "--passes", "select,replace", "--select-policy", "ar", "--keep-count", "2",
            "--calibration", str(story[0]), "--set", "select.samples=1", "--set", f"select.length={story[1].numel()}"]
    result = runner.invoke(app, [*args, "--out", str(tmp_path / "hybrid")], env=env)
    assert result.exit_code == 0, result.output
    recipe = json.loads((tmp_path / "hybrid" / "recipe.json").read_text())
    select = recipe["decisions"]["select"]
    assert recipe["passes"][0]["config"]["calibration"] == [str(story[0])]
    lines = [l.split("│") for l in result.stdout.splitlines() if l.count("│") >= 5]
    table = {int(c[2]): c[5].strip() for c in lines if c[2].strip().isdigit()}
    assert table == {l: ("keep" if l in select["keep"] else "convert") for l in range(5)}
    result = runner.invoke(app, ["apply", "--model", str(stories_path), "--passes", "select,replace", "--select-policy", "retrieval",
                                 "--keep-count", "2", "--set", "select.samples=2", "--set", "select.retrieval_length=300",
                                 "--out", str(tmp_path / "by-retrieval")], env=env)
    assert result.exit_code == 0, result.output
    select = json.loads((tmp_path / "by-retrieval" / "recipe.json").read_text())["decisions"]["select"]
    lines = [l.split("│") for l in result.stdout.splitlines() if l.count("│") >= 5]
    assert "answer_nll" in result.stdout and select["policy"] == "retrieval"
    assert {int(c[2]): c[5].strip() for c in lines if c[2].strip().isdigit()} == {l: ("keep" if l in select["keep"] else "convert") for l in range(5)}
    for bad, words in ([["--select-policy", "best"], "best"], [["--select-policy", "ar", "--layers", "1"], "--layers"]):
        result = runner.invoke(app, ["apply", "--model", str(stories_path), *bad, "--out", str(tmp_path / "x")], env=env)
        assert result.exit_code == 2 and "Traceback" not in result.output and words in result.stderr, result.output
    assert not (tmp_path / "x").exists()
