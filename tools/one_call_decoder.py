"""What the one-call decoder (executor/decoder.py) saves: the target's and the draft model's forwards with it and
module by module, alternated in one process, at a short and a longer context; then greedy generation of a
HumanEval prompt both ways, plain and speculative (the bundled head, or --speculative-model), with the outputs
compared.

    python tools/one_call_decoder.py --contexts 128 1024 --rounds 5
    python tools/one_call_decoder.py --model gemma3-270m --speculative-model ngram
"""

from __future__ import annotations

import argparse
import statistics

from specdecode import LLM, SamplingParams
from specdecode.bench.datasets import humaneval_prompts
from specdecode.bench.results import describe_machine, machine_info
from specdecode.config import DEFAULT_HEAD
from specdecode.engine.profile import time_forward


def forward_costs(model, contexts: list[int], rows: list[int], rounds: int) -> None:
    """Median ms of forwards of each row count after each context, both ways, the way that goes first alternating."""
    kernel = model.layers_kernel
    for context in contexts:
        for n in rows:
            times = {"one call": [], "modules": []}
            for r in range(rounds):
                ways = [("one call", kernel), ("modules", None)][:: 1 if r % 2 == 0 else -1]
                for name, way in ways:
                    model.layers_kernel = way
                    times[name].append(time_forward(model, 1, n, context, repeats=9) * 1e3)
            one, modules = (statistics.median(times[k]) for k in ("one call", "modules"))
            print(
                f"  {n} row{'s' * (n > 1)} after {context}: one call {one:.2f} ms, modules {modules:.2f} ms; "
                f"{modules / one:.3f}×",
                flush=True,
            )
    model.layers_kernel = kernel


def generation(llm: LLM, prompt: str, max_tokens: int, rounds: int) -> None:
    """tok/s of greedy generation both ways, plain (k = 0) and speculative, and whether the outputs agree."""
    draft = getattr(llm.engine.proposer, "model", None)
    models = [m for m in (llm.engine.runner.model, draft) if getattr(m, "layers_kernel", None) is not None]
    kernels = [m.layers_kernel for m in models]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    k = llm.engine.k
    for label, steps in (("plain", 0), ("speculative", k)):
        llm.engine.k = steps
        rates, texts = {"one call": [], "modules": []}, {}
        for r in range(rounds):
            for name in ("one call", "modules")[:: 1 if r % 2 == 0 else -1]:
                for model, kernel in zip(models, kernels):
                    model.layers_kernel = kernel if name == "one call" else None
                out = llm.generate([prompt], params)[0]
                rates[name].append(1 / out.spec["tpot_s"])
                texts.setdefault(name, out.outputs[0].token_ids)
        one, modules = (statistics.median(rates[k]) for k in ("one call", "modules"))
        same = texts["one call"] == texts["modules"]
        print(f"  {label}: one call {one:.2f} tok/s, modules {modules:.2f}; {one / modules:.3f}×; same tokens: {same}")
    llm.engine.k = k
    for model, kernel in zip(models, kernels):
        model.layers_kernel = kernel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="the target (default: the bundled 1.5B)")
    parser.add_argument("--speculative-model", default=DEFAULT_HEAD, help=f"the drafter (default {DEFAULT_HEAD})")
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    target = {"model": args.model} if args.model else {}
    llm = LLM(progress=False, speculative_model=args.speculative_model, **target)
    print(
        f"{describe_machine(machine_info())}; {llm.engine.runner.model.cfg.arch} target, drafter "
        f"{args.speculative_model}, k = {llm.engine.k}",
        flush=True,
    )
    target, proposer = llm.engine.runner.model, llm.engine.proposer
    print("target forwards:", flush=True)
    forward_costs(target, args.contexts, args.rows, args.rounds)
    draft = getattr(proposer, "model", None)
    if getattr(draft, "layers_kernel", None) is not None:
        print("draft model forwards:", flush=True)
        forward_costs(draft, args.contexts, [1], args.rounds)
    print(f"greedy generation, {args.max_tokens} tokens of HumanEval/0:", flush=True)
    generation(llm, humaneval_prompts(1)[0], args.max_tokens, args.rounds)


if __name__ == "__main__":
    main()
