"""Batch-size-1 latency benchmark: plain decoding vs draft-model and n-gram speculation for several k,
on each requested backend (one loaded target per backend), greedy, in one run; optionally llama.cpp on the
same GGUF files and prompts beside it. Prints a table and writes JSON."""
from __future__ import annotations

import gc
import itertools
import time
from dataclasses import asdict, dataclass

from ..engine.llm import LLM
from ..engine.profile import time_forward
from ..metrics import SpecCounters
from ..models.loader import load_model
from ..models.sources import default_draft, resolve
from ..sampling import SamplingParams
from .datasets import humaneval_prompts
from .formatting import fmt, ratio, yes_no
from .llama_cpp import LlamaBench, run_llama_bench, run_llama_speculative
from .results import command_line, describe_machine, machine_info, write_json


@dataclass
class LatencyResult:
    config: str
    backend: str
    proposer: str
    k: int
    output_tokens: int
    seconds: float
    tokens_per_s: float  # decoding: tokens after the first over the time after the first
    acceptance_rate: float | None
    mean_accepted_length: float | None
    target_step_ms: float | None
    draft_step_ms: float | None
    speedup: float | None = None  # against plain decoding on the same backend
    cost_ratio_c: float | None = None
    predicted_speedup: float | None = None
    identical_to_plain: bool | None = None
    verify_cost_ratio: float | None = None  # T(n+1) / T(1) of the target's forward, n = mean_drafts rounded
    vs_llama_cpp_plain: float | None = None  # tokens/s against llama.cpp's plain decoding
    e2e_tokens_per_s: float | None = None  # every token over the whole request, prefill included
    mean_ttft_ms: float | None = None
    draft_confidence: float = 0.0  # the draft stopped after a token it gave less probability
    mean_drafts: float | None = None  # tokens drafted per speculative step (below k when the draft stops early)
    acceptance_per_position: list[float] | None = None  # accepted / drafted at each draft position


def run_config(llm: LLM, prompts: list[str], params: SamplingParams, k: int, label: str, proposer: str):
    llm.engine.k = k
    llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    llm.timer.reset()
    start = time.perf_counter()
    outs = [llm.generate(p, params)[0] for p in prompts]  # one at a time: batch size 1
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    ttft = sum(o.metrics.ttft for o in outs)
    drafted = sum(o.spec["num_draft_tokens"] for o in outs)
    accepted = sum(o.spec["num_accepted_tokens"] for o in outs)
    spec_steps = sum(o.spec["num_spec_steps"] for o in outs)
    counters = SpecCounters()
    for o in outs:
        counters.merge(o.metrics.spec)
    t = llm.timer
    result = LatencyResult(
        label, llm.target.model.backend, proposer, k, tokens, seconds, (tokens - len(outs)) / (seconds - ttft),
        accepted / drafted if drafted else None,
        (accepted + spec_steps) / spec_steps if spec_steps else None,
        t.target_step_s * 1000 if t.target_step_s else None, t.draft_step_s * 1000 if t.draft_step_s else None,
        e2e_tokens_per_s=tokens / seconds, mean_ttft_ms=1000 * ttft / len(outs),
        mean_drafts=drafted / spec_steps if spec_steps else None,
        acceptance_per_position=counters.acceptance_per_position or None)
    return result, [o.outputs[0].token_ids for o in outs]


def verify_cost_ratio(model, k: int, context: int = 256) -> float:
    """T(k+1)/T(1): one forward over k+1 new tokens against one over a single token, after `context`."""
    return time_forward(model, 1, k + 1, context, 5) / time_forward(model, 1, 1, context, 5)


def predicted_speedup(r: LatencyResult) -> float:
    """Tokens per step over a step's cost in plain decoding steps: one verify forward (T(n+1)/T(1)) plus
    the drafted tokens' forwards at c each; measured/predicted shows what else the step spends."""
    return r.mean_accepted_length / (r.verify_cost_ratio + r.mean_drafts * r.cost_ratio_c)


