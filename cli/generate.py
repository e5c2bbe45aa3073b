"""`surgery generate`: continue prompts with incremental decoding (surgery.decode).

stdout carries the continuations and nothing else (one per prompt, each ended by a newline, streamed
token by token; with --json one JSON document once all are done), so the command can be piped;
loading messages, progress and errors go to stderr."""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import List, Optional

import typer

from surgery.errors import SurgeryError

from .common import check_device_fits, emit_json, err, guard, model_inputs, more_files, placement
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


class Clock:
    """Time to first token (the prefill, through surgery.decode.fast's route) and the decode rate."""

    def __init__(self):
        self.start, self.times = time.perf_counter(), []

    def tick(self) -> None:
        self.times.append(time.perf_counter() - self.start)

    def summary(self, index: int, prompt_tokens: int) -> str:
        if not self.times:
            return f"prompt {index}: {prompt_tokens} tokens, nothing generated"
        rate = f", then {(len(self.times) - 1) / (self.times[-1] - self.times[0]):.1f} tokens/s" if len(self.times) > 1 else ""
        return f"prompt {index}: {prompt_tokens} tokens, first token after {self.times[0]:.3f} s{rate}"


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
    as_json: bool = typer.Option(False, "--json", help="Print the continuations as one JSON document on stdout once done (no streaming)."),
):
    """Continue prompts with a teacher or a saved hybrid (KV cache for attention, recurrent state for GDN)."""
    from surgery.decode import Decoder, check_sampling
    from surgery.io.exported import ExportedModel, open_runnable

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
        graph = open_runnable(model, device=dev, dtype=dt, debug=debug, compile=compile)  # an export: verified, run by its own code
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
        exported = isinstance(graph, ExportedModel)  # decoded by transformers' generate, through the export's own cache
        decoder = None if exported else Decoder(graph, compile=compile)
        if decoder is None:
            kinds = graph.layer_kinds
            err.print(f"decoding: {kinds.count('attention')} attention layers with a KV cache, {kinds.count('gdn')} GDN layers with a recurrent state")
        else:
            split = len(decoder.attention.keys() & decoder.gdn.keys())  # select.granularity=head: a layer holds both
            err.print(f"decoding: {len(decoder.attention)} attention layers with a KV cache, {len(decoder.gdn)} GDN layers with a recurrent state"
                      + (f" ({split} layers split by heads hold both)" if split else ""))

        sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed}
        continuations = [continuation(graph, decoder, p, ids, max_new_tokens, sampling, stream=not as_json, index=i)
                         for i, (p, ids) in enumerate(zip(prompts, encoded), 1)]
        if as_json:
            emit_json({"model": model, "temperature": temperature, "seed": seed, "continuations": continuations})


def continuation(graph, decoder, prompt: str, ids: list, max_new_tokens: int, sampling: dict, stream: bool,
                 index: int = 1) -> dict:
    """One prompt's continuation, streamed to stdout as it decodes (stream), or collected with its
    progress on stderr (--json: nothing reaches stdout until the end); its time to first token and
    rate on stderr. decoder None: an export, continued by transformers' generate through its own cache."""
    from surgery.core import progress
    from surgery.decode import generate as decode_generate

    pieces: list[str] = []
    tokens: list[int] = []
    text = TextStream(graph.tokenizer, ids, write if stream else pieces.append)
    clock = Clock()
    with progress.task("generate", max_new_tokens, "tokens", enabled=not stream) as bar:
        def push(_, token):
            clock.tick()
            tokens.append(token)
            text.push(token)
            bar.update(len(tokens))

        if decoder is None:
            graph.generate(ids, max_new_tokens, **sampling, stream=lambda token: push(None, token))
        else:
            decode_generate(decoder, [ids], max_new_tokens, **sampling, stream=push)
    text.close()
    err.print(clock.summary(index, len(ids)))
    return {"prompt": prompt, "text": "".join(pieces).removesuffix("\n"), "prompt_tokens": len(ids), "new_tokens": len(tokens)}


def write(text: str) -> None:
    """A piece of a continuation on stdout at once (the command pipes)."""
    sys.stdout.write(text)
    sys.stdout.flush()
