"""Requests that share a long prefix (a system prompt, a file under discussion), arriving together: each one's
time to first token, the prompt tokens computed, the KV blocks held at most and the wall time, with prefix
caching (blocks shared among running requests) and without, on one engine configuration each. Greedy outputs
must be equal between the two. With --kv-blocks, a memory budget that holds that many KV blocks beside the
weights: how many requests admission lets run at once when they share their prefix, and when they do not.

    python tools/shared_prefix.py --prefix-tokens 2048 --requests 4 [--kv-blocks 24 --max-model-len 1536]
"""

from __future__ import annotations

import argparse
import gc
import time

from specdecode import LLM, SamplingParams
from specdecode.bench.budgets import llm_holding
from specdecode.bench.datasets import stdlib_text
from specdecode.bench.results import describe_machine, machine_info
from specdecode.config import DEFAULT_HEAD, DEFAULT_TARGET

QUESTIONS = [
    "\n# Summarise what the code above does.\n",
    "\n# List the functions defined above.\n",
    "\n# Which modules does the code above import?\n",
    "\n# Suggest one test for the code above.\n",
    "\n# Find one bug in the code above.\n",
    "\n# Explain the first class above.\n",
    "\n# Rewrite the first function above more simply.\n",
    "\n# What does the code above return?\n",
]


def run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict:
    engine = llm.engine
    engine.forget_cached_prefixes()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    seqs = [engine.add_request(p, params) for p in prompts]
    most, together = 0, 0
    while engine.has_unfinished():
        engine.step()
        most, together = max(most, engine.runner.blocks_in_use()), max(together, engine.num_running)
    return {
        "wall_s": time.perf_counter() - start,
        "most_blocks": most,
        "together": together,
        "ttft_s": [s.metrics.ttft for s in seqs],
        "computed": sum(len(s.prompt_ids) - s.metrics.num_cached_prompt_tokens for s in seqs),
        "outputs": [s.output_ids for s in seqs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_TARGET)
    parser.add_argument("--draft", default=DEFAULT_HEAD, help="'none' for plain decoding")
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--requests", type=int, default=4, choices=range(1, len(QUESTIONS) + 1))
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--kv-blocks", type=int, help="a memory budget of the weights and this many KV blocks")
    parser.add_argument("--max-model-len", type=int, help="default: the model's context (a budget must hold one)")
    args = parser.parse_args()
    print(describe_machine(machine_info()))
    results, prompts = {}, None
    for caching in (True, False):
        llm = llm_holding(
            args.kv_blocks,
            model=args.model,
            speculative_model=None if args.draft == "none" else args.draft,
            max_num_seqs=args.requests,
            prefix_caching=caching,
            progress=False,
            max_model_len=args.max_model_len,
        )
        if args.kv_blocks:
            plan = llm.memory_plan
            print(f"memory budget {plan.budget_bytes / 2**30:.2f} GiB: {plan.num_blocks} KV blocks")
        if prompts is None:  # the same tokenizer both times: encode the sources once
            prefix = llm.tokenizer.encode(stdlib_text())[: args.prefix_tokens]
            prompts = [prefix + llm.tokenizer.encode(q) for q in QUESTIONS[: args.requests]]
        run(llm, prompts[:1], 2)  # warm-up: kernels and the policy's first measurements
        results[caching] = run(llm, prompts, args.max_tokens)
        del llm
        gc.collect()
    print(
        f"{args.requests} requests, a {args.prefix_tokens}-token common prefix, {args.max_tokens} tokens each, "
        f"draft {args.draft}"
    )
    print(
        "| prefix caching | prompt tokens computed | KV blocks held at most | running at once | TTFT per request (s) "
        "| wall (s) |"
    )
    print("|---|---:|---:|---:|---|---:|")
    for caching, r in results.items():
        ttfts = " / ".join(f"{t:.2f}" for t in r["ttft_s"])
        state = "on" if caching else "off"
        print(f"| {state} | {r['computed']:,} | {r['most_blocks']} | {r['together']} | {ttfts} | {r['wall_s']:.1f} |")
    same = results[True]["outputs"] == results[False]["outputs"]
    print(f"greedy outputs equal with and without: {same}")
    if not same:
        raise SystemExit("outputs differ with prefix caching")


if __name__ == "__main__":
    main()
