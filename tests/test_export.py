"""surgery.export --format hf: the directory loads in transformers (trust_remote_code, no surgery) with
the hybrid's logits, generates the same greedy tokens, takes left-padded batches, round-trips."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import typer
from safetensors.torch import save_file
from typer.testing import CliRunner

import surgery
from surgery import PassManager
from surgery.decode import generate
from surgery.errors import CheckpointError, ExportError
from surgery.io.export import export

pytestmark = pytest.mark.versions  # exports load in the users' transformers: repeated at the floor in CI


def convert(graph, layers):
    PassManager(["select", "replace"], {"select": {"policy": "convert", "layers": list(layers)}})(graph)
    return graph


def hf_load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32).eval()


def relative_error(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def ids_for(shape, vocab, seed=0):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def stories_export(stories, tmp_path_factory):
    """(saved hybrid, its export) for stories260K with layers 1 and 3 converted."""
    root = tmp_path_factory.mktemp("export")
    surgery.save(convert(stories(), [1, 3]), root / "hybrid")
    return root / "hybrid", export(root / "hybrid", root / "hf")


def test_stories_logits_equal_surgery_load(stories_export):
    hybrid, out = stories_export
    config = json.loads((out / "config.json").read_text())
    assert set(config["surgery_hybrid"]["gdn_layers"]) == {"model.layers.1.self_attn", "model.layers.3.self_attn"}
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_surgery_hybrid.SurgeryHybridForCausalLM"
    assert {"gdn.py", "kernels.py", "token_step.py", "delta_inputs.py", "gated_norm.py", "split_state.py", "modeling_surgery_hybrid.py", "layer_graphs.py", "model.safetensors", "generation_config.json", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert "import surgery" not in (out / "modeling_surgery_hybrid.py").read_text()
    loaded, model = surgery.load(hybrid), hf_load(out)
    ids = ids_for((2, 33), 512)
    with torch.no_grad():
        assert relative_error(model(ids).logits, loaded(ids)) <= 1e-4


def test_stories_greedy_generate_and_left_padding(stories_export):
    hybrid, out = stories_export
    loaded, model = surgery.load(hybrid), hf_load(out)
    generates_as(loaded, model)
    pad = 3
    short = loaded.tokenizer("The dog")["input_ids"]
    with pytest.raises(ValueError, match="left padding"):
        model(torch.tensor([short + [0] * pad]), attention_mask=torch.tensor([[1] * len(short) + [0] * pad]),
              cache=__import__("transformers").DynamicCache())


def test_padding_mask_read_however_passed(stories_export):
    """The GDN layers' 2-D mask is forward's attention_mask argument passed by keyword or by position, as
    binding the call to forward's signature reads it (the pre-hook reads it without binding)."""
    import inspect

    model = hf_load(stories_export[1])
    modeling = sys.modules[type(model).__module__]
    ids = ids_for((2, 9), 512)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad():
        keyword = model(ids, attention_mask=mask).logits
        assert torch.equal(model(ids, mask).logits, keyword)
        assert not torch.equal(model(ids).logits[1], keyword[1])  # the mask was read
    cls = type(model)
    for args, kwargs in [((ids, mask), {}), ((ids,), {"attention_mask": mask}), ((), {"input_ids": ids}), ((ids,), {})]:
        bound = inspect.signature(cls.forward).bind_partial(model, *args, **kwargs).arguments.get("attention_mask")
        assert modeling.call_argument(cls, "attention_mask", args, kwargs) is bound
    assert modeling.call_argument(cls, "no_such_argument", (), {"no_such_argument": 1}) is None


def generates_as(loaded, model) -> None:
    """The export's greedy tokens in transformers' generate equal surgery's, alone and in a left-padded batch."""
    long, short = loaded.tokenizer("Once upon a time")["input_ids"], loaded.tokenizer("The dog")["input_ids"]
    assert len(long) > len(short)
    expected = generate(loaded, [long, short], max_new_tokens=10, eos_token_id=None)
    one = model.generate(torch.tensor([long]), max_new_tokens=10, min_new_tokens=10, do_sample=False)
    assert one[0, len(long):].tolist() == expected[0]
    pad = len(long) - len(short)
    ids = torch.tensor([long, [0] * pad + short])
    mask = torch.tensor([[1] * len(long), [0] * pad + [1] * len(short)])
    both = model.generate(ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    assert both[:, len(long):].tolist() == expected


def test_save_pretrained_round_trip_is_exact(stories_export, tmp_path):
    model = hf_load(stories_export[1])
    model.save_pretrained(tmp_path / "again")
    again = hf_load(tmp_path / "again")
    ids = ids_for((2, 17), 512, seed=3)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, again(ids).logits)


# fused QKV (phi3, gpt2, falcon_new), GQA (llama), qk-norm (qwen3), sliding window (mistral, gemma3), softcap (gemma2);
# gemma3 and falcon_new put their GDN beside the attention module (<path>_gdn), which the export moves back
ARCHS = ["llama", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "gpt2", "falcon_new"]


