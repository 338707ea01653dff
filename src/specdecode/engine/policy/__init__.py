"""How many tokens to draft, decided every step and for every sequence: `fixed`, `disable_by_batch_size`
(vLLM's) or `adaptive` (goodput-maximising, per sequence). Costs, acceptance estimates and the decision
live in their own modules; the engine talks to the `Policy` interface only."""

from __future__ import annotations

from dataclasses import replace

from ...config import DEFAULT_K, POLICIES, AdaptiveOptions, EngineConfig
from ...errors import SpecDecodeError
from .acceptance import AcceptanceEstimator, LookupAcceptance
from .adaptive import AdaptivePolicy
from .base import DraftDecision, Policy
from .costs import CostModel, CostTable, TargetCost
from .simple import DisableByBatchSize, FixedPolicy


def make_policy(
    name: str = EngineConfig.speculation_policy,
    k_max: int = DEFAULT_K,
    max_batch_for_speculation: int | None = None,
    options: AdaptiveOptions | None = None,
    **overrides,
) -> Policy:
    """A policy by name; the adaptive one's knobs are `options` with `overrides` (AdaptiveOptions' fields)."""
    if name == "fixed":
        return FixedPolicy(k_max)
    if name == "disable_by_batch_size":
        return DisableByBatchSize(k_max, max_batch_for_speculation)
    if name == "adaptive":
        return AdaptivePolicy(k_max=k_max, options=replace(options or AdaptiveOptions(), **overrides))
    raise SpecDecodeError(f"unknown speculation policy {name!r}; use one of {', '.join(POLICIES)}")


__all__ = [
    "POLICIES",
    "make_policy",
    "Policy",
    "DraftDecision",
    "FixedPolicy",
    "DisableByBatchSize",
    "AdaptivePolicy",
    "AcceptanceEstimator",
    "LookupAcceptance",
    "CostModel",
    "CostTable",
    "TargetCost",
]
