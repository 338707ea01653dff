"""Speculation and latency metrics, per request and aggregated. Terms as in Leviathan et al. (2023):
α = accepted / drafted, τ = tokens emitted per verification step (bonus/recovered token included)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


def expected_speedup(alpha: float, k: float, c: float) -> float:
    """Leviathan et al.: (1 - α^(k+1)) / ((1 - α)(k·c + 1)), for cost ratio c = draft step / target step
    (k may be a mean number of drafts a step)."""
    if k == 0:
        return 1.0
    tokens = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (k * c + 1)


@dataclass
class SpecCounters:
    """Counters that add up across requests."""

    num_steps: int = 0  # target forward passes while decoding (verification or plain decode)
    num_spec_steps: int = 0  # of which had at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0  # tokens produced by decoding steps (accepted + recovered/bonus)
    num_draft_forwards: int = 0  # draft-model forward passes that included this sequence
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)

    def record_step(self, num_draft: int, num_accepted: int, num_emitted: int) -> None:
        self.num_steps += 1
        self.num_spec_steps += num_draft > 0
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        self.num_emitted_tokens += num_emitted
        self._cover_positions(num_draft)
        for i in range(num_draft):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += i < num_accepted

    def merge(self, other: "SpecCounters") -> None:
        self._cover_positions(len(other.drafted_per_position))
        for i, (d, a) in enumerate(zip(other.drafted_per_position, other.accepted_per_position)):
            self.drafted_per_position[i] += d
            self.accepted_per_position[i] += a
        self.num_steps += other.num_steps
        self.num_spec_steps += other.num_spec_steps
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_emitted_tokens += other.num_emitted_tokens
        self.num_draft_forwards += other.num_draft_forwards

    def _cover_positions(self, k: int) -> None:
        grow = k - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position += [0] * grow
            self.accepted_per_position += [0] * grow

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """τ over speculative steps: accepted drafts + 1 per step."""
        if not self.num_spec_steps:
            return None
        return (self.num_accepted_tokens + self.num_spec_steps) / self.num_spec_steps

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]


@dataclass
class RequestMetrics:
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # the prompt's prefix found in the KV cache, not computed again
    num_output_tokens: int = 0
    spec: SpecCounters = field(default_factory=SpecCounters)
    forced_accept: bool = False  # lossy upper-bound run: every draft token was accepted
    num_preemptions: int = 0  # times it gave its KV blocks back and was recomputed later

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.finish_time is None or self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_output_tokens - 1)

    @property
    def tokens_per_s(self) -> float | None:
        if self.finish_time is None:
            return None
        return self.num_output_tokens / max(self.finish_time - self.arrival_time, 1e-9)

    def as_dict(self) -> dict:
        s = self.spec
        return {
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_cached_prompt_tokens": self.num_cached_prompt_tokens,
            "num_output_tokens": self.num_output_tokens,
            "ttft_s": self.ttft,
            "tpot_s": self.tpot,
            "tokens_per_s": self.tokens_per_s,
            "num_target_forwards": s.num_steps + 1,
            "num_draft_forwards": s.num_draft_forwards,
            "num_steps": s.num_steps,
            "num_spec_steps": s.num_spec_steps,
            "num_draft_tokens": s.num_draft_tokens,
            "num_accepted_tokens": s.num_accepted_tokens,
            "acceptance_rate": s.acceptance_rate,
            "mean_accepted_length": s.mean_accepted_length,
            "acceptance_per_position": s.acceptance_per_position,
            "forced_accept": self.forced_accept,
            "num_preemptions": self.num_preemptions,
        }


def peak_rss_bytes() -> int:
    """The process's peak resident memory so far (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
