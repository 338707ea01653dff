"""A low-bit decoder's layers for packed (decode and verify) forwards in one call (kernels/decoder.c), which
calls the same kernels as the modules do, in the same order, so logits are the same bit for bit. At a short
context a step's ~250 small calls from Python cost more than a tenth of it
(docs/decisions.md#fused-norms-and-swiglu-and-a-steps-layers-in-one-call).

It applies to the decoders whose every layer is RMSNorm, attention by the rowwise kernel, SwiGLU or GeGLU by the
elementwise kernel or experts by theirs, and low-bit projections: Qwen2/2.5/3, Llama, Mistral, SmolLM, Gemma 3,
Mixtral and Qwen3-MoE from GGUF block formats. Float weights run module by module."""

from __future__ import annotations

import ctypes
import weakref

import torch

from ..errors import SpecDecodeError
from .attention import ERRORS as ATTENTION_ERRORS
from .attention import RowwiseAttentionKernel
from .elementwise import ERRORS as NORM_ERRORS
from .elementwise import ActMulKernel, NormKernel
from .experts import ERRORS as EXPERTS_ERRORS
from .experts import ExpertsKernel
from .kernels import load
from .lora_kernel import ERRORS as LORA_ERRORS
from .lora_kernel import FORMATS as LORA_FORMATS
from .quant import ERRORS as QUANT_ERRORS
from .quant import BlockLinear, ConcatLinear

_I32, _F32, _P = ctypes.c_int32, ctypes.c_float, ctypes.c_void_p
MAX_PARTS = 3  # as kernels/decoder.c


class _Block(ctypes.Structure):
    _fields_ = [(name, _I32) for name in ("format", "in_features", "rows", "out_features", "S", "passes")] + [
        (name, _P) for name in ("lo", "hi", "sc", "mn", "d", "dmin")
    ]


class _LoRA(ctypes.Structure):
    _fields_ = [("rank", _I32), ("blocks", _I32), ("format", _I32), ("A", _P), ("scales", _P), ("spans", _P), ("B", _P)]


class _Projection(ctypes.Structure):
    _fields_ = [
        ("parts", _I32), ("out_features", _I32), ("part", _Block * MAX_PARTS), ("bias", _P), ("lora", _P),
        ("sets", _I32),
    ]  # fmt: skip


_EXPERTS_INTS = "experts top normalize inter passes gate_up_format gate_up_S down_format down_S".split()


class _Experts(ctypes.Structure):
    _fields_ = [(name, _I32) for name in _EXPERTS_INTS] + [
        (name, _P) for name in ("router", "gate_up_table", "down_table")
    ]


class _Layer(ctypes.Structure):
    _fields_ = (
        [(name, _P) for name in ("input_norm", "post_norm", "q_norm", "k_norm", "pre_ff_norm", "post_ff_norm", "sinks")]
        + [(name, _F32) for name in ("eps", "qk_eps", "scale", "softcap")]
        + [("window", _I32), ("local_rope", _I32)]
        + [(name, _Projection) for name in ("qkv", "o", "gate_up", "down")]
        + [("moe", _Experts)]
    )


class _Decoder(ctypes.Structure):
    _fields_ = (
        [(name, _P) for name in ("linear", "norm", "add_norm", "act_mul", "attention", "moe", "lora")]
        + [(name, _I32) for name in ("layers", "hidden", "heads", "kv_heads", "head_dim")]
        + [("layer", _P)]
    )


class _Tokens(ctypes.Structure):
    _fields_ = (
        [("rows", _I32), ("slots", _P), ("positions", _P), ("cos", _P * 2), ("sin", _P * 2)]
        + [(name, _P) for name in ("kcache", "vcache", "tables")]
        + [(name, _I32) for name in ("num_slots", "max_blocks", "block_size", "num_blocks")]
        + [("runs", _P), ("num_runs", _I32)]
    )