@pytest.mark.parametrize("name", ARCHS)
def test_tiny_arch_export_matches_hybrid(name, tiny, tmp_path):
    t = tiny(name)
    t.require_sites()
    hybrid = convert(t.graph.branch(), [0])
    model = hf_load(export(hybrid, tmp_path / "hf"))
    vocab = t.model.config.vocab_size
    for shape in [(1, 5), (2, 23)]:
        ids = ids_for(shape, vocab, seed=shape[1])
        with torch.no_grad():
            assert relative_error(model(ids).logits, hybrid(ids)) <= 1e-4, shape


@pytest.mark.parametrize("mixer", ["gla", "kda", "mamba2"])
def test_layer_mixers_export_exactly(stories, tiny, tmp_path, mixer):
    """Every mixer that replaces a whole attention module (replace.mixer) exports: calibrated, with short
    convolutions, its logits and greedy tokens (left-padded too) in plain transformers are the hybrid's;
    and on two tiny architectures whose layer sits beside its attention module (gemma3) or behind fused QKV (gpt2)."""
    hybrid = stories()
    PassManager(["select", "replace", "calibrate"], {"select": {"policy": "convert", "layers": [1, 3]},
                                                     "replace": {"mixer": mixer, "use_short_conv": True},
                                                     "calibrate": {"samples": 2, "length": 64}})(hybrid)
    model = hf_load(export(hybrid, tmp_path / "hf"))
    assert [type(m).__name__ for m in model.modules()].count(f"{mixer.upper()}Attention") == 2
    ids = ids_for((2, 33), 512)
    with torch.no_grad():
        assert relative_error(model(ids).logits, hybrid(ids)) <= 1e-4
    generates_as(hybrid, model)
    for name in ("gemma3", "gpt2"):
        t = tiny(name)
        converted = t.graph.branch()
        PassManager(["select", "replace"], {"select": {"policy": "convert", "layers": [0]}, "replace": {"mixer": mixer}})(converted)
        model = hf_load(export(converted, tmp_path / name))
        ids = ids_for((2, 23), t.model.config.vocab_size, seed=1)
        with torch.no_grad():
            assert relative_error(model(ids).logits, converted(ids)) <= 1e-4, name


