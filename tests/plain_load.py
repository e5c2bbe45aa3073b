"""Load surgery exports in plain transformers (no surgery importable) and record what they compute.

    python plain_load.py SPEC.json OUT_DIR

SPEC.json: {"exports": {name: {"dir", "ids", "prompt", "new_tokens", "probe" (text or null), "needs" (a
transformers class the export needs, or null)}}}.
OUT_DIR/results.safetensors gets, per export, <name>.logits (float32), <name>.greedy (the generated
ids) and <name>.probe (the tokenizer's ids for the probe text); OUT_DIR/results.json the transformers
version, the exports whose needed class this transformers lacks ("absent") and, per export, the
one-line error of a load that failed. Run by tests/test_export_versions.py
with the python of each transformers version under test: one process loads every export."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.modules["surgery"] = None  # the export must load without the project that wrote it

import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402


def run(entry: dict) -> dict:
    dtype_key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    model = AutoModelForCausalLM.from_pretrained(entry["dir"], trust_remote_code=True, **{dtype_key: torch.float32}).eval()
    out = {}
    with torch.no_grad():
        out["logits"] = model(torch.tensor(entry["ids"])).logits.float().contiguous()
        prompt = torch.tensor([entry["prompt"]])
        n = entry["new_tokens"]
        generated = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, min_new_tokens=n,
                                   do_sample=False, pad_token_id=0)
    out["greedy"] = generated[0, prompt.shape[1]:].contiguous()
    if entry.get("probe") is not None:
        tokenizer = AutoTokenizer.from_pretrained(entry["dir"])
        out["probe"] = torch.tensor(tokenizer(entry["probe"])["input_ids"])
    return out


def main(spec_path: str, out_dir: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    tensors, errors, absent = {}, {}, []
    for name, entry in spec["exports"].items():
        if entry.get("needs") and not hasattr(transformers, entry["needs"]):
            absent.append(entry["needs"])
            continue
        try:
            tensors.update({f"{name}.{k}": v for k, v in run(entry).items()})
        except Exception as e:  # noqa: BLE001 -- recorded per export, the test reports it
            errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(Path(out_dir) / "results.safetensors"))
    (Path(out_dir) / "results.json").write_text(json.dumps({"transformers": transformers.__version__, "errors": errors, "absent": absent}, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:3])
