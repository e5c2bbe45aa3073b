"""surgery.export --format kimi_linear: stories260K (a Llama) with every layer converted to KDA in Kimi
Linear's form (replace.kimi_form), calibrated, loads in plain transformers as KimiLinearForCausalLM (no
remote code) with the hybrid's logits and greedy tokens; hybrids the class cannot hold are refused with
the reason, before anything is written. References: transformers' own Kimi Linear modeling code, the
surgery graph, and the teacher's attention block outputs (Phase 1 of the sigmoid gate)."""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from typer.testing import CliRunner

import surgery
from surgery import PassManager
from surgery.decode import generate
from surgery.errors import ExportError
from surgery.io.export import export
from tcal.mixers.kda import KimiDeltaAttention

from test_mixer_swa import block_error, held_out  # noqa: F401  (held_out: a fixture)

FITTING = {"mixer": "kda", "kimi_form": True, "v_activation": "silu", "use_short_conv": True}
SMALL = {"samples": 2, "length": 64}


def convert(graph, layers, replace):
    PassManager(["select", "replace"], {"select": {"policy": "convert", "layers": list(layers)}, "replace": replace})(graph)
    return graph


def kimi_load(path):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert type(model).__name__ == "KimiLinearForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def relative_error(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def randomise_convs(graph):
    """replace starts the convolutions as the identity and the norm at 1: make them matter."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for kda in graph.gdn_modules().values():
            for name, p in kda.named_parameters():
                if "conv1d" in name or "o_norm" in name:
                    p.add_(0.2 * torch.randn(p.shape, generator=g))
    return graph


@pytest.fixture(scope="module")
def exported(stories, tmp_path_factory):
    root = tmp_path_factory.mktemp("kimi_linear")
    graph = stories()
    hybrid = convert(graph, range(graph.num_layers), FITTING)
    PassManager(["calibrate"], {"calibrate": SMALL})(hybrid)
    surgery.save(randomise_convs(hybrid), root / "hybrid")
    return root / "hybrid", export(root / "hybrid", root / "out", format="kimi_linear")


def test_config_names_the_native_class(exported):
    config = json.loads((exported[1] / "config.json").read_text())
    assert config["model_type"] == "kimi_linear" and config["architectures"] == ["KimiLinearForCausalLM"]
    assert set(config["layer_types"]) == {"linear_attention"} and set(config["mlp_layer_types"]) == {"dense"}
    assert config["use_cache"] is False and json.loads((exported[1] / "generation_config.json").read_text())["use_cache"] is False
    assert "auto_map" not in config and not list(exported[1].glob("*.py"))


def test_logits_and_greedy_tokens_equal_surgery_load(exported):
    hybrid, out = exported
    loaded, model = surgery.load(hybrid), kimi_load(out)
    vocab = model.config.vocab_size
    for shape in [(1, 5), (2, 23), (1, 70)]:  # 70: past one chunk of transformers' chunked KDA kernel
        ids = torch.randint(3, vocab, shape, generator=torch.Generator().manual_seed(shape[1]))
        with torch.no_grad():
            assert relative_error(model(ids).logits, loaded(ids)) <= 1e-4, shape
    prompt = [1, 17, 9, 33, 70, 2, 41]
    expected = generate(loaded, [prompt], max_new_tokens=8, eos_token_id=None)[0]
    tokens = model.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert tokens[0, len(prompt):].tolist() == expected


def test_kimi_form_phase1_gate_is_a_half_and_beats_copy_only(stories, stories_teacher, held_out, record):
    """Phase 1's constant gate through a sigmoid: gate exactly sigmoid(0) = 0.5, each head's amplitude
    moved into o_proj (2 a_h times the teacher's columns); on held-out stories the block outputs come
    closer to the teacher's than copy-only, Phase 2 closer still (as tests/test_mixer_kda.py's form)."""
    baseline = convert(stories(), [1, 3], FITTING)
    phase1 = convert(stories(), [1, 3], FITTING)
    copied = phase1.gdn_modules()[1].o_proj.weight.detach().clone()
    PassManager(["calibrate"], {"calibrate": {"samples": 4, "length": 128}})(phase1)
    layer = phase1.gdn_modules()[1]
    assert isinstance(layer, KimiDeltaAttention) and layer.o_norm.activation == "sigmoid"
    assert not layer.g_proj[0].weight.any()  # the gate's pre-activation is 0 for every token
    amplitude = torch.tensor(phase1.meta["calibrate"]["layers"][1]["gate_amplitude"]).clamp_min(1e-2)
    scale = (2 * amplitude).repeat_interleave(layer.head_dim)
    torch.testing.assert_close(layer.o_proj.weight, copied * scale[None, :], rtol=1e-5, atol=1e-7)
    both = convert(stories(), [1, 3], FITTING)
    small = {"samples": 4, "length": 128}
    PassManager(["calibrate", "align"], {"calibrate": small, "align": {**small, "progress": False}})(both)
    errors = [block_error(g, stories_teacher, held_out, [1, 3], record) for g in (baseline, phase1, both)]
    assert errors[1] < 0.7 * errors[0] and errors[2] < 0.95 * errors[1], errors  # measured: 1.992, 0.800, 0.552


def test_kept_attention_is_refused_naming_mla_and_the_fix(stories, tmp_path):
    hybrid = convert(stories(), [0, 2], FITTING)
    with pytest.raises(ExportError) as caught:
        export(hybrid, tmp_path / "out", format="kimi_linear")
    assert "layer(s) 1, 3, 4 keep the teacher's attention, which is not MLA without RoPE" in caught.value.problem
    assert "apply RoPE" in caught.value.problem and "select.layers=0,1,2,3,4 " in caught.value.fix
    assert not (tmp_path / "out").exists()


def test_gdn_hybrid_is_refused(stories, tmp_path):
    graph = stories()
    with pytest.raises(ExportError, match=r"layer 0 \(gdn\), .* are not KDA"):
        export(convert(graph, range(graph.num_layers), {}), tmp_path / "out", format="kimi_linear")
    assert not (tmp_path / "out").exists()


def test_kda_not_of_kimi_form_is_refused_with_the_options_that_fit(stories, tmp_path):
    graph = stories()
    with pytest.raises(ExportError) as caught:
        export(convert(graph, range(graph.num_layers), {"mixer": "kda", "norm_eps": 1e-6}), tmp_path / "out", format="kimi_linear")
    assert "forget and output gates are not Kimi Linear's" in caught.value.problem
    assert caught.value.fix == ("Convert with --set replace.kimi_form=true --set replace.v_activation=silu "
                                "--set replace.norm_eps=1e-05 to build KDAs of Kimi Linear's form.")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name, reason", [("gemma2", "logits are not one linear map"), ("qwen2", "copied the teacher's projection biases")])
def test_teacher_that_does_not_fit_is_refused(tiny, name, reason, tmp_path):
    t = tiny(name)
    t.require_sites()
    graph = t.graph.branch()
    with pytest.raises(ExportError, match=reason) as caught:
        export(convert(graph, range(graph.num_layers), {**FITTING, "norm_eps": 1e-6}), tmp_path / "out", format="kimi_linear")
    assert caught.value.fix.startswith("Kimi Linear's class cannot hold this hybrid exactly")
    assert not (tmp_path / "out").exists()


def test_kimi_form_is_refused_for_other_mixers():
    from surgery.errors import PassConfigError
    from surgery.passes.replace import ReplaceConfig

    with pytest.raises(PassConfigError, match="kimi_form is an option of the kda mixer"):
        ReplaceConfig(mixer="gdn", kimi_form=True).validate()


def test_unknown_format_lists_kimi_linear(exported, tmp_path):
    with pytest.raises(ExportError, match="kimi_linear"):
        export(exported[0], tmp_path / "out", format="kimi")


def test_cli_help_and_export(exported, tmp_path):
    from surgery.cli.app import app

    assert "kimi_linear" in CliRunner().invoke(app, ["export", "--help"], env={"COLUMNS": "200"}).output
    args = ["export", "--model", str(exported[0]), "--out", str(tmp_path / "out"), "--format", "kimi_linear"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "kimi_linear"


def kimi_teacher(**overrides):
    """A tiny KimiLinear with every layer MLA (the natural teacher), float32, eval."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("kimi_linear", **{
        "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "intermediate_size": 96, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "layer_types": ["full_attention"] * 2, "mlp_layer_types": ["dense"] * 2, "pad_token_id": 0, "bos_token_id": 1,
        "eos_token_id": 2, **overrides})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).float().eval()


