"""Batch-size-1 latency benchmark: plain decoding vs draft-model and n-gram speculation for several k,
on each requested backend (one loaded target per backend), greedy, in one run; optionally llama.cpp on the
same GGUF files and prompts beside it. Prints a table and writes JSON."""

from __future__ import annotations

import gc
import itertools
import statistics
from dataclasses import asdict, dataclass

from ..engine.llm import LLM
from ..engine.profile import time_forward
from ..metrics import SpecCounters
from ..models.loader import load_model
from ..models.lora import Adapter
from ..models.sources import default_draft, resolve
from ..proposers.registry import DRAFT_MODEL, proposer_kind
from ..sampling import SamplingParams
from .datasets import prompts_for
from .edits import CHAT_DATASETS, agent_loop_scripts, code_edit_prompts, describe_dataset
from .formatting import fmt, ratio, yes_no
from .llama_cpp import (
    LLAMA_NGRAM_MODES,
    NO_FLASH_ATTENTION_NOTE,
    NO_REPACK_NOTE,
    LlamaBench,
    llama_cpp_draft,
    run_llama_bench,
    run_llama_speculative,
)
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
    prefill_tokens_per_s: float | None = None  # plain rows: one PREFILL_TOKENS-token prompt's forward
    draft_prefill_ms: float | None = None  # the draft's forwards over each prompt, a request's mean (not in c)


# A prompt of llama-bench's pp512: its forward computes the last row's logits only, as a prefill does.
PREFILL_TOKENS = 512


def run_config(llm: LLM, requests: list, params: SamplingParams, k: int, label: str, proposer: str):
    """Each request alone (batch size 1); see `play` for what a request is. Figures are pooled over the
    timed outputs: decoding speed is their tokens after the first over their time after the first."""
    llm.engine.k = k
    llm.generate("def", SamplingParams(temperature=0, max_tokens=4))  # warm-up
    llm.timer.reset()
    llm.engine.forget_cached_prefixes()  # no configuration starts from another's prompts (a session's turns may)
    outs = [out for request in requests for out in play(llm, request, params)]
    counters = SpecCounters()
    for o in outs:
        counters.merge(o.metrics.spec)
    m = [o.metrics for o in outs]
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    seconds = sum(x.finish_time - x.arrival_time for x in m)
    ttft = sum(x.ttft for x in m)
    drafted, steps = counters.num_draft_tokens, counters.num_spec_steps
    t = llm.timer
    result = LatencyResult(
        label,
        llm.target.model.backend,
        proposer,
        k,
        tokens,
        seconds,
        (tokens - len(outs)) / (seconds - ttft),
        counters.num_accepted_tokens / drafted if drafted else None,
        (counters.num_accepted_tokens + steps) / steps if steps else None,
        t.target_step_s * 1000 if t.target_step_s else None,
        t.draft_step_s * 1000 if t.draft_step_s else None,
        e2e_tokens_per_s=tokens / seconds,
        mean_ttft_ms=1000 * ttft / len(outs),
        mean_drafts=drafted / steps if steps else None,
        acceptance_per_position=counters.acceptance_per_position or None,
        draft_prefill_ms=1000 * t.draft_prefill_time / len(outs) if t.draft_prefill_calls else None,
    )
    return result, outs


def play(llm: LLM, request, params: SamplingParams) -> list:
    """The timed outputs of one request: a prompt (one completion), a chat (one reply), or an agent
    session (`Session`: its turns one after the other, each reply put into the next turn's history; the
    first turn, which has nothing to repeat yet, is not timed)."""
    if isinstance(request, str):
        return llm.generate(request, params)
    if not isinstance(request, Session):
        return llm.chat(request, params)
    history, timed = [], []
    for turn, message in enumerate(request.turns):
        history.append({"role": "user", "content": message})
        out = llm.chat(history, params)[0]
        history.append({"role": "assistant", "content": out.outputs[0].text})
        if turn:
            timed.append(out)
    return timed


@dataclass
class Session:
    turns: list[str]  # user messages, in order


def load_requests(dataset: str, count: int, turns: int, tokenizer_name: str) -> list:
    """Code-edit chats or agent sessions (see bench/edits.py), or completion prompts of any dataset that
    datasets.load_prompts reads (HumanEval, sonnet:LEN sized by the model's tokenizer, jsonl:PATH, hf:NAME)."""
    if dataset == "code-edit":
        return code_edit_prompts(count)
    if dataset == "agent-loop":
        return [Session(script) for script in agent_loop_scripts(count, turns)]
    return prompts_for(dataset, count, tokenizer_name)


