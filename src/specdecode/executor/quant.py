"""Low-bit linear and embedding layers, one class per weight format.

Every layer here keeps each output row independent of the other rows computed with it, so a token's
logits are the same whether it is decoded alone or verified beside k drafts (greedy speculation then
reproduces plain decoding exactly):
- `W4A8Linear`, `W6A8Linear` (both `PackedLinear`): 4-bit weights (GGUF Q4_K as stored, or requantized)
  and 6-bit weights (GGUF Q6_K as stored) times int8 activations with a scale per 32 values, by this
  package's kernels (kernels/lowbit.c).
- `W8A8Linear`: int8 weights (per output channel) times int8 activations quantized per row, summed in
  int32 by FBGEMM. Integer sums are exact, and per-row scales make each row's quantization its own.
- `W8A16Linear`: int8 weights, bf16 activations (torch's weight-only int8 kernel).
`ConcatLinear` stacks layers of different formats (a fused q/k/v whose parts are stored differently);
`Int8Embedding` keeps the token table in int8.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .cpu import touch_pages


def quantize_rows(w: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: w ≈ q * scale[:, None], |q| <= qmax."""
    w = w.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-10) / qmax
    return (w / scale[:, None]).round_().clamp_(-qmax, qmax).to(torch.int8), scale


class W8A8Linear(nn.Module):
    """int8 x int8 -> int32 by FBGEMM's prepacked GEMM, which reads each weight once for all rows: on a
    memory-bound CPU verifying 5 tokens costs about what decoding 1 does.

    FBGEMM quantizes its input with one scale per call. Scaling each row to the same range first (its
    absolute maximum to 127) and the output back afterwards turns that into per-row quantization."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        zeros = torch.zeros(self.out_features, dtype=torch.long)
        with warnings.catch_warnings():  # deprecated as a user API, but FBGEMM's packing still takes one
            warnings.simplefilter("ignore", UserWarning)
            qw = torch._make_per_channel_quantized_tensor(qweight, scale.double(), zeros, 0)
        self.packed = torch.ops.quantized.linear_prepack(qw, None)
        self.bias = bias
        self.nbytes = qweight.numel() + 8 * self.out_features  # packed int8 + scales and column offsets

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features).float()
        amax = rows.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-10)
        # input scale 1 and zero point 128: each scaled row lands on the integers -127..127 (+128)
        y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
            rows * (127.0 / amax), 1.0, 128, self.packed)
        y = (y * (amax / 127.0)).reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def int8_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        qw, _ = torch.ops.quantized.linear_unpack(self.packed)
        return qw.int_repr(), qw.q_per_channel_scales().float()

    def select_rows(self, ids: torch.Tensor) -> "W8A8Linear":
        q, s = self.int8_weight()
        bias = None if self.bias is None else self.bias[ids]
        return W8A8Linear(q[ids], s[ids], bias)


class W8A16Linear(nn.Module):
    """int8 weights (per output channel) with bf16 activations, by `torch._weight_int8pack_mm`. Always bf16:
    with float32 activations the kernel takes a scalar path slower than the float32 GEMM it replaces."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale.to(dtype))
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch._weight_int8pack_mm(x.reshape(-1, self.in_features), self.qweight, self.scale)
        y = y.reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def select_rows(self, ids: torch.Tensor) -> "W8A16Linear":
        bias = None if self.bias is None else self.bias[ids]
        return W8A16Linear(self.qweight[ids], self.scale.float()[ids], bias, self.scale.dtype)


