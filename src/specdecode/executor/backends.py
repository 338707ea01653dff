"""Backends: how a model's linear layers compute, chosen per device and per CPU capability.

- "none": floating weights in the model's dtype (bfloat16 where the CPU has native bf16 or on CUDA,
  float32 elsewhere).
- "w4a8": GGUF weights as the file stores them (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q3_K, Q4_K, Q5_K, Q6_K) times
  int8 activations with a scale per 32 values, by this package's kernel (scalar C, AVX2, AVX-512 VNNI);
  float weights (checkpoints, F16 tensors) as Q8_0. Computed as llama.cpp's CPU backend pairs them.
- "w4a16": the same weights; activations in two int8 passes (x, then what x's int8 blocks missed), ~15
  significant bits, for twice the integer work per weight read: float's answers from small models, whose
  next tokens int8 activations flip more often.
- "w8a8": every linear weight as Q8_0 (8 bits with a scale per 32), the same kernel.
- "w8a16": int8 weights with bfloat16 activations (CPUs with native bf16).
- "w4a8-all": every linear weight in 4 bits, requantized where the file stores another format. Lossy
  beyond the file: the default for draft models, whose weights only propose (verification keeps the
  output exact).

"auto" takes w4a8 where the kernel builds with SIMD (it streams far fewer bytes than float and verifies
k+1 tokens for little more than one), float elsewhere, and bf16 on CUDA
(docs/decisions.md#linear-layers-gguf-block-formats-as-stored has the measurements).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable

import torch
from torch import nn

from ..config import QUANTIZATIONS, ModelConfig
from ..errors import SpecDecodeError
from ..models.gguf_loader import RawTensor
from ..models.runtime import Linear, Transformer, check_all_used, hf_parts
from .cpu import cpu_has_native_bf16
from .experts import attach_experts_kernels
from .formats import EXACTLY_AS_Q8_0, FORMATS, BlockArrays, quantize_4bit, quantize_q8_0, split
from .quant import (
    BlockEmbedding,
    BlockLinear,
    ConcatLinear,
    W8A16Linear,
    block_linear_from,
    lowbit_isa,
    quantize_rows,
    stored_layer_tensors,
    w8a16_supported,
)

LOW_BIT = ("w8a8", "w4a8", "w4a16", "w4a8-all")  # the block kernel's backends


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device) -> torch.dtype:
    """ "auto": bfloat16 on CUDA and on CPUs with native bf16 matmul (AVX512-BF16/AMX), else float32.

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
        return {
            "float32": torch.float32,
            "fp32": torch.float32,
            "bfloat16": torch.bfloat16,
            "bf16": torch.bfloat16,
            "float16": torch.float16,
            "fp16": torch.float16,
        }[dtype]
    except KeyError:
        raise SpecDecodeError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16") from None


def resolve_quantization(name: str, device: str | torch.device, draft: bool = False) -> str:
    """The quantization that `name` means on this device; "auto" is the fastest measured one (for a
    draft, which may be lossy, every weight in 4 bits)."""
    from .kernels import build_problem, default_isa

    if name not in QUANTIZATIONS:
        raise SpecDecodeError(f"unknown quantization {name!r}; use one of {', '.join(QUANTIZATIONS)}")
    on_cpu = torch.device(device).type == "cpu"
    isa = lowbit_isa() if on_cpu else -1
    if name == "auto":
        if isa > 0 or (isa == 0 and default_isa() == "scalar"):
            return "w4a8-all" if draft else "w4a8"
        if on_cpu and isa < 0:
            warnings.warn(f"low-bit kernel unavailable, computing in float: {build_problem('lowbit')}", stacklevel=2)
        return "none"
    if name in LOW_BIT and not on_cpu:
        raise SpecDecodeError(f"{name} runs on the CPU; use --quantization none on {device}")
    if name in LOW_BIT and isa < 0:
        raise SpecDecodeError(
            f"{name} needs the low-bit kernel, which is unavailable here: "
            f"{build_problem('lowbit')}\nuse --quantization none"
        )
    if name == "w8a16" and not w8a16_supported(device):
        raise SpecDecodeError(f"w8a16 has no kernel on {device}; use --quantization none")
    return name


# Below this many layer parameters, `auto` computes a target's activations in two int8 passes (w4a16): a
# model this small flips a few percent of its next tokens under int8 activations, and its step is cheap
# (docs/decisions.md#w4a16-two-activation-passes-for-small-models: SmolLM2-135M, 106M, 96.5% -> 100.0%
# top-1 for ~8% step time; the 0.5B, 358M, keeps 98.2% with w4a8, where a second pass would double its verify
# cost).
SMALL_MODEL_PARAMETERS = 200_000_000