# kernels/decoder.c's steps, as its enum numbers them, and whose error codes each returns (a projection's: its
# low-bit product's or its adapters')
LINEAR_ERRORS = QUANT_ERRORS | LORA_ERRORS
STEPS = [
    ("input norm", NORM_ERRORS),
    ("q/k/v projection", LINEAR_ERRORS),
    ("attention", ATTENTION_ERRORS),
    ("output projection", LINEAR_ERRORS),
    ("post-attention norm", NORM_ERRORS),
    ("gate/up projection", LINEAR_ERRORS),
    ("activation", NORM_ERRORS),
    ("down projection", LINEAR_ERRORS),
    ("pre-feedforward norm", NORM_ERRORS),
    ("post-feedforward norm", NORM_ERRORS),
    ("experts", EXPERTS_ERRORS),
]
OWN_ERRORS = {
    -100: "a call with no rows or no layers",
    -101: "out of memory for its scratch",
    -102: "an adapter run outside the call's rows or the projection's adapter sets",
}


def _address(fn) -> int:
    return ctypes.cast(fn, _P).value


def _parts(projection) -> tuple[list[BlockLinear], torch.Tensor | None] | None:
    """A projection's low-bit parts and the bias over them all, or None where the kernel cannot run it (an adapted
    projection: where its update has the LoRA kernel)."""
    if _adapted(projection):
        return _parts(projection.base) if projection.kernel is not None else None
    if isinstance(projection, BlockLinear):
        return [projection], projection.bias
    if isinstance(projection, ConcatLinear) and len(projection.parts) <= MAX_PARTS:
        parts = list(projection.parts)
        if all(isinstance(p, BlockLinear) and p.bias is None for p in parts):
            return parts, projection.bias
    return None


def _adapted(projection) -> bool:
    """models/lora.py's LowRankAdded (told by its adapter, as models/ imports this package)."""
    return hasattr(projection, "route")


def _projection(projection, kept: list) -> _Projection:
    """The projection's struct; the structs it points to go into `kept`, which must outlive it."""
    parts, bias = _parts(projection)
    p = _Projection(parts=len(parts), out_features=sum(b.out_features for b in parts))
    p.bias = None if bias is None else bias.data_ptr()
    if _adapted(projection):
        sets = (_LoRA * len(projection.sets))(*(_adapter_set(projection.kernel, s) for s in projection.sets))
        kept.append(sets)
        p.lora, p.sets = ctypes.addressof(sets), len(projection.sets)
    for i, b in enumerate(parts):
        p.part[i] = _Block(b.format.id, b.in_features, b.rows, b.out_features, b.S, b.passes, *b.buffer_addresses)
    return p


def _adapter_set(kernel, adapter_set) -> _LoRA:
    """One adapter set's struct (rank 0: none), pointing into the kernel's kept layout of it."""
    if not adapter_set.rank:
        return _LoRA(0, 0, 0, None, None, None, None)
    spans, addresses = kernel.layout(adapter_set)
    return _LoRA(
        adapter_set.rank, len(adapter_set.spans), LORA_FORMATS[adapter_set.lora_a.dtype], adapter_set.lora_a.data_ptr(),
        adapter_set.scales.data_ptr(), ctypes.addressof(spans), ctypes.addressof(addresses),
    )  # fmt: skip


def _adapter_runs(batch):
    """The batch's runs of rows by adapter set, (first, rows, set) each, as the C array the call reads; None: every
    row the model's own set."""
    runs = batch.adapter_runs
    return None if runs is None else (_I32 * (3 * len(runs)))(*(n for run in runs for n in run))


def _experts(moe) -> _Experts:
    kernel = moe.kernel
    gate_up, down = kernel.tables()
    fmt_gu, s_gu, fmt_down, s_down = kernel.formats
    return _Experts(
        len(gate_up),
        moe.gate.top_k,
        int(moe.gate.normalize),
        kernel.inter,
        kernel.passes,
        fmt_gu,
        s_gu,
        fmt_down,
        s_down,
        moe.gate.weight.data_ptr(),
        gate_up.data_ptr(),
        down.data_ptr(),
    )


