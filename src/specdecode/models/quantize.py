"""Weight-only int8 for draft models: per-output-channel symmetric scales, matmul by torch's
`_weight_int8pack_mm`. A draft only proposes (the target verifies every token), so quantizing it keeps
decoding lossless while halving the bytes each draft step streams: on a memory-bound CPU that is the
draft's step cost, i.e. the c in the speedup formula.

Torch's int8 kernel works row by row, so its time grows with the rows: ~4x faster than the bf16 GEMM for
one row, about even at 8, and 2-4x slower for a catch-up of a hundred tokens (measured on this project's
CPU, Qwen 0.5B shapes). So the layer keeps its floating weight too (3 bytes per weight instead of 1) and
calls with many rows take the GEMM.
"""
from __future__ import annotations

import torch
from torch import nn


class Int8Linear(nn.Module):
    # calls with at least this many rows (a large batch, a draft's catch-up) use the floating weight
    MAX_INT8_ROWS = 8

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight = linear.weight
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
        self.register_buffer("weight_int8", (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(linear.weight.dtype))
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.out_features = linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        if len(rows) >= self.MAX_INT8_ROWS:
            y = torch.nn.functional.linear(rows, self.weight)
        else:
            y = torch._weight_int8pack_mm(rows, self.weight_int8, self.scale)
        y = y.reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def int8_supported(device: torch.device) -> bool:
    """The op has CPU (and MPS) kernels; elsewhere the draft stays in its floating dtype."""
    try:
        x = torch.zeros(1, 32, dtype=torch.bfloat16, device=device)
        torch._weight_int8pack_mm(x, torch.zeros(8, 32, dtype=torch.int8, device=device),
                                  torch.ones(8, dtype=torch.bfloat16, device=device))
        return True
    except (RuntimeError, NotImplementedError, AttributeError):
        return False


def quantize_int8_(model: nn.Module) -> nn.Module:
    """Replace every Linear (attention, MLP, LM head) in place."""
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, Int8Linear(child))
    return model
