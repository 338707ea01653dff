"""Policies that need no measurement."""

from __future__ import annotations

from ...errors import SpecDecodeError
from .base import DraftDecision, Policy


class FixedPolicy(Policy):
    """k_max for every sequence, every step."""

    name = "fixed"

    def decide(self, request_ids, catch_up, remaining, lookups, drafter, contexts=None) -> DraftDecision:
        return DraftDecision.main_proposer([self.k_max] * len(request_ids))


class DisableByBatchSize(Policy):
    """vLLM's `speculative_disable_by_batch_size`: k_max while the batch has at most N sequences, none above."""

    name = "disable_by_batch_size"

    def __init__(self, k_max: int, max_batch_for_speculation: int | None):
        if not max_batch_for_speculation:
            raise SpecDecodeError("disable_by_batch_size needs a batch size (speculative_disable_by_batch_size)")
        super().__init__(k_max)
        self.max_batch_for_speculation = max_batch_for_speculation

    def decide(self, request_ids, catch_up, remaining, lookups, drafter, contexts=None) -> DraftDecision:
        n = len(request_ids)
        return DraftDecision.main_proposer([self.k_max if n <= self.max_batch_for_speculation else 0] * n)

    def expects_drafting(self, batch: int) -> bool:
        return self.k_max > 0 and batch <= self.max_batch_for_speculation
