"""The adaptive policy against fixed k and plain decoding, in one process: engines on one loaded target (the same
drafter, k_max and draft confidence), taking turns batch by batch, in an order that alternates, so that the host's
drift falls on all alike. With --batch N, N prompts are decoded together (the engine's batch holds N sequences
throughout: ignore_eos). Decoding rate: output tokens after each request's first over the time after the batch's
last first token; per round and pooled, with the ratios and the adaptive policy's share of sequence-steps drafted.

    python tools/policy_vs_fixed.py [--draft head:qwen2.5-coder-1.5b] [-k 3] [--batch 1] [--rounds 10]
        [--max-tokens 128] [--no-chat]
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


def decode_rate(llm: LLM, prompts: list, params: SamplingParams) -> tuple[int, float]:
    """(tokens after each request's first, seconds after the last first token) of prompts decoded together."""
    started = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - started - max(out.spec["ttft_s"] for out in outs)
    return sum(out.spec["num_output_tokens"] - 1 for out in outs), seconds


def drafted_share(llm: LLM) -> float:
    """The share of sequence-steps the engine's policy let draft, so far."""
    decisions = llm.engine.policy.decisions
    return 1 - decisions[0] / max(1, sum(decisions.values()))


def engines_for(args) -> dict[str, LLM]:
    target = load_model(args.model, progress=False)
    drafter = dict(target=target, speculative_model=args.draft, draft_confidence=args.confidence)
    return {
        "adaptive": LLM(speculation_policy="adaptive", num_speculative_tokens=args.k, **drafter),
        f"fixed k={args.k}": LLM(speculation_policy="fixed", num_speculative_tokens=args.k, **drafter),
        "plain": LLM(speculation_policy="fixed", num_speculative_tokens=0, **drafter),
    }


def compare(engines: dict[str, LLM], batches: list[list], params: SamplingParams) -> dict[str, float]:
    """Each engine's pooled decoding rate over the batches, printing each round's rates."""
    totals = {name: [0, 0.0] for name in engines}
    for r, batch in enumerate(batches):
        rates = {}
        for name in list(engines) if r % 2 == 0 else list(engines)[::-1]:
            tokens, seconds = decode_rate(engines[name], batch, params)
            totals[name][0] += tokens
            totals[name][1] += seconds
            rates[name] = tokens / seconds
        print(f"  round {r}: " + ", ".join(f"{name} {rates[name]:.2f}" for name in engines) + " tok/s", flush=True)
    return {name: tokens / seconds for name, (tokens, seconds) in totals.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_TARGET)
    parser.add_argument("--draft", default=DEFAULT_HEAD)
    parser.add_argument("-k", type=int, default=3)
    parser.add_argument("--confidence", type=float, default=0.8)
    parser.add_argument("--batch", type=int, default=1, help="prompts decoded together")
    parser.add_argument("--rounds", type=int, default=10, help="batches of HumanEval prompts")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--no-chat", action="store_true", help="skip the demo's chat prompt")
    args = parser.parse_args()
    engines = engines_for(args)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = humaneval_prompts(args.batch * args.rounds)
    workloads = {"HumanEval": [prompts[r * args.batch : (r + 1) * args.batch] for r in range(args.rounds)]}
    if not args.no_chat:
        chat = engines["adaptive"].tokenizer.apply_chat_template([{"role": "user", "content": DEMO_CHAT}])
        workloads["the demo's chat"] = [[chat] * args.batch] * 3
    print(describe_machine(machine_info()))
    fixed = f"fixed k={args.k}"
    for label, batches in workloads.items():
        print(f"{label}, {len(batches)} rounds of {args.batch} x {args.max_tokens} tokens:", flush=True)
        rates = compare(engines, batches, params)
        each = ", ".join(f"{n} {r:.2f} tok/s" for n, r in rates.items())
        print(
            f"{label}: {each}; adaptive / {fixed} = {rates['adaptive'] / rates[fixed]:.3f}, adaptive / plain ="
            f" {rates['adaptive'] / rates['plain']:.3f}, {fixed} / plain = {rates[fixed] / rates['plain']:.3f};"
            f" adaptive drafted {drafted_share(engines['adaptive']):.0%} of sequence-steps so far"
        )


if __name__ == "__main__":
    main()