def _layer(layer, kept: list) -> _Layer:
    attn, mlp = layer.self_attn, layer.mlp
    norms = attn.qk_norms
    out = _Layer(
        input_norm=layer.input_layernorm.weight.data_ptr(),
        post_norm=layer.post_attention_layernorm.weight.data_ptr(),
        eps=layer.input_layernorm.eps,
        scale=attn.scale,
        softcap=attn.softcap or 0.0,
        sinks=None if attn.sinks is None else attn.sinks.data_ptr(),
        window=attn.window or 0,
        local_rope=int(attn.rope != "global"),  # its own table: Gemma's local RoPE, a NoPE layer's identity
        qkv=_projection(attn.qkv_proj, kept),
        o=_projection(attn.o_proj, kept),
    )
    if norms is not None:
        out.q_norm, out.k_norm, out.qk_eps = norms[0].weight.data_ptr(), norms[1].weight.data_ptr(), norms[0].eps
    if hasattr(layer, "post_feedforward_layernorm"):
        out.pre_ff_norm = layer.pre_feedforward_layernorm.weight.data_ptr()
        out.post_ff_norm = layer.post_feedforward_layernorm.weight.data_ptr()
    if _sparse(mlp):
        out.moe = _experts(mlp)
    else:
        out.gate_up, out.down = _projection(mlp.gate_up_proj, kept), _projection(mlp.down_proj, kept)
    return out


def _norms(layer) -> list:
    names = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
    return [getattr(layer, name) for name in names if hasattr(layer, name)]


def _sparse(mlp) -> bool:
    """A mixture of experts (models/layers.py's SparseMoE) in place of the MLP."""
    return hasattr(mlp, "gate")


def _mlp_runs_in_one_call(mlp) -> bool:
    # a mixture of experts: the kernel routes by a plain router, reading its weights as float32 rows, and has no
    # shared expert (Qwen2-MoE's)
    if _sparse(mlp):
        router = mlp.gate.weight
        routed = isinstance(mlp.kernel, ExpertsKernel) and mlp.gate.plain and not hasattr(mlp, "shared_expert")
        return routed and router.dtype == torch.float32 and router.is_contiguous()
    return isinstance(mlp.act_mul_kernel, ActMulKernel) and all(
        _parts(p) is not None for p in (mlp.gate_up_proj, mlp.down_proj)
    )


def runs_in_one_call(layer) -> bool:
    """Whether the decoder kernel computes this layer as its modules would."""
    attn, norms = layer.self_attn, _norms(layer)
    return (
        isinstance(attn.rowwise_kernel, RowwiseAttentionKernel)
        and not attn.whole_qk_norms
        and not layer.parallel
        and all(isinstance(n.kernel, NormKernel) and n.eps == norms[0].eps for n in norms)
        and _mlp_runs_in_one_call(layer.mlp)
        and all(_parts(p) is not None for p in (attn.qkv_proj, attn.o_proj))
    )


def _dense_mlps(model) -> list:
    return [layer.mlp for layer in model.layers if not _sparse(layer.mlp)]


