"""LoRA adapters on the target, as llama.cpp's --lora applies them: each adapted linear layer adds scale · B(Ax) to
its output, computed beside its weights rather than merged into them, so weights in a GGUF block format stay as
stored (merging would requantize them) and the layer computes what the adapter's training computed. Adapters come as
a PEFT folder (adapter_config.json and adapter_model.safetensors) or llama.cpp's conversion of one
(convert_lora_to_gguf.py); several add up. One set serves every request."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..config import ModelConfig
from ..errors import SpecDecodeError
from .checkpoints import canonical_hf_weights, gguf_parts, qkv_rows
from .layers import row_by_row_linear
from .runtime import hf_parts

# The runtime's linear layers an adapter may adapt (names under the Transformer)
ADAPTABLE = re.compile(r"layers\.\d+\.(self_attn\.(qkv_proj|o_proj)|mlp\.(gate_up_proj|down_proj))")
# A PEFT adapter's settings that change what it computes, and are not read here
PEFT_REFUSED = {
    "use_dora": "DoRA",
    "modules_to_save": "modules_to_save (layers replaced whole)",
    "fan_in_fan_out": "fan_in_fan_out (GPT-2's transposed layers)",
}


@dataclass(frozen=True)
class Adapter:
    path: str
    scale: float = 1.0  # llama.cpp's --lora-scaled: the adapter's output times this

    def identity(self) -> list:
        """The adapter as its files are now: path, scale, and each file's size and time of change."""
        files = [self.path] if os.path.isfile(self.path) else sorted(os.scandir(self.path), key=lambda e: e.name)
        stats = [os.stat(f) for f in files]
        return [os.path.abspath(self.path), self.scale, [(st.st_size, st.st_mtime_ns) for st in stats]]

    @classmethod
    def parse(cls, spec: str) -> Adapter:
        """PATH, or PATH:SCALE."""
        path, colon, scale = spec.rpartition(":")
        try:
            return cls(path, float(scale)) if colon else cls(spec)
        except ValueError:
            return cls(spec)


# One adapter's matrices by the layer they adapt (its Hugging Face name, "model.layers.3.self_attn.q_proj"):
# A [rank, in] and B [out, rank], B's rows in the order the runtime computes the layer's and its scale folded in
Deltas = dict[str, tuple[torch.Tensor, torch.Tensor]]


def read_adapter(adapter: Adapter, cfg: ModelConfig) -> Deltas:
    if os.path.isdir(adapter.path):
        deltas = _peft_deltas(adapter.path, cfg)
    elif adapter.path.endswith(".gguf") and os.path.isfile(adapter.path):
        deltas = _gguf_deltas(adapter.path, cfg)
    else:
        raise SpecDecodeError(
            f"LoRA adapter {adapter.path!r}: give a PEFT adapter's folder (adapter_config.json and "
            "adapter_model.safetensors) or llama.cpp's .gguf conversion of one"
        )
    return {name: (a, b * adapter.scale) for name, (a, b) in deltas.items()}


def _peft_deltas(folder: str, cfg: ModelConfig) -> Deltas:
    from safetensors.torch import load_file

    settings = _peft_settings(folder)
    weights = os.path.join(folder, "adapter_model.safetensors")
    if not os.path.exists(weights):
        raise SpecDecodeError(f"LoRA adapter {folder}: no adapter_model.safetensors (save it with safe_serialization)")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in load_file(weights).items():
        m = re.fullmatch(r"base_model\.model\.(.+)\.lora_([AB])(?:\.\w+)?\.weight", name)
        if m is None:
            raise SpecDecodeError(f"LoRA adapter {folder}: {name} is not a LoRA matrix of a linear layer")
        pairs.setdefault(m[1], {})[m[2]] = tensor.float()
    deltas = {}
    for module, pair in pairs.items():
        a, b = pair["A"], pair["B"]
        rank = a.shape[0]
        alpha = _matching(settings.get("alpha_pattern") or {}, module, settings.get("lora_alpha", 8))
        scale = alpha / (math.sqrt(rank) if settings.get("use_rslora") else rank)
        for name, rows in canonical_hf_weights(cfg, {f"{module}.weight": b * scale}).items():
            deltas[name.removesuffix(".weight")] = a, rows  # a fused layer's (Phi-3's) A serves each of its parts
    return deltas


def _peft_settings(folder: str) -> dict:
    path = os.path.join(folder, "adapter_config.json")
    if not os.path.exists(path):
        raise SpecDecodeError(f"LoRA adapter {folder}: no adapter_config.json")
    settings = json.load(open(path))
    if settings.get("peft_type", "LORA") != "LORA":
        raise SpecDecodeError(f"LoRA adapter {folder} is a {settings['peft_type']} adapter; only LoRA is read")
    refused = [what for key, what in PEFT_REFUSED.items() if settings.get(key)]
    if settings.get("bias", "none") != "none":
        refused.append(f"bias {settings['bias']!r} (trained biases)")
    if refused:
        raise SpecDecodeError(f"LoRA adapter {folder} uses {', '.join(refused)}, which is not supported")
    return settings


def _matching(patterns: dict, module: str, default):
    """PEFT's per-layer value: the pattern that matches the layer's name (its last parts), else the default."""
    return next((v for key, v in patterns.items() if re.fullmatch(rf"(.*\.)?{key}", module)), default)


