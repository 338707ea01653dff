"""Native CPU kernels that no installed library provides (docs/decisions.md has the measurements).

Each kernel is one C file, compiled on first use for this machine's CPU (`-march=native`) with the
system's C compiler, and cached under the specdecode cache; it is called through ctypes on tensor
memory. Without a compiler, or on a CPU without AVX2, `load` returns None and the backends that need it
are not offered."""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from importlib import resources

from ...models.sources import cache_root
from ..cpu import cpu_flags

FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC"]


_P, _I = ctypes.c_void_p, ctypes.c_int
# Argument types per exported function: ctypes then passes addresses (ints) without wrapping each one.
SIGNATURES = {
    "lowbit": {"w4a8_isa": [],
               "w4a8_linear": [_P, _I, _I, _I, _I, _P, _P, _P, _P, _P, _P, _I],
               "w6a8_linear": [_P, _I, _I, _I, _P, _P, _P, _P, _P, _I]},
    "norm": {"rms_norm": [_P, _P, _P, _I, _I, ctypes.c_float, _I],
             "add_rms_norm": [_P, _P, _P, _P, _I, _I, ctypes.c_float, _I],
             "silu_mul": [_P, _P, _I, _I, _I]},
    "attention": {"attention_dim_ok": [_I],
                  "rowwise_attention": [_P, _I, _I, _I, _I, _P, _P, _P, _P, _P, _P, _I, _P, _I]},
}

# Instruction sets a kernel can be built for below the machine's own: each path is tested on any machine
# that has it (an AVX-512 machine runs the AVX2 path too).
ISA_FLAGS = {"native": [], "avx2": ["-mno-avx512f"]}


@functools.cache
def load(name: str, isa: str = "native") -> ctypes.CDLL | None:
    source = resources.files(__package__).joinpath(f"{name}.c").read_bytes()
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    flags = FLAGS + ISA_FLAGS[isa]
    key = hashlib.sha1(source + " ".join(flags).encode() + _cpu_signature().encode()).hexdigest()[:16]
    path = os.path.join(cache_root(), "kernels", f"{name}-{key}.so")
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, f"{name}.c")
            with open(src, "wb") as f:
                f.write(source)
            built = os.path.join(tmp, f"{name}.so")
            done = subprocess.run([compiler, *flags, src, "-o", built], capture_output=True, text=True)
            if done.returncode != 0:
                return None
            os.replace(built, path)
    lib = ctypes.CDLL(path)
    for function, argtypes in SIGNATURES.get(name, {}).items():
        getattr(lib, function).argtypes = argtypes
    return lib


def _cpu_signature() -> str:
    """A compiled kernel is specific to the CPU it was built for (-march=native)."""
    return " ".join(sorted(cpu_flags()))