class Int8Embedding(nn.Module):
    """Token embeddings stored as int8 rows with one scale each: a lookup dequantizes only the rows it
    reads. With tied weights the LM head is the same int8 matrix."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale.float())
        self.dtype = dtype
        touch_pages(qweight)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(tokens, self.qweight).float() * self.scale[tokens].unsqueeze(-1)
        return rows.to(self.dtype)


def w8a8_supported() -> bool:
    """FBGEMM is in x86 CPU builds of torch; other builds lack its ops."""
    try:
        q, s = quantize_rows(torch.ones(4, 8), 127)
        W8A8Linear(q, s)(torch.ones(1, 8))
        return True
    except (RuntimeError, NotImplementedError, AttributeError):
        return False


def w8a16_supported(device: torch.device | str) -> bool:
    """The weight-only int8 op has CPU (and MPS) kernels."""
    try:
        x = torch.zeros(1, 32, dtype=torch.bfloat16, device=device)
        torch._weight_int8pack_mm(x, torch.zeros(8, 32, dtype=torch.int8, device=device),
                                  torch.ones(8, dtype=torch.bfloat16, device=device))
        return True
    except (RuntimeError, NotImplementedError, AttributeError):
        return False


Q4_K_BLOCK_BYTES = 144


def split_q4_k(blocks: torch.Tensor) -> dict[str, torch.Tensor]:
    """GGUF Q4_K blocks [rows, 144 * K/256] -> the kernel's arrays (no value changes: w = d*sc*q - dmin*mn).

    A block holds d and dmin (fp16), twelve bytes of 6-bit scales and mins for its eight sub-blocks of
    32 weights, and 128 bytes of 4-bit values laid out as the kernel reads them."""
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, Q4_K_BLOCK_BYTES)
    d = b[..., 0:2].contiguous().view(torch.float16).float().reshape(rows, -1)
    dmin = b[..., 2:4].contiguous().view(torch.float16).float().reshape(rows, -1)
    packed = b[..., 4:16].int()
    low, high = packed[..., 0:4], packed[..., 4:8]
    tail = packed[..., 8:12]
    sc = torch.cat([low & 63, (tail & 0xF) | ((low >> 6) << 4)], dim=-1)
    mn = torch.cat([high & 63, (tail >> 4) | ((high >> 6) << 4)], dim=-1)
    return {"qs": b[..., 16:].reshape(rows, -1).contiguous(), "sc": sc.to(torch.uint8).reshape(rows, -1),
            "mn": mn.to(torch.uint8).reshape(rows, -1), "d": d, "dmin": dmin}


W4A8_GROUP = 16  # output rows per vector of the kernel


def quantize_4bit(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Float weights [rows, K] -> 4-bit values with an 8-bit scale and min per 32 weights and float d, dmin
    per (up to) 8 such sub-blocks: the Q4_K arrays the kernel reads (split_q4_k's layout), lossy.
    For draft models, whose weights only propose."""
    rows, cols = w.shape
    nsub = cols // 32
    per_super = max(s for s in range(1, 9) if nsub % s == 0)
    g = w.float().reshape(rows, nsub, 32)
    low, high = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    step, shift = ((high - low) / 15).reshape(rows, -1, per_super), (-low).reshape(rows, -1, per_super)
    d = step.amax(-1).clamp(min=1e-12) / 255
    dmin = shift.amax(-1).clamp(min=1e-12) / 255
    sc = (step / d[..., None]).round().clamp(1, 255)
    mn = (shift / dmin[..., None]).round().clamp(0, 255)
    scale, offset = (d[..., None] * sc).reshape(rows, nsub, 1), (dmin[..., None] * mn).reshape(rows, nsub, 1)
    q = ((g + offset) / scale).round().clamp(0, 15).to(torch.uint8).reshape(rows, -1, 64)
    return {"qs": (q[..., :32] | (q[..., 32:] << 4)).reshape(rows, -1), "sc": sc.to(torch.uint8).reshape(rows, -1),
            "mn": mn.to(torch.uint8).reshape(rows, -1), "d": d, "dmin": dmin}


