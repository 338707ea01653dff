"""GGUF files -> ModelConfig + Hugging Face-named float32 tensors (dequantized with the `gguf` package), or,
for the weight types the low-bit kernel computes as stored, their blocks. Any type `gguf` can dequantize
loads (Q2_K, the IQ and TQ types, MXFP4...): a low-bit backend requantizes what it cannot compute as
stored, at more bytes per weight than the file's, and says so."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from tqdm import tqdm

from ..config import ModelConfig
from ..errors import SpecDecodeError
from .checkpoints import INTERLEAVED_ROPE_FAMILIES, LATENT_FLOAT_TENSORS, as_computed, gguf_parts, halves_paired
from .families import from_gguf

# GGUF architectures whose files hold q/k rows interleaved: llama.cpp's converter permutes its LlamaModel's so, and
# stores as they are the checkpoints of families that turn adjacent dimensions
PERMUTED_ROPE_FAMILIES = ("llama", "smollm3", "granite", "granitemoe", "mistral3", *INTERLEAVED_ROPE_FAMILIES)


class MappedReader(GGUFReader):
    """gguf's reader over a plain array view of the file's memory map: its parse slices the map once or twice per
    value (each token of a vocabulary), and a slice of a numpy memmap costs several times one of a plain array
    (docs/decisions.md#model-families-one-decoder-from-a-description). Tensor data stay mapped all the same."""

    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, mapped: np.ndarray) -> None:
        self._plain = mapped.view(np.ndarray)


def dequantize_tensor(tensor) -> np.ndarray:
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims fastest-first
    try:
        values = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise SpecDecodeError(
            f"tensor {tensor.name} uses GGUF type {tensor.tensor_type.name}, which the gguf package cannot "
            "dequantize; use a file quantized as Q4_K_M, Q8_0 or F16 (or another llama.cpp k- or i-quant)"
        ) from None
    return values.reshape(shape).astype(np.float32, copy=False)


def iter_gguf_tensors(
    path: str, progress: bool = True, raw_types: frozenset = frozenset()
) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor | RawTensor]]]:
    """The architecture, and the tensors as (runtime name, float32 tensor; models/checkpoints.py), dequantized
    one at a time as they are consumed (the file is memory-mapped: nothing else is read). Weights of a type in
    `raw_types` come as their GGUF blocks instead, one row of blocks per output row; a tensor of stacked
    experts comes as one weight per expert."""
    reader = MappedReader(path)
    cfg = from_gguf(reader)
    for t in reader.tensors:
        gguf_parts(cfg, t.name, 0)  # an unknown tensor is refused before anything is computed

    def tensors():
        if raw_types:
            _warn_of_requantized_types(reader, raw_types)
        for t in tqdm(
            reader.tensors, desc=f"loading {path.rsplit('/', 1)[-1]}", unit="tensor", disable=not progress, leave=False
        ):
            latent = bool(cfg.kv_lora_rank) and t.name.split(".")[-2] in LATENT_FLOAT_TENSORS
            raw = t.tensor_type in raw_types and t.name.endswith(".weight") and len(t.shape) in (2, 3) and not latent
            w = np.asarray(t.data) if raw else dequantize_tensor(t)
            # experts' weights, or their biases: one matrix an expert (DeepSeek's expansions, one a head, go whole)
            stacked = (len(t.shape) == 3 or t.name.endswith("_exps.bias")) and not latent
            for expert, matrix in enumerate(w) if stacked else [(None, w)]:
                for name, rows in gguf_parts(cfg, t.name, matrix.shape[0]):
                    yield _named_part(cfg, name.format(expert=expert), matrix[rows], raw and t)

    return cfg, tensors()


def _named_part(cfg: ModelConfig, name: str, w: np.ndarray, raw_tensor):
    tensor = runtime_rows(cfg, name, w)
    return name, RawTensor(raw_tensor.tensor_type, int(raw_tensor.shape[0]), tensor) if raw_tensor else tensor


def runtime_rows(cfg: ModelConfig, name: str, w: np.ndarray) -> torch.Tensor:
    """A GGUF matrix (or a LoRA adapter's B, whose rows are its layer's output rows) as the runtime computes with the
    weight `name`: q/k rows back in the order llama.cpp's converter interleaved."""
    if cfg.arch in PERMUTED_ROPE_FAMILIES:
        w = halves_paired(cfg, name, w)  # a permutation of whole rows: blocks move with them
    return as_computed(cfg, name, torch.from_numpy(np.ascontiguousarray(w) if w.flags.writeable else w.copy()))


FLOAT_TYPES = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}


def _warn_of_requantized_types(reader: GGUFReader, raw_types: frozenset) -> None:
    """Block types of the file's weights that a low-bit backend will requantize instead of computing."""
    other = sorted(
        {
            t.tensor_type.name
            for t in reader.tensors
            if len(t.shape) in (2, 3) and t.tensor_type not in raw_types | FLOAT_TYPES
        }
    )
    if other:
        warnings.warn(
            f"weights in {', '.join(other)} are not computed as stored: they are requantized (Q8_0; 4 "
            f"bits under w4a8-all), more bytes per token than the file (computed as stored: "
            f"{', '.join(sorted(t.name for t in raw_types))})",
            stacklevel=3,
        )


@dataclass
class RawTensor:
    """A GGUF weight as stored: `blocks` [rows, bytes per row] of type `qtype`, `columns` weights per row."""

    qtype: GGMLQuantizationType
    columns: int
    blocks: torch.Tensor


def load_gguf(path: str, progress: bool = True) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    cfg, tensors = iter_gguf_tensors(path, progress)
    return cfg, dict(tensors)