class DecoderKernel:
    """Transformer.forward's layers for packed batches: (x, residual) as the module loop returns them."""

    def __init__(self, lib):
        self.lib = lib
        self._decoder: _Decoder | None = None  # the weights' addresses, taken again after the layers move
        self._layers = None  # the array the decoder's struct points into
        self._kept: list = []  # and the adapters' structs its layers point to
        self._moves: list[int] | None = None
        self._attention_lib = None
        self._cache: weakref.ref | None = None  # the cache whose layers' addresses `_kv` holds
        self._kv: tuple | None = None
        self._failed = (_I32 * 2)()

    def __call__(self, model, x: torch.Tensor, rope: dict, batch, cache) -> tuple[torch.Tensor, torch.Tensor]:
        moves = [layer.moves for layer in model.layers]
        decoder = self._decoder if moves == self._moves else self._describe(model, moves)
        attention = model.layers[0].self_attn.rowwise_kernel
        n, hidden = x.shape[0] * x.shape[1], x.shape[-1]
        x = x.reshape(n, hidden).contiguous()
        residual = torch.empty_like(x)
        flat = {kind: attention.flat_inputs(batch, table, n) for kind, table in rope.items()}
        slots, positions, cos, sin = flat["global"]
        _, _, local_cos, local_sin = flat.get("local", flat.get("none", flat["global"]))
        tokens = _Tokens(n, slots.data_ptr(), positions.data_ptr())
        tokens.cos[:] = cos.data_ptr(), local_cos.data_ptr()
        tokens.sin[:] = sin.data_ptr(), local_sin.data_ptr()
        tokens.kcache, tokens.vcache = self._cache_addresses(cache, decoder)
        tokens.tables = cache.table.data_ptr()
        tokens.num_slots, tokens.max_blocks = cache.num_slots, cache.max_blocks
        tokens.block_size, tokens.num_blocks = cache.block_size, cache.num_blocks
        runs = _adapter_runs(batch)  # alive for the call
        tokens.runs, tokens.num_runs = (None, 0) if runs is None else (ctypes.addressof(runs), len(runs) // 3)
        code = self.lib.decoder_layers(
            ctypes.addressof(decoder),
            ctypes.addressof(tokens),
            x.data_ptr(),
            residual.data_ptr(),
            torch.get_num_threads(),
            ctypes.addressof(self._failed),
        )
        if code:
            raise SpecDecodeError(self._message(code))
        return x.view(1, n, hidden), residual.view(1, n, hidden)

    def _describe(self, model, moves: list[int]) -> _Decoder:
        cfg, first = model.cfg, model.layers[0]
        kept: list = []  # the adapters' structs the layers point to
        layers = (_Layer * len(model.layers))(*(_layer(layer, kept) for layer in model.layers))
        lora = next((m.kernel.lib.lora_update for m in model.modules() if _adapted(m)), None)
        linear_lib = _parts(first.self_attn.o_proj)[0][0].lib
        norm_lib, attention_lib = first.input_layernorm.kernel.lib, first.self_attn.rowwise_kernel.lib
        dense = _dense_mlps(model)
        decoder = _Decoder(
            _address(linear_lib.lowbit_linear),
            _address(norm_lib.rms_norm),
            _address(norm_lib.add_rms_norm),
            _address(dense[0].act_mul_kernel.fn) if dense else None,
            _address(attention_lib.rowwise_attention),
            _address(linear_lib.lowbit_moe) if len(dense) < len(model.layers) else None,
            _address(lora) if lora is not None else None,
            len(model.layers),
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.dim_per_head,
            ctypes.addressof(layers),
        )
        self._decoder, self._layers, self._moves, self._attention_lib = decoder, layers, moves, attention_lib
        self._kept = kept
        self._cache = None
        return decoder

    def _cache_addresses(self, cache, decoder: _Decoder) -> tuple[int, int]:
        """Each layer's keys and values, and the attention kernel for the cache's element type."""
        if self._cache is None or self._cache() is not cache:
            self._kv = tuple((_P * len(part))(*(t.data_ptr() for t in part)) for part in (cache.k, cache.v))
            self._cache = weakref.ref(cache)  # not kept alive by the model
            lib, half = self._attention_lib, cache.k[0].dtype == torch.float16
            decoder.attention = _address(lib.rowwise_attention_f16 if half else lib.rowwise_attention)
        return ctypes.addressof(self._kv[0]), ctypes.addressof(self._kv[1])

    def _message(self, code: int) -> str:
        layer, step = self._failed
        if step < 1:
            return f"the decoder kernel refused the call: {OWN_ERRORS.get(code, code)}"
        name, errors = STEPS[step - 1]
        return f"the decoder kernel's {name} in layer {layer} failed: {errors.get(code, code)}"


def attach_decoder_kernel(model) -> bool:
    """Give the model the one-call decoder where every layer runs in it (after the attention and elementwise
    kernels are attached); True if it did."""
    if model.device.type != "cpu" or not all(runs_in_one_call(layer) for layer in model.layers):
        return False
    if len({mlp.activation for mlp in _dense_mlps(model)}) > 1:  # the kernel takes one activation
        return False
    lib = load("decoder")
    if lib is None:
        return False
    model.layers_kernel = DecoderKernel(lib)
    return True