def pack_w4a8(arrays: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Q4_K arrays (split_q4_k) -> the kernel's layout: output rows in groups of 16, one lane per row
    holding 4 consecutive weights; scales and mins per group. Values are moved, never changed."""
    qs = arrays["qs"]
    rows, cols = qs.shape[0], qs.shape[1] * 2
    groups = rows // W4A8_GROUP
    chunks = qs.reshape(rows, -1, 32)  # 32 bytes per 64 weights: low nibbles 0..31, high nibbles 32..63
    q = torch.cat([chunks & 0xF, chunks >> 4], dim=-1).reshape(groups, W4A8_GROUP, cols // 8, 8)
    packed = (q[..., :4] | (q[..., 4:] << 4)).permute(0, 2, 1, 3).contiguous()
    return {"q": packed, **{name: _by_group(arrays[name]) for name in ("sc", "mn", "d", "dmin")}}


def unpack_w4a8(packed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of pack_w4a8: the kernel's layout -> Q4_K arrays, one row per output row."""
    q = packed["q"]  # [G, K/8, 16, 4]
    groups, lanes = q.shape[0], q.shape[2]
    q = torch.cat([q & 0xF, q >> 4], dim=-1).permute(0, 2, 1, 3).reshape(groups * lanes, -1, 64)
    qs = (q[..., :32] | (q[..., 32:] << 4)).reshape(groups * lanes, -1)
    return {"qs": qs, **{name: _by_row(packed[name]) for name in ("sc", "mn", "d", "dmin")}}


def _by_group(per_row: torch.Tensor) -> torch.Tensor:
    """Per-row values [rows, n] -> [groups, n, 16]: the 16 rows of a group side by side, one per lane."""
    return per_row.reshape(-1, W4A8_GROUP, per_row.shape[1]).transpose(1, 2).contiguous()


def _by_row(per_group: torch.Tensor) -> torch.Tensor:
    return per_group.transpose(1, 2).reshape(-1, per_group.shape[1])


def w4a8_packable(columns: int, rows: int) -> bool:
    """The kernel takes 16 output rows at a time and 64 weights per packed chunk."""
    return columns % 64 == 0 and rows % W4A8_GROUP == 0


class PackedLinear(nn.Module):
    """A linear layer computed by one of this package's kernels on packed buffers (NAMES). The buffers'
    addresses are taken once (again if the module is moved), since a decode step makes ~100 such calls
    and per-call Python work would cost more than the smaller layers' kernels."""

    NAMES: tuple[str, ...] = ()
    KERNEL = ""

    def __init__(self, packed: dict[str, torch.Tensor], bias: torch.Tensor | None, out_features: int,
                 in_features: int):
        super().__init__()
        from .kernels import load

        self.lib = load("lowbit")
        self.out_features, self.in_features = out_features, in_features
        for name in self.NAMES:
            self.register_buffer(name, packed[name].contiguous())
        self.bias = bias
        self._take_addresses()

    def _take_addresses(self) -> None:
        self._buffers_at = tuple(getattr(self, name).data_ptr() for name in self.NAMES)

    def _apply(self, fn, recurse=True):
        module = super()._apply(fn, recurse)
        self._take_addresses()
        return module

    def _shape_args(self) -> tuple[int, ...]:
        """The kernel's arguments between the sizes and the buffers."""
        return ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.float32 or not rows.is_contiguous():
            rows = rows.float().contiguous()
        y = torch.empty(rows.shape[0], self.out_features)
        getattr(self.lib, self.KERNEL)(rows.data_ptr(), rows.shape[0], self.in_features, self.out_features,
                                       *self._shape_args(), *self._buffers_at, y.data_ptr(), torch.get_num_threads())
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def dequantize(self) -> torch.Tensor:
        """The float weights [out, in] this layer computes with."""
        raise NotImplementedError

    def select_rows(self, ids: torch.Tensor) -> nn.Module:
        """A vocabulary subset for a draft's LM head (any number of rows): as int8 rows."""
        bias = None if self.bias is None else self.bias[ids]
        return W8A8Linear(*quantize_rows(self.dequantize()[ids], 127), bias)


class W4A8Linear(PackedLinear):
    """4-bit weights (GGUF Q4_K as stored: 4.5 bits per weight; or quantize_4bit's) times int8 activations
    with a scale per 32 values, by this package's kernel (executor/kernels/lowbit.c): 40% fewer bytes per
    step than int8, and a verify of a few tokens costs little more than one decode step."""

    NAMES = ("q", "sc", "mn", "d", "dmin")
    KERNEL = "w4a8_linear"

    def __init__(self, packed: dict[str, torch.Tensor], bias: torch.Tensor | None = None):
        groups, column_groups = packed["q"].shape[:2]
        super().__init__(packed, bias, groups * W4A8_GROUP, column_groups * 8)
        self.sub_per_super = packed["sc"].shape[1] // packed["d"].shape[1]  # 32-weight sub-blocks per d

    def _shape_args(self) -> tuple[int, ...]:
        return (self.sub_per_super,)

    def select_rows(self, ids: torch.Tensor) -> nn.Module:
        """A vocabulary subset for a draft's LM head: its rows as stored, still 4-bit, when their number
        is a multiple of the kernel's 16-row groups (else as int8 rows)."""
        if len(ids) % W4A8_GROUP:
            return super().select_rows(ids)
        rows = unpack_w4a8({name: getattr(self, name) for name in self.NAMES})
        bias = None if self.bias is None else self.bias[ids]
        return W4A8Linear(pack_w4a8({name: t[ids] for name, t in rows.items()}), bias)

    def dequantize(self) -> torch.Tensor:
        """The float weights [out, in] this layer computes with."""
        g = self.q.shape[0]
        q = torch.stack([self.q & 0xF, self.q >> 4], dim=3)  # [G, K/8, 16, 2, 4]
        q = q.permute(0, 2, 1, 3, 4).reshape(g, W4A8_GROUP, -1).float()  # [G, 16, K]
        expand = lambda t, n: t.transpose(1, 2).repeat_interleave(n, dim=2)  # noqa: E731  -> [G, 16, K]
        span = 32 * self.sub_per_super
        scale = expand(self.d, span) * expand(self.sc.float(), 32)
        shift = expand(self.dmin, span) * expand(self.mn.float(), 32)
        return (q * scale - shift).reshape(self.out_features, self.in_features)


Q6_K_BLOCK_BYTES = 210


def split_q6_k(blocks: torch.Tensor) -> dict[str, torch.Tensor]:
    """GGUF Q6_K blocks [rows, 210 * K/256] -> 6-bit values q [rows, K] in weight order, a signed 8-bit
    scale per 16 weights and d per 256 (no value changes: w = d * sc * (q - 32)).

    A block holds 128 bytes of low nibbles, 64 bytes of top bit pairs, 16 scales and d (fp16); each half
    of 128 weights takes 64 low-nibble bytes and 32 top-bit bytes, four weights 32 apart per byte pair."""
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, Q6_K_BLOCK_BYTES)
    ql, qh = b[..., :128].reshape(rows, -1, 2, 64), b[..., 128:192].reshape(rows, -1, 2, 32)
    low = torch.stack([ql[..., :32] & 0xF, ql[..., 32:] & 0xF, ql[..., :32] >> 4, ql[..., 32:] >> 4], dim=-2)
    top = torch.stack([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], dim=-2)
    q = (low | (top << 4)).reshape(rows, -1)  # [rows, blocks, half, quarter, 32] -> weight order
    sc = b[..., 192:208].contiguous().view(torch.int8).reshape(rows, -1)
    d = b[..., 208:210].contiguous().view(torch.float16).float().reshape(rows, -1)
    return {"q": q, "sc": sc, "d": d}


