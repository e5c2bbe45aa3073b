"""lm-eval's custom_dataset for surgery_next_sentence: items.jsonl beside this file, so the task
needs no hub and no path that depends on where the package is installed or the working directory."""
import json
from pathlib import Path


def load(**_):
    from datasets import Dataset, DatasetDict

    text = (Path(__file__).parent / "items.jsonl").read_text(encoding="utf-8")
    return DatasetDict({"test": Dataset.from_list([json.loads(line) for line in text.splitlines() if line.strip()])})
