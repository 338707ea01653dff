"""Concurrency sweep through the server: plain decoding, fixed-k speculation and the adaptive policy,
each in its own `specdecode serve` process, at each concurrency; the same HumanEval prompts,
greedy, a fixed number of new tokens (EOS ignored so every configuration does the same work).
Prints throughput and TPOT with their ratios to plain decoding at the same concurrency; writes JSON."""
from __future__ import annotations

import asyncio
from collections import defaultdict
from contextlib import ExitStack

import torch

from .datasets import humaneval_prompts
from .load import LoadResult, run_load, send_requests
from .results import command_line, machine_info, write_json
from .server_process import ServerProcess, llama_server


def server_configs(args) -> list[tuple[str, list[str]]]:
    common = ["--model", args.model, "--max-num-seqs", str(max(args.concurrency)),
              "--max-model-len", str(args.max_model_len), "--dtype", args.dtype,
              "--quantization", args.quantization, "--draft-quantization", args.draft_quantization]
    draft = ["--speculative-model", args.draft] if args.draft else []
    configs = {"plain": common + ["--num-speculative-tokens", "0"],
               "fixed": common + draft + ["--policy", "fixed", "-k", str(args.k)],
               "adaptive": common + draft + ["--policy", "adaptive", "-k", str(args.k)]}
    return [(name, configs[name]) for name in args.policies]


def start_server(name: str, serve_args: list[str], args) -> ServerProcess:
    """Ours, or llama.cpp's llama-server (plain, or with its draft model) on the same GGUF files."""
    if not name.startswith("llama.cpp"):
        return ServerProcess(serve_args)
    from ..models.sources import resolve

    draft = resolve(args.draft).path if name == "llama.cpp-draft" else None
    return llama_server(args.vs_llama_server, resolve(args.model).path, max(args.concurrency), args.max_model_len,
                        torch.get_num_threads(), draft, args.k)


def requests_at(concurrency: int, args) -> int:
    return max(args.min_requests, args.requests_per_client * concurrency)


def run_sweep(args) -> dict:
    """All servers run side by side (idle ones cost no compute). At each concurrency the configurations take
    turns, in an order that alternates by level and by round, so drift in the machine's speed hits them
    alike; with `--rounds N` each cell is measured N times and its requests are pooled (configurations named
    in `--once` only in the first round)."""
    prompts = humaneval_prompts()
    configs = server_configs(args)
    if args.vs_llama_server:
        configs += [("llama.cpp", []), ("llama.cpp-draft", [])]
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
                batch = [prompts[i % len(prompts)] for i in range(requests_at(c, args))]
                turn = order if (level + rnd) % 2 == 0 else order[::-1]
                for name in [n for n in turn if rnd == 0 or n not in args.once]:
                    requests, seconds = asyncio.run(
                        send_requests(servers[name].base_url, batch, args.max_tokens, concurrency=c))
                    runs[name, c].append((requests, seconds))
                    print(row_text(name, LoadResult.from_requests(requests, seconds, c, None), rnd), flush=True)
    rows = [pooled_row(name, c, runs[name, c]) for name in order for c in args.concurrency]
    add_ratios_to_plain(rows)
    return {"meta": meta(args), "results": rows}


def pooled_row(name: str, concurrency: int, rounds: list[tuple[list, float]]) -> dict:
    """One cell: the rounds' requests pooled (throughput = all tokens / all seconds), with each round's
    throughput kept beside it to show the spread."""
    requests = [r for batch, _ in rounds for r in batch]
    pooled = LoadResult.from_requests(requests, sum(s for _, s in rounds), concurrency, None)
    per_round = [LoadResult.from_requests(batch, s, concurrency, None).output_throughput for batch, s in rounds]
    return {"config": name, **pooled.as_dict(), "rounds": len(rounds), "round_throughputs": per_round}


def add_ratios_to_plain(rows: list[dict]) -> None:
    """Ratios of pooled figures, and for throughput also each round's ratio to plain's round at the same
    level (paired: they ran back to back)."""
    plain = {r["concurrency"]: r for r in rows if r["config"] == "plain"}
    for r in rows:
        base = plain.get(r["concurrency"])
        if base and r["tpot_s"] and base["tpot_s"]:
            r["throughput_vs_plain"] = r["output_throughput"] / base["output_throughput"]
            r["tpot_reduction_vs_plain"] = base["tpot_s"]["mean"] / r["tpot_s"]["mean"]
            pairs = zip(r.get("round_throughputs", []), base.get("round_throughputs", []))
            r["round_throughputs_vs_plain"] = [a / b for a, b in pairs]


def meta(args) -> dict:
    return {"command": command_line(), "model": args.model, "draft": args.draft, "quantization": args.quantization,
            "draft_quantization": args.draft_quantization,
            "k": args.k, "max_tokens": args.max_tokens, "dataset": "humaneval", "greedy": True,
            "requests": {c: requests_at(c, args) for c in args.concurrency}, "rounds": args.rounds,
            "once": args.once, "machine": machine_info(), "cuda": torch.cuda.is_available()}


def row_text(name: str, r: LoadResult, rnd: int) -> str:
    alpha = "-" if r.acceptance_rate is None else f"{r.acceptance_rate:.3f}"
    spec = "-" if r.speculating_fraction is None else f"{r.speculating_fraction:.0%}"
    return (f"{rnd + 1:>5} {name:<10}{r.concurrency:>5}{r.num_requests:>6}{r.output_throughput:>10.2f}"
            f"{r.tpot_s['mean'] * 1000 if r.tpot_s else float('nan'):>10.1f}"
            f"{r.ttft_s['mean'] if r.ttft_s else float('nan'):>9.2f}{alpha:>8}{spec:>8}{r.num_failed:>7}")


HEADER = f"{'round':>5} {'config':<10}{'conc':>5}{'reqs':>6}{'tok/s':>10}{'TPOT ms':>10}{'TTFT s':>9}{'α':>8}{'spec%':>8}{'failed':>7}"


def summary_table(rows: list[dict]) -> str:
    lines = [f"{'config':<10}{'conc':>5}{'tok/s':>10}{'vs plain':>10}{'rounds vs plain':>26}{'TPOT ms':>10}"
             f"{'TPOT ÷':>9}"]
    for r in rows:
        ratio = r.get("throughput_vs_plain")
        tpot = r.get("tpot_reduction_vs_plain")
        spread = ", ".join(f"{x:.2f}" for x in r.get("round_throughputs_vs_plain", []))
        lines.append(f"{r['config']:<10}{r['concurrency']:>5}{r['output_throughput']:>10.2f}"
                     f"{'' if ratio is None else f'{ratio:.2f}x':>10}{spread:>26}{r['tpot_s']['mean'] * 1000:>10.1f}"
                     f"{'' if tpot is None else f'{tpot:.2f}x':>9}")
    return "\n".join(lines)


def run_concurrency_cli(args) -> int:
    print(f"HumanEval through the server, greedy, {args.max_tokens} new tokens; policies {', '.join(args.policies)}; "
          f"concurrency {args.concurrency}; {args.rounds} round(s)", flush=True)
    print(HEADER, flush=True)
    report = run_sweep(args)
    print("\n" + summary_table(report["results"]))
    write_json(args.out, report)
    return 0
