"""The other side of tests/test_checkpoint.py's round trip between two torch versions, run by the python of
the other torch (SURGERY_OTHER_TORCH_PYTHON; .ci/run sets it to its ceiling venv):

    python other_torch.py HYBRID_DIR STORIES_GGUF LAYERS OUT_DIR

loads the hybrid saved by the test's torch and records its logits on fixed ids, then converts the stories
teacher the same way (select + replace of LAYERS, comma-separated) and saves it for the test to load:
OUT_DIR/logits.safetensors (its logits of HYBRID_DIR, and of its own hybrid before saving), OUT_DIR/hybrid
and OUT_DIR/torch.txt (its torch.__version__)."""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

import surgery
from surgery import PassManager

IDS = torch.tensor([[1, 5, 9, 77, 300, 12, 4, 400, 2, 17, 19, 255, 3, 101, 64, 8]])


def logits(graph) -> torch.Tensor:
    with torch.no_grad():
        return graph(IDS).float().contiguous()


def main(hybrid: str, stories: str, layers: str, out: str) -> None:
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    theirs = logits(surgery.load(hybrid))
    mine = surgery.capture(stories)
    PassManager(["select", "replace"], {"select": {"policy": "convert", "layers": [int(x) for x in layers.split(",")]}})(mine)
    surgery.save(mine, out_dir / "hybrid")
    save_file({"theirs": theirs, "mine": logits(mine)}, str(out_dir / "logits.safetensors"))
    (out_dir / "torch.txt").write_text(torch.__version__)


if __name__ == "__main__":
    main(*sys.argv[1:5])
