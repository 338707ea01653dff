"""Requests whose answers are much shorter than their max_tokens (a chat client that sets no limit gets the rest of
the context), arriving together into a KV cache of a few blocks: admission that holds each request's whole length
against admission that holds its next --lookahead tokens and preempts when the pool runs short. Wall time, the
most requests running at once, preemptions and each request's time to first token; greedy outputs must be equal.

    python tools/preemption.py --requests 8 --kv-blocks 24 --max-tokens 800
    python tools/preemption.py --requests 8 --kv-blocks 24 --max-tokens 300 --whole --lookahead 32
"""

from __future__ import annotations

import argparse
import time

from specdecode import LLM, SamplingParams
from specdecode.bench.budgets import llm_holding
from specdecode.bench.datasets import humaneval_prompts
from specdecode.bench.results import describe_machine, machine_info
from specdecode.config import DEFAULT_HEAD, DEFAULT_TARGET
from specdecode.engine.admission import ADMISSION_LOOKAHEAD

STOPS = ["\nclass", "\ndef", "\n#", "\nif", "\nprint"]  # HumanEval's: where an answer ends


def run(llm: LLM, prompts: list[list[int]], max_tokens: int, whole: bool = False) -> dict:
    engine = llm.engine
    engine.forget_cached_prefixes()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, stop=None if whole else STOPS, ignore_eos=whole)
    start = time.perf_counter()
    seqs = [engine.add_request(p, params) for p in prompts]
    together, preempted = 0, 0
    while engine.has_unfinished():
        preempted += engine.step().preempted
        together = max(together, engine.num_running)
    return {
        "wall_s": time.perf_counter() - start,
        "together": together,
        "preempted": preempted,
        "ttft_s": [s.metrics.ttft for s in seqs],
        "tokens": sum(len(s.output_ids) for s in seqs),
        "outputs": [s.output_ids for s in seqs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_TARGET)
    parser.add_argument("--draft", default=DEFAULT_HEAD, help="'none' for plain decoding")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=800)
    parser.add_argument("--kv-blocks", type=int, default=24, help="a memory budget of the weights and these blocks")
    parser.add_argument("--max-model-len", type=int, default=1024, help="a budget must hold one such sequence")
    parser.add_argument("--lookahead", type=int, default=ADMISSION_LOOKAHEAD)
    parser.add_argument("--whole", action="store_true", help="every answer runs to max_tokens (no stop, no EOS)")
    args = parser.parse_args()
    print(describe_machine(machine_info()))
    llm = llm_holding(
        args.kv_blocks,
        model=args.model,
        speculative_model=None if args.draft == "none" else args.draft,
        max_num_seqs=args.requests,
        progress=False,
        max_model_len=args.max_model_len,
    )
    plan = llm.memory_plan
    print(f"memory budget {plan.budget_bytes / 2**30:.2f} GiB: {plan.num_blocks} KV blocks of {plan.block_size} tokens")
    prompts = [llm.tokenizer.encode(p) for p in humaneval_prompts(args.requests)]
    run(llm, prompts[:1], 2)  # warm-up: kernels and the policy's first measurements
    results = {}
    for name, lookahead in (("whole length held", args.max_model_len), (f"next {args.lookahead} held", args.lookahead)):
        llm.engine.blocks.lookahead = lookahead
        results[name] = run(llm, prompts, args.max_tokens, args.whole)
    ends = "every answer that long" if args.whole else "answers stop earlier"
    print(f"{args.requests} HumanEval prompts, max_tokens {args.max_tokens} ({ends}), draft {args.draft}")
    print("| admission | running at once | preemptions | output tokens | mean TTFT (s) | wall (s) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        ttft = sum(r["ttft_s"]) / len(r["ttft_s"])
        print(f"| {name} | {r['together']} | {r['preempted']} | {r['tokens']:,} | {ttft:.2f} | {r['wall_s']:.1f} |")
    first, second = results.values()
    print(f"wall time ratio {first['wall_s'] / second['wall_s']:.2f}x")
    same = first["outputs"] == second["outputs"]
    print(f"greedy outputs equal: {same}")
    if not same:
        raise SystemExit("outputs differ between the two admissions")


if __name__ == "__main__":
    main()
