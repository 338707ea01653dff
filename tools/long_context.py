"""A long prompt of real text (standard-library source) through `LLM` on default settings: prefill time, decode
rate, and the memory the process holds before and after, per prompt length.

    python tools/long_context.py --lengths 16384 32000 [--max-tokens 32] [--model qwen2.5-coder-1.5b]
"""

from __future__ import annotations

import argparse
import resource
import time

from specdecode import LLM, SamplingParams
from specdecode.bench.datasets import stdlib_sources
from specdecode.bench.results import describe_machine, machine_info
from specdecode.config import DEFAULT_TARGET


def rss_gib() -> float:
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_TARGET)
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384])
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    llm = LLM(model=args.model, num_speculative_tokens=0, progress=False)  # every option at its default
    text = "\n".join(source for _, source in stdlib_sources())
    ids = llm.tokenizer.encode(text)
    print(
        f"{describe_machine(machine_info())}; max_model_len {llm.engine.max_model_len}; {llm.memory_plan.summary()}",
        flush=True,
    )
    print(f"idle: RSS {rss_gib():.2f} GiB", flush=True)
    for length in args.lengths:
        started = time.perf_counter()
        out = llm.generate([ids[:length]], SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True))
        spec = out[0].spec
        print(
            f"{length} tokens: prefill {spec['ttft_s']:.1f} s ({length / spec['ttft_s']:.0f} tok/s), decode "
            f"{1 / spec['tpot_s']:.2f} tok/s, {time.perf_counter() - started:.1f} s in all; RSS now "
            f"{rss_gib():.2f} GiB, peak {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB",
            flush=True,
        )


if __name__ == "__main__":
    main()
