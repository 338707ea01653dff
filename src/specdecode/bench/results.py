"""What every benchmark records beside its figures (the command line, the machine), how its rows compare with
plain decoding, and where they go: a JSON file per run."""

from __future__ import annotations

import json
import os
import platform
import sys

KEY_CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def command_line() -> str:
    return "specdecode " + " ".join(sys.argv[1:])


def write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
    print(f"wrote {path}")


KERNEL_PATHS = {
    1024: "AVX-512 VNNI + AMX int8 tiles",
    512: "AVX-512 VNNI",
    256: "AVX2",
    0: "scalar C",
    -1: "unavailable",
}


def machine_info() -> dict:
    """What a figure was measured on: CPU model and the flags that decide our kernels, torch, threads."""
    import torch

    from ..executor.cpu import cpu_flags
    from ..executor.kernels import default_isa
    from ..executor.quant import lowbit_isa

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.partition(":")[2].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return {
        "cpu": model,
        "cpu_flags": [f for f in KEY_CPU_FLAGS if f in cpu_flags()],
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "kernels": f"{default_isa()} build: {KERNEL_PATHS[lowbit_isa()]}",
    }


def read_bandwidth(gib: int = 2, repeats: int = 5) -> float:
    """Bytes per second that summing a tensor far larger than the caches reads on this process's threads (the best
    of a few passes): the most a decode step's weights and KV cache could stream at."""
    import time

    import torch

    data = torch.ones(gib * 2**30 // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    return data.numel() * 4 / best


def median_seconds(fn, repeats: int = 30) -> float:
    """The median wall time of `repeats` calls of fn after one warm-up call, each timed after the accelerator
    (if any) finishes its queued work."""
    from ..timing import now

    fn()
    times = []
    for _ in range(repeats):
        start = now()
        fn()
        times.append(now() - start)
    return sorted(times)[len(times) // 2]


def describe_machine(info: dict) -> str:
    """machine_info in one line, for a benchmark's printed header."""
    return (
        f"{info['cpu']} ({info['cores']} cores; {' '.join(info['cpu_flags']) or 'no AVX2'}), "
        f"torch {info['torch']}, {info['threads']} threads, kernels {info.get('kernels', '?')}"
    )


def speedup_against(row: dict, plain: dict) -> tuple[float | None, float | None]:
    """(output throughput ratio, TPOT reduction) of a load row against plain decoding's row under the same
    load; None where a figure is missing, e.g. when every request failed."""
    speedup = row["output_throughput"] / plain["output_throughput"] if plain["output_throughput"] else None
    tpot = plain["tpot_s"]["mean"] / row["tpot_s"]["mean"] if row["tpot_s"] and plain["tpot_s"] else None
    return speedup, tpot