def _gguf_deltas(path: str, cfg: ModelConfig) -> Deltas:
    from .families import field
    from .gguf_loader import MappedReader, dequantize_tensor, runtime_rows

    reader = MappedReader(path)
    if field(reader, "general.type") != "adapter" or field(reader, "adapter.type") != "lora":
        raise SpecDecodeError(f"{path} is not a LoRA adapter (general.type 'adapter', adapter.type 'lora')")
    alpha = float(field(reader, "adapter.lora.alpha", 0.0))
    pairs: dict[str, dict[str, object]] = {}
    for t in reader.tensors:
        base, _, part = t.name.rpartition(".")
        if part not in ("lora_a", "lora_b"):
            raise SpecDecodeError(f"{path}: {t.name} is not a LoRA matrix (adapters that replace norms are refused)")
        pairs.setdefault(base, {})[part] = dequantize_tensor(t)
    deltas = {}
    for base, pair in pairs.items():
        a, b = pair["lora_a"], pair["lora_b"]
        scale = alpha / a.shape[0] if alpha else 1.0  # llama.cpp's: an alpha of 0 means none
        for name, rows in gguf_parts(cfg, base, b.shape[0]):
            deltas[name.removesuffix(".weight")] = torch.from_numpy(a.copy()), runtime_rows(cfg, name, b[rows]) * scale
    return deltas


class LowRankAdded(nn.Module):
    """A linear layer and its adapters' low-rank updates: base(x) + B(Ax). Every adapter of every part of a fused
    layer (q/k/v, gate/up) reads the same x, so their A's are one (ranks stacked); each part's B adds to its own
    rows only."""

    kernel = None  # executor/lora_kernel.py's, where it applies: (module, x, y) adds the update to y in place

    def __init__(self, base: nn.Module, lora_a: torch.Tensor, blocks: list[tuple[slice, slice, torch.Tensor]]):
        super().__init__()
        self.base = base
        self.register_buffer("lora_a", lora_a)
        self.spans = [(rows, ranks) for rows, ranks, _ in blocks]  # each B's output rows and ranks of A
        for i, (_, _, b) in enumerate(blocks):
            self.register_buffer(f"lora_b{i}", b.t().contiguous())  # [ranks, rows]: the kernel sums along its rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's update as it would be computed among any others, as the base layer's output is (a token's
        logits the same decoded alone or verified beside drafts)."""
        y = self.base(x)
        if self.kernel is not None and x.dtype == y.dtype == torch.float32 and y.is_contiguous():
            self.kernel(self, x, y)
            return y
        reduced = row_by_row_linear(x, self.lora_a)
        for i, (rows, ranks) in enumerate(self.spans):
            y[..., rows] += row_by_row_linear(reduced[..., ranks], getattr(self, f"lora_b{i}").t()).to(y.dtype)
        return y


def attach_adapters(model: nn.Module, adapters: Sequence[Adapter]) -> int:
    """Wrap each linear layer the adapters adapt in a LowRankAdded; returns how many. An adapter of layers the
    runtime does not compute as linear layers (experts, embeddings, the LM head) or of another model is refused."""
    deltas: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for adapter in adapters:
        for name, pair in read_adapter(adapter, model.cfg).items():
            deltas.setdefault(name, []).append(pair)
    adapted = 0
    for name, module in list(model.named_modules()):
        parts = hf_parts(name) if ADAPTABLE.fullmatch(name) else []
        if any(part in deltas for part in parts):
            lora_a, blocks = _stacked(model, name, module, [deltas.pop(part, []) for part in parts])
            parent, _, local = name.rpartition(".")
            setattr(model.get_submodule(parent), local, LowRankAdded(module, lora_a, blocks))
            adapted += 1
    if deltas:
        raise SpecDecodeError(
            f"the LoRA adapter adapts {next(iter(deltas))}, which this runtime does not compute as a linear layer of "
            "its own (experts, embeddings and the LM head cannot be adapted)"
        )
    return adapted


def _stacked(model, name: str, module: nn.Module, per_part: list[list]) -> tuple[torch.Tensor, list]:
    """A layer's A (each part's adapters' A's stacked) and each adapted part's B (its adapters' side by side), with
    the rows and ranks it spans, in the model's dtype; checked against the layer's shape."""
    rows = _part_rows(model.cfg, name, module.out_features, len(per_part))
    in_features = getattr(module, "in_features", None) or module.parts[0].in_features
    a_blocks, blocks = [], []
    for part_rows, pairs in zip(rows, per_part):
        for part_a, part_b in pairs:
            if part_a.shape[1] != in_features or part_b.shape[0] != part_rows.stop - part_rows.start:
                raise SpecDecodeError(
                    f"the LoRA adapter's matrices for {name} are {tuple(part_a.shape)} and {tuple(part_b.shape)}, "
                    f"where the model's layer takes {in_features} inputs to {module.out_features} outputs: an adapter "
                    "of another model?"
                )
        if pairs:
            start = sum(a.shape[0] for a in a_blocks)
            a_blocks += [a for a, _ in pairs]
            ranks = slice(start, sum(a.shape[0] for a in a_blocks))
            blocks.append((part_rows, ranks, torch.cat([b for _, b in pairs], dim=1).to(model.dtype).contiguous()))
    return torch.cat(a_blocks).to(model.dtype).contiguous(), blocks


def _part_rows(cfg: ModelConfig, name: str, out_features: int, parts: int) -> list[slice]:
    if name.endswith("qkv_proj"):
        return qkv_rows(cfg)
    size = out_features // parts  # gate and up: halves
    return [slice(i * size, (i + 1) * size) for i in range(parts)]
