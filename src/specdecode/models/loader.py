"""Load a model by name: weights (with an on-disk cache of dequantized GGUF weights) and tokenizer."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..config import ModelConfig
from ..errors import SpecDecodeError
from .checkpoints import canonical_hf_weights
from .families import from_hf_config, with_rope_scaling
from .generation_config import recommended_sampling
from .lora import Adapter, attach_adapters, serve_adapter, unserve_adapter
from .runtime import Transformer, build_model
from .sources import ModelSource, cache_root, resolve
from .tokenizer import Tokenizer


@dataclass
class LoadedModel:
    name: str
    model: Transformer
    tokenizer: Tokenizer
    config: ModelConfig
    load_seconds: float = 0.0
    recommended_sampling: dict = field(default_factory=dict)  # its files' (generation_config.recommended_sampling)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_tokenizer(name: str) -> Tokenizer:
    """Only the tokenizer of a model (bundled name, GGUF file, checkpoint folder or hub id)."""
    source = resolve(name)
    if source.format == "gguf":
        return Tokenizer.from_gguf(source.path, _cache_dir_for(source, "tokenizer"))
    return Tokenizer.from_pretrained(source.path)


def load_model(
    name: str,
    device: str | None = None,
    dtype: str | torch.dtype = "auto",
    progress: bool = True,
    quantization: str = "auto",
    draft: bool = False,
    kv_cache_dtype: str = "auto",
    rope_scaling: dict | None = None,
    lora: Sequence[Adapter] = (),
    served_lora: dict[str, Adapter] | None = None,
    lora_dtype: str = "auto",
) -> LoadedModel:
    """quantization: "auto" (the fastest measured for this machine; for a `draft`, which may be lossy,
    every weight in 4 bits), "none" (floating weights in `dtype`), or a low-bit format of
    executor.backends (w4a8, w4a16, w4a8-all, w8a8, w8a16). kv_cache_dtype: see executor.attention.
    rope_scaling: config.json's fields of a RoPE scaling for a model that has none (families.with_rope_scaling).
    lora: adapters whose updates the model's layers add (models/lora.py); served_lora: adapters by name, each added
    for the requests that name it; lora_dtype: the format their matrices are kept in (config.py's LORA_DTYPES)."""
    from ..executor.attention import attach_attention_kernel
    from ..executor.backends import build_quantized_model, refine_for_model, resolve_dtype, resolve_quantization
    from ..executor.decoder import attach_decoder_kernel
    from ..executor.elementwise import attach_elementwise_kernels
    from ..executor.hugepages import move_to_huge_pages

    device = device or default_device()
    requested, quantization = quantization, resolve_quantization(quantization, device, draft)
    started = time.perf_counter()
    if quantization == "none":
        torch_dtype = resolve_dtype(dtype, device)
        native, tensors = load_weights(name, torch_dtype, progress)
        cfg = with_rope_scaling(native, rope_scaling)
        model = build_model(cfg, tensors, torch_dtype, device)
        model.backend = f"{torch.device(device).type} {str(torch_dtype).removeprefix('torch.')}"
    else:
        native, tensors = load_low_bit_weights(name, quantization, progress)
        cfg = with_rope_scaling(native, rope_scaling)
        model = build_quantized_model(cfg, tensors, refine_for_model(quantization, cfg, requested), device)
    del tensors
    model.lora_dtype = lora_dtype  # adapters served later too (load_served_adapter)
    if lora or served_lora:
        _adapt(model, lora, served_lora or {}, lora_dtype)
    model.native_cfg = native  # its identity (a draft head's fingerprint of it) whatever RoPE scaling it runs with
    attach_attention_kernel(model, kv_cache_dtype)
    attach_elementwise_kernels(model)
    attach_decoder_kernel(model)
    move_to_huge_pages(model)
    tokenizer = load_tokenizer(name)
    recommended = _recommended_sampling(resolve(name))
    return LoadedModel(name, model, tokenizer, cfg, time.perf_counter() - started, recommended)


def _adapt(model, adapters: Sequence[Adapter], served: dict[str, Adapter], dtype: str) -> None:
    """The adapters on the model's layers, before the kernels attach (the one-call decoder reads each adapted
    projection's adapter sets)."""
    _on_the_cpu(model)
    from ..executor.lora_kernel import attach_lora_kernel

    layers = attach_adapters(model, adapters, served, dtype)
    attach_lora_kernel(model)
    model.backend += f" + LoRA ({layers} layers" + (f", {len(served)} served by name)" if served else ")")
    model.adapters = [adapter.identity() for adapter in adapters]  # what a recording of its features is keyed by


def _on_the_cpu(model) -> None:
    if model.device.type != "cpu":
        raise SpecDecodeError(
            "LoRA adapters run on the CPU for now; leave out --lora and --lora-modules, or run with --device cpu"
        )


def load_served_adapter(model, name: str, adapter: Adapter) -> None:
    """Serve one more adapter by name on a loaded model, while it serves (the runner reads its route again)."""
    _on_the_cpu(model)
    serve_adapter(model, name, adapter)
    _kernels_again(model)


def unload_served_adapter(model, name: str) -> None:
    unserve_adapter(model, name)
    _kernels_again(model)


def _kernels_again(model) -> None:
    """The LoRA kernel on the adapted layers, and the one-call decoder (where the model has it) describing them
    anew."""
    from ..executor.decoder import attach_decoder_kernel
    from ..executor.lora_kernel import attach_lora_kernel

    attach_lora_kernel(model)
    if getattr(model, "layers_kernel", None) is not None:
        attach_decoder_kernel(model)


def load_weights(name: str, dtype: torch.dtype, progress: bool = True) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The architecture and the weights, named as in Hugging Face checkpoints (GGUF is dequantized)."""
    source = resolve(name)
    if source.format == "gguf":
        return _load_gguf_cached(source, dtype, progress)
    return _load_hf_checkpoint(source.path)


def load_low_bit_weights(
    name: str, quantization: str, progress: bool = True
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Linear weights (and the embedding) in the block kernel's layout (GGUF formats as stored for w4a8;
    see executor.backends), or int8 rows with a `weight_scale` for w8a16; the rest float32.

    A GGUF file streams one tensor at a time, so the float model never exists whole; the result is
    cached (about what the file holds), so later loads only read it back."""
    from gguf import GGMLQuantizationType

    from ..executor.backends import LOW_BIT, quantize_weights, weight_layout
    from ..executor.formats import EXACTLY_AS_Q8_0, FORMATS

    quantization = weight_layout(quantization)
    source = resolve(name)
    if source.format != "gguf":
        cfg, tensors = _load_hf_checkpoint(source.path)
        return cfg, quantize_weights(tensors.items(), quantization)
    folder = _cache_dir_for(source, "weights")
    # v4: every GGUF block format in the block kernel's layout, the runtime's names for every family; a layout
    # or naming change must not read an older file
    path = os.path.join(folder, f"{quantization}-v4.safetensors")
    config_path = os.path.join(folder, "config.json")
    if os.path.exists(path) and os.path.exists(config_path):
        from safetensors.torch import load_file

        return ModelConfig(**json.load(open(config_path))), load_file(path)
    from .gguf_loader import iter_gguf_tensors

    # GGUF blocks the kernel takes as stored or holds exactly in another format; everything else arrives as float
    raw = {GGMLQuantizationType[f] for f in (*FORMATS, *EXACTLY_AS_Q8_0)}
    raw = frozenset(raw) if quantization in LOW_BIT else frozenset()
    cfg, named = iter_gguf_tensors(source.path, progress, raw)
    tensors = quantize_weights(named, quantization)
    _save_cache(tensors, path, cfg, config_path)
    return cfg, tensors


def _recommended_sampling(source: ModelSource) -> dict:
    """The sampling the model's files recommend; a GGUF's read once (reading its metadata takes seconds) and kept."""
    if source.format != "gguf":
        return recommended_sampling(source)
    saved = os.path.join(_cache_dir_for(source, "sampling"), "recommended.json")
    if os.path.exists(saved):
        with open(saved) as f:
            return json.load(f)
    found = recommended_sampling(source)
    with open(saved, "w") as f:
        json.dump(found, f)
    return found


def _cache_dir_for(source: ModelSource, kind: str) -> str:
    st = os.stat(source.path)
    key = hashlib.sha1(f"{os.path.abspath(source.path)}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    path = os.path.join(cache_root(), kind, f"{os.path.basename(source.path)}-{key}")
    os.makedirs(path, exist_ok=True)
    return path


def _load_gguf_cached(source: ModelSource, dtype: torch.dtype, progress: bool):
    """Dequantizing takes ~15 s for 1.5B parameters; the result is kept as safetensors per dtype."""
    from safetensors.torch import load_file

    from .gguf_loader import iter_gguf_tensors

    folder = _cache_dir_for(source, "weights")
    weights = os.path.join(folder, f"{str(dtype).removeprefix('torch.')}-v4.safetensors")
    config_path = os.path.join(folder, "config.json")
    if os.path.exists(weights) and os.path.exists(config_path):
        return ModelConfig(**json.load(open(config_path))), load_file(weights)
    cfg, named = iter_gguf_tensors(source.path, progress)
    tensors = {name: t if name == "model.rope_freqs" else t.to(dtype) for name, t in named}  # factors stay float32
    _save_cache(tensors, weights, cfg, config_path)
    return cfg, tensors


def _save_cache(tensors: dict[str, torch.Tensor], path: str, cfg: ModelConfig, config_path: str) -> None:
    from safetensors.torch import save_file

    try:
        save_file(tensors, path + ".tmp")
        os.replace(path + ".tmp", path)
        json.dump(cfg.__dict__, open(config_path, "w"))
    except OSError:
        pass  # a full or read-only disk only costs the next load its speed


def _load_hf_checkpoint(folder: str):
    from safetensors.torch import load_file

    cfg = from_hf_config(json.load(open(os.path.join(folder, "config.json"))))
    tensors: dict[str, torch.Tensor] = {}
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {folder}; convert the checkpoint to safetensors")
    for f in files:
        tensors.update(load_file(os.path.join(folder, f)))
    return cfg, canonical_hf_weights(cfg, tensors)
