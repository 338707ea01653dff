"""LoRA adapters on the target, as llama.cpp's --lora applies them: each adapted linear layer adds scale · B(Ax) to
its output, computed beside its weights rather than merged into them, so weights in a GGUF block format stay as
stored (merging would requantize them) and the layer computes what the adapter's training computed. Adapters come as
a PEFT folder (adapter_config.json and adapter_model.safetensors) or llama.cpp's conversion of one
(convert_lora_to_gguf.py); several add up. The adapters given at load serve every request; served adapters (vLLM's
--lora-modules) serve the requests that name them, beside requests of other adapters in the same forward."""

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
    def served(cls, specs: Sequence[str]) -> dict[str, Adapter]:
        """Adapters by name from NAME=PATH or NAME=PATH:SCALE (config.py's lora_modules, checked there)."""
        return {name: cls.parse(path) for name, _, path in (spec.partition("=") for spec in specs)}

    @classmethod
    def parse(cls, spec: str) -> Adapter:
        """PATH, or PATH:SCALE."""
        path, colon, scale = spec.rpartition(":")
        try:
            return cls(path, float(scale)) if colon else cls(spec)
        except ValueError:
            return cls(spec)


# One adapter's matrices by the layer they adapt (its Hugging Face name, "model.layers.3.self_attn.q_proj"):
# A [rank, in] and B [out, rank] in the format they are stored in (16-bit floats stay so; others float32), B's rows
# in the order the runtime computes the layer's, and the scale of B(Ax) (kept apart: folded into B, it would round
# 16-bit values)
Deltas = dict[str, tuple[torch.Tensor, torch.Tensor, float]]
# Formats an adapter's matrices are kept in as stored: each value widens to float32 exactly where it is read
HALF_FORMATS = (torch.float16, torch.bfloat16)


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
    return {name: (a, b, scale * adapter.scale) for name, (a, b, scale) in deltas.items()}


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
        pairs.setdefault(m[1], {})[m[2]] = tensor if tensor.dtype in HALF_FORMATS else tensor.float()
    deltas = {}
    for module, pair in pairs.items():
        a, b = pair["A"], pair["B"]
        rank = a.shape[0]
        alpha = _matching(settings.get("alpha_pattern") or {}, module, settings.get("lora_alpha", 8))
        scale = alpha / (math.sqrt(rank) if settings.get("use_rslora") else rank)
        for name, rows in canonical_hf_weights(cfg, {f"{module}.weight": b}).items():
            deltas[name.removesuffix(".weight")] = a, rows, scale  # a fused layer's (Phi-3's) A serves each part
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
    from gguf import GGMLQuantizationType

    from .families import field
    from .gguf_loader import MappedReader, dequantize_tensor, runtime_rows

    reader = MappedReader(path)
    if field(reader, "general.type") != "adapter" or field(reader, "adapter.type") != "lora":
        raise SpecDecodeError(f"{path} is not a LoRA adapter (general.type 'adapter', adapter.type 'lora')")
    alpha = float(field(reader, "adapter.lora.alpha", 0.0))
    pairs: dict[str, dict[str, object]] = {}
    stored = {GGMLQuantizationType.F16: torch.float16, GGMLQuantizationType.BF16: torch.bfloat16}
    for t in reader.tensors:
        base, _, part = t.name.rpartition(".")
        if part not in ("lora_a", "lora_b"):
            raise SpecDecodeError(f"{path}: {t.name} is not a LoRA matrix (adapters that replace norms are refused)")
        # float32 from 16 bits is exact, and so is the way back once the rows are in place
        pairs.setdefault(base, {})[part] = dequantize_tensor(t), stored.get(t.tensor_type, torch.float32)
    deltas = {}
    for base, pair in pairs.items():
        (a, a_format), (b, b_format) = pair["lora_a"], pair["lora_b"]
        scale = alpha / a.shape[0] if alpha else 1.0  # llama.cpp's: an alpha of 0 means none
        for name, rows in gguf_parts(cfg, base, b.shape[0]):
            deltas[name.removesuffix(".weight")] = (
                torch.from_numpy(a.copy()).to(a_format),
                runtime_rows(cfg, name, b[rows]).to(b_format),
                scale,
            )
    return deltas


