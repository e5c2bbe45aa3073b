"""Training corpora for distillation: text files tokenised once with the teacher's tokenizer into one
flat memory-mapped array (cached by file content and tokenizer, so a second run or a second rank
reads it without tokenising), cut into fixed-length windows that are visited in an order that is a
pure function of (seed, step, rank, world): a resumed run, or the same run on more processes, reads
exactly the same sequences at the same step."""
from __future__ import annotations

import hashlib
import json
import lzma
import os
from pathlib import Path

import numpy as np
import torch

from ..core.files import sha256_file as file_digest
from ..errors import DataError
from .cache import cache_dir, tokenizer_fingerprint

FORMAT = 1               # bump when the on-disk layout or the tokenisation rule changes
BLOCK_CHARS = 1 << 20    # text is tokenised in blocks of about this many characters, cut at newlines


def cache_root() -> Path:
    return cache_dir("corpus")


def _blocks(path: Path):
    """The file's text in blocks cut after a newline, so a fast tokenizer never holds a whole corpus."""
    opener = lzma.open if path.suffix == ".xz" else open
    with opener(path, "rt", encoding="utf-8", newline=None) as f:
        rest = ""
        while True:
            chunk = f.read(BLOCK_CHARS)
            if not chunk:
                break
            text = rest + chunk
            cut = text.rfind("\n")
            if cut < 0:
                rest = text
                continue
            yield text[:cut + 1]
            rest = text[cut + 1:]
        if rest:
            yield rest


def _token_dtype(tokenizer) -> np.dtype:
    size = len(tokenizer) if hasattr(tokenizer, "__len__") else len(tokenizer.get_vocab())
    return np.dtype(np.uint16) if size <= np.iinfo(np.uint16).max else np.dtype(np.uint32)


def check_files(files) -> list[Path]:
    """The data paths, or a DataError naming what is missing (checked before any model is loaded)."""
    paths = [Path(f) for f in files]
    if not paths:
        raise DataError("No training data was given.", "Pass one or more text files with --data.")
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise DataError(f"Training data file(s) not found: {', '.join(missing)}.", "Check the paths given to --data.")
    return paths


class TokenCorpus:
    """The tokens of the training files, in order, as a read-only np.memmap (EOS between files)."""

    def __init__(self, path: Path, key: str, files: list[str]):
        self.path, self.key, self.files = path, key, files
        dtype = np.dtype(path.suffix.lstrip("."))
        self.ids = np.memmap(path, dtype=dtype, mode="r") if path.stat().st_size else np.zeros(0, dtype)

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    @classmethod
    def build(cls, files, tokenizer, *, digests: list[str] | None = None, cache_dir: Path | None = None) -> "TokenCorpus":
        """Tokenise (or find in the cache) the files; raise DataError for missing or empty data.
        `digests`: the files' sha256 when the caller has them already (a large corpus is read once)."""
        paths = check_files(files)
        if tokenizer is None:
            raise DataError("Neither the teacher nor the hybrid has a tokenizer to read the training text with.", "Use a teacher source that carries one (a GGUF or a model directory with tokenizer files).")
        dtype = _token_dtype(tokenizer)
        digests = digests or [file_digest(p) for p in paths]
        key = hashlib.sha256(json.dumps([FORMAT, digests, tokenizer_fingerprint(tokenizer)]).encode()).hexdigest()[:24]
        folder = cache_dir or cache_root()
        target = folder / f"{key}.{dtype.name}"
        if not target.exists():
            folder.mkdir(parents=True, exist_ok=True)
            tmp = folder / f".{key}.{os.getpid()}.tmp"
            eos = getattr(tokenizer, "eos_token_id", None)
            try:
                with open(tmp, "wb") as f:
                    for i, path in enumerate(paths):
                        if i and eos is not None:
                            np.asarray([eos], dtype=dtype).tofile(f)
                        for block in _blocks(path):
                            ids = tokenizer(block, add_special_tokens=False, return_attention_mask=False)["input_ids"]
                            np.asarray(ids, dtype=dtype).tofile(f)
                os.replace(tmp, target)  # concurrent builders write identical bytes; the last rename wins
            finally:
                tmp.unlink(missing_ok=True)
        corpus = cls(target, key, [str(p) for p in paths])
        if len(corpus) == 0:
            raise DataError(f"The training data ({', '.join(map(str, paths))}) holds no tokens.", "Pass non-empty text files with --data.")
        return corpus


class WindowOrder:
    """Non-overlapping windows of seq_len tokens, shuffled once per epoch with a seed derived from
    (seed, epoch). Optimizer step s consumes the global_batch windows at positions
    [s * global_batch, (s + 1) * global_batch) of that endless sequence; rank r of w takes the r-th
    contiguous slice. Nothing depends on history, so any step can be produced directly."""

    def __init__(self, corpus: TokenCorpus, seq_len: int, global_batch: int, seed: int):
        self.corpus, self.seq_len, self.global_batch, self.seed = corpus, seq_len, global_batch, seed
        self.windows = len(corpus) // seq_len
        if self.windows == 0:
            raise DataError(
                f"The training data holds {len(corpus):,} tokens; one sequence needs {seq_len:,}.",
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
        rows = [np.asarray(self.corpus.ids[i * self.seq_len:(i + 1) * self.seq_len], dtype=np.int64) for i in self.indices(step, rank, world)]
        return torch.from_numpy(np.stack(rows))
