"""LoRA adapters' updates by this package's kernel (kernels/lora.c): one call a layer where PyTorch takes several
small ones, each row computed alone (docs/decisions.md#lora-adapters-beside-the-weights)."""

from __future__ import annotations

import ctypes

import torch

from ..errors import SpecDecodeError
from .kernels import load_for

ERRORS = {
    -31: "an adapter's rows, widths, ranks, a block out of range or an unknown format",
    -32: "an adapter's buffer is missing",
}
# The element formats the kernel reads an adapter's matrices in (FORMAT_* there)
FORMATS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


class LoRAKernel:
    """Replaces an adapter set's update (models/lora.py's AdapterSet): y += B(Ax) in place, for float32 rows on the
    CPU, the set's matrices in float32 or as stored in 16 bits."""

    def __init__(self, lib):
        self.lib = lib

    def __call__(self, adapter_set, x: torch.Tensor, y: torch.Tensor) -> None:
        code = self.lib.lora_update(*self.arguments(adapter_set, x.contiguous(), y))
        if code:
            raise SpecDecodeError(f"the LoRA kernel refused an update: {ERRORS.get(code, code)}")

    def arguments(self, adapter_set, x: torch.Tensor, y: torch.Tensor) -> tuple:
        """lora_update's arguments for y += B(Ax), x contiguous (the structs they point to kept on the set)."""
        spans, addresses = self.layout(adapter_set)
        return (
            x.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], adapter_set.lora_a.data_ptr(),
            FORMATS[adapter_set.lora_a.dtype], adapter_set.scales.data_ptr(), adapter_set.rank,
            len(adapter_set.spans), ctypes.addressof(spans), ctypes.addressof(addresses), y.data_ptr(), y.shape[-1],
            torch.get_num_threads(),
        )  # fmt: skip

    def layout(self, adapter_set) -> tuple:
        """The set's spans as C ints and its B's addresses as a C array (kept on the set, made again where its
        buffers moved)."""
        spans = adapter_set.spans
        pointers = [getattr(adapter_set, f"lora_b{i}").data_ptr() for i in range(len(spans))]
        found = getattr(adapter_set, "kernel_layout", None)
        if found is None or found[2] != pointers:
            ints = [n for rows, ranks in spans for n in (rows.start, _width(rows), ranks.start, _width(ranks))]
            found = (ctypes.c_int * len(ints))(*ints), (ctypes.c_void_p * len(pointers))(*pointers), pointers
            adapter_set.kernel_layout = found
        return found[0], found[1]


def _width(span: slice) -> int:
    return span.stop - span.start


def attach_lora_kernel(model) -> bool:
    """Give the model's adapted layers the kernel where it applies (float32 on the CPU); True if it did."""
    from ..models.lora import LowRankAdded

    lib = load_for(model, "lora")
    if lib is None:
        return False
    kernel = LoRAKernel(lib)
    for module in model.modules():
        if isinstance(module, LowRankAdded):
            module.kernel = kernel
    return True