class AdapterRoute:
    """Which adapter set each row of the forward in flight computes with, shared by the model's adapted layers: runs
    (first row, rows, set) over the flat rows, set 0 the model as loaded (its --lora adapters, or none) and set i its
    i-th served adapter on top; None: every row set 0. The model sets it from each batch (Transformer.forward).
    Adapters served at run time take the next set; an unloaded one's set is left empty, never reused, so that KV
    computed with it (kept by the set's number) is never found for a later adapter of its name."""

    def __init__(self, names: Sequence[str], common: Sequence[Adapter] = (), dtype: str = "auto"):
        self.sets = {"": 0} | {name: i + 1 for i, name in enumerate(names)}  # by the name requests give
        self.size = len(self.sets)  # sets each adapted layer holds
        self.common, self.dtype = list(common), dtype  # set 0's adapters, under every other set's; their format
        self.runs: list[tuple[int, int, int]] | None = None

    def set_of(self, name: str) -> int:
        if name not in self.sets:
            served = ", ".join(repr(n) for n in self.sets if n) or "none"
            raise SpecDecodeError(f"no LoRA adapter {name!r} is served (served: {served}); name one of them")
        return self.sets[name]

    def add(self, name: str) -> int:
        if not name or name in self.sets:
            raise SpecDecodeError(f"a LoRA adapter named {name!r} is served already; unload it first or name another")
        self.sets[name], self.size = self.size, self.size + 1
        return self.sets[name]

    def cancel(self, name: str) -> None:
        """Undo the last add (of `name`), which nothing computed with: its number is taken again by the next."""
        del self.sets[name]
        self.size -= 1

    def remove(self, name: str) -> int:
        index = self.set_of(name)
        if not index:
            raise SpecDecodeError("name the served LoRA adapter to unload")
        del self.sets[name]
        return index


