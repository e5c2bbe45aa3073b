"""surgery.save / surgery.load: exact round trips, the recipe, and refusal of damaged checkpoints."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import surgery
from surgery import PassManager
from surgery.errors import CheckpointError, ModelLoadError
from surgery.core.rewrite import computed_buffers

pytestmark = pytest.mark.versions  # round trips through transformers' config and tokenizer: repeated at the floor in CI


def convert(graph, layers):
    PassManager(["select", "replace"], {"select": {"policy": "convert", "layers": list(layers)}})(graph)
    return graph


def ids_for(shape, vocab, seed=0):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def assert_same_logits(a, b, vocab):
    for shape in [(1, 5), (2, 33)]:
        ids = ids_for(shape, vocab, seed=shape[1])
        with torch.no_grad():
            x, y = a(ids), b(ids)
        assert torch.equal(x, y), f"{shape}: max diff {(x - y).abs().max().item():.3g}"


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def stories_hybrid(stories):
    return convert(stories(), [1, 3])


@pytest.fixture(scope="module")
def saved(stories_hybrid, tmp_path_factory):
    """A saved stories260K hybrid; tests that damage it work on a copy (`damaged`)."""
    out = tmp_path_factory.mktemp("ckpt") / "hybrid"
    assert surgery.save(stories_hybrid, out) == out
    return out


@pytest.fixture
def damaged(saved, tmp_path):
    copy = tmp_path / "hybrid"
    shutil.copytree(saved, copy)
    return copy


# ------------------------------------------------------------------------------------------------
# round trips


def test_stories_hybrid_round_trip_is_exact(stories_hybrid, saved):
    loaded = surgery.load(saved)
    assert_same_logits(stories_hybrid, loaded, 512)
    assert loaded.layer_kinds == ["attention", "gdn", "attention", "gdn", "attention"]
    assert [h["pass"] for h in loaded.history] == ["select", "replace"]
    assert len(loaded.sites) == 5 and loaded.teacher is None
    assert loaded.max_length == 512
    text = "Once upon a time, there was a little dog."
    assert loaded.tokenizer(text)["input_ids"] == stories_hybrid.tokenizer(text)["input_ids"]
    # the loaded hybrid does not share tensors with the session's teacher
    teacher = {p.data_ptr() for p in stories_hybrid.teacher.parameters()}
    assert not teacher & {p.data_ptr() for p in loaded.gm.parameters()}


@pytest.mark.parametrize("name", ["gpt2", "opt"])  # gpt2: fused Conv1D QKV + tied embeddings; opt: tied, scaled q
def test_tiny_arch_round_trip_is_exact(name, tiny, tmp_path):
    t = tiny(name)
    t.require_sites()
    assert t.model.config.tie_word_embeddings
    g = convert(t.graph.branch(), [1])
    surgery.save(g, tmp_path / name)
    recipe = json.loads((tmp_path / name / "recipe.json").read_text())
    loaded = surgery.load(tmp_path / name)
    assert_same_logits(g, loaded, 128)
    assert loaded.layer_kinds == ["attention", "gdn"]
    assert recipe["model_type"] == t.model.config.model_type
    state = load_file(tmp_path / name / "model.safetensors")
    assert recipe["weights"]["tensors"] == len(state)
    # the tied embedding / lm_head matrix is stored once
    embedding = t.model.get_input_embeddings().weight.detach()
    assert sum(1 for v in state.values() if v.shape == embedding.shape and torch.equal(v, embedding)) == 1


def test_unconverted_teacher_round_trip_stores_tied_weights_as_an_alias(tiny, tmp_path):
    t = tiny("gpt2")
    t.require_graph()
    g = t.graph.branch()
    surgery.save(g, tmp_path / "teacher")
    recipe = json.loads((tmp_path / "teacher" / "recipe.json").read_text())
    assert recipe["passes"] == [] and recipe["weights"]["aliases"] == {"lm_head.weight": "transformer.wte.weight"}
    assert "lm_head.weight" not in load_file(tmp_path / "teacher" / "model.safetensors")
    loaded = surgery.load(tmp_path / "teacher")
    assert_same_logits(g, loaded, 128)
    ids = ids_for((1, 9), 128)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), t.model(input_ids=ids).logits, atol=1e-5, rtol=0)


def test_round_trip_after_calibrate_and_align(stories, tmp_path):
    g = convert(stories(), [2, 4])
    small = {"samples": 2, "length": 64}
    PassManager(["calibrate", "align"], {"calibrate": small, "align": {"steps": 5, "progress": False, **small}})(g)
    surgery.save(g, tmp_path / "h")
    loaded = surgery.load(tmp_path / "h")
    assert_same_logits(g, loaded, 512)
    assert [h["pass"] for h in loaded.history] == ["select", "replace", "calibrate", "align"]
    assert loaded.meta["calibrate"]["layers"]["2"]["beta_target"] == pytest.approx(g.meta["calibrate"]["layers"][2]["beta_target"])
    assert loaded.meta["align"]["steps"] == 5
    # a loaded hybrid has no teacher: calibrate/align cannot run on it again, and the order check says so
    with pytest.raises(surgery.errors.PassOrderError):
        PassManager(["calibrate"])(loaded)


def test_capture_points_a_saved_hybrid_to_load(saved):
    with pytest.raises(ModelLoadError) as info:
        surgery.capture(saved)
    assert "surgery.load" in str(info.value)


# ------------------------------------------------------------------------------------------------
# the directory and the recipe


def test_existing_directory_needs_force(stories, stories_hybrid, tmp_path):
    out = tmp_path / "out"
    surgery.save(stories_hybrid, out)
    before = sha256(out / "recipe.json")
    other = convert(stories(), [0])
    with pytest.raises(CheckpointError) as info:
        surgery.save(other, out)
    assert str(out) in str(info.value) and "--force" in info.value.fix
    assert sha256(out / "recipe.json") == before
    surgery.save(other, out, force=True)
    recipe = json.loads((out / "recipe.json").read_text())
    assert recipe["decisions"]["select"]["convert"] == [0]
    assert surgery.load(out).layer_kinds == ["gdn", "attention", "attention", "attention", "attention"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary or old directories left


def test_extra_files_arrive_with_the_checkpoint_or_not_at_all(stories, stories_hybrid, tmp_path):
    """save's `extra` writes into the staging directory: its files appear in the same final rename,
    and when it fails the directory already there is untouched and nothing is left beside it."""
    out = tmp_path / "out"
    surgery.save(stories_hybrid, out, extra=lambda staging: (staging / "state.txt").write_text("step 3"))
    assert (out / "state.txt").read_text() == "step 3"
    before = sha256(out / "recipe.json")

    def fail(staging):
        (staging / "state.txt").write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        surgery.save(convert(stories(), [0]), out, force=True, extra=fail)
    assert sha256(out / "recipe.json") == before and (out / "state.txt").read_text() == "step 3"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_recipe_contents(saved, stories_hybrid):
    recipe = json.loads((saved / "recipe.json").read_text())
    assert recipe["format"] == "surgery-hybrid" and recipe["version"] == 1
    assert [p["pass"] for p in recipe["passes"]] == ["select", "replace"]
    assert recipe["passes"][0]["config"]["policy"] == "convert" and recipe["passes"][0]["config"]["layers"] == [1, 3]
    assert recipe["decisions"]["select"]["convert"] == [1, 3]
    assert [(row["layer"], row["kind"]) for row in recipe["layers"]] == [
        (0, "attention"), (1, "gdn"), (2, "attention"), (3, "gdn"), (4, "attention")]
    assert recipe["layers"][1]["module"] == "model.layers.1.self_attn"
    for key in ("python", "surgery", "torch", "transformers", "safetensors"):
        assert recipe["versions"][key], key
    assert recipe["versions"]["torch"] == torch.__version__
    files = recipe["weights"]["files"]
    assert list(files) == ["model.safetensors"]
    assert files["model.safetensors"] == sha256(saved / "model.safetensors")
    assert recipe["source"]["kind"] == "gguf" and recipe["model_type"] == "llama"
    assert recipe["config"]["num_hidden_layers"] == 5
    assert len(recipe["sites"]) == 5 and recipe["capture"]["max_length"] == 512
    state = load_file(saved / "model.safetensors")
    assert "model.layers.1.self_attn.A_log" in state and "model.layers.1.self_attn.q_proj.weight" in state
    assert torch.equal(state["model.layers.1.self_attn.q_proj.weight"],
                       stories_hybrid.gm.get_parameter("model.layers.1.self_attn.q_proj.weight").detach())
    assert (saved / "tokenizer").is_dir()


# ------------------------------------------------------------------------------------------------
# damaged checkpoints


def _rewrite_weights(path, state):
    """Write new weights and a matching sha256 into the recipe (a consistent but wrong checkpoint)."""
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    recipe = json.loads((path / "recipe.json").read_text())
    recipe["weights"]["files"]["model.safetensors"] = sha256(path / "model.safetensors")
    (path / "recipe.json").write_text(json.dumps(recipe))


def test_truncated_weights(damaged):
    data = (damaged / "model.safetensors").read_bytes()
    (damaged / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as info:
        surgery.load(damaged)
    assert "model.safetensors" in str(info.value) and "sha256" in str(info.value)
    with pytest.raises(CheckpointError) as info:
        surgery.load(damaged, verify=False)  # even unverified, the reader refuses it cleanly
    assert "cannot be read" in str(info.value)


def test_modified_bytes(damaged):
    path = damaged / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # inside the tensor data: same size, still a valid safetensors file
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as info:
        surgery.load(damaged)
    assert "does not match the sha256" in str(info.value)


def test_missing_recipe_and_weights(damaged, tmp_path):
    (damaged / "model.safetensors").unlink()
    with pytest.raises(CheckpointError) as info:
        surgery.load(damaged)
    assert "missing" in str(info.value)
    (damaged / "recipe.json").unlink()
    with pytest.raises(CheckpointError) as info:
        surgery.load(damaged)
    assert "recipe.json" in str(info.value)
    with pytest.raises(CheckpointError):
        surgery.load(tmp_path / "never-written")


@pytest.mark.parametrize("edit", ["not json", "wrong format", "no passes", "newer version"])
def test_bad_recipe(damaged, edit):
    file = damaged / "recipe.json"
    recipe = json.loads(file.read_text())
    if edit == "not json":
        file.write_text(file.read_text()[:-10])
    else:
        if edit == "wrong format":
            recipe["format"] = "something-else"
        elif edit == "no passes":
            del recipe["passes"]
        else:
            recipe["version"] = 99
        file.write_text(json.dumps(recipe))
    with pytest.raises(CheckpointError) as info:
        surgery.load(damaged)
    assert "\n" not in str(info.value)


def test_extra_tensor_is_refused(damaged):
    state = load_file(damaged / "model.safetensors")
    state["model.layers.1.self_attn.stray.weight"] = torch.zeros(3)
    _rewrite_weights(damaged, state)
    with pytest.raises(CheckpointError) as info:
        surgery.load(damaged)
    assert "1 unexpected" in str(info.value) and "stray.weight" in str(info.value)


def test_missing_tensor_is_refused(damaged):
    state = load_file(damaged / "model.safetensors")
    del state["model.layers.3.self_attn.dt_bias"]
    _rewrite_weights(damaged, state)
    with pytest.raises(CheckpointError) as info:
        surgery.load(damaged)
    assert "1 missing" in str(info.value) and "model.layers.3.self_attn.dt_bias" in str(info.value)


@pytest.mark.parametrize("name", ["llama", "gemma3", "phi3"])  # phi3: longrope's two factor buffers beside inv_freq
def test_a_converted_graph_keeps_computed_buffers_out_of_its_weights(name, tiny):
    """The buffers the teacher keeps out of its state_dict (a rotary embedding's inv_freq, computed from the
    config) stay out of the hybrid's on every torch: 2.11-2.13 copied them into a forked graph as persistent
    (surgery.core.rewrite.graph_module), so a hybrid saved there held inv_freq and did not load on 2.14+."""
    t = tiny(name)
    t.require_sites()
    computed = computed_buffers(t.graph.gm)
    assert any("inv_freq" in n for n in computed), computed
    hybrid = convert(t.graph.branch(), [1])
    assert not computed & set(hybrid.gm.state_dict())


def test_a_checkpoint_holding_a_computed_buffer_loads_with_the_rebuilt_value(stories_hybrid, damaged):
    """A hybrid saved under torch 2.11-2.13 before the fix above holds model.rotary_emb.inv_freq: it loads on
    every torch, the value computed from the config kept (here the stored one is wrong on purpose)."""
    state = load_file(damaged / "model.safetensors")
    assert not computed_buffers(stories_hybrid.gm) & set(state)
    rebuilt = dict(stories_hybrid.gm.named_buffers())["model.rotary_emb.inv_freq"]
    state["model.rotary_emb.inv_freq"] = torch.full_like(rebuilt, 7.0)
    _rewrite_weights(damaged, state)
    loaded = surgery.load(damaged)
    assert torch.equal(dict(loaded.gm.named_buffers())["model.rotary_emb.inv_freq"], rebuilt)
    assert_same_logits(stories_hybrid, loaded, 512)


@pytest.mark.skipif(not os.environ.get("SURGERY_OTHER_TORCH_PYTHON"),
                    reason="SURGERY_OTHER_TORCH_PYTHON (a python with another torch and surgery; .ci/run sets it) not set")
def test_a_hybrid_moves_between_torch_versions(stories_hybrid, saved, stories_path, tmp_path):
    """A hybrid saved here loads under another torch (CI: the ceiling of the range) and one saved there loads
    here, each computing what it computed where it was written (float32 on the CPU: the same kernels)."""
    other = os.environ["SURGERY_OTHER_TORCH_PYTHON"]
    here = Path(__file__).resolve().parent
    done = subprocess.run([other, str(here / "other_torch.py"), str(saved), str(stories_path), "1,3", str(tmp_path / "other")],
                          capture_output=True, text=True, timeout=300, cwd=here.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "other" / "torch.txt").read_text() != torch.__version__  # another torch indeed
    from other_torch import IDS

    got = load_file(tmp_path / "other" / "logits.safetensors")
    with torch.no_grad():
        torch.testing.assert_close(got["theirs"], stories_hybrid(IDS).float(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(surgery.load(tmp_path / "other" / "hybrid")(IDS).float(), got["mine"], rtol=1e-5, atol=1e-5)


def test_recipe_decisions_that_disagree_with_the_weights_are_refused(damaged):
    """A recipe edited to convert another layer rebuilds a different hybrid: the weights cannot fit."""
    file = damaged / "recipe.json"
    recipe = json.loads(file.read_text())
    recipe["decisions"]["select"]["convert"] = [1, 2]
    recipe["decisions"]["replace"]["layers"] = [1, 2]
    recipe["decisions"]["replace"]["modules"]["2"] = dict(recipe["decisions"]["replace"]["modules"]["3"], target="model.layers.2.self_attn")
    del recipe["decisions"]["replace"]["modules"]["3"]
    file.write_text(json.dumps(recipe))
    with pytest.raises(CheckpointError) as info:
        surgery.load(damaged)
    assert "do not match the rebuilt hybrid" in str(info.value)


def _set(path: str, value):
    """An edit of the recipe at a dotted path (list indices and dict keys alike)."""
    def edit(recipe):
        *parents, last = path.split(".")
        node = recipe
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    return edit


@pytest.mark.parametrize("edit, words", [
    (_set("decisions.replace.layers.0", -1), "decisions.replace.layers[0] = -1 is out of range 0..4"),
    (_set("decisions.replace.layers.1", 5), "decisions.replace.layers[1] = 5 is out of range 0..4"),
    (_set("decisions.replace.layers.0", "1"), "decisions.replace.layers[0] = '1' is not an integer"),
    (_set("decisions.replace.layers.0", 1.0), "decisions.replace.layers[0] = 1.0 is not an integer"),
    (_set("decisions.replace.layers", "1,3"), "decisions.replace.layers = '1,3' is not a list"),
    (_set("decisions.replace.layers", [1, 1]), "names a layer twice"),
    (_set("decisions.replace.layers", [1, 3, 4]), "decisions.replace.layers = 4 has no entry in decisions.replace.modules"),
    (_set("decisions.select.convert.0", -1), "decisions.select.convert[0] = -1 is out of range"),
    (_set("decisions.select.keep", [0, 2, 40]), "decisions.select.keep[2] = 40 is out of range"),
    (_set("decisions.replace.modules.9", {"target": "x", "gdn_config": {}}), "decisions.replace.modules['9'] = 9 is out of range"),
    (_set("decisions.replace.modules.1.gdn_config.num_heads", "8"), "decisions.replace.modules['1'].gdn_config.num_heads = '8' is not an integer"),
    (_set("decisions.replace.modules.1.gdn_config.head_dim", 4), "decisions.replace.modules['1'].gdn_config builds 'model.layers.1.self_attn.q_proj.weight' with shape [32, 64]"),
    (_set("decisions.replace.modules.3.gdn_config.use_short_conv", "yes"), "gdn_config.use_short_conv = 'yes' is not true or false"),
    (_set("decisions.replace.modules.3.target", 7), "decisions.replace.modules['3'].target = 7 is not a string"),
    (_set("sites", {"0": {}}), "sites = {'0': {}} is not a list"),
    (_set("sites.0.layer", "0"), "sites[0].layer = '0' is not an integer"),
    (_set("passes", {}), "passes = {} is not a list"),
    (_set("passes.1.config.v_activation", "gelu"), "passes[1] ('replace'): v_activation 'gelu'"),
    (_set("capture.dtype", "manual_seed"), "capture.dtype = 'manual_seed' is not one of"),
    (_set("capture.max_length", "512"), "capture.max_length = '512' is not an integer"),
    (_set("config", [1]), "config = [1] is not an object"),
    (_set("weights.files", {"../other/model.safetensors": "0" * 64}), "weights.files = '../other/model.safetensors' is not a .safetensors file name"),
    (_set("weights.aliases", {"lm_head.weight": "nowhere"}), "weights.aliases['lm_head.weight'] = 'nowhere' names no stored tensor"),
])
def test_every_recipe_field_is_validated(damaged, edit, words):
    """A damaged recipe is refused with the field it got wrong, never read as something else
    (layer -1 would be the last layer) nor a TypeError/IndexError traceback."""
    file = damaged / "recipe.json"
    recipe = json.loads(file.read_text())
    edit(recipe)
    file.write_text(json.dumps(recipe))
    with pytest.raises(CheckpointError) as info:
        surgery.load(damaged)
    assert words in str(info.value) and f"{damaged}/recipe.json" in str(info.value)


def test_binary_recipe_is_a_checkpoint_error(damaged):
    (damaged / "recipe.json").write_bytes(b"\xff\xfe{\x00")
    with pytest.raises(CheckpointError, match="not text"):
        surgery.load(damaged)


# ------------------------------------------------------------------------------------------------
# the attention implementation the teacher was captured with (gemma2 has no SDPA)


@pytest.fixture(scope="module")
def gemma2_saved(tiny, tmp_path_factory):
    """tests/archs.py's gemma2 (eager only), one layer replaced, saved."""
    hybrid = convert(tiny("gemma2").graph.branch(), [1])
    out = surgery.save(hybrid, tmp_path_factory.mktemp("gemma2") / "h")
    return hybrid, out


