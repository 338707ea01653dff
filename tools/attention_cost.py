"""The CPU attention kernel alone at a context length, beside the two floors a decode step's attention cannot
go under on this machine: the KV bytes at the read bandwidth, and its multiply-adds at the rate a float32 matrix
product reaches on the same threads. The 1.5B's shape by default (28 layers, 12 query heads on 2 KV heads of
128, a float16 cache), one cache per layer so the stream comes from memory as it does in the engine.

    python tools/attention_cost.py --keys 1024 16384 32000 [--rows 1 2 4]
"""

from __future__ import annotations

import argparse
import os
import time
from types import SimpleNamespace

import torch

from specdecode.bench.results import describe_machine, machine_info, read_bandwidth
from specdecode.executor.attention import RowwiseAttentionKernel
from specdecode.executor.hugepages import huge_page_zeros
from specdecode.executor.kernels import load

LAYERS, HEADS, KV_HEADS, DIM, BLOCK = 28, 12, 2, 128, 64


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


def step_seconds(kernel: RowwiseAttentionKernel, keys: int, rows: int, repeats: int = 5) -> float:
    """The best of `repeats` steps: every layer's call for `rows` new tokens after `keys` cached ones."""
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

    def step():
        for attn in layers:
            kernel(qkv, rope, batch, cache, attn)

    return min(_seconds(step) for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, nargs="+", default=[1024, 16384])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    args = parser.parse_args()
    kernel = RowwiseAttentionKernel(load("attention"), HEADS, KV_HEADS, DIM)
    bandwidth, flops = read_bandwidth(), matmul_flops()
    print(f"{describe_machine(machine_info())}; read {bandwidth / 1e9:.1f} GB/s, matmul {flops / 1e9:.0f} GFLOP/s")
    print("| keys | rows | ms a step | KV bytes at the read rate | its arithmetic at the matmul rate | ns a key |")
    print("|---:|---:|---:|---:|---:|---:|")
    for keys in args.keys:
        for rows in args.rows:
            seconds = step_seconds(kernel, keys, rows)
            kv_bytes = LAYERS * 2 * KV_HEADS * keys * DIM * 2
            arithmetic = LAYERS * KV_HEADS * keys * rows * HEADS // KV_HEADS * DIM * 2 * 2  # scores, values
            per_key = seconds / (LAYERS * keys) * 1e9  # a key of each KV head: one thread each
            print(
                f"| {keys:,} | {rows} | {seconds * 1e3:.1f} | {kv_bytes / bandwidth * 1e3:.1f} | "
                f"{arithmetic / flops * 1e3:.1f} | {per_key:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
