"""Native CPU kernels that no installed library provides
(docs/decisions.md#linear-layers-gguf-block-formats-as-stored has the measurements).

Each kernel is one C file, compiled on first use for this machine's CPU (`-march=native`) with the
system's C compiler, and cached under the specdecode cache; it is called through ctypes on tensor
memory. Every kernel has a portable scalar path, which is also the reference its SIMD paths are tested
against bit for bit: `SPECDECODE_KERNELS=scalar` builds that path for every kernel (CI runs the suite
both ways). Without a compiler, or when the build fails, `load` returns None, `build_problem` says why
(the compiler's own output included), and the backends that need a kernel are not offered.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from importlib import resources

from ...models.sources import cache_root
from ..cpu import cpu_flags, cpu_vendor

FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC"]
ENV = "SPECDECODE_KERNELS"

_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
# Argument types per exported function: ctypes then passes addresses (ints) without wrapping each one.
SIGNATURES = {
    "lowbit": {
        "lowbit_isa": ([], _I),
        "lowbit_linear": ([_I, _P, _I, _I, _I, _I, _P, _P, _P, _P, _P, _P, _P, _I, _I], _I),
        "lowbit_dequantize_rows": ([_I, _I, _I, _I, _P, _P, _P, _P, _P, _P, _P, _I, _P], _I),
        "lowbit_moe": (
            [_I, _I, _I, _I, _P, _I, _I, _I, _I, _P, _I, _I, _P, _F, _P, _P, _P, _I, _P, _P, _P, _I, _I],
            _I,
        ),
    },
    "norm": {
        "rms_norm": ([_P, _P, _P, _I, _I, _F, _I], _I),
        "add_rms_norm": ([_P, _P, _P, _P, _I, _I, _F, _I], _I),
        "silu_mul": ([_P, _P, _I, _I, _I], _I),
        "gelu_tanh_mul": ([_P, _P, _I, _I, _I], _I),
    },
    "decoder": {"decoder_layers": ([_P, _P, _P, _P, _I, _P], _I)},
    # x, rows, in, A, rank, blocks, spans, B (an array of addresses), y, out, threads
    "lora": {"lora_update": ([_P, _I, _I, _P, _I, _P, _I, _I, _P, _P, _P, _I, _I], _I)},
    "attention": {
        "attention_dim_ok": ([_I], _I),
        "attention_group_ok": ([_I], _I),
        "attention_half_ok": ([], _I),
        "attention_softmax_unnormalised": ([_P, _I, _F], _F),
        # qkv, N, H, Hkv, D, slots, positions, cos, sin, q_norm, k_norm, eps, scale, window, softcap, sinks, kcache,
        # vcache, tables, S, MB, B, num_blocks, out, threads
        **{
            name: ([_P, _I, _I, _I, _I, *[_P] * 6, _F, _F, _I, _F, _P, _P, _P, _P, _I, _I, _I, _I, _P, _I], _I)
            for name in ("rowwise_attention", "rowwise_attention_f16")
        },
    },
}

# Instruction sets a kernel can be built for at or below the machine's own, so that each path is tested on
# any machine that has it: an AMX machine runs the AVX-512 path too, an AVX-512 machine the AVX2 one, every
# machine the scalar one.
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")
ISA_FLAGS = {
    "native": [],
    "avx512": ["-mno-amx-tile", "-mno-amx-int8"],
    "avx2": ["-mno-avx512f"],
    "scalar": ["-DSPECDECODE_SCALAR"] + (["-mno-avx"] if _X86 else []),
}

_problems: dict[str, str] = {}


class KernelBuildError(RuntimeError):
    """A kernel did not compile; the message holds the compiler's output."""


def default_isa() -> str:
    """The build the backends use: the machine's own, or what SPECDECODE_KERNELS names."""
    isa = os.environ.get(ENV, "native") or "native"
    if isa not in ISA_FLAGS:
        raise ValueError(f"{ENV}={isa!r}: use one of {', '.join(ISA_FLAGS)}")
    return isa


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def load(name: str, isa: str | None = None) -> ctypes.CDLL | None:
    """The compiled kernel `name` for `isa` (default: default_isa()), or None (build_problem says why)."""
    return _load(name, isa or default_isa())