def test_a_saved_eager_only_hybrid_loads_generates_and_exports(gemma2_saved, tmp_path):
    hybrid, out = gemma2_saved
    assert json.loads((out / "recipe.json").read_text())["capture"]["attn_implementation"] == "eager"
    loaded = surgery.load(out)
    assert_same_logits(hybrid, loaded, 128)
    prompt = ids_for((1, 6), 128, seed=3)
    assert surgery.generate(loaded, prompt, 5, eos_token_id=None) == surgery.generate(hybrid, prompt, 5, eos_token_id=None)
    from surgery.io import export

    assert (export(loaded, tmp_path / "x") / "config.json").exists()


def test_a_recipe_without_the_attention_implementation_loads_as_the_model_class_allows(gemma2_saved, tmp_path):
    """Recipes written before the field existed: transformers' own choice (SDPA, else eager)."""
    hybrid, out = gemma2_saved
    old = tmp_path / "old"
    shutil.copytree(out, old)
    recipe = json.loads((old / "recipe.json").read_text())
    del recipe["capture"]["attn_implementation"]
    (old / "recipe.json").write_text(json.dumps(recipe))
    assert_same_logits(hybrid, surgery.load(old), 128)


@pytest.mark.parametrize("value, error", [(7, "is not a string"), ("", "names no attention implementation"),
                                          ("sdpa", "cannot build the 'gemma2' teacher"),
                                          ("no_such_attention", "cannot build the 'gemma2' teacher")])
def test_a_bad_attention_implementation_is_a_checkpoint_error(gemma2_saved, tmp_path, value, error):
    _, out = gemma2_saved
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    recipe = json.loads((bad / "recipe.json").read_text())
    recipe["capture"]["attn_implementation"] = value
    (bad / "recipe.json").write_text(json.dumps(recipe))
    with pytest.raises(CheckpointError, match=error):
        surgery.load(bad)
