"""Training corpora for distillation: text files tokenised with the teacher's tokenizer through the
token cache (surgery.data.cache, block rule: a second run or a second rank reads ids, never text),
joined with EOS between files, cut into fixed-length windows that are visited in an order that is a
pure function of (seed, step, rank, world): a resumed run, or the same run on more processes, reads
exactly the same sequences at the same step."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from ..core.files import sha256_file as file_digest
from ..errors import DataError
from ..core.bos import lead_windows, text_length
from .cache import FORMAT, file_tokens, token_dtype, tokenizer_fingerprint
from .text import require_file


def check_files(files) -> list[Path]:
    """The data paths, or a DataError naming what is missing (checked before any model is loaded)."""
    paths = [Path(f) for f in files]
    if not paths:
        raise DataError("No training data was given.", "Pass one or more text files with --data.")
    missing = [str(p) for p in paths if not p.exists()]  # what is there but no regular file: data.text names it
    if missing:
        raise DataError(f"Training data file(s) not found: {', '.join(missing)}.", "Check the paths given to --data.")
    for path in paths:
        require_file(path)
    return paths


class TokenCorpus:
    """The tokens of the training files, in order, with EOS between files: a view over each file's
    cached ids (read-only memmaps), so no corpus-sized array is built in memory."""

    def __init__(self, parts: list[np.ndarray], key: str, files: list[str], cache_files: list):
        self.parts, self.key, self.files, self.cache_files = parts, key, files, cache_files
        self.starts = np.cumsum([0] + [len(p) for p in parts])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def window(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the corpus as int64, across file boundaries."""
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        out, at = [], start
        for k in range(first, len(self.parts)):
            if at >= stop:
                break
            lo = at - int(self.starts[k])
            piece = self.parts[k][lo:lo + stop - at]
            out.append(np.asarray(piece, dtype=np.int64))
            at += len(piece)
        return np.concatenate(out) if len(out) != 1 else out[0]

    @classmethod
    def build(cls, files, tokenizer, *, digests: list[str] | None = None) -> "TokenCorpus":
        """Tokenise (or find in the cache) the files; raise DataError for missing or empty data.
        `digests`: the files' sha256 when the caller has them already (a large corpus is read once)."""
        paths = check_files(files)
        if tokenizer is None:
            raise DataError("Neither the teacher nor the hybrid has a tokenizer to read the training text with.", "Use a teacher source that carries one (a GGUF or a model directory with tokenizer files).")
        digests = digests or [file_digest(p) for p in paths]
        fingerprint = tokenizer_fingerprint(tokenizer)
        key = hashlib.sha256(json.dumps([FORMAT, digests, fingerprint]).encode()).hexdigest()[:24]
        eos = getattr(tokenizer, "eos_token_id", None)
        parts, cache_files = [], []
        for i, (path, digest) in enumerate(zip(paths, digests)):
            if i and eos is not None:
                parts.append(np.asarray([eos], dtype=token_dtype(tokenizer)))
            ids, where = file_tokens(path, tokenizer, rule="blocks", fingerprint=fingerprint, digest=digest)
            parts.append(ids)
            cache_files.append(where)
        corpus = cls(parts, key, [str(p) for p in paths], cache_files)
        if len(corpus) == 0:
            raise DataError(f"The training data ({', '.join(map(str, paths))}) holds no tokens.", "Pass non-empty text files with --data.")
        return corpus


class WindowOrder:
    """Non-overlapping windows of seq_len tokens, shuffled once per epoch with a seed derived from
    (seed, epoch). Optimizer step s consumes the global_batch windows at positions
    [s * global_batch, (s + 1) * global_batch) of that endless sequence; rank r of w takes the r-th
    contiguous slice. Nothing depends on history, so any step can be produced directly. With a lead
    token (the tokenizer's BOS, surgery.core.bos) each sequence is it + seq_len-1 corpus tokens."""

    def __init__(self, corpus: TokenCorpus, seq_len: int, global_batch: int, seed: int, lead: int | None = None):
        self.corpus, self.seq_len, self.global_batch, self.seed, self.lead = corpus, seq_len, global_batch, seed, lead
        self.text_len = text_length(seq_len, lead)
        self.windows = len(corpus) // self.text_len
        if self.windows == 0:
            raise DataError(
                f"The training data holds {len(corpus):,} tokens; one sequence needs {self.text_len:,}.",
                "Give more text with --data, or a shorter --seq-len.",
            )
        self._perm: tuple[int, np.ndarray] | None = None

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.windows))
        return self._perm[1]

    def indices(self, step: int, rank: int = 0, world: int = 1) -> list[int]:
        """Window indices of this rank's share of step `step`."""
        if self.global_batch % world:
            raise DataError(f"A global batch of {self.global_batch} sequences cannot be split over {world} processes.", "Use a batch size divisible by the number of processes.")
        share = self.global_batch // world
        first = step * self.global_batch + rank * share
        return [int(self._permutation(g // self.windows)[g % self.windows]) for g in range(first, first + share)]

    def batch(self, step: int, rank: int = 0, world: int = 1) -> torch.Tensor:
        """[global_batch // world, seq_len] token ids (int64)."""
        rows = [self.corpus.window(i * self.text_len, (i + 1) * self.text_len) for i in self.indices(step, rank, world)]
        return lead_windows(torch.from_numpy(np.stack(rows)), self.lead)
