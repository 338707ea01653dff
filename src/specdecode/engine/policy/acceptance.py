"""Acceptance estimates: how likely each sequence's next draft tokens are to be accepted."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...config import AdaptiveOptions

PRIOR_TRIALS = 2  # weight of the prior acceptance, in draft-token trials
# A request's own first-token estimate starts from the pooled one with more weight: at 2 trials its first two misses
# (common at an acceptance of 0.7) priced its drafts at 0.32, where a verify row that costs 40% of a plain step (a
# 16k context) does not pay, and it decoded plainly for steps while its text accepted well. Pooled estimates rest on
# many trials and keep 2 (docs/decisions.md#adaptive-policy-acceptance-estimates).
REQUEST_PRIOR_TRIALS = 4


def discounted_update(counts: tuple[float, float], success: bool, keep: float) -> tuple[float, float]:
    """(accepted, tried) with older outcomes discounted by `keep` per new one: acceptance drifts within a
    request and across a workload, so recent outcomes count most."""
    accepted, tried = counts
    return keep * accepted + success, keep * tried + 1


def _bucket(match: int) -> int:
    """Match lengths pooled where they behave alike: 1, 2, 3, 4-7, 8-15, 16+ (suffix matches run long)."""
    return match if match < 4 else 4 if match < 8 else 8 if match < 16 else 16


@dataclass
class LookupAcceptance:
    """How often prompt-lookup drafts are right, by the length of the match behind them: a long match is
    right far more often than a one-token one. Position l counts only when l-1 was accepted, as for the
    draft model."""

    prior: float = 0.5
    smoothing: float = 0.01
    counts: dict[tuple[int, int], tuple[float, float]] = field(default_factory=dict)  # (match, l) -> (accepted, tried)

    def gains(self, match: int, available: int, probs: list[float] | None = None) -> list[float]:
        """P(lookup token j is emitted), j = 1 .. available. Until measured, position j is right with the
        proposer's own estimate probs[j-1] where it gives one, else with the prior."""
        gains, p = [], 1.0
        for position in range(1, available + 1):
            accepted, tried = self.counts.get((_bucket(match), position), (0.0, 0.0))
            prior = probs[position - 1] if probs else self.prior
            p *= (accepted + prior * PRIOR_TRIALS) / (tried + PRIOR_TRIALS)
            gains.append(p)
        return gains

    def observe(self, match: int, drafted: int, accepted: int) -> None:
        for position in range(1, min(drafted, accepted + 1) + 1):
            key = (_bucket(match), position)
            self.counts[key] = discounted_update(
                self.counts.get(key, (0.0, 0.0)), accepted >= position, 1 - self.smoothing
            )


