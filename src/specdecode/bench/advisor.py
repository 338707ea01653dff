"""`specdecode plan`: an advisor. From a short calibration run it predicts the speedup of draft-model
speculation for each k and batch size, and recommends k and the batch size above which to stop.

Calibration measures
- acceptance by draft position at batch size 1, with k_max drafted every step: p_i = P(the first i
  draft tokens are all accepted). A step with k drafts then emits E(k) = 1 + p_1 + ... + p_k tokens on
  average, with no assumption that positions are independent (acceptance is bursty);
- the target's forward time for b sequences of t new tokens each (t = 1 is plain decoding, t = k + 1 a
  verification), and the draft's forward time for b sequences of one token, at a fixed context length.

Prediction: speedup(k, b) = E(k) · T(b, 1) / (T(b, k + 1) + k · D(b)). It leaves out sampling and
bookkeeping, and assumes every sequence of the batch accepts like the calibration prompts; the sweep
report sets it beside measured speedups.

Ceiling: max over t of t · T(b, 1) / T(b, t), what any proposer could gain at batch size b if every draft
token were accepted and drafting cost nothing (a lookup's drafts nearly do). Where a batch already keeps
the cores' arithmetic busy, a verified token costs about what a decoded one does, and no drafter, however
good, can lift the ceiling there."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from ..engine.profile import time_forward
from ..errors import SpecDecodeError
from .datasets import load_prompts
from .formatting import ratio
from .results import command_line, write_json


@dataclass
class AdvisorOptions:
    k_max: int = 6
    batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    num_prompts: int = 3
    max_tokens: int = 64
    context: int = 256  # tokens already cached when the step costs are timed
    repeats: int = 3
    dataset: str = "humaneval"

    def __post_init__(self):
        if self.k_max < 1:
            raise SpecDecodeError(f"plan k_max must be >= 1, got {self.k_max}")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise SpecDecodeError(f"plan batch_sizes must be positive integers, got {self.batch_sizes}")


def measure_acceptance(target, draft, options: AdvisorOptions, seed: int) -> list[float]:
    """p_i for i = 1..k_max: the share of speculative steps whose first i draft tokens were all accepted."""
    from ..engine.llm import LLM
    from ..sampling import SamplingParams

    llm = LLM(
        target=target,
        draft=draft,
        num_speculative_tokens=options.k_max,
        max_num_seqs=1,
        max_model_len=max(2048, options.context * 2),
        speculation_policy="fixed",
        draft_confidence=0.0,
    )  # acceptance per position needs every position drafted
    prompts = load_prompts(
        options.dataset, options.num_prompts, seed=seed, count_tokens=lambda text: len(target.tokenizer.encode(text))
    )
    params = SamplingParams(temperature=0, max_tokens=options.max_tokens, ignore_eos=True)
    for prompt in prompts:
        llm.generate(prompt, params)
    totals = llm.engine.totals
    return [a / d if d else 0.0 for a, d in zip(totals.accepted_per_position, totals.drafted_per_position)]


def expected_tokens(prefix_acceptance: list[float], k: int) -> float:
    return 1.0 + sum(prefix_acceptance[:k])


def predict(prefix_acceptance: list[float], target_s: dict, draft_s: dict, k: int, b: int) -> float:
    """Predicted speedup of k drafts per sequence over plain decoding at batch size b."""
    spec = target_s[b][k + 1] + k * draft_s[b]
    return expected_tokens(prefix_acceptance, k) * target_s[b][1] / spec


def ceiling(target_s: dict) -> dict:
    """Per batch size b: (the best speedup with every draft accepted and free drafting, the tokens per
    sequence a step verifies there), over the verify lengths timed."""
    best = {}
    for b, seconds in target_s.items():
        tokens = max(seconds, key=lambda t: t * seconds[1] / seconds[t])
        best[b] = (tokens * seconds[1] / seconds[tokens], tokens)
    return best


def calibrate(target, draft, options: AdvisorOptions, seed: int = 0) -> dict:
    if draft is None:
        raise SpecDecodeError("the plan needs a draft model (it predicts draft-model speculation)")
    started = time.perf_counter()
    prefix = measure_acceptance(target, draft, options, seed)
    target_s = {
        b: {t: time_forward(target.model, b, t, options.context, options.repeats) for t in range(1, options.k_max + 2)}
        for b in options.batch_sizes
    }
    draft_s = {b: time_forward(draft.model, b, 1, options.context, options.repeats) for b in options.batch_sizes}
    ks = range(1, options.k_max + 1)
    speedup = {b: {k: predict(prefix, target_s, draft_s, k, b) for k in ks} for b in options.batch_sizes}
    best_k = {b: max(ks, key=lambda k: speedup[b][k]) for b in options.batch_sizes}
    paying = [b for b in options.batch_sizes if speedup[b][best_k[b]] > 1.0]
    return {
        "kind": "plan",
        "options": asdict(options),
        "target": target.name,
        "draft": draft.name,
        "prefix_acceptance": prefix,
        "alpha": {k: sum(prefix[:k]) / k for k in ks},  # the acceptance rate a run with k drafts would see
        "expected_tokens": {k: expected_tokens(prefix, k) for k in ks},
        "target_seconds": target_s,
        "draft_seconds": draft_s,
        "predicted_speedup": speedup,
        "best_k": best_k,
        "ceiling": ceiling(target_s),
        "recommended_k": best_k[min(options.batch_sizes)],
        # speculation should stop above the largest measured batch size at which it still pays
        "speculate_up_to_batch": max(paying) if paying else 0,
        "seconds": time.perf_counter() - started,
    }


def plan_table(plan: dict) -> str:
    batches = list(plan["predicted_speedup"])
    ks = list(plan["expected_tokens"])
    lines = [f"{'k':>3}{'α':>7}{'E[tokens]':>11}  " + "".join(f"{'b=' + str(b):>8}" for b in batches)]
    for k in ks:
        cells = "".join(ratio(plan["predicted_speedup"][b][k], 8) for b in batches)
        lines.append(f"{k:>3}{plan['alpha'][k]:>7.3f}{plan['expected_tokens'][k]:>11.2f}  {cells}")
    return "\n".join(lines)


def recommendation(plan: dict) -> str:
    b1 = min(plan["predicted_speedup"])
    k = plan["recommended_k"]
    text = f"recommended k = {k} at batch size {b1} (predicted {ratio(plan['predicted_speedup'][b1][k])})"
    up_to = plan["speculate_up_to_batch"]
    if not up_to:
        return text + "; speculation is not predicted to pay at any batch size measured"
    above = [b for b in plan["predicted_speedup"] if b > up_to]
    return text + (
        f"; speculate up to batch size {up_to}, decode plainly from batch size {above[0]}"
        if above
        else f"; speculation pays at every batch size measured (up to {up_to})"
    )


def ceiling_line(plan: dict) -> str:
    cells = ", ".join(f"b={b} {ratio(best)} ({tokens} tokens a step)" for b, (best, tokens) in plan["ceiling"].items())
    return f"ceiling, every draft accepted and drafting free: {cells}"


def print_advice(plan: dict) -> None:
    print(f"predicted speedup over plain decoding (draft {plan['draft']}, target {plan['target']}):")
    print(plan_table(plan))
    print(ceiling_line(plan))
    print(recommendation(plan), flush=True)


def run_advisor_cli(args) -> int:
    from ..models.loader import load_model
    from ..models.sources import default_draft

    options = AdvisorOptions(
        k_max=args.k_max,
        batch_sizes=args.batch_sizes,
        num_prompts=args.num_prompts,
        max_tokens=args.max_tokens,
        context=args.context,
    )
    draft_name = default_draft(args.model, args.draft)
    if not draft_name:
        raise SpecDecodeError("pass --draft: the plan predicts draft-model speculation")
    target = load_model(
        args.model, args.device, args.dtype, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype
    )
    draft = load_model(
        draft_name,
        str(target.model.device),
        args.dtype,
        quantization=args.draft_quantization,
        draft=True,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    print(
        f"calibrating: {options.num_prompts} prompts x {options.max_tokens} tokens at k={options.k_max}, "
        f"step costs at batch sizes {options.batch_sizes}",
        flush=True,
    )
    plan = calibrate(target, draft, options)
    plan["command"] = command_line()
    print_advice(plan)
    write_json(args.out, plan)
    return 0
