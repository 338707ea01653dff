"""A long prompt of real text (standard-library source) through `LLM` on default settings, per prompt length (each
the text's last `length` tokens up to where the longest prompt ends, so every length decodes the same continuation
and only the context before it differs): prefill rate, decode rate against what the bytes a step reads allow
(weights + the KV cache at the read bandwidth measured just after its decoding), and memory the process holds. With
`--vs-llama-cpp`, llama.cpp's prefill of the first length (`llama-bench -p N`) on the same file and threads, in the
same run. With `--draft`, each length's prompt is prefilled once, then decoded `--rounds` times with that drafter
(the default adaptive policy) and plain (the policy swapped for k = 0) in turn, the prompt found cached; the median
time per token of each gives the drafter's speedup. Alternating matters: the first steps after a long prefill run
slower (the host's caches and pages), and whichever mode ran there would lose.

    python tools/long_context.py --lengths 16384 32000 1024 [--max-tokens 32] [--rounds 3] [--vs-llama-cpp BIN]
        [--draft NAME [--fixed-k K]]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from contextlib import contextmanager, nullcontext

import torch

from specdecode import LLM, SamplingParams
from specdecode.bench.datasets import stdlib_sources
from specdecode.bench.llama_cpp import run_llama_bench
from specdecode.bench.results import describe_machine, machine_info, read_bandwidth
from specdecode.config import DEFAULT_TARGET
from specdecode.engine.memory import kv_bytes_per_token
from specdecode.engine.policy import FixedPolicy
from specdecode.models.sources import resolve


def rss_gib() -> float:
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 2**20


def llama_prefill(bin_dir: str, gguf: str, tokens: int) -> float:
    bench = run_llama_bench(bin_dir, gguf, torch.get_num_threads(), 1, forward_sizes=(tokens,), repeats=1, warmup=False)
    return bench.prefill_tokens_per_s(tokens)


@contextmanager
def fixed_k(llm: LLM, k: int):
    """The engine with k drafts a step for every sequence (k = 0: the drafter never runs, the target decodes as
    plain)."""
    policy, llm.engine.policy = llm.engine.policy, FixedPolicy(k)
    try:
        yield
    finally:
        llm.engine.policy = policy


def decode(llm: LLM, ids: list[int], max_tokens: int) -> dict:
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return {**out[0].spec, "token_ids": out[0].outputs[0].token_ids}


def decode_in_turn(llm: LLM, ids: list[int], max_tokens: int, rounds: int, fixed: int | None) -> list[list[dict]]:
    """The drafter's runs (the adaptive policy, then fixed k where asked) and plain runs, in turn, so that none
    always meets the host just after the prefill."""
    modes = [None, *([fixed] if fixed else []), 0]
    runs: list[list[dict]] = [[] for _ in modes]
    for _ in range(rounds):
        for mode, done in zip(modes, runs):
            with nullcontext() if mode is None else fixed_k(llm, mode):
                done.append(decode(llm, ids, max_tokens))
    return runs


def median_tpot(runs: list[dict]) -> float:
    return statistics.median(run["tpot_s"] for run in runs)


def print_drafter(name: str, drafted: list[dict], plain: list[dict]) -> None:
    rates = " ".join(f"{1 / run['tpot_s']:.2f}/{1 / p['tpot_s']:.2f}" for run, p in zip(drafted, plain))
    taus = " ".join(f"{run['mean_accepted_length'] or 1:.2f}" for run in drafted)
    steps = " ".join(f"{run['num_spec_steps']}/{run['num_steps']}" for run in drafted)
    drafts = " ".join(f"{run['num_draft_tokens'] / max(run['num_spec_steps'], 1):.2f}" for run in drafted)
    same = all(run["token_ids"] == plain[0]["token_ids"] for run in drafted + plain)
    print(
        f"  {name}: {1 / median_tpot(drafted):.2f} tok/s: {median_tpot(plain) / median_tpot(drafted):.2f}× plain "
        f"(medians; tok/s drafter/plain per round {rates}; τ {taus}; steps drafted {steps}; drafts a drafted step "
        f"{drafts}); the same tokens: {same}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_TARGET)
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--vs-llama-cpp", metavar="BIN", help="llama.cpp's tools folder (build-llama-cpp.sh's)")
    parser.add_argument("--draft", help="also decode with this drafter (e.g. head:qwen2.5-coder-1.5b)")
    parser.add_argument("--rounds", type=int, default=3, help="with --draft: decodes of each mode, in turn")
    parser.add_argument("--fixed-k", type=int, help="with --draft: also the drafter at this fixed k, in turn")
    args = parser.parse_args()
    drafter = {"speculative_model": args.draft} if args.draft else {"num_speculative_tokens": 0}
    llm = LLM(model=args.model, progress=False, **drafter)  # every other option at its default
    plan = llm.memory_plan
    text = "\n".join(source for _, source in stdlib_sources())
    ids = llm.tokenizer.encode(text)
    print(f"{describe_machine(machine_info())}; max_model_len {llm.engine.max_model_len}; {plan.summary()}")
    bandwidth = read_bandwidth()
    print(f"idle: RSS {rss_gib():.2f} GiB; read bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)
    target = llm.engine.runner.model
    target_kv_bytes = kv_bytes_per_token(target.cfg, target.kv_dtype)  # what a plain step reads a cached token
    first_prefill, end = None, max(args.lengths)
    for length in args.lengths:
        started = time.perf_counter()
        prompt = ids[end - length : end]  # every length decodes the same continuation, after more or less context
        spec = decode(llm, prompt, args.max_tokens)
        computed = length - spec["num_cached_prompt_tokens"]
        first_prefill = first_prefill or computed / spec["ttft_s"]
        runs = decode_in_turn(llm, prompt, args.max_tokens, args.rounds, args.fixed_k) if args.draft else [[spec]]
        plain = runs[-1]
        step_bytes = plan.target_weight_bytes + target_kv_bytes * length
        beside = read_bandwidth()  # the host's rate drifts over a long prefill: the one beside the decoding counts
        allowed, plain_rate = beside / step_bytes, 1 / median_tpot(plain)
        print(
            f"{length} tokens: prefill {computed} in {spec['ttft_s']:.1f} s ({computed / spec['ttft_s']:.0f} tok/s); "
            f"plain decoding {plain_rate:.2f} tok/s, the bytes allow {allowed:.2f} ({step_bytes / 2**30:.2f} GiB a "
            f"step at {beside / 1e9:.1f} GB/s, read just after): {plain_rate / allowed:.0%}; "
            f"{time.perf_counter() - started:.1f} s in all; RSS now "
            f"{rss_gib():.2f} GiB, peak {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB",
            flush=True,
        )
        if args.draft:
            print_drafter(args.draft, runs[0], plain)
        if args.draft and args.fixed_k:
            print_drafter(f"{args.draft} at fixed k = {args.fixed_k}", runs[1], plain)
    if args.vs_llama_cpp:
        theirs = llama_prefill(args.vs_llama_cpp, resolve(args.model).path, args.lengths[0])
        print(f"llama.cpp llama-bench -p {args.lengths[0]}: {theirs:.0f} tok/s; ours {first_prefill / theirs:.2f}×")


if __name__ == "__main__":
    main()
