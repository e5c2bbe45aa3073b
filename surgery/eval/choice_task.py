"""The shipped multiple-choice task, scored by the project itself (no lm-eval): the same requests,
tokens and metrics as lm-eval 0.4.13's `output_type: multiple_choice`, so both give the same accuracy.

lm-eval's rule, reproduced here (lm_eval/api/task.py, api/model.py `_encode_pair`, models/huggingface.py):
* the request of choice c is (context, target_delimiter + c), target_delimiter " " (the YAML's);
  trailing whitespace of the context moves to the front of the continuation;
* tokens: whole = tokenizer.encode(context + continuation), ctx = tokenizer.encode(context) (the
  tokenizer's default special tokens, e.g. stories260K's BOS; none when the text starts with the BOS
  string), continuation tokens = whole[len(ctx):];
* the model reads (ctx + continuation)[:-1]; the choice's log-likelihood is the sum of the
  log-softmax at the continuation's tokens;
* acc: argmax of the log-likelihoods == label; acc_norm: argmax of log-likelihood / len(choice)
  (characters of the choice without the delimiter); ties go to the first choice (np.argmax)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import DataError

TASKS_DIR = Path(__file__).parent / "tasks"  # lm-eval's --include_path
TASK = "surgery_next_sentence"
TARGET_DELIMITER = " "  # = target_delimiter in the task's YAML


def items_path(task: str = TASK) -> Path:
    return TASKS_DIR / task / "items.jsonl"


def read_items(path: str | Path | None = None, limit: int | None = None) -> list[dict]:
    """The task's items in file order (lm-eval's --limit N takes the first N the same way)."""
    path = Path(path) if path is not None else items_path()
    if not path.is_file():
        raise DataError(f"The task's items file '{path}' is missing.", "Rebuild it: python -m surgery.eval.choice_items.")
    items = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return items[:limit] if limit is not None else items


def requests(item: dict) -> list[tuple[str, str]]:
    """(context, continuation) of each choice, after lm-eval's whitespace move."""
    context = item["context"]
    spaces = len(context) - len(context.rstrip())
    head, moved = (context[:-spaces], context[-spaces:]) if spaces else (context, "")
    return [(head, moved + TARGET_DELIMITER + choice) for choice in item["choices"]]


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split: encode the whole text and the context, the continuation is the rest."""
    bos = tokenizer.bos_token
    special = {"add_special_tokens": False} if bos and context.startswith(bos) else {}
    whole = tokenizer.encode(context + continuation, **special)
    ctx = tokenizer.encode(context, **special)
    return ctx, whole[len(ctx):]


@torch.no_grad()
def loglikelihood(graph, context_ids: list[int], continuation_ids: list[int]) -> float:
    """Sum of log p(continuation token) given what precedes it, one sequence, float32 softmax."""
    ids = context_ids + continuation_ids
    if len(ids) - 1 > graph.max_length:
        raise DataError(f"An item takes {len(ids) - 1} tokens; the model reads at most {graph.max_length}.", "Use shorter items.")
    logits = graph(torch.tensor([ids[:-1]], device=graph.device))
    logp = torch.log_softmax(logits[0, -len(continuation_ids):].float(), dim=-1)
    return logp.gather(-1, torch.tensor(continuation_ids, device=logp.device)[:, None]).sum().item()


def first_max(values: list[float]) -> int:
    return max(range(len(values)), key=lambda k: (values[k], -k))


def score(graph, items: list[dict] | None = None, *, limit: int | None = None) -> dict:
    """acc and acc_norm of `graph` (anything called on [1, T] ids giving logits, with .tokenizer,
    .max_length, .device) on the items, with each item's log-likelihoods and picks."""
    items = read_items(limit=limit) if items is None else items[:limit]
    rows = []
    for item in items:
        lls = [loglikelihood(graph, *encode_pair(graph.tokenizer, c, x)) for c, x in requests(item)]
        normed = [ll / len(choice) for ll, choice in zip(lls, item["choices"])]
        rows.append({"id": item["id"], "loglikelihoods": lls, "pred": first_max(lls), "pred_norm": first_max(normed), "label": item["label"]})
    n = len(rows)
    return {"acc": sum(r["pred"] == r["label"] for r in rows) / n, "acc_norm": sum(r["pred_norm"] == r["label"] for r in rows) / n,
            "items": n, "rows": rows}