def verify_cost_ratio(model, k: int, context: int = 256, rounds: int = 5) -> float:
    """T(k+1)/T(1): one forward over k+1 new tokens against one over a single token, after `context`; the median
    of ratios timed in pairs, so that a slow spell of the host falls on both sides of one ratio."""
    pairs = [time_forward(model, 1, k + 1, context, 1) / time_forward(model, 1, 1, context, 1) for _ in range(rounds)]
    return statistics.median(pairs)


def prefill_tokens_per_s(model, max_model_len: int) -> float:
    """Tokens per second of one prompt's forward (PREFILL_TOKENS, or what the model's length allows)."""
    tokens = min(PREFILL_TOKENS, max_model_len - 1)
    return tokens / time_forward(model, 1, tokens, 0, 3, logits="last")


def predicted_speedup(r: LatencyResult) -> float:
    """Tokens per step over a step's cost in plain decoding steps: one verify forward (T(n+1)/T(1)) plus
    the drafted tokens' forwards at c each; measured/predicted shows what else the step spends."""
    return r.mean_accepted_length / (r.verify_cost_ratio + r.mean_drafts * r.cost_ratio_c)


@dataclass
class Run:
    """One engine the backend's rows come from: `kind` names the rows; `ks` and `confidences` are swept
    (the adaptive runs take one k, the most the drafter may draft, and choose below it)."""

    llm: LLM
    kind: str
    proposer: str
    ks: list[int]
    confidences: list[float]


def draft_model_name(args) -> str | None:
    """The draft model of the draft rows (the bundled draft by default); None when --draft names a
    proposer kind (ngram, suffix, head:PATH, a plug-in), which gets rows of its own instead."""
    if proposer_kind(args.draft) not in (None, DRAFT_MODEL):
        return None
    return default_draft(args.model, args.draft)


def make_runs(args, target, draft, draft_name: str | None) -> list[Run]:
    common = dict(device=args.device, dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=1)
    fixed = dict(common, speculation_policy="fixed")  # the study sweeps k
    runs = []
    kind = proposer_kind(args.draft)
    if kind not in (None, DRAFT_MODEL):
        confidences = [0.0] if kind in ("ngram", "suffix") else args.draft_confidence  # their drafts are sure
        runs.append(
            Run(LLM(target=target, speculative_model=args.draft, **fixed), kind, args.draft, args.ks, confidences)
        )
    if draft:
        runs.append(
            Run(
                LLM(target=target, draft=draft, draft_vocab_size=args.draft_vocab_size or None, **fixed),
                "draft",
                draft_name,
                args.ks,
                args.draft_confidence,
            )
        )
    head = _head(args)
    if args.head:
        runs.append(
            Run(LLM(target=target, speculative_model=head, **fixed), "head", head, args.ks, args.draft_confidence)
        )
    if not args.no_ngram and kind != "ngram":
        runs.append(Run(LLM(target=target, speculative_model="ngram", **fixed), "ngram", "ngram", args.ks, [0.0]))
    if args.suffix:
        runs += _suffix_runs(args, target, draft, draft_name, head, common)
    return runs


def _suffix_runs(args, target, draft, draft_name: str | None, head: str | None, common: dict) -> list[Run]:
    """Suffix speculation alone, then each drafter alone and with suffix drafts beside it, all adaptive."""
    k = max(args.ks)
    suffix = LLM(target=target, speculative_model="suffix", num_speculative_tokens=k, **common)
    runs = [Run(suffix, "suffix adaptive", "suffix", [k], [0.0])]
    drafters = (
        [("draft", draft_name, dict(draft=draft, draft_vocab_size=args.draft_vocab_size or None))] if draft else []
    )
    drafters += [("head", head, dict(speculative_model=head))] if head else []
    confidence = args.draft_confidence[-1]
    for kind, name, drafter in drafters:
        for lookup in (None, "suffix"):
            llm = LLM(
                target=target,
                draft_confidence=confidence,
                prompt_lookup=lookup,
                num_speculative_tokens=k,
                **drafter,
                **common,
            )
            label = f"{kind}+suffix adaptive" if lookup else f"{kind} adaptive"
            runs.append(Run(llm, label, f"{name}+{lookup}" if lookup else name, [k], [confidence]))
    return runs


