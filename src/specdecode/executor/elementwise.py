"""RMSNorm (with the residual add before it), SwiGLU and GeGLU by this package's kernel (kernels/norm.c): one
call each where PyTorch runs about eight and three small operations, which at one token per step cost
more than the arithmetic (docs/decisions.md#fused-norms-and-swiglu-and-a-steps-layers-in-one-call)."""

from __future__ import annotations

import torch

from ..errors import SpecDecodeError
from .kernels import load_for

ERRORS = {-1: "rows, width or epsilon out of range", -2: "a buffer is missing"}


def _check(code: int, what: str) -> None:
    if code:
        raise SpecDecodeError(f"the elementwise kernel refused {what}: {ERRORS.get(code, code)}")


class NormKernel:
    """Replaces RMSNorm.forward: norm(x), or (norm(x + residual), x + residual) with the sum written into
    the residual tensor, which the model owns."""

    def __init__(self, lib):
        self.lib = lib

    def __call__(self, norm, x: torch.Tensor, residual: torch.Tensor | None = None):
        x = x.contiguous()
        dim = x.shape[-1]
        out = torch.empty_like(x)
        rows, threads = x.numel() // dim, torch.get_num_threads()
        if residual is None:
            _check(
                self.lib.rms_norm(x.data_ptr(), norm.weight.data_ptr(), out.data_ptr(), rows, dim, norm.eps, threads),
                "an RMSNorm",
            )
            return out
        residual = residual.contiguous()
        _check(
            self.lib.add_rms_norm(
                residual.data_ptr(), x.data_ptr(), norm.weight.data_ptr(), out.data_ptr(), rows, dim, norm.eps, threads
            ),
            "an RMSNorm",
        )
        return out, residual


class ActMulKernel:
    """Replaces MLP's act(gate) * up on the gate_up projection's output [..., 2 * inter]: SiLU (SwiGLU) or GELU's
    tanh approximation (GeGLU)."""

    FUNCTIONS = {"silu": ("silu_mul", "a SwiGLU"), "gelu_tanh": ("gelu_tanh_mul", "a GeGLU")}  # and what they compute

    def __init__(self, lib, activation: str):
        name, self.what = self.FUNCTIONS[activation]
        self.lib, self.fn = lib, getattr(lib, name)

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate_up = gate_up.contiguous()
        inter = gate_up.shape[-1] // 2
        out = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype)
        _check(
            self.fn(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * inter), inter, torch.get_num_threads()),
            self.what,
        )
        return out


def attach_elementwise_kernels(model) -> bool:
    """Give the model's norms and gated MLPs the kernels where they apply (float32 on the CPU); True if it
    did. A norm the model shares with another (a draft head reads its target's final norm) gets it too."""
    from ..models.layers import MLP, RMSNorm

    lib = load_for(model, "norm")
    if lib is None:
        return False
    norm = NormKernel(lib)
    act_mul = {activation: ActMulKernel(lib, activation) for activation in ActMulKernel.FUNCTIONS}
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.kernel = norm
        elif isinstance(module, MLP):
            module.act_mul_kernel = act_mul.get(module.activation)  # gpt-oss's clamped SwiGLU: PyTorch's
    return True
