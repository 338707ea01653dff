"""Batch-size-1 latency benchmark: plain decoding vs draft-model and n-gram speculation for several k,
all on one engine and one loaded target, greedy, in one run. Prints a table and writes JSON."""
from __future__ import annotations

import platform
import time
from dataclasses import asdict, dataclass

import torch

from ..engine.llm import LLM
from ..metrics import expected_speedup
from ..models.loader import load_model
from ..sampling import SamplingParams
from .datasets import humaneval_prompts
from .results import command_line, write_json


@dataclass
class LatencyResult:
    config: str
    proposer: str
    k: int
    output_tokens: int
    seconds: float
    tokens_per_s: float
    acceptance_rate: float | None
    mean_accepted_length: float | None
    target_step_ms: float | None
    draft_step_ms: float | None
    speedup: float | None = None
    cost_ratio_c: float | None = None
    predicted_speedup: float | None = None
    identical_to_plain: bool | None = None


def run_config(llm: LLM, prompts: list[str], params: SamplingParams, k: int, label: str, proposer: str):
    llm.engine.k = k
    llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    llm.timer.__init__()
    start = time.perf_counter()
    outs = [llm.generate(p, params)[0] for p in prompts]  # one at a time: batch size 1
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    drafted = sum(o.spec["num_draft_tokens"] for o in outs)
    accepted = sum(o.spec["num_accepted_tokens"] for o in outs)
    spec_steps = sum(o.spec["num_spec_steps"] for o in outs)
    t = llm.timer
    result = LatencyResult(
        label, proposer, k, tokens, seconds, tokens / seconds,
        accepted / drafted if drafted else None,
        (accepted + spec_steps) / spec_steps if spec_steps else None,
        t.target_step_s * 1000 if t.target_step_s else None, t.draft_step_s * 1000 if t.draft_step_s else None)
    return result, [o.outputs[0].token_ids for o in outs]


def run_latency(args) -> list[LatencyResult]:
    prompts = humaneval_prompts(args.num_prompts)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    target = load_model(args.model, args.device, args.dtype)
    from ..cli import default_draft

    draft_name = default_draft(args)
    draft = load_model(draft_name, str(target.model.device), args.dtype) if draft_name else None
    common = dict(device=args.device, dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=1)
    runs: list[tuple[LLM, str, str]] = []
    if draft:
        runs.append((LLM(target=target, draft=draft, draft_vocab_size=args.draft_vocab_size or None,
                         draft_quantization=args.draft_quantization, **common),
                     "draft", draft_name))
    if not args.no_ngram:
        runs.append((LLM(target=target, speculative_model="ngram", **common), "ngram", "ngram"))
    plain, plain_ids = run_config(runs[0][0], prompts, params, 0, "plain", "none")
    print(_row(plain), flush=True)
    results = [plain]
    for llm, kind, name in runs:
        for k in args.ks:
            res, ids = run_config(llm, prompts, params, k, f"{kind} k={k}", name)
            res.speedup = res.tokens_per_s / plain.tokens_per_s
            res.identical_to_plain = ids == plain_ids
            if res.acceptance_rate is not None:
                res.cost_ratio_c = (res.draft_step_ms / plain.target_step_ms) if res.draft_step_ms else 0.0
                res.predicted_speedup = expected_speedup(res.acceptance_rate, k, res.cost_ratio_c)
            results.append(res)
            print(_row(res), flush=True)
    return results


HEADER = (f"{'config':<14}{'tok/s':>8}{'speedup':>9}{'α':>7}{'τ':>6}{'c':>7}{'predicted':>11}"
          f"{'meas/pred':>11}{'target ms':>11}{'draft ms':>10}  identical")


def _fmt(value, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


def _row(r: LatencyResult) -> str:
    ratio = r.speedup / r.predicted_speedup if r.speedup and r.predicted_speedup else None
    same = "-" if r.identical_to_plain is None else ("yes" if r.identical_to_plain else "NO")
    return (f"{r.config:<14}{r.tokens_per_s:>8.2f}{_fmt(r.speedup, '.2f', 9)}{_fmt(r.acceptance_rate, '.3f', 7)}"
            f"{_fmt(r.mean_accepted_length, '.2f', 6)}{_fmt(r.cost_ratio_c, '.3f', 7)}"
            f"{_fmt(r.predicted_speedup, '.2f', 11)}{_fmt(ratio, '.0%', 11)}{_fmt(r.target_step_ms, '.1f', 11)}"
            f"{_fmt(r.draft_step_ms, '.1f', 10)}  {same}")


def run_latency_cli(args) -> int:
    print(f"HumanEval, batch 1, greedy, {args.max_tokens} new tokens, {args.num_prompts} prompts, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    print(HEADER, flush=True)
    results = run_latency(args)
    meta = {"command": command_line(), "model": args.model, "draft": args.draft,
            "dtype": args.dtype, "draft_quantization": args.draft_quantization, "num_prompts": args.num_prompts, "max_tokens": args.max_tokens,
            "machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}
    write_json(args.out, {"meta": meta, "results": [asdict(r) for r in results]})
    return 0
