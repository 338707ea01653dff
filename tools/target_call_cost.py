"""A target call's time by the rows in it, after --context tokens of standard-library source: a prompt's chunk
of R rows alone, and beside a 5-row verify of another sequence (its drafts after a 100-token chat), in two
calls and in one (the engine's step while a long prompt prefills). Medians of --reps calls, nothing committed.

    python tools/target_call_cost.py --context 2048 --rows 16 32 64 65 69 96 128 133
"""

from __future__ import annotations

import argparse

from specdecode import LLM
from specdecode.bench.datasets import stdlib_text
from specdecode.bench.results import describe_machine, machine_info, median_seconds
from specdecode.config import DEFAULT_TARGET

VERIFY_ROWS = 5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_TARGET)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64, 65, 69, 96, 128, 133])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    llm = LLM(model=args.model, progress=False)
    runner, ids = llm.engine.runner, llm.tokenizer.encode(stdlib_text())
    print(f"{describe_machine(machine_info())}; {args.model}, a chunk after {args.context} tokens", flush=True)
    prompt, chat = runner.allocate(), runner.allocate()
    runner.forward([prompt], [ids[: args.context]], "last")
    runner.commit(prompt, args.context)
    runner.forward([chat], [ids[-200:-100]], "last")
    runner.commit(chat, 100)
    verify = ids[-100 : -100 + VERIFY_ROWS]
    alone = median_seconds(lambda: runner.forward([chat], [verify], "all"), args.reps) * 1e3
    print(f"the verify alone ({VERIFY_ROWS} rows): {alone:.1f} ms", flush=True)
    for rows in args.rows:
        by_itself, two, one = _chunk_costs(
            runner, (prompt, chat), ids[args.context : args.context + rows], verify, args.reps
        )
        print(
            f"chunk {rows:4d} rows: alone {by_itself:7.1f} ms; beside the verify: two calls {two:7.1f} ms, "
            f"one call {one:7.1f} ms ({one / two:.2f}x)",
            flush=True,
        )


def _chunk_costs(runner, slots: tuple[int, int], chunk: list[int], verify: list[int], reps: int) -> list[float]:
    """The chunk alone, then beside the verify in two calls and in one (ms)."""
    prompt, chat = slots
    calls = [
        lambda: runner.forward([prompt], [chunk], "last"),
        lambda: (runner.forward([chat], [verify], "all"), runner.forward([prompt], [chunk], "last")),
        lambda: runner.forward([chat, prompt], [verify, chunk], [len(verify), 1]),
    ]
    return [median_seconds(call, reps) * 1e3 for call in calls]


if __name__ == "__main__":
    main()