def load_for(model, name: str) -> ctypes.CDLL | None:
    """The kernel `name` where `model` computes in float32 on the CPU (what the kernels take), else None."""
    import torch

    return load(name) if model.device.type == "cpu" and model.dtype == torch.float32 else None


def build_problem(name: str, isa: str | None = None) -> str | None:
    """Why `load(name, isa)` returns None: no compiler, or the compiler's error output."""
    return _problems.get(f"{name}/{isa or default_isa()}")


@functools.cache
def _load(name: str, isa: str) -> ctypes.CDLL | None:
    cc = compiler()
    if cc is None:
        _problems[f"{name}/{isa}"] = (
            "no C compiler found (install gcc or clang, or set CC); the native kernels "
            "are needed for the low-bit backends"
        )
        return None
    try:
        path = build(name, isa, cc)
        try:
            lib = ctypes.CDLL(path)
        except OSError:  # a damaged cached library (a full disk, a copy cut short): built again
            os.remove(path)
            lib = ctypes.CDLL(build(name, isa, cc))
    except (KernelBuildError, OSError) as e:
        _problems[f"{name}/{isa}"] = str(e)
        return None
    return bind(lib, name)


def bind(lib: ctypes.CDLL, name: str) -> ctypes.CDLL:
    """`lib` with the argument and result types of kernel `name`'s entry points set."""
    for function, (argtypes, restype) in SIGNATURES.get(name, {}).items():
        getattr(lib, function).argtypes = argtypes
        getattr(lib, function).restype = restype
    return lib


def build(name: str, isa: str, cc: str, source: bytes | None = None) -> str:
    """Compile kernels/<name>.c (or `source` in its place, another version of it) for `isa` into the cache (once
    per source, flags and CPU); the path of the shared library. Processes that need the same library at once (the
    test workers, the replicas of a server) wait for one build under a file lock instead of each compiling it."""
    if source is None:
        source = resources.files(__package__).joinpath(f"{name}.c").read_bytes()
    flags = FLAGS + ISA_FLAGS[isa] + machine_defines(name, isa)
    key = hashlib.sha1(source + " ".join([cc, *flags]).encode() + _cpu_signature().encode()).hexdigest()[:16]
    folder = os.path.join(cache_root(), "kernels")
    path = os.path.join(folder, f"{name}-{isa}-{key}.so")
    if os.path.exists(path):
        return path
    os.makedirs(folder, exist_ok=True)
    lock_path = path + ".lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not os.path.exists(path):
                _compile(name, cc, flags, source, path)
        finally:  # the library is in place before the lock goes, so a process that finds no lock finds the library
            with contextlib.suppress(FileNotFoundError):
                os.remove(lock_path)
    return path


def _compile(name: str, cc: str, flags: list[str], source: bytes, path: str) -> None:
    """The build goes to a temporary file beside its final place and is renamed there, so an interrupted build
    never leaves a partial library behind."""
    fd, src = tempfile.mkstemp(dir=os.path.dirname(path), prefix=f"{name}-", suffix=".c")
    built = src[:-2] + ".so.tmp"
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(source)
        try:
            done = subprocess.run([cc, *flags, src, "-o", built], capture_output=True, text=True)
        except OSError as e:
            raise KernelBuildError(f"could not run the C compiler {cc!r}: {e}") from None
        if done.returncode != 0:
            raise KernelBuildError(f"compiling the {name} kernel with {cc} failed:\n{done.stderr.strip()}")
        os.replace(built, path)
    finally:
        for leftover in (src, built):
            if os.path.exists(leftover):
                os.remove(leftover)


def machine_defines(name: str, isa: str) -> list[str]:
    """Choices of a kernel's build that its instruction set does not make: the attention kernel asks for the
    cache into L2 on Intel's AVX-512 cores, into L1 elsewhere (docs/decisions.md#avx2-attention)."""
    avx512 = isa == "avx512" or (isa == "native" and "avx512f" in cpu_flags())
    if name == "attention" and avx512 and cpu_vendor() == "GenuineIntel":
        return ["-DSPECDECODE_PREFETCH_L2"]
    return []


def _cpu_signature() -> str:
    """A compiled kernel is specific to the CPU it was built for (-march=native)."""
    return " ".join(sorted(cpu_flags()))
