"""What this CPU can do: every speed choice is made per capability (AVX2, AVX-512 VNNI/BF16, AMX)."""
from __future__ import annotations

import functools

import torch


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def cpu_has_native_bf16() -> bool:
    try:
        mkldnn_bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:
        return False
    return mkldnn_bf16 and ("avx512_bf16" in cpu_flags() or "amx_bf16" in cpu_flags())
