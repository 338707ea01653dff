"""Step-cost profile: time the forwards the adaptive policy plans with before any request arrives (as
vLLM profiles every batch size at start-up), and record them in the policy's cost model.

Learning costs online only covers the sizes the policy has already run. Beyond them it extrapolates,
and forward costs are not smooth: the int8 draft switches to its floating-point GEMM at 8 rows
(129 ms for 8 sequences where 1, 2 and 4 cost 55, 63 and 69), and verifying k + 1 tokens for every
sequence of a large batch makes the target compute-bound. Through the server, an extrapolated bet at
concurrency 8 started the draft on all 8 sequences at once: a 5 s step of catch-ups for drafting that
never paid (adaptive 0.91x plain there). The profile measures those sizes up front, so the first
decision at a new load already prices them; real steps keep refining the tables."""
from __future__ import annotations

import statistics
import time

import torch

from ..kv_cache import KVCache
from ..metrics import now
from ..models.runtime import Transformer, forward_ragged
from ..proposers.draft_model import DraftModelProposer

CATCH_UP_TOKENS = 128  # a typical prompt, read by the draft when a sequence starts drafting


def time_forward(model: Transformer, batch: int, tokens: int, context: int, repeats: int,
                 logits: str | None = None) -> float:
    """Median seconds of one forward of `batch` sequences with `tokens` new tokens each after `context`
    cached ones, in a cache of its own (contents do not change the cost, so they are left as zeros).
    logits: "all" (verification, the default for several tokens) or "last" (decoding, a draft)."""
    cache = KVCache(model.cfg, batch, context + tokens + 1, model.dtype, model.device)
    slots = [cache.allocate() for _ in range(batch)]
    for s in slots:
        cache.lengths[s] = context
    inputs = [[0] * tokens for _ in slots]
    logits = logits or ("all" if tokens > 1 else "last")
    times = []
    with torch.inference_mode():
        for i in range(repeats + 1):  # the first call warms up (a new shape can carry one-off work)
            start = now()
            forward_ragged(model, cache, slots, inputs, logits)
            if i:
                times.append(now() - start)
    return statistics.median(times)


def profiled_batch_sizes(max_num_seqs: int) -> list[int]:
    """Powers of two up to the engine's batch limit, and the limit itself."""
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    return sizes + [max_num_seqs]


def profile_step_costs(engine, context: int = 128, budget_s: float = 120.0) -> float:
    """Record in the engine's policy the target's cost at each profiled batch size b for plain decoding
    (b tokens), half and full drafts (b · (1 + k_max / 2), b · (1 + k_max) tokens), the draft's cost per
    forward for 1 .. b sequences, and its catch-up cost per token. Smaller batches first; stops adding
    sizes once `budget_s` is spent (the rest stay extrapolated). Returns the seconds it took."""
    started = time.perf_counter()
    costs, k = engine.policy.costs, engine.k
    draft = engine.proposer.model if isinstance(engine.proposer, DraftModelProposer) else None
    if draft is None or k == 0:
        return 0.0  # nothing to weigh: plain decoding, or prompt lookup (no draft forward)
    context = min(context, engine.max_model_len - (k + 2))
    target_seconds: dict[int, list[float]] = {}
    drafted = 0
    for b in profiled_batch_sizes(engine.cache.num_slots):
        for tokens in sorted({1, 1 + k // 2, 1 + k}):
            target_seconds.setdefault(b * tokens, []).append(time_forward(engine.model, b, tokens, context, 1))
        for n in range(drafted + 1, b + 1):  # every size: the int8 draft's cost jumps inside a power of two
            costs.draft.record(n, time_forward(draft, n, 1, context, repeats=2))  # cheap: steadier median
        drafted = b
        if time.perf_counter() - started > budget_s:
            break
    for size, seconds in target_seconds.items():  # one size can come from two shapes (8 x 2, 16 x 1)
        costs.target.record(size, statistics.fmean(seconds))
    catch_up = min(CATCH_UP_TOKENS, engine.max_model_len - 1)
    costs.observe_draft_prefill(catch_up, time_forward(draft, 1, catch_up, 0, 1, logits="last"))
    return time.perf_counter() - started
