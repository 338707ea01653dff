"""GGUF files -> ModelConfig + Hugging Face-named float32 tensors (dequantized with the `gguf` package), or,
for the weight types the low-bit kernel computes as stored, their blocks. Any type `gguf` can dequantize
loads (Q2_K, the IQ and TQ types, MXFP4...): a low-bit backend requantizes what it cannot compute as
stored, at more bytes per weight than the file's, and says so."""
from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGUFReader, GGMLQuantizationType
from gguf.quants import dequantize
from tqdm import tqdm

from ..config import ModelConfig
from ..errors import SpecDecodeError

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def field(reader: GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_config(reader: GGUFReader) -> ModelConfig:
    arch = field(reader, "general.architecture")
    if arch not in ("llama", "qwen2"):
        raise SpecDecodeError(f"GGUF architecture {arch!r} is not supported; use a Llama- or Qwen2-family model")

    def key(name, default=None):
        return field(reader, f"{arch}.{name}", default)

    names = {t.name for t in reader.tensors}
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    hidden, heads = key("embedding_length"), key("attention.head_count")
    return ModelConfig(
        arch=arch,
        vocab_size=int(embd.shape[1]),
        hidden_size=hidden,
        intermediate_size=key("feed_forward_length"),
        num_layers=key("block_count"),
        num_heads=heads,
        num_kv_heads=key("attention.head_count_kv", heads),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position=int(key("context_length", 4096)),
        qkv_bias="blk.0.attn_q.bias" in names,
        tie_word_embeddings="output.weight" not in names,
        head_dim=key("attention.key_length"),
    )


def hf_name(gguf_name: str) -> str:
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m:
        return f"model.layers.{m[1]}.{_LAYER_NAMES[m[2]]}.{m[3]}"
    base, _, suffix = gguf_name.rpartition(".")
    return f"{_GLOBAL_NAMES[base]}.{suffix}"


def unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves the rotary halves of Llama q/k rows; undo it (NeoX layout)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize_tensor(tensor) -> np.ndarray:
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims fastest-first
    try:
        values = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise SpecDecodeError(
            f"tensor {tensor.name} uses GGUF type {tensor.tensor_type.name}, which the gguf package cannot "
            "dequantize; use a file quantized as Q4_K_M, Q8_0 or F16 (or another llama.cpp k- or i-quant)") from None
    return values.reshape(shape).astype(np.float32, copy=False)


def iter_gguf_tensors(path: str, progress: bool = True, raw_types: frozenset = frozenset()
                      ) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor | RawTensor]]]:
    """The architecture, and the tensors as (Hugging Face name, float32 tensor), dequantized one at a time
    as they are consumed (the file is memory-mapped: nothing else is read). Weights of a type in
    `raw_types` come as their GGUF blocks instead, one row of blocks per output row."""
    reader = GGUFReader(path)
    cfg = read_config(reader)

    def tensors():
        if raw_types:
            _warn_of_requantized_types(reader, raw_types)
        for t in tqdm(reader.tensors, desc=f"loading {path.rsplit('/', 1)[-1]}", unit="tensor",
                      disable=not progress, leave=False):
            raw = t.tensor_type in raw_types and t.name.endswith(".weight") and len(t.shape) == 2
            w = np.asarray(t.data) if raw else dequantize_tensor(t)
            if cfg.arch == "llama" and t.name.endswith(("attn_q.weight", "attn_q.bias")):
                w = unpermute_rope(w, cfg.num_heads)  # a permutation of whole rows: blocks move with them
            elif cfg.arch == "llama" and t.name.endswith(("attn_k.weight", "attn_k.bias")):
                w = unpermute_rope(w, cfg.num_kv_heads)
            tensor = torch.from_numpy(np.ascontiguousarray(w) if w.flags.writeable else w.copy())
            yield hf_name(t.name), RawTensor(t.tensor_type, int(t.shape[0]), tensor) if raw else tensor

    return cfg, tensors()


FLOAT_TYPES = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}


def _warn_of_requantized_types(reader: GGUFReader, raw_types: frozenset) -> None:
    """Block types of the file's weights that a low-bit backend will requantize instead of computing."""
    other = sorted({t.tensor_type.name for t in reader.tensors if len(t.shape) == 2
                    and t.tensor_type not in raw_types | FLOAT_TYPES})
    if other:
        warnings.warn(f"weights in {', '.join(other)} are not computed as stored: they are requantized (Q8_0; 4 "
                      f"bits under w4a8-all), more bytes per token than the file (computed as stored: "
                      f"{', '.join(sorted(t.name for t in raw_types))})", stacklevel=3)


@dataclass
class RawTensor:
    """A GGUF weight as stored: `blocks` [rows, bytes per row] of type `qtype`, `columns` weights per row."""
    qtype: GGMLQuantizationType
    columns: int
    blocks: torch.Tensor


def load_gguf(path: str, progress: bool = True) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    cfg, tensors = iter_gguf_tensors(path, progress)
    return cfg, dict(tensors)
