"""Low-bit linear and embedding layers, one class per weight format.

Every layer here keeps each output row independent of the other rows computed with it, so a token's
logits are the same whether it is decoded alone or verified beside k drafts (greedy speculation then
reproduces plain decoding exactly):
- `W8A8Linear`: int8 weights (per output channel) times int8 activations quantized per row, summed in
  int32 by FBGEMM. Integer sums are exact, and per-row scales make each row's quantization its own.
- `W8A16Linear`: int8 weights, floating activations (torch's weight-only int8 kernel).
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn


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
        with warnings.catch_warnings():  # quantized tensors are deprecated as a user API; FBGEMM's packing still takes one
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
    """int8 weights (per output channel) with bf16 activations, by `torch._weight_int8pack_mm`. The kernel
    vectorizes bf16 only where the CPU has native bf16; with float32 activations it takes a scalar path
    slower than the float32 GEMM it replaces, so the backend offers it only on bf16-capable machines."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale.to(dtype))
        self.bias = bias
        self.nbytes = qweight.numel() + scale.numel() * scale.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch._weight_int8pack_mm(x.reshape(-1, self.in_features), self.qweight, self.scale)
        y = y.reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def int8_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.qweight, self.scale.float()

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
