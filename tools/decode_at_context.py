"""Plain decoding after a context, ours and llama.cpp's llama-server on the same GGUF file and threads, in turn
on one host. Each engine holds the same prompt (the text's last N tokens, as tools/long_context.py takes them) in
its cache; every round decodes the same tokens with each (ours first in even rounds, llama-server first in odd ones),
then reads the bandwidth, so both meet the host's drift alike. Per length: each engine's rate, what the bytes a step
reads allow (weights + KV at the round's read rate), and ours against theirs, as medians over the rounds.

    python tools/decode_at_context.py --vs-llama-cpp BIN [--lengths 16384 1024] [--max-tokens 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics

import httpx
import torch

from specdecode import LLM, SamplingParams
from specdecode.bench.datasets import stdlib_text
from specdecode.bench.results import describe_machine, machine_info, read_bandwidth
from specdecode.bench.server_process import llama_server
from specdecode.config import DEFAULT_TARGET
from specdecode.engine.memory import kv_bytes_per_token
from specdecode.models.sources import resolve


def ours(llm: LLM, ids: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """Tokens a second after the first (the prompt is found cached after the first call), and the tokens."""
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0]
    return 1 / out.spec["tpot_s"], list(out.outputs[0].token_ids)


def theirs(base_url: str, ids: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """llama-server's decode rate (its own timing, prompt excluded) and tokens; the prompt as our tokenizer gave it,
    kept in its slot between calls."""
    body = {
        "prompt": ids,
        "n_predict": max_tokens,
        "temperature": 0,
        "top_k": 1,
        "cache_prompt": True,
        "return_tokens": True,
        "ignore_eos": True,
    }
    reply = httpx.post(f"{base_url}/completion", json=body, timeout=3600).raise_for_status().json()
    return reply["timings"]["predicted_per_second"], reply["tokens"]


def share_of_bytes(rate: float, bytes_per_step: float, bandwidth: float) -> float:
    """The decode rate as a share of what reading `bytes_per_step` at `bandwidth` allows."""
    return rate * bytes_per_step / bandwidth


def rounds_at(llm: LLM, server, prompt: list[int], args, bytes_per_step: float) -> None:
    """One length: both prefill once (untimed here), then `args.rounds` rounds in turn; prints each round and the
    medians."""
    ours(llm, prompt, args.max_tokens)
    theirs(server.base_url, prompt, args.max_tokens)
    rows = []
    for round_ in range(args.rounds):
        if round_ % 2:  # whichever goes first follows the bandwidth read: alternating favours neither
            peer, peer_tokens = theirs(server.base_url, prompt, args.max_tokens)
            mine, my_tokens = ours(llm, prompt, args.max_tokens)
        else:
            mine, my_tokens = ours(llm, prompt, args.max_tokens)
            peer, peer_tokens = theirs(server.base_url, prompt, args.max_tokens)
        bandwidth = read_bandwidth()
        shares = share_of_bytes(mine, bytes_per_step, bandwidth), share_of_bytes(peer, bytes_per_step, bandwidth)
        rows.append((mine, peer, *shares))
        same = sum(a == b for a, b in zip(my_tokens, peer_tokens))
        print(
            f"  ours {mine:.2f} tok/s ({shares[0]:.0%} of the bytes), llama.cpp {peer:.2f} ({shares[1]:.0%}) at "
            f"{bandwidth / 1e9:.1f} GB/s; {mine / peer:.2f}×; the same token at {same} of {args.max_tokens} places",
            flush=True,
        )
    mine, peer, mine_pct, peer_pct = (statistics.median(column) for column in zip(*rows))
    print(
        f"{len(prompt)} tokens ({bytes_per_step / 2**30:.2f} GiB a step), medians of {args.rounds} rounds: ours "
        f"{mine:.2f} tok/s, {mine_pct:.0%} of what the bytes allow; llama.cpp {peer:.2f}, {peer_pct:.0%}; ours "
        f"{statistics.median(r[0] / r[1] for r in rows):.2f}× theirs",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vs-llama-cpp", metavar="BIN", required=True, help="build-llama-cpp.sh's folder")
    parser.add_argument("--model", default=DEFAULT_TARGET)
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 1024])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    llm = LLM(model=args.model, progress=False, num_speculative_tokens=0)
    ids = llm.tokenizer.encode(stdlib_text())
    target = llm.engine.runner.model
    kv_per_token = kv_bytes_per_token(target.cfg, target.kv_dtype)
    print(f"{describe_machine(machine_info())}; {llm.memory_plan.summary()}", flush=True)
    end, context = max(args.lengths), max(args.lengths) + args.max_tokens + 64
    gguf, threads = resolve(args.model).path, torch.get_num_threads()
    with llama_server(args.vs_llama_cpp, gguf, slots=1, context=context, threads=threads) as server:
        print(f"llama-server: {' '.join(server.args[1:])}", flush=True)
        for length in args.lengths:
            print(f"# after {length} tokens", flush=True)
            bytes_per_step = llm.memory_plan.target_weight_bytes + kv_per_token * length
            rounds_at(llm, server, ids[end - length : end], args, bytes_per_step)


if __name__ == "__main__":
    main()
