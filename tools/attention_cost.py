"""The CPU attention kernel alone at a context length, beside the two floors a decode step's attention cannot
go under on this machine: the KV bytes at the read bandwidth, and its multiply-adds at the rate a float32 matrix
product reaches on the same threads. The 1.5B's shape by default (28 layers, 12 query heads on 2 KV heads of
128, a float16 cache), one cache per layer so the stream comes from memory as it does in the engine.

    python tools/attention_cost.py --keys 1024 16384 32000 [--rows 1 2 4] [--against REVISION] [--in-engine]

With --against, the kernel as of a git revision too (its attention.c built with this build's flags), the two
timed in turn over the same caches, and the ratio of their steps. With --in-engine, the default target's whole
decode step instead (its weights' kernels between the attention calls, as in the engine) after that many cached
tokens (synthetic: the contents change no cost), against what its bytes allow at the read rate.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from specdecode.bench.results import describe_machine, machine_info, read_bandwidth
from specdecode.config import DEFAULT_TARGET
from specdecode.engine.memory import kv_bytes_per_token
from specdecode.executor.attention import RowwiseAttentionKernel
from specdecode.executor.hugepages import huge_page_zeros
from specdecode.executor.kernels import bind, build, compiler, default_isa, load
from specdecode.executor.runner import ModelRunner
from specdecode.models.loader import load_model

LAYERS, HEADS, KV_HEADS, DIM, BLOCK = 28, 12, 2, 128, 64
SOURCE = "src/specdecode/executor/kernels/attention.c"


def matmul_flops(n: int = 2048, repeats: int = 3) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / min(_seconds(lambda: a @ b) for _ in range(repeats))


def _seconds(work) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def _on_huge_pages(cache: torch.Tensor) -> torch.Tensor:
    """The cache on 2 MB pages where the kernel gives them, as the engine allocates it."""
    if os.environ.get("SMALL_PAGES"):
        return cache
    moved = huge_page_zeros(tuple(cache.shape), cache.dtype)
    moved.copy_(cache)
    return moved


def step_seconds(kernels: list, keys: int, rows: int, repeats: int = 5) -> list[float]:
    """Each kernel's best of `repeats` steps, the kernels taken in turn over the same caches: every layer's call for
    `rows` new tokens after `keys` cached ones."""
    blocks = (keys + rows + BLOCK - 1) // BLOCK
    caches = [_on_huge_pages(torch.randn(blocks, KV_HEADS, BLOCK, DIM).half()) for _ in range(2 * LAYERS)]
    cache = SimpleNamespace(
        k=caches[:LAYERS], v=caches[LAYERS:], table=torch.arange(blocks, dtype=torch.int32)[None], num_slots=1,
        max_blocks=blocks, block_size=BLOCK, num_blocks=blocks,
    )  # fmt: skip
    batch = SimpleNamespace(
        slots=torch.zeros(1, rows, dtype=torch.int64), positions=torch.arange(keys, keys + rows)[None]
    )
    angles = torch.rand(1, rows, DIM // 2).repeat(1, 1, 2)
    rope = (angles.cos(), angles.sin())
    qkv = torch.randn(1, rows, (HEADS + 2 * KV_HEADS) * DIM)
    layers = [SimpleNamespace(layer=i, qk_norms=None, scale=DIM**-0.5, window=0) for i in range(LAYERS)]

    def step(kernel):
        for attn in layers:
            kernel(qkv, rope, batch, cache, attn)

    best = [float("inf")] * len(kernels)
    for _ in range(repeats):
        for i, kernel in enumerate(kernels):
            best[i] = min(best[i], _seconds(lambda kernel=kernel: step(kernel)))
    return best


def engine_step_seconds(model, kernels: list, keys: int, repeats: int) -> list[float]:
    """The median seconds of the target's decode step after `keys` cached tokens with each attention kernel, the
    kernels taken in turn."""
    runner = ModelRunner(model, 1, keys + 1)
    slot = runner.allocate()
    runner.assume_cached(slot, keys)
    attentions = [layer.self_attn for layer in model.layers]
    steps: list[list[float]] = [[] for _ in kernels]
    with torch.inference_mode():
        for i in range(len(kernels) * (repeats + 1)):
            for attention in attentions:
                attention.rowwise_kernel = kernels[i % len(kernels)]
            seconds = _seconds(lambda: runner.forward([slot], [[0]], "last"))  # writes position `keys`, commits none
            if i >= len(kernels):  # each kernel's first step warms up
                steps[i % len(kernels)].append(seconds)
    return [statistics.median(s) for s in steps]


def in_engine(kernels: list, keys: list[int], repeats: int, against: str | None) -> None:
    model = load_model(DEFAULT_TARGET, progress=False).model
    bandwidth = read_bandwidth()
    print(f"{describe_machine(machine_info())}; {DEFAULT_TARGET}; read {bandwidth / 1e9:.1f} GB/s")
    columns = f" ms at {against} | this kernel's step against it |" if against else ""
    print("| cached tokens | ms a decode step | ms its bytes take at the read rate | bytes' rate reached |" + columns)
    print("|---:|---:|---:|---:|" + "---:|---:|" * bool(against))
    for n in keys:
        seconds = engine_step_seconds(model, kernels, n, repeats)
        floor = (model.weight_bytes() + kv_bytes_per_token(model.cfg, model.kv_dtype) * n) / bandwidth
        row = f"| {n:,} | {seconds[0] * 1e3:.1f} | {floor * 1e3:.1f} | {floor / seconds[0]:.0%} |"
        if against:
            row += f" {seconds[1] * 1e3:.1f} | {seconds[0] / seconds[1]:.2f}× |"
        print(row, flush=True)


def kernel_at(revision: str) -> RowwiseAttentionKernel:
    """The attention kernel as of a git revision, compiled as the current one is."""
    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(["git", "show", f"{revision}:{SOURCE}"], cwd=root, capture_output=True, check=True).stdout
    lib = ctypes.CDLL(build("attention", default_isa(), compiler(), source))
    return RowwiseAttentionKernel(bind(lib, "attention"), HEADS, KV_HEADS, DIM)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, nargs="+", default=[1024, 16384])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--against", metavar="REVISION", help="also the kernel as of this git revision")
    parser.add_argument("--repeats", type=int, default=5, help="steps of each kernel: the best (engine: median)")
    parser.add_argument("--in-engine", action="store_true", help="the default target's decode step (1 row)")
    args = parser.parse_args()
    kernels = [RowwiseAttentionKernel(load("attention"), HEADS, KV_HEADS, DIM)]
    if args.against:
        kernels.append(kernel_at(args.against))
    if args.in_engine:
        in_engine(kernels, args.keys, args.repeats, args.against)
        return
    bandwidth, flops = read_bandwidth(), matmul_flops()
    print(f"{describe_machine(machine_info())}; read {bandwidth / 1e9:.1f} GB/s, matmul {flops / 1e9:.0f} GFLOP/s")
    against = f" ms at {args.against} | this kernel's step against it |" if args.against else ""
    header = "| keys | rows | ms a step | KV bytes at the read rate | its arithmetic at the matmul rate | ns a key |"
    print(header + against)
    print("|---:|---:|---:|---:|---:|---:|" + "---:|---:|" * bool(args.against))
    for keys in args.keys:
        for rows in args.rows:
            seconds = step_seconds(kernels, keys, rows, args.repeats)
            kv_bytes = LAYERS * 2 * KV_HEADS * keys * DIM * 2
            arithmetic = LAYERS * KV_HEADS * keys * rows * HEADS // KV_HEADS * DIM * 2 * 2  # scores, values
            per_key = seconds[0] / (LAYERS * keys) * 1e9  # a key of each KV head: one thread each
            row = (
                f"| {keys:,} | {rows} | {seconds[0] * 1e3:.1f} | {kv_bytes / bandwidth * 1e3:.1f} | "
                f"{arithmetic / flops * 1e3:.1f} | {per_key:.0f} |"
            )
            if args.against:
                row += f" {seconds[1] * 1e3:.1f} | {seconds[0] / seconds[1]:.2f}× |"
            print(row, flush=True)


if __name__ == "__main__":
    main()
