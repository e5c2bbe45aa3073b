"""One parse of a GGUF per load. transformers reads a GGUF's metadata anew for the config (twice),
the weights and the tokenizer, and rebuilds gguf's tensor-name table once per submodule while it maps
the weights (397 times for SmolLM2). Within `one_gguf_parse` each of these is computed once and
handed out again; the results are what transformers computes itself, so the model is unchanged."""
from __future__ import annotations

import copy
from contextlib import ExitStack, contextmanager
from functools import cache
from pathlib import Path


@cache
def plain_reader_class(base):
    """`base` (gguf.GGUFReader) over a plain ndarray view of its memory map. The reader slices its map once or
    twice per value (~150k times for a 49k-token vocabulary) and a np.memmap runs Python code on every
    slice; the same bytes through an ndarray view parse in a third of the time. Views of a read-only
    map stay read-only."""
    import numpy as np

    class PlainReader(base):
        @property
        def data(self):
            return self.plain

        @data.setter
        def data(self, value):
            self.plain = np.asarray(value)  # a view: nothing is read or copied

    return PlainReader


def read_gguf(path: Path):
    """The GGUF at `path` parsed (metadata and tensor table), as gguf.GGUFReader(path) parses it."""
    import gguf

    return plain_reader_class(gguf.GGUFReader)(path)


@contextmanager
def swapped(owner, name: str, replacement):
    """owner.name is `replacement` within the block."""
    original = getattr(owner, name)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, original)


def shared_reader(path: Path, reader, original):
    """gguf.GGUFReader (`original`) that returns `reader` (read-only memory maps, safe to share) for `path`."""
    target = Path(path).resolve()

    def open_reader(file, *args, **kwargs):
        return reader if not args and not kwargs and Path(file).resolve() == target else original(file, *args, **kwargs)

    return open_reader


def memoized_metadata(path: Path, original):
    """transformers' load_gguf_checkpoint whose metadata-only result (return_tensors=False) for `path`
    is parsed once; every caller gets its own deep copy, as if it had parsed the file itself."""
    target, parsed = Path(path).resolve(), {}

    def load_checkpoint(file, return_tensors=False, *args, **kwargs):
        if return_tensors or args or kwargs or Path(file).resolve() != target:
            return original(file, return_tensors, *args, **kwargs)
        if "result" not in parsed:
            parsed["result"] = original(file, False)
        return copy.deepcopy(parsed["result"])

    return load_checkpoint


def memoized_name_maps(original):
    """gguf.get_tensor_name_map once per (architecture, block count). The table is only read after it
    is built, and building it again gives the same table."""
    built = {}

    def name_map(arch, n_blocks):
        if (arch, n_blocks) not in built:
            built[arch, n_blocks] = original(arch, n_blocks)
        return built[arch, n_blocks]

    return name_map


@contextmanager
def one_gguf_parse(path: Path | None, reader):
    """Within this block transformers' reads of the GGUF at `path` share one parse: gguf.GGUFReader(path)
    returns `reader` (the one check_gguf made), the metadata is parsed into Python once, the
    tensor-name table built once. Nothing changes without a reader (no gguf package, or no GGUF)."""
    if reader is None:
        yield
        return
    import gguf
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    wrappers = ((gguf, "GGUFReader", lambda original: shared_reader(path, reader, original)),
                (gguf, "get_tensor_name_map", memoized_name_maps),
                (hf_gguf, "load_gguf_checkpoint", lambda original: memoized_metadata(path, original)))
    with ExitStack() as stack:
        for owner, name, wrap in wrappers:
            if hasattr(owner, name):  # another gguf or transformers version may lack one: it then parses as it always did
                stack.enter_context(swapped(owner, name, wrap(getattr(owner, name))))
        yield
