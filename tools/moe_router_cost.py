"""What routing a mixture of experts inside the CPU's experts kernel saves, against PyTorch's Router handing the
kernel its choices (as the kernel ran ERNIE 4.5's and GLM-4.5's routers before it computed them): plain decoding of
one prompt, the two alternating in one process, rounds x tokens each.

    python tools/moe_router_cost.py MODEL.gguf [--tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import time

import torch

from specdecode import LLM, SamplingParams
from specdecode.executor import experts
from specdecode.executor.quant import _check
from specdecode.models.loader import load_model


def routed_by_pytorch(kernel, moe, flat: torch.Tensor) -> torch.Tensor:
    """The experts kernel given the rows' choices and weights by PyTorch's Router (no router pointer)."""
    rows, hidden = flat.shape
    weights, chosen = moe.gate(flat)
    weights, chosen = weights.float().contiguous(), chosen.contiguous()
    flat, y = flat.float().contiguous(), torch.empty(rows, hidden)
    gate_up, down = kernel.tables()
    code = kernel.lib.lowbit_moe(
        *kernel.formats,
        flat.data_ptr(),
        rows,
        hidden,
        kernel.inter,
        len(gate_up),
        None,
        0,
        0,
        None,
        1.0,
        torch.tensor([1, 1, 0], dtype=torch.int32).data_ptr(),  # no groups
        chosen.data_ptr(),
        weights.data_ptr(),
        moe.gate.top_k,
        gate_up.data_ptr(),
        down.data_ptr(),
        y.data_ptr(),
        kernel.passes,
        torch.get_num_threads(),
    )
    _check(code, "a mixture of experts' MLP", experts.ERRORS)
    return y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(target=load_model(args.model, progress=False), num_speculative_tokens=0, max_model_len=512)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate([[1, 2, 3]], params)  # warm
    variants = {"PyTorch routes": routed_by_pytorch, "the kernel routes": experts.ExpertsKernel.__call__}
    rates: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, call in variants.items():
            experts.ExpertsKernel.__call__ = call
            start = time.perf_counter()
            llm.generate([[1, 2, 3]], params)
            rates[name].append(args.tokens / (time.perf_counter() - start))
    for name, values in rates.items():
        print(f"{name:20s} tok/s {' '.join(f'{v:.2f}' for v in values)}  mean {sum(values) / len(values):.2f}")


if __name__ == "__main__":
    main()
