"""max |Δlogit| between stories260K's export loaded in plain transformers and surgery.load, per python.

    python bench/export_versions.py PYTHON [PYTHON ...]

Each PYTHON is a venv with one transformers version and no surgery (tests/plain_load.py runs in it).
The hybrid: stories260K with layers 1 and 3 converted (select, replace), exported --format hf.
Inputs: 4 rows of 64 random token ids; greedy: 16 new tokens from "Once upon a time"."""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

import surgery
from surgery import PassManager
from surgery.decode import generate
from surgery.io.export import export

STORIES = Path("/work/shared/models/stories260k/stories260K.gguf")
LOADER = Path(__file__).resolve().parent.parent / "tests" / "plain_load.py"
PROBE = "Once upon a time, Tom   saw 12 cats.\n\nThey said: \"héllo wörld\""


def main(pythons: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        graph = surgery.capture(STORIES)
        PassManager(["select", "replace"], {"select": {"policy": "convert", "layers": [1, 3]}})(graph)
        surgery.save(graph, root / "hybrid")
        export(root / "hybrid", root / "hf")
        loaded = surgery.load(root / "hybrid")
        ids = torch.randint(3, loaded.config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))
        prompt = loaded.tokenizer("Once upon a time")["input_ids"]
        with torch.no_grad():
            want = loaded(ids)
        greedy = generate(loaded, [prompt], max_new_tokens=16, eos_token_id=None)[0]
        probe = loaded.tokenizer(PROBE)["input_ids"]
        spec = {"exports": {"stories": {"dir": str(root / "hf"), "ids": ids.tolist(), "prompt": prompt, "new_tokens": 16, "probe": PROBE}}}
        (root / "spec.json").write_text(json.dumps(spec))
        for i, python in enumerate(pythons):
            out = root / f"run{i}"
            subprocess.run([python, str(LOADER), str(root / "spec.json"), str(out)], check=True, capture_output=True,
                           env={"USE_HUB_KERNELS": "0", "PATH": "/usr/bin:/bin", "HOME": str(Path.home())})
            info = json.loads((out / "results.json").read_text())
            if info["errors"]:
                print(f"transformers {info['transformers']}: {info['errors']['stories']}")
                continue
            got = load_file(out / "results.safetensors")
            delta = (got["stories.logits"] - want).abs().max().item()
            print(f"transformers {info['transformers']}: max |Δlogit| {delta:.3g} (logits up to {want.abs().max().item():.3g}); "
                  f"greedy equal {got['stories.greedy'].tolist() == greedy}; probe ids equal {got['stories.probe'].tolist() == probe}")


if __name__ == "__main__":
    main(sys.argv[1:])
