"""Weights and KV caches on 2 MB pages (Linux transparent huge pages, asked for with madvise).

A decode step streams every weight and, over a long context, the whole KV cache: on 4 KB pages that is a
page walk every 4 KB (a 1.5B model's 1 GB is 250,000 pages, far past what the TLB holds), and the
hardware prefetchers stop at every page's end. On 2 MB pages neither happens. Weights loaded from the
cache file sit in the page cache, which has no huge pages, so they are copied once into one anonymous
arena that does. Where the kernel refuses (another OS, THP set to "never") the memory stays on small
pages and everything works as before."""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import os

import torch
from torch import nn

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE, _MADV_COLLAPSE = 14, 25  # linux/mman.h
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"
ENV = "SPECDECODE_HUGE_PAGES"  # "0": small pages only (to measure what huge pages change)
_ALIGN = 64  # each tensor's start in the arena: a cache line, as the kernels' loads expect at least


@functools.cache
def _madvise():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise


def huge_pages_available() -> bool:
    """Whether this kernel gives huge pages to memory that asks (THP "always" or "madvise")."""
    try:
        with open(_THP_SETTING) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def _collapse(tensor: torch.Tensor) -> None:
    """Have the kernel put the whole 2 MB pages of this filled range on huge pages now where the page
    faults could not (memory too fragmented to find 2 MB at once); a kernel before Linux 6.1 declines."""
    madvise = _madvise()
    whole = tensor.numel() * tensor.element_size() // HUGE_PAGE * HUGE_PAGE
    if madvise is not None and whole > 0:
        madvise(tensor.data_ptr(), whole, _MADV_COLLAPSE)


def huge_page_empty(nbytes: int) -> tuple[torch.Tensor, bool]:
    """An uninitialised uint8 CPU tensor of `nbytes`, and whether its pages will be huge: from 2 MB on it
    starts on a 2 MB boundary of a mapping of its own, whose pages are asked to be huge before first touch (smaller
    ones, or with huge pages turned off, are a plain allocation). A mapping of its own, not the allocator's memory:
    that may reuse pages already touched, which stay small unless the kernel finds 2 MB free to collapse them into."""
    madvise = _madvise() if os.environ.get(ENV, "1") != "0" else None
    if madvise is None or nbytes < HUGE_PAGE:
        return torch.empty(nbytes, dtype=torch.uint8), False
    # the tensor holds the mapping (torch.frombuffer keeps its buffer), which is unmapped when the last view goes
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    padded = torch.frombuffer(region, dtype=torch.uint8)
    skip = -padded.data_ptr() % HUGE_PAGE
    tensor = padded[skip : skip + nbytes]
    return tensor, madvise(tensor.data_ptr(), nbytes // HUGE_PAGE * HUGE_PAGE, _MADV_HUGEPAGE) == 0


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype) on huge pages (for a KV cache)."""
    raw, advised = huge_page_empty(math.prod(shape) * dtype.itemsize)
    raw.zero_()
    if advised:
        _collapse(raw)
    return raw.view(dtype).view(shape)


def move_to_huge_pages(model: nn.Module) -> int:
    """Copy every CPU parameter and buffer of `model` into one huge-page arena, tensors that share memory
    (tied weights, views) still sharing it; modules keep their tensors (Parameters stay Parameters).
    Returns the bytes moved, 0 where the kernel gave no huge pages (then nothing moves)."""
    storages: dict[int, tuple[torch.UntypedStorage, int]] = {}
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        storage = t.untyped_storage()
        if t.device.type == "cpu" and storage.data_ptr() not in storages and storage.nbytes() > 0:
            storages[storage.data_ptr()] = (storage, total)
            total += -(-storage.nbytes() // _ALIGN) * _ALIGN
    if total < HUGE_PAGE:
        return 0
    arena, advised = huge_page_empty(total)
    if not advised:
        return 0
    for storage, at in storages.values():
        arena[at : at + storage.nbytes()].copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
    _collapse(arena)

    def in_arena(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if t.device.type != "cpu" or storage.data_ptr() not in storages:
            return t
        _, at = storages[storage.data_ptr()]
        whole = arena[at : at + storage.nbytes()].view(t.dtype)
        return whole.as_strided(t.shape, t.stride(), whole.storage_offset() + t.storage_offset())

    with torch.no_grad():
        model._apply(in_arena)  # modules that cache buffer addresses take them again (BlockLinear)
    return total
