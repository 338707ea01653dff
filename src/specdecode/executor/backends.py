"""Backends: how a model's linear layers compute, chosen per device and per CPU capability.

- "none": floating weights in the model's dtype (bfloat16 where the CPU has native bf16 or on CUDA,
  float32 elsewhere).
- "w8a8": int8 weights x int8 activations per row, by FBGEMM (x86 CPUs). Float32 activations around it.
- "w8a16": int8 weights with bfloat16 activations (CPUs with native bf16).
- "w4a8": GGUF Q4_K and Q6_K weights kept as stored (4.5 and 6.56 bits) times int8 activations (a scale
  per 32 values), by this package's kernels (AVX2 or AVX512-VNNI); the file's other formats as in w8a8.
- "w4a8-all": every linear weight in 4 bits, requantized where the file stores more. Lossy beyond the
  file: the default for draft models, whose weights only propose (verification keeps the output exact).

"auto" takes w4a8 where its kernel builds, else w8a8 on x86 CPUs (both stream far fewer bytes than
float and verify k+1 tokens for little more than one), and bf16 on CUDA; docs/decisions.md has the
measurements.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from gguf import GGMLQuantizationType
from torch import nn

from ..config import QUANTIZATIONS, ModelConfig
from ..errors import SpecDecodeError
from ..models.gguf_loader import RawTensor
from ..models.runtime import Linear, RotaryEmbedding, Transformer, hf_parts
from .cpu import cpu_flags, cpu_has_native_bf16
from .quant import (ConcatLinear, Int8Embedding, W4A8Linear, W6A8Linear, W8A8Linear, W8A16Linear, pack_w4a8,
                    pack_w6a8, quantize_4bit, quantize_rows, split_q4_k, split_q6_k, w4a8_packable, w4a8_supported,
                    w6a8_packable, w8a8_supported, w8a16_supported)

INT8_LINEAR = {"w8a8": W8A8Linear, "w8a16": W8A16Linear, "w4a8": W8A8Linear, "w4a8-all": W8A8Linear}


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


def resolve_quantization(name: str, device: str | torch.device, draft: bool = False) -> str:
    """The quantization that `name` means on this device; "auto" is the fastest measured one (for a
    draft, which may be lossy, every weight in 4 bits)."""
    if name not in QUANTIZATIONS:
        raise SpecDecodeError(f"unknown quantization {name!r}; use one of {', '.join(QUANTIZATIONS)}")
    on_cpu = torch.device(device).type == "cpu"
    if name == "auto":
        if not (on_cpu and w8a8_supported()):
            return "none"
        return ("w4a8-all" if draft else "w4a8") if w4a8_supported() else "w8a8"
    if name in ("w8a8", "w4a8", "w4a8-all") and not (on_cpu and w8a8_supported()):
        raise SpecDecodeError(f"{name} needs FBGEMM on an x86 CPU; use --quantization none (or w8a16)")
    if name.startswith("w4a8") and not w4a8_supported():
        raise SpecDecodeError("w4a8 needs a C compiler (cc) and a CPU with AVX2 and FMA; use --quantization w8a8")
    if name == "w8a16" and not w8a16_supported(device):
        raise SpecDecodeError(f"w8a16 has no kernel on {device}; use --quantization none")
    return name


def activation_dtype(quantization: str, dtype: str | torch.dtype, device) -> torch.dtype:
    """FBGEMM and the w4a8 kernel take and return float32; the weight-only int8 kernel is fast with bf16 only."""
    if quantization in ("w8a8", "w4a8", "w4a8-all"):
        return torch.float32
    if quantization == "w8a16":
        return torch.bfloat16
    return resolve_dtype(dtype, device)


def is_linear_weight(name: str) -> bool:
    """HF names of the weights that low-bit formats quantize (the embedding too: it may be the LM head)."""
    return name.endswith("_proj.weight") or name in ("lm_head.weight", "model.embed_tokens.weight")


def quantize_weights(named: Iterable[tuple[str, torch.Tensor | RawTensor]], qmax: int,
                     all_4bit: bool = False) -> dict[str, torch.Tensor]:
    """Linear weights to int8 rows (+ `weight_scale`), or to the w4a8 kernel's layout (`weight.q`, `.sc`,
    `.mn`, `.d`, `.dmin`) when they come as GGUF Q4_K blocks or `all_4bit` asks for it, one tensor at a
    time as they stream in, so the float model never exists whole; everything else stays float32."""
    out = {}
    for name, tensor in named:
        four_bit = name != "model.embed_tokens.weight" and is_linear_weight(name)
        if isinstance(tensor, RawTensor):
            packed = _pack_as_stored(tensor) if is_linear_weight(name) and name != "model.embed_tokens.weight" \
                else None
            if packed is not None:
                out.update({f"{name}.{k}": v for k, v in packed.items()})
                continue
            tensor = _dequantize_raw(tensor)
        if all_4bit and four_bit and w4a8_packable(tensor.shape[1], tensor.shape[0]):
            out.update({f"{name}.{k}": v for k, v in pack_w4a8(quantize_4bit(tensor)).items()})
        elif is_linear_weight(name):
            out[name], out[name + "_scale"] = quantize_rows(tensor, qmax)
        else:
            out[name] = tensor.float()
    return out


def _pack_as_stored(raw: RawTensor) -> dict[str, torch.Tensor] | None:
    """A GGUF tensor in the layout of the kernel for its format (None where no kernel takes it)."""
    rows = raw.blocks.shape[0]
    if raw.qtype == GGMLQuantizationType.Q4_K and w4a8_packable(raw.columns, rows):
        return pack_w4a8(split_q4_k(raw.blocks))
    if raw.qtype == GGMLQuantizationType.Q6_K and w6a8_packable(raw.columns, rows):
        return pack_w6a8(split_q6_k(raw.blocks))
    return None


def _dequantize_raw(raw: RawTensor) -> torch.Tensor:
    from gguf.quants import dequantize

    return torch.from_numpy(dequantize(raw.blocks.numpy(), raw.qtype).reshape(-1, raw.columns).copy())


def build_quantized_model(cfg: ModelConfig, tensors: dict[str, torch.Tensor], quantization: str,
                          device) -> Transformer:
    """A Transformer whose linear layers (and embedding) are low-bit in the given format."""
    dtype = activation_dtype(quantization, "auto", device)
    with torch.device("meta"):
        model = Transformer(cfg)
    if _stored_format(tensors, "lm_head") is None and "lm_head.weight" not in tensors:  # tied: the embedding
        tensors = {**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"],
                   "lm_head.weight_scale": tensors["model.embed_tokens.weight_scale"]}
    for name, module in list(model.named_modules()):
        if isinstance(module, Linear):
            _set_module(model, name, _linear(tensors, hf_parts(name), quantization, device, dtype))
    embed = "model.embed_tokens."
    model.embed_tokens = Int8Embedding(tensors[embed + "weight"].to(device), tensors[embed + "weight_scale"].to(device),
                                       dtype)
    norms = {"norm.weight": tensors["model.norm.weight"]}
    for i in range(cfg.num_layers):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            norms[f"layers.{i}.{norm}.weight"] = tensors[f"model.layers.{i}.{norm}.weight"]
    params = {k: nn.Parameter(v.to(device=device, dtype=dtype), requires_grad=False) for k, v in norms.items()}
    model.load_state_dict(params, assign=True, strict=False)
    model.rotary = RotaryEmbedding(cfg.dim_per_head, cfg.rope_theta).to(device)
    model.backend = f"{torch.device(device).type} {quantization}"
    return model.eval()


def _linear(tensors: dict[str, torch.Tensor], parts: list[str], quantization: str, device, dtype,
            with_bias: bool = True) -> nn.Module:
    """One layer for HF layers whose output rows are stacked; parts stored in different formats (a Q6_K
    v beside Q4_K q and k) become one layer each, side by side, under one bias."""
    biases = [tensors.get(f"{p}.bias") for p in parts]
    bias = None if biases[0] is None or not with_bias else torch.cat(biases).to(device=device, dtype=dtype)
    formats = {_stored_format(tensors, p) for p in parts}
    if formats in ({W4A8Linear}, {W6A8Linear}):
        layer = formats.pop()
        arrays = {key: torch.cat([tensors[f"{p}.weight.{key}"] for p in parts]) for key in layer.NAMES}
        return layer(arrays, bias)
    if formats == {None}:
        q = torch.cat([tensors[f"{p}.weight"] for p in parts]).to(device)
        scale = torch.cat([tensors[f"{p}.weight_scale"] for p in parts]).to(device)
        layer = INT8_LINEAR[quantization]
        return layer(q, scale, bias) if layer is W8A8Linear else layer(q, scale, bias, dtype)
    return ConcatLinear([_linear(tensors, [p], quantization, device, dtype, with_bias=False) for p in parts], bias)


def _stored_format(tensors: dict[str, torch.Tensor], part: str) -> type[nn.Module] | None:
    """The kernel layer whose layout a weight was packed in (None: int8 rows)."""
    for layer in (W4A8Linear, W6A8Linear):
        if f"{part}.weight.{layer.NAMES[0]}" in tensors:
            return layer
    return None


def _set_module(root: nn.Module, dotted: str, module: nn.Module) -> None:
    parent, _, child = dotted.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)