def pack_w6a8(arrays: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Q6_K arrays (split_q6_k) -> the kernel's layout (see lowbit.c): low nibbles as w4a8's q, top bit
    pairs four to a byte, scales and d per group of 16 output rows. Values are moved, never changed."""
    q = arrays["q"]
    rows, cols = q.shape
    groups = rows // W4A8_GROUP
    q = q.reshape(groups, W4A8_GROUP, cols // 8, 8).permute(0, 2, 1, 3)  # [G, K/8, 16 rows, 8 weights]
    low, top = q & 0xF, q >> 4
    lo = (low[..., :4] | (low[..., 4:] << 4)).contiguous()  # [G, K/8, 16, 4]: lane = row * 4 + e
    pairs = (top[..., :4] | (top[..., 4:] << 2)).reshape(groups, cols // 8, 64)  # per lane: (e, 4+e)
    hi = (pairs[..., :32] | (pairs[..., 32:] << 4)).to(torch.uint8).contiguous()
    return {"lo": lo.to(torch.uint8), "hi": hi, "sc": _by_group(arrays["sc"]), "d": _by_group(arrays["d"])}


def w6a8_packable(columns: int, rows: int) -> bool:
    return columns % 256 == 0 and rows % W4A8_GROUP == 0


class W6A8Linear(PackedLinear):
    """6-bit weights (GGUF Q6_K as stored: 6.56 bits per weight) times int8 activations with a scale per
    32 values, by this package's kernel (executor/kernels/lowbit.c): a fifth fewer bytes than int8 rows
    for the file's Q6_K tensors (the LM head among them), computed as precisely as the file allows."""

    NAMES = ("lo", "hi", "sc", "d")
    KERNEL = "w6a8_linear"

    def __init__(self, packed: dict[str, torch.Tensor], bias: torch.Tensor | None = None):
        groups, column_groups = packed["lo"].shape[:2]
        super().__init__(packed, bias, groups * W4A8_GROUP, column_groups * 8)

    def values(self) -> torch.Tensor:
        """The 6-bit values q [out, in] (0..63) as stored."""
        g, kk = self.lo.shape[:2]
        low = torch.stack([self.lo & 0xF, self.lo >> 4], dim=3)  # [G, K/8, 16, 2, 4]
        pairs = torch.cat([self.hi & 0xF, self.hi >> 4], dim=-1).reshape(g, kk, W4A8_GROUP, 4)
        top = torch.stack([pairs & 3, pairs >> 2], dim=3)  # [G, K/8, 16, 2, 4]
        q = low | (top << 4)
        return q.permute(0, 2, 1, 3, 4).reshape(self.out_features, self.in_features)

    def dequantize(self) -> torch.Tensor:
        """The float weights [out, in] this layer computes with (as gguf computes them: (d * sc) * (q - 32))."""
        expand = lambda t, n: t.transpose(1, 2).reshape(self.out_features, -1).repeat_interleave(n, dim=1)  # noqa: E731
        scale = expand(self.d, 256) * expand(self.sc.float(), 16)
        return scale * (self.values().float() - 32)


class ConcatLinear(nn.Module):
    """Output rows of several layers side by side (a fused q/k/v whose parts are stored in different
    formats)."""

    def __init__(self, parts: list[nn.Module], bias: torch.Tensor | None = None):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.bias = bias
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([p(x) for p in self.parts], dim=-1)
        return y if self.bias is None else y + self.bias


def w4a8_supported() -> bool:
    """The kernel compiles (a C compiler is present) and the CPU has AVX2 and FMA at least."""
    from .kernels import load

    lib = load("lowbit")
    return lib is not None and lib.w4a8_isa() > 0
