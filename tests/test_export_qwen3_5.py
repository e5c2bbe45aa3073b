"""surgery.export --format qwen3_5: a tiny Qwen3 teacher converted with Qwen3.5's GDN form loads in
transformers' Qwen3_5ForCausalLM (no remote code) with the hybrid's logits and greedy tokens; hybrids
that the class cannot hold are refused with the reason, before anything is written."""
from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import surgery
from surgery import PassManager
from surgery.decode import generate
from surgery.errors import ExportError
from surgery.io.export import export

FITTING = {"use_short_conv": True, "v_activation": "silu", "norm_eps": 1e-6}


def qwen35_load(path):
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM

    model, info = Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def relative_error(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def convert(graph, layers, replace):
    PassManager(["select", "replace"], {"select": {"policy": "convert", "layers": list(layers)}, "replace": replace})(graph)
    return graph


@pytest.fixture(scope="module")
def teacher():
    """A 3-layer Qwen3 (GQA, q/k norms) with norm weights away from 1, so the (1 + w) conversion shows."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3", vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, intermediate_size=96, max_position_embeddings=128,
                                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return surgery.capture(model)


def randomise_gdns(graph):
    """The replace pass starts the convolutions as the identity and the norm at 1: make every GDN
    parameter matter."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for gdn in graph.gdn_modules().values():
            for name, p in gdn.named_parameters():
                if "conv1d" in name or "o_norm" in name or name in ("A_log", "dt_bias"):
                    p.add_(0.2 * torch.randn(p.shape, generator=g))
    return graph


@pytest.fixture(scope="module")
def exported(teacher, tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_5")
    hybrid = randomise_gdns(convert(teacher.branch(), [0, 2], FITTING))
    surgery.save(hybrid, root / "hybrid")
    return root / "hybrid", export(root / "hybrid", root / "out", format="qwen3_5")


def test_config_names_the_native_class(exported):
    config = json.loads((exported[1] / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_text" and config["architectures"] == ["Qwen3_5ForCausalLM"]
    assert config["layer_types"] == ["linear_attention", "full_attention", "linear_attention"]
    assert "auto_map" not in config and not list(exported[1].glob("*.py"))
    assert "config.json" in config["surgery_hybrid"]["files"]


def test_logits_and_greedy_tokens_equal_surgery_load(exported):
    hybrid, out = exported
    loaded, model = surgery.load(hybrid), qwen35_load(out)
    for shape in [(1, 5), (2, 23), (1, 70)]:  # 70: past one chunk of transformers' chunked kernel
        ids = torch.randint(3, 128, shape, generator=torch.Generator().manual_seed(shape[1]))
        with torch.no_grad():
            assert relative_error(model(ids).logits, loaded(ids)) <= 1e-4, shape
    prompt = [5, 17, 9, 33, 70, 2, 41]
    expected = generate(loaded, [prompt], max_new_tokens=12, eos_token_id=None)[0]
    tokens = model.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert tokens[0, len(prompt):].tolist() == expected


def test_gdn_without_short_conv_exports_with_identity_taps(teacher, tmp_path):
    hybrid = randomise_gdns(convert(teacher.branch(), [1], {"v_activation": "silu", "norm_eps": 1e-6}))
    model = qwen35_load(export(hybrid, tmp_path / "out", format="qwen3_5"))
    assert model.config.linear_conv_kernel_dim == 4
    ids = torch.randint(3, 128, (2, 19), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert relative_error(model(ids).logits, hybrid(ids)) <= 1e-4


def test_a_probe_transformers_cannot_run_is_a_named_error_and_writes_nothing(teacher, tmp_path, monkeypatch):
    """transformers' linear-attention layers take fla's Triton kernels whenever fla imports, which fails on
    CPU tensors (Triton without a GPU: "0 active drivers"): the export says so, and --out stays unwritten."""
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM

    def no_driver(self, *args, **kwargs):
        raise RuntimeError("0 active drivers ([]). There should only be one.")

    monkeypatch.setattr(Qwen3_5ForCausalLM, "forward", no_driver)
    hybrid = randomise_gdns(convert(teacher.branch(), [0, 2], FITTING))
    with pytest.raises(ExportError, match=r"Qwen3_5ForCausalLM could not run the probe on cpu \(0 active drivers.*export without Triton"):
        export(hybrid, tmp_path / "out", format="qwen3_5")
    assert not (tmp_path / "out").exists()


def test_default_gdn_form_is_refused_with_the_options_that_fit(teacher, tmp_path):
    with pytest.raises(ExportError, match=r"v has no SiLU.*--set replace.v_activation=silu --set replace.norm_eps=1e-06"):
        export(convert(teacher.branch(), [0], {}), tmp_path / "out", format="qwen3_5")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name, reason", [("llama", "no q/k norm"), ("gpt2", "LayerNorm"), ("gemma2", "logits are not one linear map")])
def test_teacher_that_does_not_fit_is_refused(tiny, name, reason, tmp_path):
    t = tiny(name)
    t.require_sites()
    with pytest.raises(ExportError, match=reason):
        export(convert(t.graph.branch(), [0], FITTING), tmp_path / "out", format="qwen3_5")
    assert not (tmp_path / "out").exists()


def test_cli_export_qwen3_5_and_force(exported, tmp_path):
    from surgery.cli.app import app

    args = ["export", "--model", str(exported[0]), "--out", str(tmp_path / "out"), "--format", "qwen3_5"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(app, args + ["--force"])  # an earlier export is replaceable
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "qwen3_5_text"


def test_bf16_capture_with_a_kept_logits_slice_names_the_real_reasons(stories_path, tmp_path):
    """A bf16 capture (as on CUDA) whose LM head reads hidden[:, 0:] as an aten.slice (torch 2.11's
    export keeps logits_to_keep=0's slice there; 2.13's makes it an alias): the fit looks through the
    whole slice and names what does not fit, not "the final norm is not an RMSNorm ('slice_...')"."""
    graph = convert(surgery.capture(stories_path, dtype=torch.bfloat16), [1], FITTING)
    head = next(n for n in graph.gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.linear.default
                and n.args[1].op == "get_attr" and n.args[1].target == "lm_head.weight")
    with graph.gm.graph.inserting_before(head):
        whole = graph.gm.graph.call_function(torch.ops.aten.slice.Tensor, (head.args[0], 1, 0, 2 ** 63 - 1))
    head.replace_input_with(head.args[0], whole)
    graph.gm.recompile()
    with pytest.raises(ExportError) as caught:
        export(graph, tmp_path / "out", format="qwen3_5")
    assert "no q/k norm" in caught.value.problem and "final norm" not in caught.value.problem
    assert not (tmp_path / "out").exists()
