"""A long prompt of real text (standard-library source) through `LLM` on default settings, per prompt length (each
the text's last `length` tokens up to where the longest prompt ends, so every length decodes the same continuation
and only the context before it differs): prefill rate, decode rate against what the bytes a step reads allow
(weights + the KV cache at the read bandwidth measured just after its decoding), and memory the process holds. With
`--vs-llama-cpp`, llama.cpp's prefill of the first length (`llama-bench -p N`) on the same file and threads, in the
same run. With `--draft`, each length's prompt is prefilled once, then decoded `--rounds` times with that drafter
(the default adaptive policy) and plain (the policy swapped for k = 0) in turn, the prompt found cached; the median
time per token of each gives the drafter's speedup. Alternating matters: the first steps after a long prefill run
slower (the host's caches and pages), and whichever mode ran there would lose.

With `--ends`, the same for several continuations (each end a token offset in the text where decoding starts), and
per length the drafter's speedup over all of them (geometric mean) and τ (mean): one continuation's acceptance varies
with what the target writes there, and the target writes differently after more context.

    python tools/long_context.py --lengths 16384 32000 1024 [--max-tokens 32] [--rounds 3] [--vs-llama-cpp BIN]
        [--draft NAME [--fixed-k K]] [--ends END ...]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from contextlib import contextmanager, nullcontext

import torch

from specdecode import LLM, SamplingParams
from specdecode.bench.datasets import stdlib_text
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


def print_drafter(name: str, drafted: list[dict], plain: list[dict]) -> float:
    """One drafter's line for one prompt; returns its speedup over plain (medians)."""
    rates = " ".join(f"{1 / run['tpot_s']:.2f}/{1 / p['tpot_s']:.2f}" for run, p in zip(drafted, plain))
    taus = " ".join(f"{tau(run):.2f}" for run in drafted)
    steps = " ".join(f"{run['num_spec_steps']}/{run['num_steps']}" for run in drafted)
    drafts = " ".join(f"{run['num_draft_tokens'] / max(run['num_spec_steps'], 1):.2f}" for run in drafted)
    same = all(run["token_ids"] == plain[0]["token_ids"] for run in drafted + plain)
    speedup = median_tpot(plain) / median_tpot(drafted)
    print(
        f"  {name}: {1 / median_tpot(drafted):.2f} tok/s: {speedup:.2f}× plain "
        f"(medians; tok/s drafter/plain per round {rates}; τ {taus}; steps drafted {steps}; drafts a drafted step "
        f"{drafts}); the same tokens: {same}",
        flush=True,
    )
    return speedup


def tau(run: dict) -> float:
    return run["mean_accepted_length"] or 1


def measure(llm: LLM, prompt: list[int], args, bytes_per_step: float) -> tuple[float, list[list[dict]]]:
    """One prompt: its prefill (the first decode), then the modes' decodes in turn; prints the prefill and
    plain decoding's rate against what its bytes allow. Returns the prefill's tokens a second and the runs."""
    started = time.perf_counter()
    spec = decode(llm, prompt, args.max_tokens)
    computed = len(prompt) - spec["num_cached_prompt_tokens"]
    prefill_rate = computed / spec["ttft_s"]
    runs = decode_in_turn(llm, prompt, args.max_tokens, args.rounds, args.fixed_k) if args.draft else [[spec]]
    beside = read_bandwidth()  # the host's rate drifts over a long prefill: the one beside the decoding counts
    allowed, plain_rate = beside / bytes_per_step, 1 / median_tpot(runs[-1])
    print(
        f"{len(prompt)} tokens: prefill {computed} in {spec['ttft_s']:.1f} s ({prefill_rate:.0f} tok/s); "
        f"plain decoding {plain_rate:.2f} tok/s, the bytes allow {allowed:.2f} ({bytes_per_step / 2**30:.2f} GiB a "
        f"step at {beside / 1e9:.1f} GB/s, read just after): {plain_rate / allowed:.0%}; "
        f"{time.perf_counter() - started:.1f} s in all; RSS now "
        f"{rss_gib():.2f} GiB, peak {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB",
        flush=True,
    )
    return prefill_rate, runs


def print_over_ends(name: str, speedups: dict[int, list[float]], taus: dict[int, list[float]]) -> None:
    for length, values in speedups.items():
        mean = statistics.geometric_mean(values)
        print(
            f"{name}, {length} tokens over {len(values)} continuations: {mean:.2f}× plain (geometric mean; each "
            f"{' '.join(f'{v:.2f}' for v in values)}), τ {statistics.mean(taus[length]):.2f}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_TARGET)
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384])
    parser.add_argument(
        "--ends", type=int, nargs="+", help="token offsets where decoding starts (default: the longest length's)"
    )
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--vs-llama-cpp", metavar="BIN", help="llama.cpp's tools folder (build-llama-cpp.sh's)")
    parser.add_argument("--draft", help="also decode with this drafter (e.g. head:qwen2.5-coder-1.5b)")
    parser.add_argument("--rounds", type=int, default=3, help="with --draft: decodes of each mode, in turn")
    parser.add_argument("--fixed-k", type=int, help="with --draft: also the drafter at this fixed k, in turn")
    args = parser.parse_args()
    drafter = {"speculative_model": args.draft} if args.draft else {"num_speculative_tokens": 0}
    llm = LLM(model=args.model, progress=False, **drafter)  # every other option at its default
    plan = llm.memory_plan
    text = stdlib_text()
    ids = llm.tokenizer.encode(text)
    print(f"{describe_machine(machine_info())}; max_model_len {llm.engine.max_model_len}; {plan.summary()}")
    print(f"idle: RSS {rss_gib():.2f} GiB; read bandwidth {read_bandwidth() / 1e9:.1f} GB/s", flush=True)
    target = llm.engine.runner.model
    target_kv_bytes = kv_bytes_per_token(target.cfg, target.kv_dtype)  # what a plain step reads a cached token
    first_prefill = None
    modes = [args.draft, *([f"{args.draft} at fixed k = {args.fixed_k}"] if args.fixed_k else [])]
    speedups = {mode: {length: [] for length in args.lengths} for mode in modes}
    taus = {mode: {length: [] for length in args.lengths} for mode in modes}
    for end in args.ends or [max(args.lengths)]:
        if len(args.ends or []) > 1:
            print(f"# the continuation from token {end}", flush=True)
        continuations = {}
        for length in args.lengths:
            prompt = ids[end - length : end]  # every length decodes the same continuation, after more or less context
            prefill_rate, runs = measure(llm, prompt, args, plan.target_weight_bytes + target_kv_bytes * length)
            first_prefill = first_prefill or prefill_rate
            continuations[length] = runs[-1][0]["token_ids"]
            for mode, drafted in zip(modes if args.draft else [], runs):
                speedups[mode][length].append(print_drafter(mode, drafted, runs[-1]))
                taus[mode][length].append(statistics.mean(tau(run) for run in drafted))
        if len(continuations) > 1:
            same = sum(len(set(tokens)) == 1 for tokens in zip(*continuations.values()))
            print(f"  plain writes the same token after every length at {same} of {args.max_tokens} places", flush=True)
    for mode in modes if args.draft and len(args.ends or []) > 1 else []:
        print_over_ends(mode, speedups[mode], taus[mode])
    if args.vs_llama_cpp:
        theirs = llama_prefill(args.vs_llama_cpp, resolve(args.model).path, args.lengths[0])
        print(f"llama.cpp llama-bench -p {args.lengths[0]}: {theirs:.0f} tok/s; ours {first_prefill / theirs:.2f}×")


if __name__ == "__main__":
    main()
