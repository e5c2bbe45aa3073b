"""Choosing tokens from logits (sample, check_sampling) and `generate`, which continues prompts with
a Decoder."""
from __future__ import annotations

import torch

from ..errors import DecodeError
from .runtime import Decoder


def _eos_ids(graph, eos) -> set:
    if eos == "auto":
        eos = getattr(graph.config, "eos_token_id", None)
        if eos is None and graph.tokenizer is not None:
            eos = getattr(graph.tokenizer, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple, set)) else [eos])}


def check_sampling(temperature: float | None, top_k: int | None, top_p: float | None) -> None:
    """Refuse sampling options that do not describe a distribution."""
    if (temperature is not None and temperature < 0) or (top_p is not None and not 0 < top_p <= 1) or (top_k is not None and top_k < 1):
        raise DecodeError(f"Sampling options out of range (temperature {temperature}, top_k {top_k}, top_p {top_p}).",
                          "Use temperature >= 0, top_k >= 1 and 0 < top_p <= 1.")


def sample(logits: torch.Tensor, *, temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token per row from logits [B, V]: argmax when temperature is 0/None, else sampling
    from softmax(logits / temperature) restricted to the top_k tokens and the top_p nucleus."""
    if not temperature:
        return logits.argmax(dim=-1)
    scores = logits.float() / temperature
    if top_k:
        kth = scores.topk(min(top_k, scores.shape[-1]), dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        ordered, index = scores.sort(dim=-1, descending=True)
        cum = ordered.softmax(-1).cumsum(-1)
        drop = cum - ordered.softmax(-1) > top_p  # keep the smallest prefix whose mass reaches top_p
        scores = scores.scatter(-1, index, ordered.masked_fill(drop, float("-inf")))
    probs = scores.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def prompt_lists(prompts, max_new_tokens: int, max_length: int) -> list[list[int]]:
    """Prompts as token-id lists (from lists, one list or a [B, T] tensor), checked to fit."""
    if isinstance(prompts, torch.Tensor):
        prompts = prompts.tolist() if prompts.dim() == 2 else [prompts.tolist()]
    elif prompts and isinstance(prompts[0], int):
        prompts = [prompts]
    prompts = [list(map(int, p)) for p in prompts]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise DecodeError("An empty prompt has nothing to continue.", "Give every prompt at least one token.")
    if max_new_tokens < 0:
        raise DecodeError(f"max_new_tokens must be >= 0, got {max_new_tokens}.", "Pass a positive number.")
    longest = max(len(p) for p in prompts) + max_new_tokens
    if longest > max_length:
        raise DecodeError(
            f"A prompt of {max(len(p) for p in prompts)} tokens plus {max_new_tokens} new ones exceeds this graph's position limit of {max_length}.",
            "Use a shorter prompt or fewer new tokens.",
        )
    return prompts


def generate(model, prompts, max_new_tokens: int, *, temperature: float | None = None, top_k: int | None = None,
             top_p: float | None = None, seed: int | None = None, eos_token_id="auto", stream=None) -> list[list[int]]:
    """Continue each prompt by up to max_new_tokens tokens; returns the new tokens per prompt (the
    end-of-sequence token included when one is produced, as transformers does).

    model     a Graph (a Decoder is built) or a Decoder
    prompts   list of token-id lists, one list, or a [B, T] tensor
    greedy unless temperature > 0; sampling is reproducible with `seed`
    eos_token_id  "auto" (the config's, else the tokenizer's), an id or ids, or None (never stop)
    stream    called as stream(prompt_index, token_id) for each new token as it is chosen

    Prompts of different lengths are grouped by length and each group is decoded as one batch (exact,
    with no padding inside the caches); a row that has ended keeps being fed but its tokens are
    dropped."""
    check_sampling(temperature, top_k, top_p)
    decoder = model if isinstance(model, Decoder) else Decoder(model)
    graph = decoder.graph
    prompts = prompt_lists(prompts, max_new_tokens, decoder.max_length)
    eos = _eos_ids(graph, eos_token_id)
    generator = None
    if temperature:
        generator = torch.Generator(device=graph.device)
        if seed is None:
            generator.seed()  # a fresh draw each call, as transformers samples without a seed
        else:
            generator.manual_seed(seed)
    results: list[list[int]] = [[] for _ in prompts]
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(len(p), []).append(i)
    for length, rows in groups.items():
        if max_new_tokens == 0:
            continue
        decoder.reset(len(rows), length + max_new_tokens)
        ids = torch.tensor([prompts[i] for i in rows], dtype=torch.long, device=graph.device)
        logits = decoder.prefill(ids, last_only=True)[:, -1]
        done = torch.zeros(len(rows), dtype=torch.bool)
        for t in range(max_new_tokens):
            nxt = sample(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
            chosen = nxt.tolist()  # one device-to-host copy per step, not one per row
            for r, i in enumerate(rows):
                if not done[r]:
                    token = chosen[r]
                    results[i].append(token)
                    if stream is not None:
                        stream(i, token)
                    if token in eos:
                        done[r] = True
            if bool(done.all()) or t == max_new_tokens - 1:
                break
            logits = decoder.step(nxt[:, None])[:, -1]
        decoder.check_kernels()  # a replayed step's kernel that gave up waiting: an error, not wrong tokens
    decoder.reset()
    return results
