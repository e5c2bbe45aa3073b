"""The longest input a model takes, read from its files before it loads (a hybrid's recipe, a
model directory's config.json), so `generate --max-new-tokens` and `distill --seq-len` past it are
refused in seconds. A GGUF says it only once parsed: its limit is checked after the load."""
from __future__ import annotations

from pathlib import Path

from ..core.capture import max_positions
from ..core.load import resolve
from .checkpoint import read_recipe
from .json_safe import read_json
from .open import is_hybrid, latest_checkpoint
from .outdir import RUN_FILE


def position_limit(source) -> int | None:
    """The graph's position limit for `source` as its files state it, or None where they do not."""
    if not isinstance(source, (str, Path)):
        return None
    path = resolve(source)
    if (path / RUN_FILE).is_file():
        path = latest_checkpoint(path)
    if is_hybrid(path):
        limit = read_recipe(path)["capture"].get("max_length")
        return limit if isinstance(limit, int) and limit > 0 else None
    if path.is_dir() and (path / "config.json").is_file():
        from transformers import AutoConfig

        data = read_json(path / "config.json")
        try:
            config = AutoConfig.for_model(data.get("model_type"), **{k: v for k, v in data.items() if k != "model_type"})
        except Exception:  # the loader names what is wrong with it
            return None
        return max_positions(config)
    return None
