"""Low-bit linear and embedding layers.

Every layer here keeps each output row independent of the other rows computed with it, so a token's
logits are the same whether it is decoded alone or verified beside k drafts (greedy speculation then
reproduces plain decoding exactly):
- `BlockLinear`: GGUF block formats as stored (Q4_0 .. Q8_0, Q3_K .. Q6_K; executor/formats.py) times
  int8 activations with a scale per 32 values (or two int8 passes: x and its residual), by this package's
  kernel (kernels/lowbit.c).
- `BlockEmbedding`: token lookups dequantize the rows they read from a BlockLinear (the LM head too,
  when the weights are tied).
- `W8A16Linear`: int8 weights, bf16 activations (torch's weight-only int8 kernel).
`ConcatLinear` stacks layers of different formats (a fused q/k/v whose parts are stored differently).
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import SpecDecodeError
from .cpu import touch_pages
from .formats import BY_ID, GROUP, BlockArrays, Format, pack, unpack

ARRAYS = ("lo", "hi", "sc", "mn", "d", "dmin")  # the kernel's buffers, in its argument order
ERRORS = {
    -1: "unknown weight format",
    -2: "input width not a multiple of 32 below 2^24, or output rows not of 16",
    -3: "input width not a whole number of super-blocks (of under 4,096 sub-blocks)",
    -4: "a buffer the format needs is missing",
    -5: "out of memory for the quantized activations",
    -6: "a token id outside the table",
    -7: "activation passes other than 1 or 2",
}


def lowbit_kernel():
    """The compiled low-bit kernel for this machine (or as SPECDECODE_KERNELS asks), or None."""
    from .kernels import load

    return load("lowbit")


def lowbit_isa() -> int:
    """1024 (AVX-512 VNNI and AMX tiles), 512 (AVX-512 VNNI), 256 (AVX2) or 0 (portable scalar C); -1
    where no kernel builds."""
    lib = lowbit_kernel()
    return -1 if lib is None else lib.lowbit_isa()


def _check(code: int, what: str, errors: dict[int, str] = ERRORS) -> None:
    if code:
        raise SpecDecodeError(f"low-bit kernel refused {what}: {errors.get(code, code)}")


class BlockLinear(nn.Module):
    """y = x W^T + b with W in a GGUF block format, kept as stored. The buffers' addresses are taken once
    (again if the module is moved): a decode step makes ~100 such calls, and per-call Python work would
    cost more than the smaller layers' kernels."""

    def __init__(
        self,
        arrays: BlockArrays | None = None,
        bias: torch.Tensor | None = None,
        *,
        packed: dict[str, torch.Tensor] | None = None,
        fmt: Format | None = None,
        S: int = 1,
        out_features: int | None = None,
    ):
        super().__init__()
        if arrays is not None:
            packed, fmt, S, out_features = pack(arrays), arrays.format, arrays.S, arrays.rows
        self.lib = lowbit_kernel()
        if self.lib is None:
            raise SpecDecodeError("the low-bit kernel is not available on this machine; use --quantization none")
        self.format, self.S = fmt, S
        self.in_features = packed["lo"].shape[1] * (4 if fmt.bits == 8 else 8)
        self.rows = packed["lo"].shape[0] * GROUP  # out_features rounded up to whole groups
        self.out_features = out_features or self.rows
        for name in ARRAYS:
            self.register_buffer(name, packed[name].contiguous() if name in packed else None)
        self.bias = bias
        self.passes = 1  # 2: x and its int8 residual, ~15-bit activations for twice the integer work
        self._take_addresses()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for name in ARRAYS if (t := getattr(self, name)) is not None)

    def _take_addresses(self) -> None:
        """The buffers' addresses in the kernel's argument order: a new tuple after each move, which the experts'
        kernel checks for."""
        self.buffer_addresses = tuple(0 if (t := getattr(self, name)) is None else t.data_ptr() for name in ARRAYS)

    def _apply(self, fn, recurse=True):
        module = super()._apply(fn, recurse)
        self._take_addresses()
        return module

    def packed_buffers(self) -> dict[str, torch.Tensor]:
        return {name: t for name in ARRAYS if (t := getattr(self, name)) is not None}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise SpecDecodeError(
                f"a {self.format.name} layer of {self.in_features} input features was given {x.shape[-1]}"
            )
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.float32 or not rows.is_contiguous():
            rows = rows.float().contiguous()
        y = torch.empty(rows.shape[0], self.rows)
        _check(
            self.lib.lowbit_linear(
                self.format.id,
                rows.data_ptr(),
                rows.shape[0],
                self.in_features,
                self.rows,
                self.S,
                *self.buffer_addresses,
                y.data_ptr(),
                self.passes,
                torch.get_num_threads(),
            ),
            f"a {self.format.name} product",
        )
        if self.rows != self.out_features:
            y = y[:, : self.out_features]
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def dequantize(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """The float weights [len(ids) or out, in] this layer computes with (gguf's products)."""
        ids = torch.arange(self.out_features) if ids is None else ids
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(len(ids), self.in_features)
        _check(
            self.lib.lowbit_dequantize_rows(
                self.format.id,
                self.in_features,
                self.rows,
                self.S,
                *self.buffer_addresses,
                ids.data_ptr(),
                len(ids),
                out.data_ptr(),
            ),
            "a row lookup",
        )
        return out

    def arrays(self) -> BlockArrays:
        """The values as stored, one row per output row (padding rows dropped)."""
        a = unpack(self.format, self.S, self.packed_buffers())
        return a.select(torch.arange(self.out_features)) if self.rows != self.out_features else a

    def select_rows(self, ids: torch.Tensor) -> "BlockLinear":
        """A vocabulary subset for a draft's LM head: its rows as stored, in the same format."""
        bias = None if self.bias is None else self.bias[ids]
        subset = BlockLinear(self.arrays().select(ids.cpu()), bias)
        subset.passes = self.passes
        return subset


def block_linear_from(tensors: dict[str, torch.Tensor], prefix: str) -> BlockLinear:
    """A BlockLinear from the buffers `quantize_weights` stored under `prefix` (`<prefix>.lo`, ...)."""
    fmt_id, S, out_features = tensors[f"{prefix}.format"].tolist()
    packed = {name: tensors[f"{prefix}.{name}"] for name in ARRAYS if f"{prefix}.{name}" in tensors}
    return BlockLinear(packed=packed, fmt=BY_ID[fmt_id], S=S, out_features=out_features)


def stored_layer_tensors(prefix: str, arrays: BlockArrays) -> dict[str, torch.Tensor]:
    """What `block_linear_from` reads back: the packed buffers and the format's numbers."""
    out = {f"{prefix}.{name}": t for name, t in pack(arrays).items()}
    out[f"{prefix}.format"] = torch.tensor([arrays.format.id, arrays.S, arrays.rows])
    return out


class BlockEmbedding(nn.Module):
    """Token embeddings looked up in a BlockLinear's rows (dequantized as they are read): with tied weights
    the LM head is the same table, kept once."""

    def __init__(self, table: BlockLinear, dtype: torch.dtype):
        super().__init__()
        self.table, self.dtype = table, dtype
        for t in table.packed_buffers().values():
            touch_pages(t)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = self.table.dequantize(tokens.reshape(-1))
        return rows.reshape(*tokens.shape, -1).to(self.dtype)


def quantize_rows(w: torch.Tensor, qmax: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: w ≈ q * scale[:, None], |q| <= qmax (for W8A16Linear)."""
    w = w.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-10) / qmax
    return (w / scale[:, None]).round_().clamp_(-qmax, qmax).to(torch.int8), scale


class W8A16Linear(nn.Module):
    """int8 weights (per output channel) with bf16 activations, by `torch._weight_int8pack_mm`. Always bf16:
    with float32 activations the kernel takes a scalar path slower than the float32 GEMM it replaces."""

    def __init__(
        self,
        qweight: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ):
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


def w8a16_supported(device: torch.device | str) -> bool:
    """The weight-only int8 op has CPU (and MPS) kernels."""
    try:
        x = torch.zeros(1, 32, dtype=torch.bfloat16, device=device)
        torch._weight_int8pack_mm(
            x, torch.zeros(8, 32, dtype=torch.int8, device=device), torch.ones(8, dtype=torch.bfloat16, device=device)
        )
        return True
    except (RuntimeError, NotImplementedError, AttributeError):
        return False


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
