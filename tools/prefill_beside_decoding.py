"""A decoding stream's time per output token while a long prompt (standard-library source) arrives and
prefills, and that prompt's time to first token, per prefill chunk size (0: the prompt whole), each against
its value alone. One process, one model load, the engine as `generate` builds it (the bundled head drafting; a
chunk rides in the verify's target call where the runner packs any width, unless --separate-calls).

    python tools/prefill_beside_decoding.py --prompt-tokens 4096 --chunks 0 256 512 1024
"""

from __future__ import annotations

import argparse
import time

from specdecode import LLM, SamplingParams
from specdecode.bench.datasets import stdlib_text
from specdecode.bench.results import describe_machine, machine_info
from specdecode.config import DEFAULT_HEAD, DEFAULT_TARGET
from specdecode.executor.runner import ModelRunner

STREAM = "Write a Python function that parses an ISO 8601 date string and explain each step."


def stream_alone(llm: LLM, tokens: int = 48) -> float:
    """Seconds per output token of the stream decoding alone (after its first 8)."""
    engine = llm.engine
    seq = engine.add_request(
        llm.tokenizer.encode(STREAM), SamplingParams(temperature=0, max_tokens=tokens + 8, ignore_eos=True)
    )
    while len(seq.output_ids) < 8:
        engine.step()
    start, before = time.perf_counter(), len(seq.output_ids)
    while engine.has_unfinished():
        engine.step()
    return (time.perf_counter() - start) / (len(seq.output_ids) - before)


def long_alone(llm: LLM, prompt: list[int]) -> float:
    engine = llm.engine
    engine.forget_cached_prefixes()
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def beside(llm: LLM, prompt: list[int]) -> tuple[float, float]:
    """(the stream's seconds per output token from the long prompt's arrival to its first token, that prompt's
    time to first token)."""
    engine = llm.engine
    engine.forget_cached_prefixes()
    stream = engine.add_request(
        llm.tokenizer.encode(STREAM), SamplingParams(temperature=0, max_tokens=4096, ignore_eos=True)
    )
    while len(stream.output_ids) < 8:
        engine.step()
    long = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
    start, before = time.perf_counter(), len(stream.output_ids)
    while not long.output_ids:
        engine.step()
    ttft = time.perf_counter() - start
    gained = len(stream.output_ids) - before
    engine.abort(stream)
    return ttft / max(gained, 1), ttft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_TARGET)
    parser.add_argument("--draft", default=DEFAULT_HEAD)
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 256, 512, 1024])
    parser.add_argument(
        "--separate-calls", action="store_true", help="each chunk in a target call of its own, not in the verify's"
    )
    args = parser.parse_args()
    if args.separate_calls:  # as a runner that cannot pack a chunk beside a verify does
        ModelRunner.packs_any_width = property(lambda self: False)
    llm = LLM(model=args.model, speculative_model=args.draft, progress=False)
    ids = llm.tokenizer.encode(stdlib_text())[: args.prompt_tokens]
    print(
        f"{describe_machine(machine_info())}; {args.model}, drafts by {args.draft}; a {len(ids)}-token prompt "
        "arriving while a chat stream decodes",
        flush=True,
    )
    tpot = stream_alone(llm)
    ttft = long_alone(llm, ids)
    print(
        f"alone: the stream {tpot * 1e3:.0f} ms per token; the long prompt's first token after {ttft:.1f} s", flush=True
    )
    for chunk in args.chunks:
        llm.engine.prefill_chunk = chunk or None
        during, first = beside(llm, ids)
        print(
            f"chunk {chunk or 'whole':>5}: the stream {during * 1e3:7.0f} ms per token ({during / tpot:5.1f}x "
            f"alone), the long prompt's first token after {first:.1f} s ({first / ttft:.2f}x alone)",
            flush=True,
        )


if __name__ == "__main__":
    main()
