"""Load a model by name: weights (with an on-disk cache of dequantized GGUF weights) and tokenizer."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import torch

from ..config import ModelConfig
from .runtime import Transformer, build_model
from .sources import ModelSource, cache_root, resolve
from .tokenizer import Tokenizer


@dataclass
class LoadedModel:
    name: str
    model: Transformer
    tokenizer: Tokenizer
    config: ModelConfig


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: str | torch.dtype, device: str) -> torch.dtype:
    """"auto": bfloat16 on CUDA and on CPUs with native bf16 matmul (AVX512-BF16/AMX), else float32.

    Why bf16 on such CPUs: decoding is bandwidth-bound, and there oneDNN's bf16 kernels verify k+1
    tokens in about the time of one, while fp32 small-batch GEMMs run 2-3x slower than fp32 GEMV.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if str(device).startswith("cuda") or _cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    try:
        return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16") from None


def _cpu_has_native_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()) and "avx512_bf16" in _cpu_flags() \
            or "amx_bf16" in _cpu_flags()
    except Exception:
        return False


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def load_tokenizer(name: str) -> Tokenizer:
    """Only the tokenizer of a model (bundled name, GGUF file, checkpoint folder or hub id)."""
    source = resolve(name)
    if source.format == "gguf":
        return Tokenizer.from_gguf(source.path, _cache_dir_for(source, "tokenizer"))
    return Tokenizer.from_pretrained(source.path)


def load_model(name: str, device: str | None = None, dtype: str | torch.dtype = "auto",
               progress: bool = True) -> LoadedModel:
    device = device or default_device()
    torch_dtype = resolve_dtype(dtype, device)
    cfg, tensors = load_weights(name, torch_dtype, progress)
    tokenizer = load_tokenizer(name)
    model = build_model(cfg, tensors, torch_dtype, device)
    return LoadedModel(name, model, tokenizer, cfg)


def load_weights(name: str, dtype: torch.dtype, progress: bool = True) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The architecture and the weights, named as in Hugging Face checkpoints (GGUF is dequantized)."""
    source = resolve(name)
    if source.format == "gguf":
        return _load_gguf_cached(source, dtype, progress)
    return _load_hf_checkpoint(source.path)


def _cache_dir_for(source: ModelSource, kind: str) -> str:
    st = os.stat(source.path)
    key = hashlib.sha1(f"{os.path.abspath(source.path)}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    path = os.path.join(cache_root(), kind, f"{os.path.basename(source.path)}-{key}")
    os.makedirs(path, exist_ok=True)
    return path


def _load_gguf_cached(source: ModelSource, dtype: torch.dtype, progress: bool):
    """Dequantizing takes ~15 s for 1.5B parameters; the result is kept as safetensors per dtype."""
    from safetensors.torch import load_file, save_file

    from .gguf_loader import load_gguf

    folder = _cache_dir_for(source, "weights")
    weights = os.path.join(folder, f"{str(dtype).removeprefix('torch.')}.safetensors")
    config_path = os.path.join(folder, "config.json")
    if os.path.exists(weights) and os.path.exists(config_path):
        return ModelConfig(**json.load(open(config_path))), load_file(weights)
    cfg, tensors = load_gguf(source.path, progress)
    tensors = {k: v.to(dtype) for k, v in tensors.items()}
    try:
        save_file(tensors, weights + ".tmp")
        os.replace(weights + ".tmp", weights)
        json.dump(cfg.__dict__, open(config_path, "w"))
    except OSError:
        pass  # a full or read-only disk only costs the next load its speed
    return cfg, tensors


def _load_hf_checkpoint(folder: str):
    from safetensors.torch import load_file

    cfg = ModelConfig.from_hf_dict(json.load(open(os.path.join(folder, "config.json"))))
    tensors: dict[str, torch.Tensor] = {}
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {folder}; convert the checkpoint to safetensors")
    for f in files:
        tensors.update(load_file(os.path.join(folder, f)))
    return cfg, tensors