def run_backend(args, quantization: str, prompts: list[str], params: SamplingParams) -> list[LatencyResult]:
    """Plain, then each proposer at each k, on one loaded target in `quantization`."""
    target = load_model(args.model, args.device, args.dtype, quantization=quantization)
    draft_name = default_draft(args.model, args.draft)
    draft = load_model(draft_name, str(target.model.device), args.dtype, quantization=args.draft_quantization,
                       draft=True) if draft_name else None
    common = dict(device=args.device, dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=1,
                  speculation_policy="fixed")  # the study sweeps k
    runs: list[tuple[LLM, str, str]] = []
    if draft:
        runs.append((LLM(target=target, draft=draft, draft_vocab_size=args.draft_vocab_size or None, **common),
                     "draft", draft_name))
    if args.head:
        head = args.head if args.head.startswith("head:") else f"head:{args.head}"
        runs.append((LLM(target=target, speculative_model=head, **common), "head", head))
    if not args.no_ngram:
        runs.append((LLM(target=target, speculative_model="ngram", **common), "ngram", "ngram"))
    name = target.model.backend
    plain, plain_ids = run_config(runs[0][0], prompts, params, 0, f"{name}: plain", "none")
    plain.verify_cost_ratio = 1.0
    print(_row(plain), flush=True)
    results = [plain]
    for llm, kind, proposer in runs:
        for confidence, k in itertools.product(args.draft_confidence if kind != "ngram" else [0.0], args.ks):
            if kind != "ngram":
                llm.engine.proposer.confidence_threshold = confidence
            label = f"{name}: {kind} k={k}" + (f" conf {confidence:g}" if confidence else "")
            res, ids = run_config(llm, prompts, params, k, label, proposer)
            res.draft_confidence = confidence
            res.speedup = res.tokens_per_s / plain.tokens_per_s
            res.identical_to_plain = ids == plain_ids
            res.verify_cost_ratio = verify_cost_ratio(target.model, round(res.mean_drafts or k))
            if res.acceptance_rate is not None:
                res.cost_ratio_c = (res.draft_step_ms / plain.target_step_ms) if res.draft_step_ms else 0.0
                res.predicted_speedup = predicted_speedup(res)
            results.append(res)
            print(_row(res), flush=True)
            if res.acceptance_per_position:
                print(f"{'':<28}α per position: " + " ".join(f"{a:.2f}" for a in res.acceptance_per_position),
                      flush=True)
    return results


def llama_cpp_plain(args, threads: int, when: str) -> tuple[LatencyResult, LlamaBench]:
    """llama.cpp's plain decoding (llama-bench tg) on the target's GGUF file, and the bench itself (its
    forwards over 1..5 tokens give llama.cpp's verify cost)."""

    bench = run_llama_bench(args.vs_llama_cpp, resolve(args.model).path, threads, args.max_tokens)
    row = LatencyResult(f"llama.cpp: plain ({when})", "llama.cpp", "none", 0, args.max_tokens,
                        args.max_tokens / bench.decode_tokens_per_s, bench.decode_tokens_per_s, None, None,
                        1000 / bench.decode_tokens_per_s, None, speedup=1.0, verify_cost_ratio=1.0)
    print(_row(row), flush=True)
    return row, bench


def run_llama_cpp_speculative(args, prompts: list[str], threads: int, plain: LatencyResult,
                              bench: LlamaBench) -> list[LatencyResult]:
    """llama.cpp's own draft-model speculation at each k, on the same files and prompts."""

    draft_name = default_draft(args.model, args.draft)
    results = []
    for k in args.ks if draft_name else []:
        spec = run_llama_speculative(args.vs_llama_cpp, resolve(args.model).path, resolve(draft_name).path,
                                     prompts, k, args.max_tokens, threads)
        res = LatencyResult(f"llama.cpp: draft k={k}", "llama.cpp", draft_name, k, spec.output_tokens,
                            spec.seconds, spec.tokens_per_s, spec.acceptance_rate, None, None, None,
                            speedup=spec.tokens_per_s / plain.tokens_per_s,
                            verify_cost_ratio=bench.verify_cost_ratio(k))
        results.append(res)
        print(_row(res), flush=True)
    return results


