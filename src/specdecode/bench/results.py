"""Where benchmark results go: a JSON file per run, which records the command line that produced it."""
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


def machine_info() -> dict:
    """What a figure was measured on: CPU model and the flags that decide our kernels, torch, threads."""
    import torch

    from ..executor.backends import cpu_flags

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.partition(":")[2].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return {"cpu": model, "cpu_flags": [f for f in KEY_CPU_FLAGS if f in cpu_flags()], "cores": os.cpu_count(),
            "torch": torch.__version__, "threads": torch.get_num_threads()}


def describe_machine(info: dict) -> str:
    return (f"{info['cpu']} ({info['cores']} cores; {' '.join(info['cpu_flags']) or 'no AVX2'}), "
            f"torch {info['torch']}, {info['threads']} threads")
