"""Requests arriving at once: the time to each one's first token (the mean and the last, as the step that makes
it returns, when a server streams it) with their prompts prefilled together (the engine's way: one forward for
all, the weights read once) and one forward each (as before it), the two in turn on one engine, the best of
--rounds each. Plain decoding of the bundled target, HumanEval prompts (their first --prompt-tokens); every first
token must be the same both ways. Where others are admitted before it in the step, a prompt longer than
--prefill-chunk-tokens (the engine's default: 64 on a CPU) is left to chunks beside them, as where others decode.

    PYTHONPATH=src python tools/prompts_together.py [--requests 1 4 16] [--rounds 3] [--prompt-tokens 60]
        [--prefill-chunk-tokens 0] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import contextlib
import time

from specdecode import LLM, SamplingParams
from specdecode.bench.datasets import humaneval_prompts
from specdecode.bench.results import describe_machine, machine_info
from specdecode.config import DEFAULT_TARGET
from specdecode.engine.prefill import Prefilling

WAYS = ("together", "one each")  # the engine's, and as before it


@contextlib.contextmanager
def one_forward_each():
    """Each prompt is prefilled before the next is admitted, as when every prompt could start from the blocks of
    the one before it."""
    first_block = Prefilling._first_block
    Prefilling._first_block = lambda self, prompt: ()  # every prompt's the same
    try:
        yield
    finally:
        Prefilling._first_block = first_block


def first_tokens_prefilled(way: str, llm: LLM, prompts: list[list[int]], max_tokens: int = 1):
    """first_tokens with the prompts prefilled `way`: one of WAYS."""
    with one_forward_each() if way == "one each" else contextlib.nullcontext():
        return first_tokens(llm, prompts, max_tokens)


def first_tokens(llm: LLM, prompts: list[list[int]], max_tokens: int = 1) -> tuple[float, float, list[int]]:
    """(mean seconds to a first token, seconds to the last, the first tokens) of the prompts arriving at once, each
    first token timed when the step that made it returns (when a server streams it); each request's later tokens
    are decoded (`max_tokens`) until every one has its first."""
    engine, params = llm.engine, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    seqs = [engine.add_request(p, params) for p in prompts]
    seen: dict[int, float] = {}
    while len(seen) < len(seqs):
        engine.step()
        seen.update({i: time.perf_counter() - start for i, s in enumerate(seqs) if s.output_ids and i not in seen})
    for seq in seqs:
        engine.abort(seq)
    return sum(seen.values()) / len(seen), max(seen.values()), [s.output_ids[0] for s in seqs]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=0, help="each prompt's first N tokens (0: whole)")
    parser.add_argument("--prefill-chunk-tokens", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=1, help="each request's (the first ones decode meanwhile)")
    args = parser.parse_args()
    n = max(args.requests)
    llm = LLM(model=DEFAULT_TARGET, num_speculative_tokens=0, prefix_caching=False, max_num_seqs=n,
              prefill_chunk_tokens=args.prefill_chunk_tokens)  # fmt: skip
    prompts = [llm.tokenizer.encode(t)[: args.prompt_tokens or None] for t in humaneval_prompts(n)]
    print(f"# {describe_machine(machine_info())}")
    print(f"# {DEFAULT_TARGET}, plain decoding, HumanEval prompts of {min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens, prefill_chunk_tokens {args.prefill_chunk_tokens}, max_tokens "
          f"{args.max_tokens}; best of {args.rounds} rounds, the two ways in turn")  # fmt: skip
    first_tokens(llm, prompts[:1])  # warm-up
    for n in args.requests:
        best: dict[str, tuple[float, float]] = {}
        tokens: dict[str, list[int]] = {}
        for way in WAYS * args.rounds:
            mean, last, tokens[way] = first_tokens_prefilled(way, llm, prompts[:n], args.max_tokens)
            best[way] = min(best.get(way, (mean, last)), (mean, last))
        assert tokens["together"] == tokens["one each"], "the first tokens differ"
        (mean, last), (mean_each, last_each) = best["together"], best["one each"]
        print(f"{n:3d} requests: first token mean / last {mean:.3f} / {last:.3f} s together, {mean_each:.3f} / "
              f"{last_each:.3f} s one forward each: {mean_each / mean:.2f}x / {last_each / last:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
