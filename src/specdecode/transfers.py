"""Copies from the host to the device that do not wait for the device.

PyTorch's default copy of host values to a GPU (`torch.tensor(values, device=...)`, `copy_` of a host tensor, a list
used as an index) waits for every kernel queued before it, so that its source may be freed at once: the host then
idles until the device catches up, and the device idles while the host prepares the next launch. From pinned memory
the copy is queued like a kernel instead (PyTorch's pinned-memory cache keeps the source until the copy has run)."""

from __future__ import annotations

import torch


def to_device(values, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """`values` (a list, or nested lists) as a tensor on `device`, queued behind the device's work."""
    if torch.device(device).type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def tensor_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, queued behind the device's work."""
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def copy_into(dest: torch.Tensor, values) -> None:
    """dest[:] = values from the host, queued behind the device's work."""
    dest.copy_(torch.tensor(values, dtype=dest.dtype, pin_memory=dest.is_cuda), non_blocking=True)
