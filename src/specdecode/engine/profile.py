"""Cost profiles taken before any request arrives and recorded in the adaptive policy's cost model: the
draft model's forward at every batch size, the target's verify call up to the longest lookup draft, and
the target's attention per cached key.

Learned online, the draft's cost is known only at the numbers of drafting sequences the policy has
already run, and it is not smooth beyond them (kernels change tiling at some row counts), so a guess can
start drafting for many sequences at once where it does not pay. Timing 1..max_num_seqs draft forwards
takes a few seconds and removes the guess. The target's verify calls are learned online up to k + 1
tokens (the policy measures plain decoding at a batch size before it speculates there, and grows calls a
token at a time); a lookup proposer whose drafts run far past k (suffix speculation, up to 32) would take
dozens of steps to learn what a long call costs, so those sizes are timed up front."""

from __future__ import annotations

import statistics
import time

import torch

from ..executor.runner import ModelRunner
from ..models.runtime import Transformer
from ..timing import now

CATCH_UP_TOKENS = 128  # a typical prompt, read by the draft when a sequence starts drafting
SHORT_CONTEXT, LONG_CONTEXT = 128, 8192  # cached tokens of the two decode steps that price attention per key


def time_forward(
    model: Transformer, batch: int, tokens: int, context: int, repeats: int, logits: str | None = None
) -> float:
    """Median seconds of one forward of `batch` sequences with `tokens` new tokens each after `context`
    cached ones, in a cache of its own (contents do not change the cost, so they are left as zeros).
    logits: "all" (verification, the default for several tokens) or "last" (decoding, a draft)."""
    runner = ModelRunner(model, batch, context + tokens + 1)
    slots = [runner.allocate() for _ in range(batch)]
    for s in slots:
        runner.assume_cached(s, context)
    inputs = [[0] * tokens for _ in slots]
    logits = logits or ("all" if tokens > 1 else "last")
    times = []
    with torch.inference_mode():
        for i in range(repeats + 1):  # the first call warms up (a new shape can carry one-off work)
            start = now()
            runner.forward(slots, inputs, logits)
            if i:
                times.append(now() - start)
    return statistics.median(times)


def profile_draft_costs(engine, context: int = 128, repeats: int = 2) -> float:
    """Record in the engine's policy the draft model's seconds per forward for 1 .. max_num_seqs
    sequences and its catch-up seconds per token. Returns the seconds it took (0 without a draft model:
    plain decoding and prompt lookup have no draft forward to price)."""
    draft = engine.proposer.model if engine.proposer is not None else None
    if draft is None or engine.k == 0:
        return 0.0
    started = time.perf_counter()
    policy = engine.policy
    context = min(context, engine.max_model_len - 2)
    for n in range(1, engine.runner.num_slots + 1):
        policy.record_draft_cost(n, time_forward(draft, n, 1, context, repeats))
    catch_up = min(CATCH_UP_TOKENS, engine.max_model_len - 1)
    policy.observe_draft_prefill(catch_up, time_forward(draft, 1, catch_up, 0, 1, logits="last"))
    return time.perf_counter() - started


def profile_verify_costs(engine, context: int = 128, repeats: int = 2) -> float:
    """Record in the engine's policy the target's seconds for one sequence verifying 1 .. lookup_cap + 1
    tokens (at sizes doubling from 1, and the largest); returns the seconds it took (0 when lookup drafts
    are no longer than k, which the policy learns online)."""
    cap = engine.lookup_cap
    if cap <= engine.k:
        return 0.0
    started = time.perf_counter()
    context = min(context, engine.max_model_len - cap - 2)
    sizes = sorted({1 << i for i in range((cap + 1).bit_length()) if 1 << i <= cap + 1} | {cap + 1})
    for tokens in sizes:
        seconds = time_forward(engine.runner.model, 1, tokens, context, repeats)
        engine.policy.record_target_cost(1, tokens, seconds, context, (tokens - 1) * context)
    return time.perf_counter() - started


def profile_attention_cost(engine, repeats: int = 5) -> float:
    """Record in the engine's policy what the target's attention costs per cached key, for a sequence's first row
    and for each further row of a verify (k + 1 rows): calls after LONG_CONTEXT cached tokens against the same
    calls after SHORT_CONTEXT (the difference is the attention over the keys between; the weights cost the same).
    A further row reads keys the first already brought in, so it costs less per key. Costs learned at one
    context length then price another. Returns the seconds it took (0 where nothing will be verified, k = 0, or
    the context is too short for the difference to be measured)."""
    long = min(LONG_CONTEXT, engine.max_model_len - engine.k - 2)
    if engine.k == 0 or long < 8 * SHORT_CONTEXT:
        return 0.0
    started = time.perf_counter()
    model, rows, keys = engine.runner.model, engine.k + 1, long - SHORT_CONTEXT

    def attention_seconds(tokens: int) -> float:  # over the keys between the two contexts
        return time_forward(model, 1, tokens, long, repeats) - time_forward(model, 1, tokens, SHORT_CONTEXT, repeats)

    first = max(0.0, attention_seconds(1))
    further = max(0.0, attention_seconds(rows) - first) / (rows - 1)
    engine.policy.record_attention_cost(first / keys, further / keys)
    return time.perf_counter() - started
