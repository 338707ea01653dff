"""GGUF files -> ModelConfig + Hugging Face-named float32 tensors (dequantized with the `gguf` package)."""
from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGUFReader, GGMLQuantizationType
from gguf.quants import dequantize
from tqdm import tqdm

from ..config import ModelConfig
from ..errors import SpecDecodeError

# Types the bundled files use plus the common others; `gguf` can dequantize more, but these are tested.
SUPPORTED_TYPES = {
    GGMLQuantizationType[name]
    for name in ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
}

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
    if tensor.tensor_type not in SUPPORTED_TYPES:
        raise SpecDecodeError(
            f"tensor {tensor.name} uses GGUF type {tensor.tensor_type.name}, which is not supported; "
            f"use a file quantized as one of {sorted(t.name for t in SUPPORTED_TYPES)}")
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims fastest-first
    return dequantize(tensor.data, tensor.tensor_type).reshape(shape).astype(np.float32, copy=False)


def iter_gguf_tensors(path: str, progress: bool = True, raw_types: frozenset = frozenset()
                      ) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor | RawTensor]]]:
    """The architecture, and the tensors as (Hugging Face name, float32 tensor), dequantized one at a time
    as they are consumed (the file is memory-mapped: nothing else is read). Weights of a type in
    `raw_types` come as their GGUF blocks instead, one row of blocks per output row."""
    reader = GGUFReader(path)
    cfg = read_config(reader)

    def tensors():
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


@dataclass
class RawTensor:
    """A GGUF weight as stored: `blocks` [rows, bytes per row] of type `qtype`, `columns` weights per row."""
    qtype: GGMLQuantizationType
    columns: int
    blocks: torch.Tensor


def load_gguf(path: str, progress: bool = True) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    cfg, tensors = iter_gguf_tensors(path, progress)
    return cfg, dict(tensors)
