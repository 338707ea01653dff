"""What this CPU can do: every speed choice is made per capability (AVX2, AVX-512 VNNI/BF16, AMX)."""

from __future__ import annotations

import ctypes
import functools

import torch


def _cpuinfo(field: str) -> str:
    """The value of the first /proc/cpuinfo line naming `field` ("" where there is none, or no such file)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith(field)), "")
    except OSError:
        return ""
    return line.partition(":")[2].strip()


@functools.cache
def cpu_flags() -> frozenset[str]:
    return frozenset(_cpuinfo("flags").split())


@functools.cache
def cpu_vendor() -> str:
    """vendor_id: GenuineIntel, AuthenticAMD, or ""."""
    return _cpuinfo("vendor_id")


def cpu_has_native_bf16() -> bool:
    try:
        mkldnn_bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:
        return False
    return mkldnn_bf16 and ("avx512_bf16" in cpu_flags() or "amx_bf16" in cpu_flags())


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


@functools.cache
def keep_freed_memory() -> bool:
    """Ask glibc to keep freed memory for reuse instead of returning it to the OS. A decode step allocates
    and frees the same activation buffers (the LM head's output among them, 600 KB) about a hundred times;
    by default blocks over 128 KiB are mmapped and unmapped each time, and heaps of other threads (the
    server's engine thread) are trimmed, so every step faults its pages in again. Process-wide; returns
    False where the C library is not glibc."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018  (glibc only)
    except (OSError, AttributeError):
        return False
    return bool(libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)) and bool(libc.mallopt(_M_MMAP_THRESHOLD, 1 << 28))


PAGE_BYTES = 4096


def touch_pages(tensor: torch.Tensor) -> None:
    """Read one byte of every page of a CPU tensor. Weights mapped from the cache file are read from disk
    on first touch; an embedding table is touched a row at a time, by whichever tokens come up, so each
    new token's lookup would wait for a read in the middle of a step. Touching it once at load moves that
    wait to start-up."""
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return
    raw = tensor.reshape(-1).view(torch.uint8)
    int(raw[::PAGE_BYTES].sum())
