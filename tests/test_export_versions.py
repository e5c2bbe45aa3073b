"""Exports load where users are: `surgery export` directories of stories260K and of 8 tiny
architectures (RoPE theta away from its default, so a transformers that ignores `rope_parameters`
shows), plus a `--format qwen3_5` export, loaded in plain transformers (no surgery importable) by
tests/plain_load.py, one subprocess per python, and compared with surgery.load: logits within 1e-4,
the same greedy tokens, the same tokenizer ids for a probe text.

Pythons: this one (the newest transformers, always), SURGERY_PLAIN_PYTHON_FLOOR (the floor of the
supported range) and SURGERY_PLAIN_PYTHON_4X (the newest 4.x); .ci/run makes those venvs and sets them."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import surgery
from surgery import PassManager
from surgery.decode import generate
from surgery.io.export import export

import archs

LOADER = Path(__file__).parent / "plain_load.py"
ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma3", "phi3", "gpt2", "gpt_neox"]
PYTHONS = {"current": None, "floor": "SURGERY_PLAIN_PYTHON_FLOOR", "4x": "SURGERY_PLAIN_PYTHON_4X"}
PROBE = "Once upon a time, Tom   saw 12 cats.\n\nThey said: \"héllo wörld\" — def f(x): return x**2\t# done"
NEW_TOKENS = 8
QWEN3_5_FITS = {"use_short_conv": True, "v_activation": "silu", "norm_eps": 1e-6}


def scaled_rope(config) -> None:
    """Every RoPE theta of the config times 7: a load that falls back to the default theta differs."""
    def scale(params):
        if isinstance(params, dict):
            for key, value in params.items():
                if key == "rope_theta":
                    params[key] = value * 7
                else:
                    scale(value)
    scale(getattr(config, "rope_parameters", None))


def convert(graph, layers: list, replace: dict | None = None):
    PassManager(["select", "replace"], {"select": {"policy": "convert", "layers": layers}, "replace": replace or {}})(graph)
    return graph


def tiny_hybrid(name: str):
    from transformers import AutoModelForCausalLM

    config = archs.config(name)
    scaled_rope(config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=archs.attn_implementation(config)).float().eval()
    return convert(surgery.capture(model), [0])


def qwen3_5_hybrid():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3", vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, intermediate_size=96, max_position_embeddings=128,
                                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return convert(surgery.capture(AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float().eval()), [0], QWEN3_5_FITS)


def expected(loaded, ids: list, prompt: list, probe: bool) -> dict:
    with torch.no_grad():
        logits = loaded(torch.tensor(ids))
    out = {"logits": logits, "greedy": generate(loaded, [prompt], max_new_tokens=NEW_TOKENS, eos_token_id=None)[0]}
    if probe:
        out["probe"] = loaded.tokenizer(PROBE)["input_ids"]
    return out


@pytest.fixture(scope="module")
def exports(stories, tmp_path_factory):
    """name -> (spec entry for plain_load.py, what surgery.load computes, the transformers class it needs)."""
    root = tmp_path_factory.mktemp("versions")
    hybrids = {"stories260k": convert(stories(), [1, 3])}
    hybrids |= {name: tiny_hybrid(name) for name in ARCHS}
    hybrids["qwen3_5"] = qwen3_5_hybrid()
    cases = {}
    for name, graph in hybrids.items():
        surgery.save(graph, root / name / "hybrid")
        fmt = "qwen3_5" if name == "qwen3_5" else "hf"
        out = export(root / name / "hybrid", root / name / "export", format=fmt)
        loaded = surgery.load(root / name / "hybrid")
        vocab = loaded.config.vocab_size
        g = torch.Generator().manual_seed(len(name))
        ids = torch.randint(3, vocab, (2, 21), generator=g).tolist()
        prompt = torch.randint(3, vocab, (6,), generator=g).tolist()
        probe = loaded.tokenizer is not None
        entry = {"dir": str(out), "ids": ids, "prompt": prompt, "new_tokens": NEW_TOKENS, "probe": PROBE if probe else None,
                 "needs": "Qwen3_5ForCausalLM" if fmt == "qwen3_5" else None}
        cases[name] = (entry, expected(loaded, ids, prompt, probe))
    (root / "spec.json").write_text(json.dumps({"exports": {n: c[0] for n, c in cases.items()}}))
    return root, cases


@pytest.fixture(scope="module")
def plain_results(exports):
    """python kind -> (results.json, tensors): plain_load.py run once per python over every export."""
    root, _ = exports
    runs = {}

    def results(kind: str):
        if kind not in runs:
            variable = PYTHONS[kind]
            python = sys.executable if variable is None else os.environ.get(variable)
            if not python:
                runs[kind] = f"{variable} is not set (the python of a venv with that transformers and no surgery)"
            else:
                out = root / f"plain-{kind}"
                env = {**os.environ, "USE_HUB_KERNELS": "0"}  # 5.25 needs the hub `kernels` package otherwise; the export uses none
                run = subprocess.run([python, str(LOADER), str(root / "spec.json"), str(out)], cwd=root, env=env,
                                     capture_output=True, text=True, timeout=600)
                assert run.returncode == 0, run.stderr[-3000:]
                runs[kind] = (json.loads((out / "results.json").read_text()), load_file(out / "results.safetensors"))
        if isinstance(runs[kind], str):
            pytest.skip(runs[kind])
        return runs[kind]

    return results


CASES = ["stories260k", *ARCHS, "qwen3_5"]


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("kind", list(PYTHONS))
def test_export_in_plain_transformers_matches_surgery_load(exports, plain_results, kind, name):
    info, tensors = plain_results(kind)
    entry, want = exports[1][name]
    if entry["needs"] and entry["needs"] in info["absent"]:
        pytest.skip(f"transformers {info['transformers']} has no {entry['needs']}")
    assert name not in info["errors"], f"transformers {info['transformers']}: {info['errors'][name]}"
    logits = tensors[f"{name}.logits"]
    error = (logits - want["logits"]).abs().max().item()
    assert error <= 1e-4 * max(1.0, want["logits"].abs().max().item()), (info["transformers"], error)
    assert tensors[f"{name}.greedy"].tolist() == want["greedy"], info["transformers"]
    if "probe" in want:
        assert tensors[f"{name}.probe"].tolist() == want["probe"], info["transformers"]



def test_a_transformers_without_the_teachers_class_is_refused_in_one_line(exports, tmp_path):
    """The modeling file checks, when it is imported, the version and the teacher's config class
    (a Qwen3 export in a transformers that predates Qwen3, here a class no version has) and names what it needs."""
    import shutil

    entry, _ = exports[1]["stories260k"]
    folder = shutil.copytree(entry["dir"], tmp_path / "export")
    (folder / "surgery_teacher.py").write_text("TEACHER_CONFIG = 'Qwen9Config'\n")
    code = "import sys; sys.modules['surgery'] = None\nfrom transformers import AutoModelForCausalLM\n" \
           "AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)"
    run = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    import transformers

    last = run.stderr.strip().splitlines()[-1]
    assert last == (f"ImportError: This surgery export needs transformers >= 4.57 with Qwen9Config (found {transformers.__version__}): "
                    "pip install -U 'transformers>=4.57'."), last