class AdapterSet(nn.Module):
    """One set of adapters' update of a layer: every adapter of every part of a fused layer (q/k/v, gate/up) reads
    the same x, so their A's are one (ranks stacked); each part's B adds to its own rows only. A set of rank 0
    adapts nothing here."""

    def __init__(self, lora_a: torch.Tensor, blocks: list[tuple[slice, slice, torch.Tensor]], scales: torch.Tensor):
        super().__init__()
        self.register_buffer("lora_a", lora_a)
        self.register_buffer("scales", scales.float())  # each rank's of Ax: its adapter's scale
        self.spans = [(rows, ranks) for rows, ranks, _ in blocks]  # each B's output rows and ranks of A
        for i, (_, _, b) in enumerate(blocks):
            self.register_buffer(f"lora_b{i}", b.t().contiguous())  # [ranks, rows]: the kernel sums along its rows

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]

    def add_update(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += B(Ax) for rows [n, in] and [n, out], each row as it would be computed among any others."""
        reduced = row_by_row_linear(x, self.lora_a.to(x.dtype)) * self.scales.to(x.dtype)
        for i, (rows, ranks) in enumerate(self.spans):
            b = getattr(self, f"lora_b{i}").t().to(x.dtype)
            y[:, rows] += row_by_row_linear(reduced[:, ranks], b).to(y.dtype)


class LowRankAdded(nn.Module):
    """A linear layer and its adapter sets' low-rank updates: base(x) + B(Ax), each row by its set's B and A (the
    route's runs), so that a token's output is the same decoded alone or verified beside drafts, and beside rows of
    other adapters."""

    kernel = None  # executor/lora_kernel.py's, where it applies: (set, x, y) adds the update to y in place

    def __init__(self, base: nn.Module, sets: list[AdapterSet], route: AdapterRoute):
        super().__init__()
        self.base, self.sets, self.route = base, nn.ModuleList(sets), route

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        flat_x, flat_y = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        runs = self.route.runs or [(0, flat_x.shape[0], 0)]
        if sum(n for _, n, _ in runs) != flat_x.shape[0]:
            raise SpecDecodeError(f"the adapters' route covers {runs}, and the forward has {flat_x.shape[0]} rows")
        fused = self.kernel is not None and x.dtype == y.dtype == torch.float32
        for first, n, index in runs:
            chosen = self.sets[index]
            if chosen.rank and fused:
                self.kernel(chosen, flat_x[first : first + n], flat_y[first : first + n])
            elif chosen.rank:
                chosen.add_update(flat_x[first : first + n], flat_y[first : first + n])
        return y


def attach_adapters(
    model: nn.Module, adapters: Sequence[Adapter], served: dict[str, Adapter] | None = None, dtype: str = "auto"
) -> int:
    """Wrap each linear layer the adapters adapt in a LowRankAdded; returns how many. Set 0 is `adapters` (every
    request's), set i + 1 those and the i-th of `served` (the requests that name it), their matrices in `dtype`
    (auto: _kept_format's choice); the model gets their route (`adapter_route`). An adapter of layers the runtime
    does not compute as linear layers (experts, embeddings, the LM head) or of another model is refused."""
    served = served or {}
    common = _deltas(model, adapters)
    per_set = [common] + [_joined(common, _deltas(model, [adapter])) for adapter in served.values()]
    model.adapter_route = AdapterRoute(list(served), adapters, dtype)
    return _add_sets(model, per_set)


def serve_adapter(model: nn.Module, name: str, adapter: Adapter) -> int:
    """One more adapter served by name on a loaded model (vLLM's /v1/load_lora_adapter): the next set of every
    adapted layer, on top of the model's own adapters; returns how many layers are adapted. An adapter that cannot
    apply is refused with the model as it was."""
    route = getattr(model, "adapter_route", None)
    if route is None:
        route = model.adapter_route = AdapterRoute([], dtype=getattr(model, "lora_dtype", "auto"))
    deltas = _joined(_deltas(model, route.common), _deltas(model, [adapter]))
    route.add(name)
    try:
        return _add_sets(model, [deltas])
    except SpecDecodeError:
        route.cancel(name)
        raise


def unserve_adapter(model: nn.Module, name: str) -> None:
    """Stop serving the adapter `name`: its set, in every adapted layer, adapts nothing from now on."""
    route = getattr(model, "adapter_route", None)
    if route is None:
        raise SpecDecodeError(f"no LoRA adapter {name!r} is served")
    index = route.remove(name)
    for module in model.modules():
        if isinstance(module, LowRankAdded):
            module.sets[index] = _empty(module.sets[index])


def _add_sets(model: nn.Module, per_set: list[dict]) -> int:
    """The route's last len(per_set) sets, one per deltas, at the end of every adapted layer's (a layer they are
    the first to adapt wrapped in a LowRankAdded, its earlier sets empty); returns how many layers are adapted.
    Deltas of a layer the runtime does not compute as a linear layer of its own (experts, embeddings, the LM head)
    or of another model are refused before any layer changes."""
    if model.cfg.kv_lora_rank:
        raise SpecDecodeError(
            "LoRA adapters of a model with DeepSeek's latent attention are not built (its attention's layers are "
            "computed as one expanded projection); serve the adapter merged into the weights instead"
        )
    route, unused, planned = model.adapter_route, set().union(*per_set), []
    for name, module in list(model.named_modules()):
        if not ADAPTABLE.fullmatch(name):
            continue
        parts, wrapped = hf_parts(name), isinstance(module, LowRankAdded)
        if wrapped or any(part in deltas for deltas in per_set for part in parts):
            base = module.base if wrapped else module
            sets = [
                AdapterSet(*_stacked(model, name, base, [d.get(p, []) for p in parts], route.dtype)) for d in per_set
            ]
            planned.append((name, module, sets))
            unused -= set(parts)
    if unused:
        raise SpecDecodeError(
            f"the LoRA adapter adapts {min(unused)}, which this runtime does not compute as a linear layer of its "
            "own (experts, embeddings and the LM head cannot be adapted)"
        )
    for name, module, sets in planned:
        if isinstance(module, LowRankAdded):
            module.sets.extend(sets)
        else:
            empty = [_empty(sets[0])] * (route.size - len(sets))
            parent, _, local = name.rpartition(".")
            setattr(model.get_submodule(parent), local, LowRankAdded(module, empty + sets, route))
    return len(planned)


def _empty(adapter_set: AdapterSet) -> AdapterSet:
    """A set of the same layer that adapts nothing (rank 0)."""
    a = adapter_set.lora_a
    return AdapterSet(a.new_zeros(0, a.shape[1]), [], torch.zeros(0))


def _deltas(model, adapters: Sequence[Adapter]) -> dict[str, list[tuple[torch.Tensor, torch.Tensor, float]]]:
    """The adapters' matrices by the layer they adapt, several adapters' of one layer side by side."""
    deltas: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for adapter in adapters:
        for name, pair in read_adapter(adapter, model.cfg).items():
            deltas.setdefault(name, []).append(pair)
    return deltas


def _joined(first: dict[str, list], then: dict[str, list]) -> dict[str, list]:
    return {name: first.get(name, []) + then.get(name, []) for name in first.keys() | then.keys()}


def _stacked(
    model, name: str, module: nn.Module, per_part: list[list], dtype: str
) -> tuple[torch.Tensor, list, torch.Tensor]:
    """A layer's A (each part's adapters' A's stacked; none: rank 0), each adapted part's B (its adapters' side by
    side) with the rows and ranks it spans, and each rank's scale; in `dtype` (auto: _kept_format's choice),
    checked against the layer's shape."""
    rows = _part_rows(model.cfg, name, module.out_features, len(per_part))
    in_features = getattr(module, "in_features", None) or module.parts[0].in_features
    matrices = [m for pairs in per_part for a, b, _ in pairs for m in (a, b)]
    kept = _kept_format(model.dtype, matrices) if dtype == "auto" else getattr(torch, dtype)
    a_blocks, blocks, scales = [], [], []
    for part_rows, pairs in zip(rows, per_part):
        for part_a, part_b, _ in pairs:
            if part_a.shape[1] != in_features or part_b.shape[0] != part_rows.stop - part_rows.start:
                raise SpecDecodeError(
                    f"the LoRA adapter's matrices for {name} are {tuple(part_a.shape)} and {tuple(part_b.shape)}, "
                    f"where the model's layer takes {in_features} inputs to {module.out_features} outputs: an adapter "
                    "of another model?"
                )
        if pairs:
            start = sum(a.shape[0] for a in a_blocks)
            a_blocks += [a.to(kept) for a, _, _ in pairs]
            scales += [torch.full((a.shape[0],), scale) for a, _, scale in pairs]
            ranks = slice(start, sum(a.shape[0] for a in a_blocks))
            blocks.append((part_rows, ranks, torch.cat([b.to(kept) for _, b, _ in pairs], dim=1).contiguous()))
    lora_a = torch.cat(a_blocks) if a_blocks else torch.zeros(0, in_features, dtype=kept)
    return lora_a.contiguous(), blocks, torch.cat(scales) if scales else torch.zeros(0)


def _kept_format(model_dtype: torch.dtype, matrices: list[torch.Tensor]) -> torch.dtype:
    """The matrices' one 16-bit format where the model computes in float32 (the kernel widens each value exactly as
    it reads it, for half the bytes a step reads), else the model's dtype."""
    formats = {m.dtype for m in matrices}
    if model_dtype == torch.float32 and len(formats) == 1 and formats <= set(HALF_FORMATS):
        return formats.pop()
    return model_dtype


def _part_rows(cfg: ModelConfig, name: str, out_features: int, parts: int) -> list[slice]:
    if name.endswith("qkv_proj"):
        return qkv_rows(cfg)
    size = out_features // parts  # gate and up: halves
    return [slice(i * size, (i + 1) * size) for i in range(parts)]