def _head(args) -> str | None:
    """The draft head measured: --head's, else --draft's where it names one."""
    if args.head:
        return args.head if args.head.startswith("head:") else f"head:{args.head}"
    return args.draft if proposer_kind(args.draft) == "head" else None


def run_backend(
    args, quantization: str, requests: list, params: SamplingParams
) -> tuple[list[LatencyResult], list[str]]:
    """Plain, then each proposer at each k, on one loaded target in `quantization`; also the texts of the
    timed prompts as plain decoding saw them (for llama.cpp's rows)."""
    target = _target(args, quantization, args.lora)
    draft_name = draft_model_name(args)
    draft = (
        load_model(
            draft_name,
            str(target.model.device),
            args.dtype,
            quantization=args.draft_quantization,
            draft=True,
            kv_cache_dtype=args.kv_cache_dtype,
        )
        if draft_name
        else None
    )
    runs = make_runs(args, target, draft, draft_name)
    name = target.model.backend
    plain_llm = (
        LLM(
            target=target,
            device=args.device,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            max_num_seqs=1,
            num_speculative_tokens=0,
        )
        if not runs
        else runs[0].llm
    )
    plain, plain_outs = run_config(plain_llm, requests, params, 0, f"{name}: plain", "none")
    plain.verify_cost_ratio = 1.0
    plain.prefill_tokens_per_s = prefill_tokens_per_s(target.model, plain_llm.engine.max_model_len)
    print(_row(plain), flush=True)
    results = [plain]
    for run in runs:
        for confidence, k in itertools.product(run.confidences, run.ks):
            if run.kind != "ngram" and run.llm.engine.proposer is not None:
                run.llm.engine.proposer.confidence_threshold = confidence
            label = f"{name}: {run.kind} k={k}" + (f" conf {confidence:g}" if confidence else "")
            res, outs = run_config(run.llm, requests, params, k, label, run.proposer)
            res.draft_confidence = confidence
            res.speedup = res.tokens_per_s / plain.tokens_per_s
            res.identical_to_plain = _token_ids(outs) == _token_ids(plain_outs)
            res.verify_cost_ratio = verify_cost_ratio(target.model, round(res.mean_drafts or k))
            if res.acceptance_rate is not None:
                res.cost_ratio_c = (res.draft_step_ms / plain.target_step_ms) if res.draft_step_ms else 0.0
                res.predicted_speedup = predicted_speedup(res)
            results.append(res)
            print(_row(res), flush=True)
            if res.acceptance_per_position:
                positions = " ".join(f"{a:.2f}" for a in res.acceptance_per_position[:8])
                prefill = f"   draft prefill: {res.draft_prefill_ms:.0f} ms a request" if res.draft_prefill_ms else ""
                print(f"{'':<28}α per position: {positions}{prefill}", flush=True)
    return results, [o.prompt for o in plain_outs]


def _token_ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def llama_cpp_plain(args, threads: int, when: str) -> tuple[LatencyResult, LlamaBench]:
    """llama.cpp's plain decoding (llama-bench tg) on the target's GGUF file, and the bench itself (its
    forwards over 1..5 tokens give llama.cpp's verify cost)."""

    bench = run_llama_bench(args.vs_llama_cpp, resolve(args.model).path, threads, args.max_tokens)
    if not bench.batches_repacked:
        print(f"note: {NO_REPACK_NOTE} (llama-bench pp)", flush=True)
    if not bench.flash_attention:
        print(f"note: {NO_FLASH_ATTENTION_NOTE}", flush=True)
    row = _llama_plain_row(when, args.max_tokens, bench.decode_tokens_per_s, bench.prefill_tokens_per_s(PREFILL_TOKENS))
    print(_row(row), flush=True)
    return row, bench


