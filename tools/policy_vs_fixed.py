"""The adaptive policy against fixed k at batch 1, in one process: two engines on one loaded target (the same
drafter, k_max and draft confidence), alternated prompt by prompt so that the host's drift falls on both alike;
decoding rate (output tokens after the first over the time after the first) per engine, and their ratio.

    python tools/policy_vs_fixed.py [--draft head:qwen2.5-coder-1.5b] [-k 3] [--num-prompts 10] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import time

from specdecode import LLM, SamplingParams
from specdecode.bench.datasets import humaneval_prompts
from specdecode.bench.results import describe_machine, machine_info
from specdecode.config import DEFAULT_HEAD, DEFAULT_TARGET
from specdecode.models.loader import load_model

DEMO_CHAT = "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring."


def decode_rate(llm: LLM, prompt, params: SamplingParams) -> tuple[int, float]:
    """(tokens after the first, seconds after the first) of one request."""
    started = time.perf_counter()
    out = llm.generate([prompt], params)[0]
    seconds = time.perf_counter() - started - out.spec["ttft_s"]
    return out.spec["num_output_tokens"] - 1, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_TARGET)
    parser.add_argument("--draft", default=DEFAULT_HEAD)
    parser.add_argument("-k", type=int, default=3)
    parser.add_argument("--confidence", type=float, default=0.8)
    parser.add_argument("--num-prompts", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    target = load_model(args.model, progress=False)
    common = dict(
        target=target, speculative_model=args.draft, num_speculative_tokens=args.k, draft_confidence=args.confidence
    )
    engines = {
        "adaptive": LLM(speculation_policy="adaptive", **common),
        f"fixed k={args.k}": LLM(speculation_policy="fixed", **common),
    }
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    chat = engines["adaptive"].tokenizer.apply_chat_template([{"role": "user", "content": DEMO_CHAT}])
    print(describe_machine(machine_info()))
    for label, prompts in (("HumanEval", humaneval_prompts(args.num_prompts)), ("the demo's chat", [chat] * 3)):
        totals = {name: [0, 0.0] for name in engines}
        for prompt in prompts:
            for name, llm in engines.items():
                tokens, seconds = decode_rate(llm, prompt, params)
                totals[name][0] += tokens
                totals[name][1] += seconds
        rates = {name: tokens / seconds for name, (tokens, seconds) in totals.items()}
        ratio = rates["adaptive"] / rates[f"fixed k={args.k}"]
        each = ", ".join(f"{n} {r:.2f} tok/s" for n, r in rates.items())
        print(f"{label} ({len(prompts)} x {args.max_tokens}): {each}; adaptive / fixed = {ratio:.3f}")


if __name__ == "__main__":
    main()
