"""Concurrency sweep through the server: plain decoding, fixed-k speculation and the adaptive policy
(with or without suffix speculation beside the drafter), each in its own `specdecode serve` process, at
each concurrency. HumanEval: the same prompts, greedy, a fixed number of new tokens (EOS ignored so every
configuration does the same work); code edits and agent loops: chat sessions (see load.play_sessions),
greedy, each reply ending at EOS (greedy output is the same under every configuration, so is the work).
Prints throughput and TPOT with their ratios to plain decoding at the same concurrency; writes JSON."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from contextlib import ExitStack

import torch

from .datasets import humaneval_prompts, prompts_for
from .edits import CHAT_DATASETS, agent_loop_scripts, code_edit_prompts, describe_dataset
from .formatting import fmt, joined, mean, ratio
from .llama_cpp import llama_cpp_draft
from .load import LoadResult, play_sessions, run_load, send_requests, summarize
from .results import command_line, machine_info, speedup_against, write_json
from .server_process import ServerProcess, llama_server, serve_argv


def server_configs(args) -> list[tuple[str, list[str]]]:
    """The `specdecode serve` flags of each policy asked for: plain, fixed k, adaptive up to k."""
    common = dict(
        model=args.model,
        max_num_seqs=max(args.concurrency),
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        quantization=args.quantization,
        draft_quantization=args.draft_quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    configs = {
        "plain": serve_argv(**common),
        "fixed": serve_argv(**common, draft=args.draft, k=args.k, policy="fixed"),
        "adaptive": serve_argv(**common, draft=args.draft, k=args.k, policy="adaptive"),
        "adaptive-suffix": serve_argv(**common, draft=args.draft, k=args.k, policy="adaptive", prompt_lookup="suffix"),
    }
    return [(name, configs[name]) for name in args.policies]


def start_server(name: str, serve_args: list[str], args) -> ServerProcess:
    """Ours, or llama.cpp's llama-server (plain, or with its draft model) on the same GGUF files."""
    if not name.startswith("llama.cpp"):
        return ServerProcess(serve_args)
    from ..models.sources import resolve

    draft = resolve(llama_cpp_draft(args.model, args.draft)).path if name == "llama.cpp-draft" else None
    return llama_server(
        args.vs_llama_server,
        resolve(args.model).path,
        max(args.concurrency),
        args.max_model_len,
        torch.get_num_threads(),
        draft,
        args.k,
    )


def requests_at(concurrency: int, args) -> int:
    """Requests (completion prompts) or sessions (chat datasets) sent at one concurrency."""
    return max(args.min_requests, args.requests_per_client * concurrency)


def workload(args, count: int) -> list:
    """`count` completion prompts or sessions: lists of user turns (one turn for a code edit)."""
    if args.dataset == "agent-loop":
        return agent_loop_scripts(count, args.turns)
    if args.dataset == "code-edit":
        return [[chat[-1]["content"]] for chat in code_edit_prompts(count)]
    return prompts_for(args.dataset, count, args.model)


def send(base_url: str, args, work: list, concurrency: int, run: str) -> tuple[list, float]:
    """One configuration's requests at one concurrency; `run` names the measurement, so that sessions
    replayed in a later round or at another concurrency are new users to the server's per-user caches
    (suffix speculation would otherwise draft a replayed session from its own earlier replies)."""
    if args.dataset not in CHAT_DATASETS:
        return asyncio.run(send_requests(base_url, work, args.max_tokens, concurrency=concurrency))
    return asyncio.run(play_sessions(base_url, work, args.max_tokens, concurrency=concurrency, run=run))


def llama_server_configs(args) -> list[tuple[str, list[str]]]:
    """llama-server plain, and with a draft model where there is one (said when it is not ours)."""
    draft = llama_cpp_draft(args.model, args.draft)
    if draft is None:
        print(f"llama.cpp-draft left out: llama-server reads no {args.draft} and {args.model} has no bundled draft")
        return [("llama.cpp", [])]
    if draft != args.draft:
        print(f"llama.cpp-draft speculates with {draft} (llama-server reads no {args.draft})")
    return [("llama.cpp", []), ("llama.cpp-draft", [])]


def measure_concurrency(args) -> dict:
    """All servers run side by side (idle ones cost no compute). At each concurrency the configurations take
    turns, in an order that alternates by level and by round, so drift in the machine's speed hits them
    alike; with `--rounds N` each cell is measured N times and its requests are pooled (configurations named
    in `--once` only in the first round)."""
    prompts = humaneval_prompts()
    configs = server_configs(args)
    if args.vs_llama_server:
        configs += llama_server_configs(args)
    order = [name for name, _ in configs]
    runs: dict[tuple[str, int], list[tuple[list, float]]] = defaultdict(list)
    with ExitStack() as stack:
        servers = {}
        for name, serve_args in configs:
            print(f"starting server: {name}", flush=True)
            servers[name] = stack.enter_context(start_server(name, serve_args, args))
            asyncio.run(run_load(servers[name].base_url, prompts[:1], 8, progress=False))  # warm-up
        for rnd in range(args.rounds):
            for level, c in enumerate(args.concurrency):
                work = workload(args, requests_at(c, args))
                turn = order if (level + rnd) % 2 == 0 else order[::-1]
                for name in [n for n in turn if rnd == 0 or n not in args.once]:
                    requests, seconds = send(servers[name].base_url, args, work, c, f"round{rnd}-c{c}-")
                    runs[name, c].append((requests, seconds))
                    print(row_text(name, LoadResult.from_requests(requests, seconds, c, None), rnd), flush=True)
    rows = [pooled_row(name, c, runs[name, c]) for name in order for c in args.concurrency]
    add_ratios_to_plain(rows)
    unrepacked = [name for name, server in servers.items() if not getattr(server, "repacked", True)]
    return {"meta": {**meta(args), "llama_server_unrepacked": unrepacked}, "results": rows}