def test_swa_exports_as_a_windowed_mask(stories, tiny, tmp_path):
    """An swa layer keeps the teacher's module and windows its mask: logits and greedy tokens (left-padded
    too) equal the hybrid's under SDPA and eager attention, the window changes them from the teacher's;
    gpt2's fused QKV and gemma2's full layer export too, and gemma2's own sliding layer is refused by name."""
    hybrid = stories()
    PassManager(["select", "replace"], {"select": {"policy": "convert", "layers": [1, 3]}, "replace": {"mixer": "swa", "window": 4}})(hybrid)
    out = export(hybrid, tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["surgery_hybrid"]["gdn_layers"]["model.layers.1.self_attn"]["mixer"] == "swa"
    ids = ids_for((2, 33), 512)
    from transformers import AutoModelForCausalLM

    for implementation in ("sdpa", "eager"):
        model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32, attn_implementation=implementation).eval()
        with torch.no_grad():
            assert relative_error(model(ids).logits, hybrid(ids)) <= 1e-4, implementation
            assert relative_error(model(ids).logits, stories()(ids)) > 1e-2  # the window is in force
        generates_as(hybrid, model)
    model.config._attn_implementation = "flex_attention"  # an implementation whose masks cannot carry the window
    with torch.no_grad(), pytest.raises(ValueError, match="attn_implementation='sdpa' or 'eager'"):
        model(ids)
    for name, layer in (("gpt2", 0), ("gemma2", 1)):
        t = tiny(name)
        converted = t.graph.branch()
        PassManager(["select", "replace"], {"select": {"policy": "convert", "layers": [layer]}, "replace": {"mixer": "swa", "window": 3}})(converted)
        model = hf_load(export(converted, tmp_path / name))
        ids = ids_for((2, 23), t.model.config.vocab_size, seed=1)
        with torch.no_grad():
            assert relative_error(model(ids).logits, converted(ids)) <= 1e-4, name
    sliding = tiny("gemma2").graph.branch()
    PassManager(["select", "replace"], {"select": {"policy": "convert", "layers": [0]}, "replace": {"mixer": "swa"}})(sliding)
    with pytest.raises(ExportError, match=r"layer 0 .*already slides over"):
        export(sliding, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()


def test_attention_that_adds_its_residual_is_refused(tiny, tmp_path):
    t = tiny("bloom")
    t.require_sites()
    with pytest.raises(ExportError, match="layer 0 .*changes the output projection's result"):
        export(convert(t.graph.branch(), [0]), tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_force_replaces_an_export_only(stories_export, tmp_path):
    hybrid, _ = stories_export
    graph = surgery.load(hybrid)
    out = export(graph, tmp_path / "hf")
    with pytest.raises(CheckpointError, match="already exists"):
        export(graph, out)
    export(graph, out, force=True, dtype=torch.bfloat16)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    (out / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="notes.txt"):
        export(graph, out, force=True)
    with pytest.raises(CheckpointError, match="input"):
        export(hybrid, hybrid, force=True)  # refused before the model loads


def test_cli_export(stories_export, tmp_path):
    from cli.export import export as command  # noqa: the command module; app.py registers it as `export`

    app = typer.Typer()
    app.command()(command)
    result = CliRunner().invoke(app, ["--model", str(stories_export[0]), "--out", str(tmp_path / "hf")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "hf" / "config.json").exists()


ISOLATED = """
import sys
sys.path.extend({sites!r})
try:
    import surgery
except ImportError:
    pass
else:
    raise SystemExit("surgery is importable")
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({out!r}, trust_remote_code=True, dtype=torch.float32).eval()
data = load_file({data!r})
with torch.no_grad():
    logits = model(data["ids"]).logits
error = ((logits - data["logits"]).abs().max() / data["logits"].abs().max()).item()
tokens = model.generate(data["ids"][:1, :5], max_new_tokens=4, min_new_tokens=4, do_sample=False)
print(error, tokens[0, 5:].tolist())
"""


def test_export_loads_without_surgery_installed(stories_export, tmp_path):
    """python -I -S: no site hooks (so no editable finder of this project), only the site-packages
    directories that hold transformers and torch on sys.path (two in a --system-site-packages venv)."""
    import transformers

    hybrid, out = stories_export
    loaded = surgery.load(hybrid)
    ids = ids_for((2, 19), 512, seed=5)
    with torch.no_grad():
        save_file({"ids": ids, "logits": loaded(ids)}, tmp_path / "data.safetensors")
    sites = list(dict.fromkeys(str(Path(m.__file__).parent.parent) for m in (transformers, torch)))  # a venv's, then the system's
    code = ISOLATED.format(sites=sites, out=str(out), data=str(tmp_path / "data.safetensors"))
    run = subprocess.run([sys.executable, "-I", "-S", "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    error, tokens = run.stdout.strip().splitlines()[-1].split(" ", 1)
    assert float(error) <= 1e-4
    assert json.loads(tokens) == generate(loaded, [ids[0, :5].tolist()], max_new_tokens=4, eos_token_id=None)[0]


def test_generate_carries_the_gdn_state(stories_export):
    """transformers' generate on the export does not recompute the prefix: after the prompt each GDN
    layer sees one token per call, and its recurrent state stays in one tensor updated in place (the
    fused token step), while the tokens equal surgery's Decoder's greedy ones."""
    hybrid, out = stories_export
    loaded, model = surgery.load(hybrid), hf_load(out)
    prompt = loaded.tokenizer("Once upon a time there was")["input_ids"]
    lengths: dict = {}
    states: dict = {}

    def record(module, args, kwargs, output):
        hidden = args[0] if args else kwargs["hidden_states"]
        lengths.setdefault(module.cache_index, []).append(hidden.shape[1])
        cache = next(kwargs[k] for k in ("past_key_values", "past_key_value", "cache", "layer_past") if k in kwargs)
        tensor = getattr(cache.layers[module.cache_index], "surgery_gdn_state").recurrent
        states.setdefault(module.cache_index, set()).add(tensor.data_ptr())

    gdn = [m for m in model.modules() if type(m).__name__ == "GDNAttention"]
    assert len(gdn) == 2
    hooks = [m.register_forward_hook(record, with_kwargs=True) for m in gdn]
    try:
        tokens = model.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    finally:
        for h in hooks:
            h.remove()
    assert tokens[0, len(prompt):].tolist() == generate(loaded, [prompt], max_new_tokens=8, eos_token_id=None)[0]
    for index in lengths:
        assert lengths[index] == [len(prompt)] + [1] * 7, lengths[index]
        assert len(states[index]) == 1  # one state tensor from the prefill on: written in place, never rebuilt


@pytest.mark.parametrize("cache_class", ["DynamicCache", "StaticCache"])
def test_a_converted_first_layer_keeps_the_cache_length(stories, tmp_path, cache_class):
    """transformers reads the sequence length from the first cache layer (positions, masks): with layer
    0 converted, a decode loop over the export's own cache continues the prompt as the whole-sequence
    forward does, and the cache reports the tokens seen (dynamic and static caches alike)."""
    import transformers

    surgery.save(convert(stories(), [0, 2]), tmp_path / "hybrid")
    model = hf_load(export(tmp_path / "hybrid", tmp_path / "hf"))
    ids = ids_for((1, 20), 512, seed=1)
    if cache_class == "StaticCache":
        cache = transformers.StaticCache(config=model.config, max_cache_len=32)
    else:
        cache = transformers.DynamicCache()
    with torch.no_grad():
        model(ids[:, :17], past_key_values=cache, use_cache=True)
        steps = torch.cat([model(ids[:, i:i + 1], past_key_values=cache, use_cache=True).logits for i in range(17, 20)], 1)
        whole = model(ids, use_cache=False).logits[:, 17:]
    assert int(cache.get_seq_length()) == 20  # the first layer's length, which transformers reads
    assert relative_error(steps, whole) <= 1e-5
    key_widths = [cache.layers[i].keys.shape[-1] for i in (0, 2)]
    assert key_widths == [1, 0]  # only the layer whose length is read carries the marks
