"""Copies between the host and the device: from the host without waiting for the device, to the host all at once.

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


def read_at_once(tensors: list[torch.Tensor]) -> list[list[float]]:
    """Each tensor's values, flattened, as floats, in one copy to the host (one wait for the device where a copy
    per tensor would wait once each). Integers read exactly below 2**53 (token ids, counts)."""
    flat = [t.reshape(-1).double() for t in tensors]
    return _split(torch.cat(flat).tolist() if flat else [], flat)


def copied_to_host(picked: torch.Tensor):
    """A copy of `picked` to the host queued now, and a function that waits for it and gives its values: on a GPU,
    waiting for this copy alone, not for work queued after it."""
    if picked.device.type != "cuda":
        return picked.tolist
    host = torch.empty(picked.shape, dtype=picked.dtype, pin_memory=True)
    host.copy_(picked, non_blocking=True)
    done = torch.cuda.Event()
    done.record()

    def read() -> list:
        done.synchronize()
        return host.tolist()

    return read


def read_later(tensors: list[torch.Tensor]):
    """read_at_once's copy queued now (copied_to_host), and a function that waits for it and gives the values: work
    that reads these values on the device goes on meanwhile."""
    flat = [t.reshape(-1).double() for t in tensors]
    read = copied_to_host(torch.cat(flat) if flat else torch.zeros(0, dtype=torch.float64))
    return lambda: _split(read(), flat)


def _split(values: list[float], flat: list[torch.Tensor]) -> list[list[float]]:
    out, taken = [], 0
    for t in flat:
        out.append(values[taken : taken + t.numel()])
        taken += t.numel()
    return out
