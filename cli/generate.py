"""`surgery generate`: continue prompts with incremental decoding (surgery.decode).

stdout carries the continuations and nothing else (one per prompt, each ended by a newline, streamed
token by token), so the command can be piped; loading messages and errors go to stderr."""
from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import List, Optional

import typer

from surgery.errors import SurgeryError

from .common import check_device_fits, err, guard, model_inputs, more_files, placement
from .options import CompileOpt, DebugOpt, DeviceOpt, DtypeOpt, ModelOpt

CONTEXT_TOKENS = 8  # prompt tokens decoded with the continuation, so a leading space survives detokenisation


class TextStream:
    """Incremental detokenisation: decode(context + new tokens) minus what was already printed.

    Decoding the new tokens alone drops SentencePiece's leading space and splits multi-byte
    characters; a trailing U+FFFD means an incomplete character, so it waits for the next token.
    Once everything decoded so far is printed and complete, the tokens roll into the context window,
    so each decode stays short (a long continuation costs linear, not quadratic, time)."""

    def __init__(self, tokenizer, prompt_ids: list, write):
        self.tokenizer, self.write = tokenizer, write
        self.context = list(prompt_ids[-CONTEXT_TOKENS:])
        self.base = self._decode(self.context)
        self.tokens: list[int] = []
        self.printed = 0

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def text(self) -> str:
        full = self._decode(self.context + self.tokens)
        return full[len(self.base):] if full.startswith(self.base) else self._decode(self.tokens)

    def push(self, token: int) -> None:
        self.tokens.append(token)
        text = self.text()
        if text.endswith("\ufffd"):
            return
        if len(text) > self.printed:
            self.write(text[self.printed:])
            self.printed = len(text)
        if len(self.tokens) >= 2 * CONTEXT_TOKENS and len(text) == self.printed:
            self.context = (self.context + self.tokens)[-CONTEXT_TOKENS:]
            self.base = self._decode(self.context)
            self.tokens, self.printed = [], 0

    def close(self) -> None:
        text = self.text()
        if len(text) > self.printed:
            self.write(text[self.printed:])
        self.write("\n")


def read_prompts(prompt: Optional[List[str]], prompt_file: Optional[Path]) -> list[str]:
    prompts = list(prompt or [])
    if prompt_file is not None:
        from surgery.data.text import check_text_file

        check_text_file(prompt_file, "Prompt file")
        prompts += [line for line in prompt_file.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise SurgeryError("No prompt given.", "Pass --prompt TEXT (repeatable) or --prompt-file FILE (one prompt per line).")
    for i, p in enumerate(prompts, 1):
        if not p.strip():
            raise SurgeryError(f"Prompt {i} is empty.", "Give every prompt some text.")
    return prompts


def check_room(path, max_new_tokens: int) -> None:
    """Before the model loads: a prompt of one token plus --max-new-tokens fits the position limit
    the model's files state (after the load every prompt is checked with its real length)."""
    from surgery.io.limits import position_limit

    limit = position_limit(path)
    if limit is not None and max_new_tokens + 1 > limit:
        raise SurgeryError(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt: this model takes at most {limit} positions (prompt and continuation).",
                           f"Pass --max-new-tokens {limit - 1} or fewer (less the prompt's length).")


def generate(
    model: str = ModelOpt,
    prompt: Optional[List[str]] = typer.Option(None, "--prompt", "-p", help="Prompt text: --prompt 'a' 'b' (or repeat the flag): one continuation per prompt."),
    more_prompts: Optional[List[str]] = typer.Argument(None, help="More prompts (after --prompt).", show_default=False),
    prompt_file: Optional[Path] = typer.Option(None, "--prompt-file", help="File with one prompt per line."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", "-n", help="New tokens per prompt at most (fewer at end-of-sequence)."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy; > 0 samples."),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="Sample from the k most likely tokens."),
    top_p: Optional[float] = typer.Option(None, "--top-p", help="Sample from the smallest set of tokens whose probability reaches p."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for sampling (reproducible continuations)."),
    device: Optional[str] = DeviceOpt,
    dtype: Optional[str] = DtypeOpt,
    compile: Optional[bool] = CompileOpt,
    debug: bool = DebugOpt,
):
    """Continue prompts with a teacher or a saved hybrid (KV cache for attention, recurrent state for GDN)."""
    from surgery.decode import Decoder, check_sampling, generate as decode_generate
    from surgery.io import open_model

    with guard(debug):
        prompts = read_prompts(more_files(prompt, more_prompts, "--prompt"), prompt_file)
        if max_new_tokens < 1:
            raise SurgeryError(f"--max-new-tokens must be at least 1, got {max_new_tokens}.", "Pass e.g. --max-new-tokens 64.")
        for option, value in (("--temperature", temperature), ("--top-p", top_p)):
            if value is not None and not math.isfinite(value):  # NaN passes every `< 0` check below
                raise SurgeryError(f"{option} {value} is not a finite number.", f"Pass e.g. {option} {0.8 if option == '--temperature' else 0.9}.")
        check_sampling(temperature, top_k, top_p)  # before the model loads
        path = model_inputs(model)[0]
        check_room(path, max_new_tokens)
        dev, dt = placement(device, dtype)
        check_device_fits(path, dev, dt)
        err.print(f"loading {model} on {dev} ({str(dt).removeprefix('torch.')})")
        graph = open_model(model, device=dev, dtype=dt, debug=debug)
        tokenizer = graph.tokenizer
        if tokenizer is None:
            raise SurgeryError(f"'{model}' has no tokenizer, so text prompts cannot be encoded.", "Use a model directory or GGUF that carries its tokenizer.")
        encoded = [tokenizer(p, add_special_tokens=True, return_attention_mask=False)["input_ids"] for p in prompts]
        for i, ids in enumerate(encoded, 1):
            if len(ids) + max_new_tokens > graph.max_length:
                raise SurgeryError(
                    f"Prompt {i} has {len(ids)} tokens; with {max_new_tokens} new ones that exceeds the model's position limit of {graph.max_length}.",
                    "Shorten the prompt or lower --max-new-tokens.",
                )
        decoder = Decoder(graph, compile=compile)
        err.print(f"decoding: {len(decoder.attention)} attention layers with a KV cache, {len(decoder.gdn)} GDN layers with a recurrent state")

        def write(text: str) -> None:
            sys.stdout.write(text)
            sys.stdout.flush()

        for ids in encoded:  # one prompt at a time, so each continuation streams whole
            text = TextStream(tokenizer, ids, write)
            decode_generate(decoder, [ids], max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                            stream=lambda _, token, text=text: text.push(token))
            text.close()
