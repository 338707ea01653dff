"""Backends: how a model's linear layers compute, chosen per device and per CPU capability.

- "none": floating weights in the model's dtype (bfloat16 where the CPU has native bf16 or on CUDA,
  float32 elsewhere).
- "w8a8": int8 weights x int8 activations per row, by FBGEMM (x86 CPUs). Float32 activations around it.
- "w8a16": int8 weights with bfloat16 activations (CPUs with native bf16).

"auto" takes w8a8 on x86 CPUs: it streams a quarter of float32's bytes (half of bf16's) and verifies
k+1 tokens for about the cost of one on both AVX2 and AVX-512 machines (docs/decisions.md has the
measurements), and bf16 on CUDA.
"""
from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
from torch import nn

from ..config import ModelConfig
from ..errors import SpecDecodeError
from ..models.runtime import Linear, RotaryEmbedding, Transformer, fuse_hf_weights
from .quant import Int8Embedding, W8A8Linear, W8A16Linear, quantize_rows, w8a8_supported, w8a16_supported

QUANTIZATIONS = ("auto", "none", "w8a8", "w8a16")


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def cpu_has_native_bf16() -> bool:
    try:
        mkldnn_bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:
        return False
    return mkldnn_bf16 and ("avx512_bf16" in cpu_flags() or "amx_bf16" in cpu_flags())


def int8_weight_max() -> int:
    """Largest |int8 weight| for W8A8. Without AVX512-VNNI, FBGEMM multiplies u8 activations by s8 weights
    with vpmaddubsw, which adds pairs of products in int16 and saturates past 32767 (2 x 255 x 127 does);
    7-bit weights (2 x 255 x 63 = 32130) keep every sum exact. VNNI sums in int32."""
    return 127 if "avx512_vnni" in cpu_flags() else 63


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device) -> torch.dtype:
    """"auto": bfloat16 on CUDA and on CPUs with native bf16 matmul (AVX512-BF16/AMX), else float32.

    Why bf16 on such CPUs: decoding is bandwidth-bound, and there oneDNN's bf16 kernels verify k+1
    tokens in about the time of one, while fp32 small-batch GEMMs run 2-3x slower than fp32 GEMV.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if str(device).startswith("cuda") or cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    try:
        return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}[dtype]
    except KeyError:
        raise SpecDecodeError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16") from None


def resolve_quantization(name: str, device: str | torch.device) -> str:
    """The quantization that `name` means on this device; "auto" is the fastest measured one."""
    if name not in QUANTIZATIONS:
        raise SpecDecodeError(f"unknown quantization {name!r}; use one of {', '.join(QUANTIZATIONS)}")
    on_cpu = torch.device(device).type == "cpu"
    if name == "auto":
        return "w8a8" if on_cpu and w8a8_supported() else "none"
    if name == "w8a8" and not (on_cpu and w8a8_supported()):
        raise SpecDecodeError("w8a8 needs FBGEMM on an x86 CPU; use --quantization none (or w8a16)")
    if name == "w8a16" and not w8a16_supported(device):
        raise SpecDecodeError(f"w8a16 has no kernel on {device}; use --quantization none")
    return name


def activation_dtype(quantization: str, dtype: str | torch.dtype, device) -> torch.dtype:
    """FBGEMM takes and returns float32; the weight-only int8 kernel is fast with bf16 only."""
    if quantization == "w8a8":
        return torch.float32
    if quantization == "w8a16":
        return torch.bfloat16
    return resolve_dtype(dtype, device)


def is_linear_weight(name: str) -> bool:
    """HF names of the weights that low-bit formats quantize (the embedding too: it may be the LM head)."""
    return name.endswith("_proj.weight") or name in ("lm_head.weight", "model.embed_tokens.weight")


def quantize_weights(named: Iterable[tuple[str, torch.Tensor]], qmax: int) -> dict[str, torch.Tensor]:
    """Quantize linear weights to int8 rows (+ `weight_scale`) one tensor at a time, as they stream in,
    so the float model never exists whole; everything else stays float32."""
    out = {}
    for name, tensor in named:
        if is_linear_weight(name):
            out[name], out[name + "_scale"] = quantize_rows(tensor, qmax)
        else:
            out[name] = tensor.float()
    return out


def build_quantized_model(cfg: ModelConfig, tensors: dict[str, torch.Tensor], quantization: str,
                          device) -> Transformer:
    """A Transformer whose linear layers (and embedding) are int8 in the given format."""
    dtype = activation_dtype(quantization, "auto", device)
    with torch.device("meta"):
        model = Transformer(cfg)
    fused = fuse_hf_weights(cfg, tensors)
    for name, module in list(model.named_modules()):
        if isinstance(module, Linear):
            q, scale = fused.pop(name + ".weight"), fused.pop(name + ".weight_scale")
            bias = fused.pop(name + ".bias", None)
            bias = None if bias is None else bias.to(device=device, dtype=dtype)
            layer = W8A8Linear(q, scale, bias) if quantization == "w8a8" else \
                W8A16Linear(q.to(device), scale.to(device), bias, dtype)
            _set_module(model, name, layer)
    model.embed_tokens = Int8Embedding(fused.pop("embed_tokens.weight").to(device),
                                       fused.pop("embed_tokens.weight_scale").to(device), dtype)
    rest = {k: nn.Parameter(v.to(device=device, dtype=dtype), requires_grad=False) for k, v in fused.items()}
    model.load_state_dict(rest, assign=True, strict=False)
    model.rotary = RotaryEmbedding(cfg.dim_per_head, cfg.rope_theta).to(device)
    model.backend = f"{device.type if isinstance(device, torch.device) else device} {quantization}"
    return model.eval()


def _set_module(root: nn.Module, dotted: str, module: nn.Module) -> None:
    parent, _, child = dotted.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)