def run_latency(args) -> list[LatencyResult]:
    """Our rows between two measurements of llama.cpp's plain decoding (when it is asked for): the machine's
    speed drifts, and ratios are taken to the mean of the two."""
    import torch

    prompts = humaneval_prompts(args.num_prompts)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    threads = torch.get_num_threads()
    before, _ = llama_cpp_plain(args, threads, "before") if args.vs_llama_cpp else (None, None)
    results = []
    for quantization in args.quantization:
        results += run_backend(args, quantization, prompts, params)
        gc.collect()  # one backend's weights at a time
    if before is None:
        return results
    after, bench = llama_cpp_plain(args, threads, "after")
    mean_plain = (before.tokens_per_s + after.tokens_per_s) / 2
    mean = LatencyResult("llama.cpp: plain (mean)", "llama.cpp", "none", 0, args.max_tokens,
                         args.max_tokens / mean_plain, mean_plain, None, None, 1000 / mean_plain, None,
                         speedup=1.0, verify_cost_ratio=1.0)
    results += [before, after, mean] + run_llama_cpp_speculative(args, prompts, threads, mean, bench)
    for r in results:
        r.vs_llama_cpp_plain = r.tokens_per_s / mean_plain
    print(f"\nagainst llama.cpp's plain decoding (same GGUF files, CPU and threads; the mean of "
          f"{before.tokens_per_s:.2f} before and {after.tokens_per_s:.2f} tok/s after our rows):", flush=True)
    for r in results:
        print(f"  {r.config:<28} {ratio(r.vs_llama_cpp_plain, 6)}", flush=True)
    return results


HEADER = (f"{'config':<28}{'tok/s':>8}{'e2e tok/s':>10}{'speedup':>9}{'α':>7}{'drafts':>7}{'τ':>6}{'c':>7}"
          f"{'predicted':>11}{'meas/pred':>11}{'T(n+1)/T(1)':>13}{'target ms':>11}{'draft ms':>10}  identical")


def _row(r: LatencyResult) -> str:
    measured_share = r.speedup / r.predicted_speedup if r.speedup and r.predicted_speedup else None
    return (f"{r.config:<28}{r.tokens_per_s:>8.2f}{fmt(r.e2e_tokens_per_s, '.2f', 10)}{fmt(r.speedup, '.2f', 9)}"
            f"{fmt(r.acceptance_rate, '.3f', 7)}{fmt(r.mean_drafts, '.2f', 7)}{fmt(r.mean_accepted_length, '.2f', 6)}{fmt(r.cost_ratio_c, '.3f', 7)}"
            f"{fmt(r.predicted_speedup, '.2f', 11)}{fmt(measured_share, '.0%', 11)}"
            f"{fmt(r.verify_cost_ratio, '.2f', 13)}"
            f"{fmt(r.target_step_ms, '.1f', 11)}{fmt(r.draft_step_ms, '.1f', 10)}  {yes_no(r.identical_to_plain)}")


def run_latency_cli(args) -> int:
    machine = machine_info()
    print(f"HumanEval, batch 1, greedy, {args.max_tokens} new tokens, {args.num_prompts} prompts; "
          f"{describe_machine(machine)}", flush=True)
    print(HEADER, flush=True)
    results = run_latency(args)
    meta = {"command": command_line(), "model": args.model, "draft": args.draft, "head": args.head,
            "dtype": args.dtype,
            "quantization": args.quantization, "draft_quantization": args.draft_quantization,
            "num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "machine": machine}
    write_json(args.out, {"meta": meta, "results": [asdict(r) for r in results]})
    return 0
