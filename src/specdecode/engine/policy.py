"""How many tokens to draft, decided every step.

- `fixed`: k every step.
- `disable_by_batch_size`: vLLM's `speculative_disable_by_batch_size`: k while the running batch has at
  most N sequences, none above.
- `adaptive`: k in 0..k_max per step, maximising expected goodput (emitted tokens per second) from each
  sequence's running acceptance estimate and the measured cost of draft and target forwards. k = 0 means
  no draft forward at all, so choosing it costs nothing over plain decoding.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ..errors import SpecDecodeError

POLICIES = ("fixed", "disable_by_batch_size", "adaptive")


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one verification emits when each draft is accepted with probability alpha: 1 + α + … + α^k."""
    return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


@dataclass
class CostModel:
    """Running means of measured forward times: target by tokens in the call, draft by batch size.
    Unseen sizes are estimated from the nearest measured one, scaled linearly (memory-bound regime)."""

    target: dict[int, float] = field(default_factory=dict)
    draft: dict[int, float] = field(default_factory=dict)
    smoothing: float = 0.3

    def observe(self, table: str, size: int, seconds: float) -> None:
        t = getattr(self, table)
        t[size] = seconds if size not in t else (1 - self.smoothing) * t[size] + self.smoothing * seconds

    def estimate(self, table: str, size: int) -> float | None:
        t = getattr(self, table)
        if size in t:
            return t[size]
        if not t:
            return None
        nearest = min(t, key=lambda s: abs(s - size))
        # weights dominate; growing the call adds a little: assume +2% per extra token/sequence
        return t[nearest] * (1 + 0.02 * (size - nearest))


@dataclass
class SpeculationPolicy:
    name: str = "adaptive"
    k_max: int = 4
    max_batch_for_speculation: int | None = None  # for disable_by_batch_size
    prior_acceptance: float = 0.7
    acceptance_smoothing: float = 0.2
    costs: CostModel = field(default_factory=CostModel)
    acceptance: dict[str, float] = field(default_factory=dict)  # request id -> running α estimate
    decisions: Counter = field(default_factory=Counter)  # k chosen -> steps

    def __post_init__(self):
        if self.name not in POLICIES:
            raise SpecDecodeError(f"unknown speculation policy {self.name!r}; use one of {', '.join(POLICIES)}")
        if self.name == "disable_by_batch_size" and not self.max_batch_for_speculation:
            raise SpecDecodeError("disable_by_batch_size needs a batch size (speculative_disable_by_batch_size)")

    def choose(self, request_ids: list[str]) -> int:
        """k for this step (the engine still caps it per sequence by max_tokens and the context)."""
        if self.k_max == 0:
            k = 0
        elif self.name == "fixed":
            k = self.k_max
        elif self.name == "disable_by_batch_size":
            k = self.k_max if len(request_ids) <= self.max_batch_for_speculation else 0
        else:
            k = self._best_k([self.acceptance.get(r, self.prior_acceptance) for r in request_ids])
        self.decisions[k] += 1
        return k

    def _best_k(self, alphas: list[float]) -> int:
        batch = len(alphas)
        plain = self.costs.estimate("target", batch)
        if plain is None:
            return 0  # measure plain decoding first
        if self.costs.estimate("draft", batch) is None:
            return self.k_max  # then measure one speculative step
        best_k, best_rate = 0, batch / plain
        for k in range(1, self.k_max + 1):
            seconds = k * self.costs.estimate("draft", batch) + self.costs.estimate("target", batch * (k + 1))
            rate = sum(expected_tokens(a, k) for a in alphas) / seconds
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def observe_step(self, num_seqs: int, num_tokens: int, target_seconds: float,
                     draft_seconds_per_forward: float | None) -> None:
        self.costs.observe("target", num_tokens, target_seconds)
        if draft_seconds_per_forward is not None:
            self.costs.observe("draft", num_seqs, draft_seconds_per_forward)

    def observe_acceptance(self, request_id: str, drafted: int, accepted: int) -> None:
        if drafted:
            rate = accepted / drafted
            prev = self.acceptance.get(request_id, self.prior_acceptance)
            self.acceptance[request_id] = (1 - self.acceptance_smoothing) * prev + self.acceptance_smoothing * rate

    def forget(self, request_id: str) -> None:
        self.acceptance.pop(request_id, None)

    @property
    def speculating_fraction(self) -> float:
        steps = sum(self.decisions.values())
        return sum(n for k, n in self.decisions.items() if k > 0) / steps if steps else 0.0
