"""An export directory (`surgery export`) run the way its users run it: by its own modeling code
(transformers, trust_remote_code=True), and only after its manifest says it is exactly what surgery
wrote (`verify_export`). `eval` (perplexity, passkey) and `generate` take it as they take a graph:
it has the few things they read (tokenizer, device, max_length, ids -> logits)."""
from __future__ import annotations

from pathlib import Path

import torch

from ..core.capture import max_positions
from ..errors import ExportError, ModelLoadError, first_line
from . import hf_export
from .export_manifest import is_export, verify_export
from .open import open_model

STATE = "surgery_gdn_state"  # the attribute of a transformers cache layer that holds a GDN layer's state (hf_modeling)


class ExportedModel:
    """A verified export loaded with its own code: `model` is transformers' AutoModelForCausalLM."""

    def __init__(self, path: Path, model, tokenizer):
        self.path, self.model, self.tokenizer = Path(path), model, tokenizer
        hybrid = getattr(model.config, hf_export.HYBRID_KEY, None) or {}
        self.layer_kinds = list(hybrid.get("layer_kinds") or [])
        self.converted = {e["layer"]: e for e in (hybrid.get("gdn_layers") or {}).values()}  # layer -> its mixer and config
        self.max_length = max_positions(model.config)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, T] -> [B, T, V], one full forward without a cache (as a graph's logits)."""
        return self.model(input_ids=input_ids.to(self.device), use_cache=False).logits

    __call__ = logits

    @torch.no_grad()
    def layer_rows(self) -> list[dict]:
        """Per layer, what the export's own cache keeps (batch 1): K and V bytes per token (the
        growth from one token to two) and the sliding window of a softmax layer (an swa layer's own,
        which windows its mask over transformers' full cache), the fixed state of a recurrent layer
        and its mixer. Read from transformers' cache after running the export's code."""
        sizes = [self.cache_sizes(n) for n in (1, 2)]
        rows = []
        for layer, (one, two) in enumerate(zip(*sizes)):
            entry = self.converted.get(layer, {})
            now = entry.get("mixer", "gdn") if entry else "attention"
            recurrent = one["state"] is not None
            window = entry["gdn_config"].get("window") if now == "swa" else one["window"]
            rows.append({"layer": layer, "now": now, "kind": now if recurrent else "softmax",
                         "window": None if recurrent else window, "kv_bytes_per_token": two["kv"] - one["kv"], "state_bytes": two["state"] or 0})
        return rows

    def cache_sizes(self, length: int) -> list[dict]:
        ids = torch.ones(1, length, dtype=torch.long, device=self.device)
        result = self.model(input_ids=ids, use_cache=True)
        cache = getattr(result, "cache", None) or result.past_key_values
        found = []
        for entry in cache.layers:
            state = getattr(entry, STATE, None)
            kv = sum(t.numel() * t.element_size() for t in (getattr(entry, "keys", None), getattr(entry, "values", None)) if torch.is_tensor(t))
            found.append({"kv": kv, "state": state.nbytes() if state is not None else None, "window": getattr(entry, "sliding_window", None)})
        return found

    @torch.no_grad()
    def generate(self, ids: list[int], max_new_tokens: int, *, temperature: float = 0.0, top_k=None, top_p=None, seed=None, stream=None) -> list[int]:
        """Continue one prompt with transformers' generate (greedy, or sampling when temperature > 0),
        each new token handed to stream(token) as it comes; returns the new tokens."""
        from transformers.generation.streamers import BaseStreamer

        class Stream(BaseStreamer):
            def __init__(self):
                self.prompt_seen = False

            def put(self, value):
                if not self.prompt_seen:  # generate hands over the prompt first
                    self.prompt_seen = True
                    return
                if stream is not None:
                    for token in value.reshape(-1).tolist():
                        stream(token)

            def end(self):
                pass

        sample = temperature > 0
        options = {"do_sample": sample, "max_new_tokens": max_new_tokens, "streamer": Stream(),
                   "pad_token_id": self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id}
        if sample:
            options |= {"temperature": temperature, "top_k": top_k or 0, "top_p": top_p if top_p is not None else 1.0}
            if seed is not None:
                torch.manual_seed(seed)
        else:
            options |= {"temperature": None, "top_k": None, "top_p": None}
        prompt = torch.tensor([ids], device=self.device)
        out = self.model.generate(prompt, attention_mask=torch.ones_like(prompt), **options)
        return out[0, prompt.shape[1]:].tolist()


def open_export(path, *, device=None, dtype: torch.dtype | None = None) -> ExportedModel:
    """Verify the export at `path` (ExportError naming what differs), then load it with its own
    modeling code (trust_remote_code=True: the directory's Python runs, as in transformers)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    verify_export(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=dtype or torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, ImportError, RuntimeError) as exc:
        raise ModelLoadError(f"The export '{path}' was verified, but transformers could not load it: {first_line(exc)}",
                             "Check the installed transformers (the export needs >= 4.57), or export the hybrid again (surgery export --force).") from exc
    return ExportedModel(path, model.to(device or "cpu").eval(), tokenizer)


def refuse_compile(path) -> ExportError:
    """What --compile gets on an export: surgery compiles its own graphs; an export runs in transformers."""
    return ExportError(f"--compile runs surgery's captured graphs; '{path}' is an export, which runs in transformers with its own code.",
                       "Drop --compile (or pass --no-compile), or open the saved hybrid it came from.")


def open_runnable(source, *, device=None, dtype: torch.dtype | None = None, debug: bool = False, compile: bool | None = None):
    """What `eval` and `generate` run: an export directory verified and loaded with its own code
    (ExportedModel), anything else as open_model opens it (a Graph)."""
    if isinstance(source, (str, Path)) and is_export(source):
        if compile:
            raise refuse_compile(source)
        return open_export(source, device=device, dtype=dtype)
    return open_model(source, device=device, dtype=dtype, debug=debug)