def run_llama_cpp_speculative(
    args, prompts: list[str], threads: int, plain: LatencyResult, bench: LlamaBench
) -> list[LatencyResult]:
    """llama.cpp's own draft-model speculation at each k, on the same files and prompts (with a head or a lookup as
    --draft, the target's bundled draft model: llama_cpp_draft)."""
    draft_name = llama_cpp_draft(args.model, args.draft)
    if draft_name is not None and draft_name != draft_model_name(args):
        print(f"llama.cpp's draft rows speculate with {draft_name} (llama.cpp reads no {args.draft})", flush=True)
    results = []
    for k in args.ks if draft_name else []:
        spec = run_llama_speculative(
            args.vs_llama_cpp, resolve(args.model).path, resolve(draft_name).path, prompts, k, args.max_tokens, threads
        )
        res = _llama_speculation_row(f"draft k={k}", draft_name, k, spec, plain, bench.verify_cost_ratio(k))
        results.append(res)
        print(_row(res), flush=True)
    return results


def _unrepacked(spec) -> str:
    """A mark on llama.cpp rows that ran with repacking off (see NO_REPACK_NOTE)."""
    return "" if spec.repacked else ", no repack"


def _llama_plain_row(when: str, max_tokens: int, tokens_per_s: float, prefill_tokens_per_s: float) -> LatencyResult:
    """A row of llama.cpp's plain decoding (llama-bench's), the reference of the ratios."""
    return LatencyResult(
        f"llama.cpp: plain ({when})",
        "llama.cpp",
        "none",
        0,
        max_tokens,
        max_tokens / tokens_per_s,
        tokens_per_s,
        None,
        None,
        1000 / tokens_per_s,
        None,
        speedup=1.0,
        verify_cost_ratio=1.0,
        prefill_tokens_per_s=prefill_tokens_per_s,
    )


def _llama_speculation_row(
    label: str, proposer: str, k: int, spec, plain: LatencyResult, verify_cost_ratio: float | None = None
) -> LatencyResult:
    """A row of llama.cpp's speculation (llama-speculative-simple's result), against its plain decoding."""
    return LatencyResult(
        f"llama.cpp: {label}{_unrepacked(spec)}",
        "llama.cpp",
        proposer,
        k,
        spec.output_tokens,
        spec.seconds,
        spec.tokens_per_s,
        spec.acceptance_rate,
        None,
        None,
        None,
        speedup=spec.tokens_per_s / plain.tokens_per_s,
        verify_cost_ratio=verify_cost_ratio,
    )


def run_llama_cpp_ngram(args, prompts: list[str], threads: int, plain: LatencyResult) -> list[LatencyResult]:
    """llama.cpp's n-gram speculation modes (no draft model), each with its defaults, on the same prompts."""
    results = []
    for mode in LLAMA_NGRAM_MODES:
        spec = run_llama_speculative(
            args.vs_llama_cpp, resolve(args.model).path, None, prompts, 0, args.max_tokens, threads, spec_type=mode
        )
        res = _llama_speculation_row(mode, mode, 0, spec, plain)
        results.append(res)
        print(_row(res), flush=True)
    return results


def _target(args, quantization: str, lora: list[str]):
    adapters = [Adapter.parse(spec) for spec in lora]
    options = dict(quantization=quantization, kv_cache_dtype=args.kv_cache_dtype, lora=adapters)
    options |= dict(lora_dtype=args.lora_dtype) if adapters else {}
    return load_model(args.model, args.device, args.dtype, **options)


def unadapted_plain_row(args, quantization: str, requests: list, params: SamplingParams) -> LatencyResult:
    """Plain decoding of the target without the adapters the other rows add: what they cost."""
    target = _target(args, quantization, [])
    llm = LLM(target=target, max_model_len=args.max_model_len, max_num_seqs=1, num_speculative_tokens=0)
    plain, _ = run_config(llm, requests, params, 0, f"{target.model.backend}: plain", "none")
    print(_row(plain), flush=True)
    return plain


