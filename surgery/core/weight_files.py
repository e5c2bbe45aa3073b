"""A teacher's tensors read one at a time from its safetensors files (one file or shards and their
index), so a model larger than the compute device is never loaded whole: the layer-streamed run
(surgery.core.streamed) asks for a tensor by its state_dict name when a layer needs it."""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
import zlib
from collections.abc import Mapping
from pathlib import Path

import torch

from ..errors import ModelLoadError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class TensorSource(ABC):
    """What a layer-streamed run reads a teacher's tensors from. `where` holds the stored names;
    `aliases` maps a name the graph uses to the one stored (tied weights are stored once:
    lm_head.weight is embed_tokens.weight in the files). A subclass reads one stored tensor (read)."""

    folder: Path
    where: dict
    aliases: dict

    def stored_name(self, name: str) -> str | None:
        """The name under which `name`'s tensor is stored, or None (a buffer the model computes itself)."""
        if name in self.where:
            return name
        alias = self.aliases.get(name)
        return alias if alias in self.where else None

    def __contains__(self, name: str) -> bool:
        return self.stored_name(name) is not None

    @abstractmethod
    def read(self, stored: str) -> torch.Tensor:
        """The stored tensor `stored`, on the CPU."""

    def load(self, name: str, device, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor `name` on `device`, floating point cast to `dtype` (as from_pretrained(dtype=) does)."""
        stored = self.stored_name(name)
        if stored is None:
            raise ModelLoadError(f"The teacher's files in '{self.folder}' hold no tensor '{name}'.", "Check that the weight files are complete.")
        tensor = self.read(stored)
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        return tensor.to(device)

    def params(self, device, dtype: torch.dtype | None = None) -> "FileParams":
        """A read-only name -> tensor mapping over these files, each tensor read when asked for."""
        return FileParams(self, device, dtype)


class WeightFiles(TensorSource):
    """A model directory's safetensors (one file, or shards and their index), memory-mapped."""

    def __init__(self, folder: str | Path, aliases: dict[str, str] | None = None):
        self.folder = Path(folder)
        self.aliases = dict(aliases or {})
        if (self.folder / INDEX).is_file():
            self.where = dict(json.loads((self.folder / INDEX).read_text())["weight_map"])
        elif (self.folder / SINGLE).is_file():
            from safetensors import safe_open

            with safe_open(self.folder / SINGLE, "pt") as f:
                self.where = dict.fromkeys(f.keys(), SINGLE)
        else:
            raise ModelLoadError(f"'{self.folder}' holds no {SINGLE} nor {INDEX}: layer-by-layer conversion reads safetensors files.",
                                 "Convert the teacher to safetensors (transformers' save_pretrained writes them), or drop --offload-layers.")
        self.handles: dict[str, object] = {}

    def read(self, stored: str) -> torch.Tensor:
        return self.handle(self.where[stored]).get_tensor(stored)

    def handle(self, file: str):
        """The open safetensors file (memory-mapped; a tensor is read when asked for)."""
        if file not in self.handles:
            from safetensors import safe_open

            self.handles[file] = safe_open(self.folder / file, "pt")
        return self.handles[file]

    def nbytes(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of every stored tensor (in `dtype` where given): the model's size on the device."""
        total = 0
        for name in self.where:
            shape, stored = self.meta(name)
            width = (dtype.itemsize if dtype is not None and stored.is_floating_point else stored.itemsize)
            total += width * int(torch.Size(shape).numel())
        return total

    def meta(self, name: str) -> tuple[list[int], torch.dtype]:
        """Shape and stored dtype of a tensor, read from the file header only."""
        stored = self.stored_name(name)
        piece = self.handle(self.where[stored]).get_slice(stored)
        return piece.get_shape(), _DTYPES[piece.get_dtype()]


class RandomWeights(TensorSource):
    """A meta-built model's parameters drawn on demand on the device (normal, std 0.02, seeded by name;
    1-D ones: norm scales): a teacher of any shape with no files, for benchmarks of the streamed run."""

    def __init__(self, model: torch.nn.Module, std: float = 0.02):
        self.where = {name: tuple(p.shape) for name, p in model.named_parameters()}
        self.aliases, self.folder = {}, Path("<random>")
        self.std = std

    def load(self, name: str, device, dtype: torch.dtype | None = None) -> torch.Tensor:
        shape, dtype = self.where[name], dtype or torch.float32
        if len(shape) == 1:
            return torch.ones(shape, device=device, dtype=dtype)
        generator = torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()))
        return torch.randn(shape, generator=generator, device=device, dtype=dtype).mul_(self.std)  # in place: no second copy

    def read(self, stored: str) -> torch.Tensor:
        return self.load(stored, "cpu")

    def nbytes(self, dtype: torch.dtype | None = None) -> int:
        return sum(int(torch.Size(shape).numel()) for shape in self.where.values()) * (dtype or torch.float32).itemsize


class FileParams(Mapping):
    """What named_parameters() gives for an in-memory teacher, for one whose weights stay in files."""

    def __init__(self, files: TensorSource, device, dtype):
        self.files, self.device, self.dtype = files, device, dtype

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.files:
            raise KeyError(name)
        return self.files.load(name, self.device, self.dtype)

    def __iter__(self):
        return iter(self.files.where)

    def __len__(self) -> int:
        return len(self.files.where)


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
