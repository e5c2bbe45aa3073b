"""A GGUF teacher's tensors one at a time: the file is memory-mapped (gguf.GGUFReader) and a tensor is
dequantized and put into transformers' layout (its own name map and tensor processors, the Q/K
un-permutation of llama.cpp's files included) only when the layer-streamed run asks for it, so the
teacher is never dequantized whole. Values equal what from_pretrained(gguf_file=...) loads."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..errors import ModelLoadError
from .weight_files import TensorSource


class GGUFWeights(TensorSource):
    """name (the transformers state_dict's) -> tensor on demand."""

    def __init__(self, path: Path, reader, model: torch.nn.Module, aliases: dict[str, str] | None = None):
        from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map,
                                                               load_gguf_checkpoint, read_field)

        self.folder, self.aliases = Path(path), dict(aliases or {})
        self.parsed = load_gguf_checkpoint(str(path), return_tensors=False)  # the config the processors read
        architecture = read_field(reader, "general.architecture")[0]
        self.processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=self.parsed["config"])
        self.mapping = get_gguf_hf_weights_map(model, self.processor)  # GGUF name -> transformers name
        self.where = {self.mapping[t.name]: t for t in reader.tensors if t.name in self.mapping}

    def read(self, stored: str) -> torch.Tensor:
        from gguf import dequantize

        tensor = self.where[stored]
        result = self.processor.process(weights=dequantize(tensor.data, tensor.tensor_type), name=tensor.name,
                                        tensor_key_mapping=self.mapping, parsed_parameters=self.parsed)
        if result.name != tensor.name:
            raise ModelLoadError(f"transformers renames the GGUF tensor '{tensor.name}' to '{result.name}' while loading it; "
                                 "such a file cannot be read a tensor at a time.", "Convert the teacher to safetensors (save_pretrained), or drop --offload-layers.")
        return torch.from_numpy(np.copy(result.weights)).to(torch.float32)  # what from_pretrained(dtype=float32) holds

    def nbytes(self, dtype: torch.dtype | None = None) -> int:
        return sum(int(np.prod(t.shape)) for t in self.where.values()) * (dtype or torch.float32).itemsize