@dataclass
class AcceptanceEstimator:
    """P(first draft token accepted) per sequence, and the deeper positions pooled over all sequences.

    Acceptance is bursty: after an accepted token the next is accepted more often than the first one is.
    So depth is modelled apart, over all sequences: position l -> discounted (emitted, tried) given that
    position l-1 was accepted. Position 1, pooled the same way, is where a new request starts.

    A draft may also stop before the k it was allowed (the draft model's confidence stop): then position
    l is not drafted at all. For the tokens a step emits that is a miss like a rejection, so a position
    counts as tried whenever it was allowed, not only when it was drafted: pricing k by the acceptance of
    the drafts that were made alone would promise the long drafts that the stop cuts short. How far drafts
    reach is tracked apart (`reach`), because a draft token costs its forward and its verify row whether
    or not it is accepted."""

    prior_acceptance: float = AdaptiveOptions.prior_acceptance  # before anything is measured; see population_acceptance
    acceptance_smoothing: float = AdaptiveOptions.acceptance_smoothing  # per step, on the first position's outcome
    # While a sequence does not draft, its estimate drifts back towards the prior by this fraction per
    # step, so a sequence that turned easy is probed again (a probe costs one draft forward).
    acceptance_recovery: float = AdaptiveOptions.acceptance_recovery
    depth_smoothing: float = AdaptiveOptions.depth_smoothing
    acceptance: dict[str, float] = field(default_factory=dict)  # request id -> P(first draft token accepted)
    depth: dict[int, tuple[float, float]] = field(default_factory=dict)
    # position l >= 2 -> discounted (drafted, tried) given that position l-1 was drafted and l allowed
    reach: dict[int, tuple[float, float]] = field(default_factory=dict)
    lookup_acceptance: LookupAcceptance = field(default_factory=LookupAcceptance)
    _evidence: dict[str, tuple[float, float]] = field(default_factory=dict)  # discounted (accepted, trials)
    _tried: set[int] = field(default_factory=set)  # deeper positions tried in the current step (see end_step)

    def conditional_acceptance(self, position: int) -> float:
        """P(draft token `position` is drafted and accepted | the one before it was), pooled over all
        sequences (for position 1: P(first draft token accepted))."""
        accepted, tried = self.depth.get(position, (0.0, 0.0))
        return (accepted + self.prior_acceptance * PRIOR_TRIALS) / (tried + PRIOR_TRIALS)

    def draft_reach(self, k: int) -> list[float]:
        """P(the draft model drafts position j), j = 1..k, when it is allowed k tokens (1 throughout
        unless it stops early: the prior assumes it does not, and the first stop corrects that)."""
        reach, p = [], 1.0
        for position in range(1, k + 1):
            if position > 1:
                drafted, tried = self.reach.get(position, (0.0, 0.0))
                p *= (drafted + PRIOR_TRIALS) / (tried + PRIOR_TRIALS)
            reach.append(p)
        return reach

    def token_gains(self, first: float, k: int) -> list[float]:
        """Probability that draft token j (1..k) is emitted, for a sequence whose first token is accepted
        with probability `first`: first · β_2 · … · β_j."""
        return [first * depth for depth in self.depth_products(k)]

    def depth_products(self, k: int) -> list[float]:
        """β_2 · … · β_j for j = 1..k (1 for j = 1): token_gains' factors, the same for every sequence."""
        products, p = [], 1.0
        for j in range(1, k + 1):
            p *= self.conditional_acceptance(j) if j > 1 else 1.0
            products.append(p)
        return products

    def observe_acceptance(self, request_id: str, drafted: int, accepted: int, allowed: int | None = None) -> None:
        """The main proposer drafted `drafted` of the `allowed` tokens (default: all of them) and `accepted`
        were accepted. Positions after the first miss are never tried: the first position is tried every
        step that drafts (per sequence), position l only when l-1 was accepted (pooled over sequences).
        Counting accepted/drafted instead would be biased low."""
        allowed = drafted if allowed is None else allowed
        evidence = self._evidence.get(request_id) or self._prior_evidence
        if drafted:
            evidence = discounted_update(evidence, accepted >= 1, 1 - self.acceptance_smoothing)
            keep, depth, reach = 1 - self.depth_smoothing, self.depth, self.reach
            for position in range(1, min(allowed, accepted + 1) + 1):  # 64 sequences a step: no call per position
                hits, tried = depth.get(position, (0.0, 0.0))
                depth[position] = keep * hits + (accepted >= position), keep * tried + 1
            for position in range(2, min(allowed, drafted + 1) + 1):
                hits, tried = reach.get(position, (0.0, 0.0))
                reach[position] = keep * hits + (drafted >= position), keep * tried + 1
            if allowed > 1:
                self._tried.update(range(2, allowed + 1))
        else:  # drift back towards the prior
            (successes, trials), (prior_s, prior_t) = evidence, self._prior_evidence
            r = self.acceptance_recovery
            evidence = (1 - r) * successes + r * prior_s, (1 - r) * trials + r * prior_t
        self._evidence[request_id] = evidence
        self.acceptance[request_id] = evidence[0] / evidence[1]

    @property
    def first_position_trials(self) -> float:
        """How much (discounted) evidence the pooled first-position estimate rests on."""
        return self.depth.get(1, (0.0, 0.0))[1]

    def fade_population_evidence(self) -> None:
        """Called once per step in which no sequence drafts by the draft model. While none does, nothing
        measures the pooled first-position acceptance, which new requests start from: one unlucky probe
        (a single rejected token) would keep every later request from drafting for good. So that evidence
        fades by acceptance_recovery per such step, and the estimate returns towards prior_acceptance
        until drafting is tried again. Per step, not per sequence: the evidence then lasts as long at
        batch 8 as at batch 1, instead of fading 8 times as fast and calling for a probe every other step."""
        if 1 in self.depth:
            accepted, tried = self.depth[1]
            keep = 1 - self.acceptance_recovery
            self.depth[1] = accepted * keep, tried * keep

    def end_step(self) -> None:
        """Called once per step: the acceptance of each deeper position no sequence was allowed to draft in it moves
        acceptance_recovery of the way to the prior, its evidence's weight kept. Else early misses at a position price
        it low for good: where a verify row is dear (a long context) the policy then never allows it, and so never
        measures it again. The ratio moves, not the weight: fading hits and trials alike leaves thick evidence's ratio
        where it was for a hundred steps and more. How far drafts reach does not move: a stale low reach only makes
        drafts look cheap, which gets them allowed and so measured
        (docs/decisions.md#adaptive-policy-acceptance-estimates)."""
        r = self.acceptance_recovery
        for position, (hits, tried) in self.depth.items():
            if position > 1 and position not in self._tried and tried > 0:
                ratio = hits / tried
                self.depth[position] = (ratio + r * (self.prior_acceptance - ratio)) * tried, tried
        self._tried.clear()

    def observe_lookup(self, request_id: str, match: int, drafted: int, accepted: int) -> None:
        """A step drafted by prompt lookup: its outcome says how good lookups of that match length are,
        and nothing about the draft model on this sequence (whose estimate drifts as in a plain step)."""
        self.lookup_acceptance.observe(match, drafted, accepted)
        self.observe_acceptance(request_id, 0, 0)

    def first_token_acceptance(self, request_id: str) -> float:
        return self.acceptance.get(request_id, self.population_acceptance)

    @property
    def population_acceptance(self) -> float:
        """P(first draft token accepted) for a sequence not measured yet: pooled over the recent drafts of
        all sequences, because a fixed prior is wrong for a whole workload and does not correct itself (a
        sequence that does not draft measures nothing)."""
        return self.conditional_acceptance(1)

    @property
    def _prior_evidence(self) -> tuple[float, float]:
        return self.population_acceptance * REQUEST_PRIOR_TRIALS, float(REQUEST_PRIOR_TRIALS)

    def forget(self, request_id: str) -> None:
        self.acceptance.pop(request_id, None)
        self._evidence.pop(request_id, None)
