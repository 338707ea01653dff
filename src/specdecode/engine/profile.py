"""Draft-cost profile: time the draft model's forward at every batch size before any request arrives,
and record it in the adaptive policy's cost model.

Learned online, the draft's cost is known only at the numbers of drafting sequences the policy has
already run, and it is not smooth beyond them: the int8 draft takes its floating-point GEMM at 8 rows
(129 ms for 8 sequences where 1, 2 and 4 cost 55, 63 and 69 ms on this project's CPU). Extrapolated
along the slope of 1-4, concurrency 8 through the server started the draft on all 8 new requests at
once, a 5 s step of catch-ups for drafting that did not pay (0.91x plain); extrapolated in proportion
(the cost table's rule now), concurrency 4 straight after 1 would not start drafting where it pays
1.1-1.4x. Timing 1..max_num_seqs draft forwards takes a few seconds and removes the guess.

The target is not profiled: the policy measures plain decoding at a batch size before it speculates
there, and the per-token cost of verifying carries over between batch sizes (see TargetCost). Profiling
the target by tokens in the call (eb43e4b) priced 8 x 2 tokens like 16 x 1 and made matters worse."""
from __future__ import annotations

import statistics
import time

import torch

from ..executor.runner import ModelRunner
from ..metrics import now
from ..models.runtime import Transformer
from ..proposers.draft_model import DraftModelProposer

CATCH_UP_TOKENS = 128  # a typical prompt, read by the draft when a sequence starts drafting


def time_forward(model: Transformer, batch: int, tokens: int, context: int, repeats: int,
                 logits: str | None = None) -> float:
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
    if not isinstance(engine.proposer, DraftModelProposer) or engine.k == 0:
        return 0.0
    started = time.perf_counter()
    draft, costs = engine.proposer.runner.model, engine.policy.costs
    context = min(context, engine.max_model_len - 2)
    for n in range(1, engine.runner.num_slots + 1):
        costs.draft.record(n, time_forward(draft, n, 1, context, repeats))
    catch_up = min(CATCH_UP_TOKENS, engine.max_model_len - 1)
    costs.observe_draft_prefill(catch_up, time_forward(draft, 1, catch_up, 0, 1, logits="last"))
    return time.perf_counter() - started
