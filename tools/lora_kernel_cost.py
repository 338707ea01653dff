"""What the LoRA kernel (kernels/lora.c) takes for one step's updates of the 1.5B with a rank-16 adapter on all 112
projections, per format the adapter is kept in, rows per call and kernel build, in one run: the best of the repeats,
each over as many copies of the adapter as it takes to read from memory rather than cache (a step reads the model's
weights between two updates of a layer).

python tools/lora_kernel_cost.py --builds native avx2 --rows 1 4 8
"""

from __future__ import annotations

import argparse
import time

import torch

from specdecode.bench.results import describe_machine, machine_info
from specdecode.executor.kernels import ISA_FLAGS, load
from specdecode.executor.lora_kernel import LoRAKernel
from specdecode.models.lora import AdapterSet

HIDDEN, INTER, KV, LAYERS, RANK = 1536, 8960, 256, 28, 16
# Each projection's input width and its parts' output widths (q/k/v and gate/up each adapted)
PROJECTIONS = {"qkv": (HIDDEN, [HIDDEN, KV, KV]), "o": (HIDDEN, [HIDDEN]), "gate_up": (HIDDEN, [INTER, INTER])}
PROJECTIONS["down"] = (INTER, [HIDDEN])


def adapter_sets(dtype: torch.dtype) -> list[tuple[AdapterSet, int, int]]:
    """One adapter's sets for every projection of every layer, with their input and output widths."""
    sets = []
    for _ in range(LAYERS):
        for inputs, parts in PROJECTIONS.values():
            blocks, first = [], 0
            for i, width in enumerate(parts):
                ranks = slice(i * RANK, (i + 1) * RANK)
                blocks.append((slice(first, first + width), ranks, torch.randn(width, RANK).to(dtype)))
                first += width
            a = torch.randn(RANK * len(parts), inputs).to(dtype)
            sets.append((AdapterSet(a, blocks, torch.ones(a.shape[0])), inputs, first))
    return sets


def step_ms(kernel: LoRAKernel, copies: list, rows: int, repeats: int) -> float:
    """The best time of one step's updates (every set of one copy), over copies read in turn; each call made as the
    one-call decoder makes it, from prepared arguments."""
    x = {inputs: torch.randn(rows, inputs) for inputs in (HIDDEN, INTER)}
    y = {out: torch.zeros(rows, out) for _, _, out in copies[0]}
    calls = [[kernel.arguments(s, x[inputs], y[out]) for s, inputs, out in sets] for sets in copies]
    best = float("inf")
    for _ in range(repeats):
        for arguments in calls:
            started = time.perf_counter()
            for args in arguments:
                kernel.lib.lora_update(*args)
            best = min(best, time.perf_counter() - started)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--builds", nargs="+", default=["native"], choices=list(ISA_FLAGS))
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4, 8])
    parser.add_argument("--copies", type=int, default=8, help="adapters read in turn (74 MB each in float32)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(describe_machine(machine_info()), flush=True)
    formats = [torch.float32, torch.bfloat16, torch.float16]
    copies = {dtype: [adapter_sets(dtype) for _ in range(args.copies)] for dtype in formats}
    print(f"{'build':8s} {'rows':>4s}  " + "  ".join(f"{str(d).removeprefix('torch.'):>9s}" for d in formats))
    for build in args.builds:
        kernel = LoRAKernel(load("lora", build))
        for rows in args.rows:
            times = [step_ms(kernel, copies[dtype], rows, args.repeats) for dtype in formats]
            print(f"{build:8s} {rows:4d}  " + "  ".join(f"{t:6.2f} ms" for t in times), flush=True)
    print(f"one step: {LAYERS} layers x {len(PROJECTIONS)} projections, rank {RANK} on each part")


if __name__ == "__main__":
    main()