def run_latency(args) -> list[LatencyResult]:
    """Our rows between two measurements of llama.cpp's plain decoding (when it is asked for): the machine's
    speed drifts, and ratios are taken to the mean of the two."""
    import torch

    requests = load_requests(args.dataset, args.num_prompts, args.turns, args.model)
    # a completion prompt has no natural end; a chat reply (a code edit) does, and what follows its end
    # would be the model talking to itself, which no user asks for
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=args.dataset not in CHAT_DATASETS)
    threads = torch.get_num_threads()
    before, _ = llama_cpp_plain(args, threads, "before") if args.vs_llama_cpp else (None, None)
    results, prompts = [], []
    for quantization in args.quantization:
        unadapted = unadapted_plain_row(args, quantization, requests, params) if args.lora else None
        rows, prompts = run_backend(args, quantization, requests, params)
        if unadapted is not None:
            print(f"{'':<28}the adapters' cost: plain {ratio(rows[0].tokens_per_s / unadapted.tokens_per_s)}")
            results.append(unadapted)
        results += rows
        gc.collect()  # one backend's weights at a time
    if before is None:
        return results
    after, bench = llama_cpp_plain(args, threads, "after")
    mean_plain = (before.tokens_per_s + after.tokens_per_s) / 2
    mean_prefill = (before.prefill_tokens_per_s + after.prefill_tokens_per_s) / 2
    mean = _llama_plain_row("mean", args.max_tokens, mean_plain, mean_prefill)
    results += [before, after, mean] + run_llama_cpp_speculative(args, prompts, threads, mean, bench)
    if args.suffix:
        results += run_llama_cpp_ngram(args, prompts, threads, mean)
    for r in results:
        r.vs_llama_cpp_plain = r.tokens_per_s / mean_plain
    print(
        f"\nagainst llama.cpp's plain decoding (same GGUF files, CPU and threads; the mean of "
        f"{before.tokens_per_s:.2f} before and {after.tokens_per_s:.2f} tok/s after our rows):",
        flush=True,
    )
    for r in results:
        print(f"  {r.config:<28} {ratio(r.vs_llama_cpp_plain, 6)}", flush=True)
    print(
        f"prefill of a {PREFILL_TOKENS}-token prompt against llama.cpp's pp{PREFILL_TOKENS} (the mean of "
        f"{before.prefill_tokens_per_s:.1f} and {after.prefill_tokens_per_s:.1f} tok/s):",
        flush=True,
    )
    for r in results:
        if r.backend != "llama.cpp" and r.prefill_tokens_per_s:
            prefill = r.prefill_tokens_per_s
            print(f"  {r.config:<28} {prefill:7.1f} tok/s {ratio(prefill / mean_prefill, 6)}", flush=True)
    return results


HEADER = (
    f"{'config':<28}{'tok/s':>8}{'e2e tok/s':>10}{'speedup':>9}{'α':>7}{'drafts':>7}{'τ':>6}{'c':>7}"
    f"{'predicted':>11}{'meas/pred':>11}{'T(n+1)/T(1)':>13}{'target ms':>11}{'draft ms':>10}  identical"
)


def _row(r: LatencyResult) -> str:
    measured_share = r.speedup / r.predicted_speedup if r.speedup and r.predicted_speedup else None
    return (
        f"{r.config:<28}{r.tokens_per_s:>8.2f}{fmt(r.e2e_tokens_per_s, '.2f', 10)}{fmt(r.speedup, '.2f', 9)}"
        f"{fmt(r.acceptance_rate, '.3f', 7)}{fmt(r.mean_drafts, '.2f', 7)}{fmt(r.mean_accepted_length, '.2f', 6)}"
        f"{fmt(r.cost_ratio_c, '.3f', 7)}"
        f"{fmt(r.predicted_speedup, '.2f', 11)}{fmt(measured_share, '.0%', 11)}"
        f"{fmt(r.verify_cost_ratio, '.2f', 13)}"
        f"{fmt(r.target_step_ms, '.1f', 11)}{fmt(r.draft_step_ms, '.1f', 10)}  {yes_no(r.identical_to_plain)}"
    )


def run_latency_cli(args) -> int:
    machine = machine_info()
    what = describe_dataset(args.dataset, args.turns) + (
        " (turns after the first timed)" if args.dataset == "agent-loop" else ""
    )
    print(
        f"{what}, batch 1, greedy, {args.max_tokens} new tokens, {args.num_prompts} prompts; "
        f"{describe_machine(machine)}",
        flush=True,
    )
    print(HEADER, flush=True)
    results = run_latency(args)
    meta = {
        "command": command_line(),
        "model": args.model,
        "draft": args.draft,
        "head": args.head,
        "dtype": args.dtype,
        "quantization": args.quantization,
        "draft_quantization": args.draft_quantization,
        "lora": args.lora,
        "lora_dtype": args.lora_dtype,
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "dataset": args.dataset,
        "turns": args.turns,
        "machine": machine,
    }
    write_json(args.out, {"meta": meta, "results": [asdict(r) for r in results]})
    return 0
