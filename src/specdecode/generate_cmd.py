"""`specdecode generate`: one generation with its statistics; --compare adds plain decoding beside it."""

from __future__ import annotations

import json
import os
import sys
import time

from .cli import GENERATE_FIXED, engine_options
from .config import LOSSY_NOTE
from .engine.llm import LLM, RequestOutput
from .errors import SpecDecodeError
from .metrics import expected_speedup
from .models.infill import infill_ids
from .models.sources import served_draft
from .sampling import SamplingParams, StructuredOutput


def validate_args(args) -> SamplingParams:
    """Fail fast, before loading gigabytes of weights."""
    if args.prompt == "-":  # a prompt longer than a command-line argument may be (128 KiB on Linux)
        args.prompt = sys.stdin.read()
    if not args.prompt.strip():
        raise SpecDecodeError("the prompt is empty; pass some text to continue")
    if args.num_speculative_tokens < 0:
        raise SpecDecodeError(f"-k must be >= 0 (0 = plain decoding), got {args.num_speculative_tokens}")
    if args.ngram and args.speculative_model:
        raise SpecDecodeError("choose one proposer: --draft MODEL or --ngram, not both")
    if args.chat and args.suffix is not None:
        raise SpecDecodeError("choose one of --chat and --suffix: a gap to fill in is not a chat turn")
    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        max_tokens=args.max_tokens,
        seed=args.seed,
        stop=args.stop,
        structured_output=structured_output(args),
    )


def structured_output(args) -> StructuredOutput | None:
    if args.json_schema and args.regex:
        raise SpecDecodeError("choose one of --json-schema and --regex")
    if args.regex:
        return StructuredOutput(regex=args.regex)
    if not args.json_schema:
        return None
    text = args.json_schema
    if os.path.isfile(text):
        with open(text) as f:
            text = f.read()
    try:
        return StructuredOutput(json=json.loads(text))
    except json.JSONDecodeError as exc:
        raise SpecDecodeError(f"--json-schema is neither a file nor valid JSON: {exc}") from None


def run_generate(args) -> int:
    params = validate_args(args)
    options = engine_options(args, skip=GENERATE_FIXED)
    options["speculative_model"] = "ngram" if args.ngram else served_draft(args.model, args.speculative_model)
    llm = LLM(**options, max_num_seqs=1)
    prompt = prompt_of(llm, args)
    if args.compare:
        print(llm.startup_summary(), flush=True)
        _warm_up(llm, prompt)
    spec = _timed(llm, prompt, params)
    print(spec.output.outputs[0].text)
    k = (
        f"k={llm.engine.k}"
        if args.speculation_policy == "fixed"
        else f"{args.speculation_policy} policy, k_max={llm.engine.k}"
    )
    lookup = f" + {llm.config.prompt_lookup} lookup" if len(llm.engine.proposers) > 1 else ""
    proposer = options["speculative_model"]
    label = f"{'n-gram' if args.ngram else proposer}{lookup}, {k}" if proposer else "none"
    print(f"\n== speculative decoding (proposer: {label}) ==")
    _print_stats(spec)
    if args.forced_accept:
        print(f"NOTE {LOSSY_NOTE}")
    if args.compare:
        plain = _timed(llm, prompt, params, k=0)
        print("\n== plain decoding (same engine, k=0) ==")
        _print_stats(plain)
        _print_comparison(llm, spec, plain, params)
    return 0


def prompt_of(llm: LLM, args) -> str | list[int]:
    """The prompt as given, in the chat template (--chat), or around the gap before --suffix."""
    if args.chat:
        return llm.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    return args.prompt if args.suffix is None else infill_ids(llm.tokenizer, args.prompt, args.suffix)


class _Run:
    def __init__(self, output: RequestOutput, seconds: float, target_step: float | None, draft_step: float | None):
        self.output, self.seconds = output, seconds
        self.target_step, self.draft_step = target_step, draft_step

    @property
    def num_tokens(self) -> int:
        return len(self.output.outputs[0].token_ids)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds


def _timed(llm: LLM, prompt: str | list[int], params: SamplingParams, k: int | None = None) -> _Run:
    saved_k = llm.engine.k
    llm.engine.k = saved_k if k is None else k
    llm.timer.reset()
    llm.engine.forget_cached_prefixes()  # each run computes its prompt whole, as the first would
    start = time.perf_counter()
    out = llm.generate(prompt, params)[0]
    seconds = time.perf_counter() - start
    llm.engine.k = saved_k
    return _Run(out, seconds, llm.timer.target_step_s, llm.timer.draft_step_s)


def _warm_up(llm: LLM, prompt: str | list[int]) -> None:
    """First calls pay for kernel selection and allocation; keep that out of both timings."""
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4))


def _print_stats(run: _Run) -> None:
    m = run.output.spec
    print(
        f"tokens: {run.num_tokens}   time: {run.seconds:.2f} s   tokens/s: {run.tokens_per_s:.2f}   "
        f"TTFT: {m['ttft_s']:.3f} s   TPOT: {(m['tpot_s'] or 0) * 1000:.1f} ms"
    )
    print(f"target forwards: {m['num_target_forwards']} (1 prefill)   draft forwards: {m['num_draft_forwards']}")
    if m["num_draft_tokens"]:
        per_pos = " ".join(f"{a:.2f}" for a in m["acceptance_per_position"])
        print(
            f"drafted: {m['num_draft_tokens']}   accepted: {m['num_accepted_tokens']}   "
            f"acceptance rate α: {m['acceptance_rate']:.3f}   mean accepted length τ: "
            f"{m['mean_accepted_length']:.2f}   α per position: {per_pos}"
        )


def _print_comparison(llm: LLM, spec: _Run, plain: _Run, params: SamplingParams) -> None:
    speedup = spec.tokens_per_s / plain.tokens_per_s
    print("\n== comparison ==")
    line = f"speedup: {speedup:.2f}x ({spec.tokens_per_s:.2f} vs {plain.tokens_per_s:.2f} tokens/s)"
    m = spec.output.spec
    alpha = m["acceptance_rate"]
    # the policy and the confidence stop draft fewer than k_max: the formula takes the drafts a step made
    k = m["num_draft_tokens"] / m["num_spec_steps"] if m["num_spec_steps"] else llm.engine.k
    if alpha is not None and spec.draft_step and plain.target_step:
        c = spec.draft_step / plain.target_step
        predicted = expected_speedup(alpha, k, c)
        line += (
            f"   cost ratio c = draft step / target step: {c:.3f}   "
            f"Leviathan-predicted speedup (α={alpha:.3f}, k={k:.2f} drafted a step, c={c:.3f}; a verify "
            f"priced as one decode step): {predicted:.2f}x (measured = {speedup / predicted:.0%} of predicted)"
        )
    elif alpha is not None:
        line += f"   (n-gram proposer: c ≈ 0, predicted speedup {expected_speedup(alpha, k, 0.0):.2f}x)"
    print(line)
    if params.greedy:
        same = spec.output.outputs[0].token_ids == plain.output.outputs[0].token_ids
        print(f"greedy outputs identical to plain decoding: {'yes' if same else 'NO'}")