def test_a_kimi_linear_teacher_captures():
    """The natural teacher (KimiLinear, every layer MLA without RoPE) captures, its sites found, the
    graph's logits the eager model's (tests/test_mla.py converts it)."""
    model = kimi_teacher()
    graph = surgery.capture(model)
    assert [(s.num_heads, s.head_dim, s.rope) for s in graph.sites] == [(4, 16, False)] * 2
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(graph.logits(ids), model(input_ids=ids).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_kept_mla_layers_of_a_kimi_teacher_are_written_as_kimi_attention(q_lora_rank, tmp_path):
    """Layer 0 kept (MLA, q_proj or q_a -> norm -> q_b), layer 1 KDA: the export loads in plain
    transformers as KimiLinearForCausalLM with layer 0 full attention, the teacher's weights, and
    its logits equal the hybrid's."""
    teacher = kimi_teacher(q_lora_rank=q_lora_rank, v_head_dim=8)
    hybrid = convert(surgery.capture(teacher), [1], {**FITTING, "norm_eps": teacher.config.rms_norm_eps})
    export(hybrid, tmp_path / "out", format="kimi_linear")
    model = kimi_load(tmp_path / "out")
    assert model.config.layer_types == ["full_attention", "linear_attention"] and model.config.q_lora_rank == q_lora_rank
    for name, p in teacher.model.layers[0].self_attn.named_parameters():
        assert torch.equal(model.model.layers[0].self_attn.get_parameter(name), p), name
    ids = torch.randint(3, 128, (2, 13), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, hybrid.logits(ids), rtol=1e-4, atol=1e-4)


def test_kept_mla_of_another_form_is_refused_by_name(tmp_path):
    """A DeepSeek-V3 teacher's kept MLA applies RoPE: not Kimi Linear's attention."""
    from transformers import AutoModelForCausalLM
    from archs import config as arch_config

    torch.manual_seed(0)
    graph = surgery.capture(AutoModelForCausalLM.from_config(arch_config("deepseek_v3")).eval())
    with pytest.raises(ExportError, match=r"layer\(s\) 0 keep the teacher's attention, which is not MLA without RoPE.*apply RoPE"):
        export(convert(graph, [1], FITTING), tmp_path / "out", format="kimi_linear")
    assert not (tmp_path / "out").exists()


def test_gate_rows_through_the_low_rank_are_exact_and_decoding_is_exact(stories):
    """write_gate_rows: one row per head through g_proj's rank head_dim gives every channel its head's
    row (heads <= rank), against the full-rank form; incremental decoding equals full recomputation."""
    from tcal.gate_forms import write_gate_rows
    from test_mixer_swa import matches_full

    layer = KimiDeltaAttention(32, 4, 8, kimi_form=True, backend="torch").double()
    rows = torch.randn(4, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x = torch.randn(3, 32, dtype=torch.float64)
    with torch.no_grad():
        write_gate_rows(layer, rows)
        torch.testing.assert_close(layer.g_proj(x), x @ rows.repeat_interleave(8, 0).T, rtol=1e-12, atol=1e-12)
    hybrid = randomise_convs(convert(stories(), [1, 3], FITTING))
    matches_full(hybrid, torch.randint(3, 512, (1, 21), generator=torch.Generator().manual_seed(3)), 9)


def test_reference_gate_is_refused_for_the_low_rank_gate_before_any_work(stories):
    from surgery.errors import PassConfigError

    hybrid = convert(stories(), [1], FITTING)
    with pytest.raises(PassConfigError, match=r"layer\(s\) 1 have a low-rank g_proj"):
        PassManager(["calibrate"], {"calibrate": {**SMALL, "gate": "reference"}})(hybrid)


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                    reason="fla's fused gated norm runs on CUDA with Triton (a CUDA-side extra)")
def test_sigmoid_gated_norm_fused_on_cuda_equals_the_eager_form():
    """The fused fla kernel (backend auto on CUDA) with Kimi Linear's sigmoid gate, against the float32 eager code."""
    from tcal.gdn import GatedRMSNorm

    norm = GatedRMSNorm(64, eps=1e-5, activation="sigmoid").cuda()
    with torch.no_grad():
        norm.weight.normal_()
    x, gate = torch.randn(2, 9, 4, 64, device="cuda"), torch.randn(2, 9, 4, 64, device="cuda")
    torch.testing.assert_close(norm(x, gate, backend="fla"), norm(x, gate, backend="torch"), atol=1e-5, rtol=1e-5)