def refine_for_model(quantization: str, cfg: ModelConfig, requested: str) -> str:
    """What an `auto` target computes in once its size is known."""
    if requested == "auto" and quantization == "w4a8" and cfg.layer_parameters < SMALL_MODEL_PARAMETERS:
        return "w4a16"
    return quantization


def weight_layout(quantization: str) -> str:
    """The stored weights a backend reads (w4a16 differs from w4a8 only in its activations)."""
    return "w4a8" if quantization == "w4a16" else quantization


def activation_dtype(quantization: str, dtype: str | torch.dtype, device) -> torch.dtype:
    """The block kernel takes and returns float32; the weight-only int8 kernel is fast with bf16 only."""
    if quantization in LOW_BIT:
        return torch.float32
    if quantization == "w8a16":
        return torch.bfloat16
    return resolve_dtype(dtype, device)


def is_linear_weight(name: str) -> bool:
    """HF names of the weights that low-bit formats quantize (the embedding too: it may be the LM head)."""
    return name.endswith("_proj.weight") or name in ("lm_head.weight", "model.embed_tokens.weight")


def quantize_weights(
    named: Iterable[tuple[str, torch.Tensor | RawTensor]], quantization: str
) -> dict[str, torch.Tensor]:
    """Linear weights (and the embedding) in the kernel's layout for `quantization` (for w8a16, int8 rows
    with a `weight_scale`), one tensor at a time as they stream in, so the float model never exists whole;
    everything else float32."""
    out = {}
    for name, tensor in named:
        if not is_linear_weight(name):
            out[name] = _as_float(tensor)
        elif quantization == "w8a16":
            weight = _as_float(tensor)
            if name == "model.embed_tokens.weight":
                out[name] = weight
            else:
                out[name], out[name + "_scale"] = quantize_rows(weight)
        else:
            out.update(stored_layer_tensors(name, block_arrays(name, tensor, quantization)))
    return out


def block_arrays(name: str, tensor: torch.Tensor | RawTensor, quantization: str) -> BlockArrays:
    """One weight in the block format `quantization` computes it in (see the module's docstring)."""
    as_stored = isinstance(tensor, RawTensor) and tensor.qtype.name in FORMATS
    layout = weight_layout(quantization)
    if as_stored and (
        layout == "w4a8"
        or name == "model.embed_tokens.weight"
        or tensor.qtype.name == {"w8a8": "Q8_0", "w4a8-all": "Q4_K"}[layout]
    ):
        return split(tensor.qtype, tensor.blocks)
    if isinstance(tensor, RawTensor) and tensor.qtype.name in EXACTLY_AS_Q8_0 and layout != "w4a8-all":
        return EXACTLY_AS_Q8_0[tensor.qtype.name](tensor.blocks)
    weight = _as_float(tensor)
    if weight.shape[1] % 32:
        raise SpecDecodeError(
            f"{name}: {weight.shape[1]} columns, not a multiple of 32, which the low-bit "
            "kernel needs; use --quantization none"
        )
    if quantization == "w4a8-all" and name != "model.embed_tokens.weight":
        return quantize_4bit(weight)
    return quantize_q8_0(weight)


def _as_float(tensor: torch.Tensor | RawTensor) -> torch.Tensor:
    if not isinstance(tensor, RawTensor):
        return tensor.float()
    from gguf.quants import dequantize

    return torch.from_numpy(dequantize(tensor.blocks.numpy(), tensor.qtype).reshape(-1, tensor.columns).copy())