def pooled_row(name: str, concurrency: int, rounds: list[tuple[list, float]]) -> dict:
    """One cell: the rounds' requests pooled (throughput = all tokens / all seconds), with each round's
    throughput kept beside it to show the spread."""
    requests = [r for batch, _ in rounds for r in batch]
    pooled = LoadResult.from_requests(requests, sum(s for _, s in rounds), concurrency, None)
    per_round = [LoadResult.from_requests(batch, s, concurrency, None).output_throughput for batch, s in rounds]
    later = summarize([r.tpot_s for r in requests if r.ok and r.turn > 0 and r.tpot_s is not None])
    return {
        "config": name,
        **pooled.as_dict(),
        "rounds": len(rounds),
        "round_throughputs": per_round,
        "later_turns_tpot_s": later,
    }


def add_ratios_to_plain(rows: list[dict]) -> None:
    """Ratios of pooled figures, and for throughput also each round's ratio to plain's round at the same
    level (paired: they ran back to back)."""
    plain = {r["concurrency"]: r for r in rows if r["config"] == "plain"}
    for r in rows:
        base = plain.get(r["concurrency"])
        speedup, tpot = speedup_against(r, base) if base else (None, None)
        if speedup is not None and tpot is not None:
            r["throughput_vs_plain"], r["tpot_reduction_vs_plain"] = speedup, tpot
            pairs = zip(r.get("round_throughputs", []), base.get("round_throughputs", []))
            r["round_throughputs_vs_plain"] = [a / b for a, b in pairs]
        later, plain_later = r.get("later_turns_tpot_s"), base.get("later_turns_tpot_s") if base else None
        if later and plain_later:
            r["later_turns_tpot_reduction_vs_plain"] = plain_later["mean"] / later["mean"]


def meta(args) -> dict:
    return {
        "command": command_line(),
        "model": args.model,
        "draft": args.draft,
        "llama_server_draft": llama_cpp_draft(args.model, args.draft) if args.vs_llama_server else None,
        "quantization": args.quantization,
        "draft_quantization": args.draft_quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "k": args.k,
        "max_tokens": args.max_tokens,
        "dataset": args.dataset,
        "turns": args.turns,
        "greedy": True,
        "requests": {c: requests_at(c, args) for c in args.concurrency},
        "rounds": args.rounds,
        "once": args.once,
        "machine": machine_info(),
        "cuda": torch.cuda.is_available(),
    }


def row_text(name: str, r: LoadResult, rnd: int) -> str:
    """One configuration's measurement in one round, as it finishes."""
    return (
        f"{rnd + 1:>5} {name:<16}{r.concurrency:>5}{r.num_requests:>6}{r.output_throughput:>10.2f}"
        f"{fmt(mean(r.tpot_s, 1000), '.1f', 10, missing='nan')}{fmt(mean(r.ttft_s), '.2f', 9, missing='nan')}"
        f"{fmt(r.acceptance_rate, '.3f', 8)}{fmt(r.speculating_fraction, '.0%', 8)}{r.num_failed:>7}"
    )


HEADER = (
    f"{'round':>5} {'config':<16}{'conc':>5}{'reqs':>6}{'tok/s':>10}{'TPOT ms':>10}{'TTFT s':>9}{'α':>8}"
    f"{'spec%':>8}{'failed':>7}"
)


def summary_table(rows: list[dict]) -> str:
    """Each cell against plain; for multi-turn sessions also the TPOT of the turns after the first, which have
    earlier replies to copy from."""
    later = any(r.get("later_turns_tpot_s") for r in rows)
    lines = [
        f"{'config':<16}{'conc':>5}{'tok/s':>10}{'vs plain':>10}{'rounds vs plain':>26}{'TPOT ms':>10}"
        f"{'TPOT ÷':>9}" + (f"{'later turns: TPOT ms':>22}{'TPOT ÷':>9}" if later else "")
    ]
    for r in rows:
        spread = joined(r.get("round_throughputs_vs_plain", []))
        line = (
            f"{r['config']:<16}{r['concurrency']:>5}{r['output_throughput']:>10.2f}"
            f"{ratio(r.get('throughput_vs_plain'), 10, missing='')}{spread:>26}"
            f"{fmt(mean(r['tpot_s'], 1000), '.1f', 10)}"
            f"{ratio(r.get('tpot_reduction_vs_plain'), 9, missing='')}"
        )
        if later:
            line += (
                f"{fmt(mean(r.get('later_turns_tpot_s'), 1000), '.1f', 22)}"
                f"{ratio(r.get('later_turns_tpot_reduction_vs_plain'), 9, missing='')}"
            )
        lines.append(line)
    return "\n".join(lines)


def run_concurrency_cli(args) -> int:
    print(
        f"{describe_dataset(args.dataset, args.turns)} through the server, greedy, {args.max_tokens} new tokens "
        f"at most; policies {', '.join(args.policies)}; concurrency {args.concurrency}; {args.rounds} round(s)",
        flush=True,
    )
    print(HEADER, flush=True)
    report = measure_concurrency(args)
    print("\n" + summary_table(report["results"]))
    write_json(args.out, report)
    return 0