def build_quantized_model(cfg: ModelConfig, tensors: dict[str, torch.Tensor], quantization: str, device) -> Transformer:
    """A Transformer whose linear layers (and embedding) are low-bit in the given format; its norms and
    routers in float."""
    dtype = activation_dtype(quantization, "auto", device)
    with torch.device("meta"):
        model = Transformer(cfg)
    embed = "model.embed_tokens.weight"
    table = block_linear_from(tensors, embed) if quantization in LOW_BIT else None
    used = {"model.embed_tokens", "lm_head", "model.rope_freqs"}
    for name, module in list(model.named_modules()):
        if isinstance(module, Linear):
            parts = hf_parts(name)
            used.update(parts)
            if parts == ["lm_head"] and not _has_weight(tensors, "lm_head"):  # tied: the embedding table
                layer = table or W8A16Linear(*quantize_rows(tensors[embed].to(device)), None, dtype)
            else:
                layer = _linear(tensors, parts, quantization, device, dtype)
            _set_module(model, name, layer)
    model.embed_tokens = (
        BlockEmbedding(table, dtype)
        if table is not None
        else nn.Embedding.from_pretrained(tensors[embed].to(device=device, dtype=dtype), freeze=True)
    )
    floats = {name: tensors[f"model.{name}"] for name, p in model.named_parameters() if p.is_meta}
    used.update(_module_of(f"model.{name}") for name in floats)  # norms, routers (and gpt-oss's sinks, no .weight)
    params = {k: nn.Parameter(v.to(device=device, dtype=dtype), requires_grad=False) for k, v in floats.items()}
    model.load_state_dict(params, assign=True, strict=False)
    check_all_used({_module_of(n) for n in tensors}, used)
    model.set_rotary(tensors.get("model.rope_freqs"), device)
    if quantization == "w4a16":
        for module in model.modules():
            if isinstance(module, BlockLinear):
                module.passes = 2
    if quantization in LOW_BIT:
        attach_experts_kernels(model, 2 if quantization == "w4a16" else 1)
    model.backend = f"{torch.device(device).type} {quantization}"
    return model.eval()


def _module_of(tensor_name: str) -> str:
    """ "model.layers.0.mlp.up_proj.weight.lo" -> "model.layers.0.mlp.up_proj" (a layer's stored arrays too)."""
    return re.sub(r"\.(weight|bias)([._]\w+)*$", "", tensor_name)


def _has_weight(tensors: dict[str, torch.Tensor], part: str) -> bool:
    return f"{part}.weight.format" in tensors or f"{part}.weight" in tensors


def _linear(tensors: dict[str, torch.Tensor], parts: list[str], quantization: str, device, dtype) -> nn.Module:
    """One layer for HF layers whose output rows are stacked (q/k/v, gate/up), under one bias; parts
    stored in different formats (a Q6_K v beside Q4_K q and k) stay one layer each, side by side."""
    biases = [tensors.get(f"{p}.bias") for p in parts]
    bias = None if biases[0] is None else torch.cat(biases).to(device=device, dtype=dtype)
    if quantization == "w8a16":
        q, scale = (torch.cat([tensors[f"{p}.weight{suffix}"] for p in parts]).to(device) for suffix in ("", "_scale"))
        return W8A16Linear(q, scale, bias, dtype)
    layers = [block_linear_from(tensors, f"{p}.weight") for p in parts]
    first = layers[0]
    if len(layers) == 1:
        first.bias = bias
        return first
    if all(x.format == first.format and x.S == first.S and x.rows == x.out_features for x in layers):
        buffers = [x.packed_buffers() for x in layers]
        fused = BlockLinear(
            packed={k: torch.cat([b[k] for b in buffers]) for k in buffers[0]},
            fmt=first.format,
            S=first.S,
            out_features=sum(x.out_features for x in layers),
        )
        fused.bias = bias
        return fused
    return ConcatLinear(layers, bias)


def _set_module(root: nn.Module, dotted: str, module: nn.Module) -> None:
    parent, _, child = dotted.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)


def prepare_head(head, quantization: str = "auto", kv_cache_dtype: str = "auto"):
    """A draft head on its target's backend: on a low-bit target its own linear layers become Q8_0 (the
    layer is small, so 4 bits would save little time and cost acceptance), and the CPU kernels attach
    (its KV cache in `kv_cache_dtype`, as the target's)."""
    from .attention import attach_attention_kernel
    from .decoder import attach_decoder_kernel
    from .elementwise import attach_elementwise_kernels
    from .hugepages import move_to_huge_pages

    if head.dtype != torch.float32:  # a bfloat16 target: the head's own layers compute in its dtype too
        for name in head.OWNED:
            getattr(head, name).to(head.dtype)
    if isinstance(head.lm_head, BlockLinear) and quantization != "none":  # the target is low-bit
        for name, module in list(head.named_modules()):
            if isinstance(module, Linear) and module is not head.lm_head:
                _set_module(
                    head,
                    name,
                    BlockLinear(
                        quantize_q8_0(module.weight.detach().float()),
                        None if module.bias is None else module.bias.detach(),
                    ),
                )
        head.backend = f"cpu {quantization} (Q8_0 head)"
    attach_attention_kernel(head, kv_cache_dtype)
    attach_elementwise_kernels(head)
    attach_decoder_kernel(head)
    for p in head.parameters():
        p.requires_grad_(False)
    move_to_huge_pages(head.own_modules())
    return head.eval()
