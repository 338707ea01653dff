"""How many tokens to draft, decided every step and for every sequence.

- `fixed`: k for every sequence, every step.
- `disable_by_batch_size`: vLLM's `speculative_disable_by_batch_size`: k while the running batch has at
  most N sequences, none above.
- `adaptive`: k_i in 0..k_max per sequence, maximising expected goodput (emitted tokens per second of the
  step) from each sequence's running acceptance estimate (a new sequence starts from the acceptance
  pooled over earlier ones) and the measured cost of draft and target forwards at the sizes involved.
  k = 0 for everyone means no draft forward at all, so choosing it costs nothing over plain decoding.
  Where the engine also offers prompt lookup, a sequence whose recent tokens occur earlier in its text
  may take its drafts from there instead: they cost no draft forward, only verification, which is what
  keeps speculation worthwhile at batch sizes where the draft model no longer pays.
"""
from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

from ..errors import SpecDecodeError

POLICIES = ("fixed", "disable_by_batch_size", "adaptive")
PRIOR_TRIALS = 2  # weight of the prior acceptance, in draft-token trials


@dataclass
class CostTable:
    """Running mean of a forward's measured seconds by size (tokens in the call, or sequences drafting).

    The first sample of a size is provisional: it often carries one-off work (a first call for a new
    shape), so it is replaced by the second, and while other sizes have two samples it is not used at
    all: a size is estimated from the trusted ones instead. Otherwise a pessimistic first sample would
    keep the policy from ever choosing that size again, and so from correcting it. For the same reason
    one later sample moves the mean as if it were at most twice the current estimate. Unmeasured sizes
    are interpolated between the trusted neighbours.

    Outside them the estimate never gets cheaper per unit than the nearest measured size: above the
    largest it grows in proportion, below the smallest it stays at the smallest's cost. Extrapolating
    along the slope of the measured sizes was optimistic where costs jump (the int8 draft takes its bf16
    GEMM at 8 rows: 129 ms for 8 sequences, 69 ms for 4, where the slope of 1, 2, 4 said ~87 ms), and
    that is how concurrency 8 came to start all 8 catch-ups at once, through the server, for drafting
    that did not pay (0.91x plain). A pessimistic guess costs little: the policy drafts for fewer
    sequences, which it has measured, and measures larger sizes as it grows into them."""

    smoothing: float = 0.3
    seconds: dict[int, float] = field(default_factory=dict)
    samples: Counter = field(default_factory=Counter)
    _known: dict[int, float] = field(default_factory=dict)  # what lookups use (see above), by size
    _sizes: list[int] = field(default_factory=list)  # its sizes, sorted
    _slope: float = 0.0  # slope() of _known

    def observe(self, size: int, seconds: float) -> None:
        self.samples[size] += 1
        if self.samples[size] <= 2:
            self.seconds[size] = seconds
        else:
            current = self.seconds[size]
            self.seconds[size] += self.smoothing * (min(seconds, 2 * current) - current)
        self._refresh()

    def record(self, size: int, seconds: float) -> None:
        """A profiled measurement (its warm-up call already left out): trusted at once, like a size seen
        twice; later observations refine it as usual."""
        self.samples[size] = max(self.samples[size], 2)
        self.seconds[size] = seconds
        self._refresh()

    def _refresh(self) -> None:
        # the policy looks sizes up many times per step: decide once here which samples it trusts
        self._known = {s: v for s, v in self.seconds.items() if self.samples[s] >= 2} or dict(self.seconds)
        self._sizes = sorted(self._known)
        self._slope = self._least_squares_slope(self._known)

    def __bool__(self) -> bool:
        return bool(self.seconds)

    @property
    def sizes(self) -> list[int]:
        """The sizes lookups are based on, sorted."""
        return self._sizes

    def __call__(self, size: int) -> float:
        if size <= 0:
            return 0.0
        known, sizes = self._known, self._sizes
        if size in known:
            return known[size]
        if not sizes:
            raise LookupError("nothing measured yet")
        i = bisect.bisect(sizes, size)
        if i == 0:
            return known[sizes[0]]
        if i == len(sizes):
            return known[sizes[-1]] * size / sizes[-1]
        lo, hi = sizes[i - 1], sizes[i]
        return known[lo] + (known[hi] - known[lo]) * (size - lo) / (hi - lo)

    def slope(self) -> float:
        """Least-squares seconds per unit of size over the trusted sizes (0 with fewer than two)."""
        return self._slope

    @staticmethod
    def _least_squares_slope(known: dict[int, float]) -> float:
        if len(known) < 2:
            return 0.0
        mean_x = sum(known) / len(known)
        mean_y = sum(known.values()) / len(known)
        var = sum((x - mean_x) ** 2 for x in known)
        return max(0.0, sum((x - mean_x) * (known[x] - mean_y) for x in known) / var)


@dataclass
class TargetCost:
    """One verify/decode forward of the target, by batch size and tokens in the call.

    The batch size matters beside the tokens: a call's tokens are verified one attention call per token,
    and the weights are streamed once per call, so 16 tokens as 8 sequences x 2 cost 437 ms where 16 x 1
    cost 347 ms (this CPU, Qwen 1.5B). A table keyed by tokens alone made k = 1 at batch 8 look cheap.
    Within a batch size the measured token counts are interpolated; beyond them the cost grows by a
    per-token slope: the batch size's own once its measurements span a few tokens, else the median of
    the other batch sizes' (10-13 ms per token at batch 4, 8 and 16 here), else 2% of its plain step."""

    tables: dict[int, CostTable] = field(default_factory=dict)  # batch size -> cost by tokens in the call
    min_slope_span: int = 4  # tokens a batch size's measurements must span for its own slope to count

    def observe(self, batch: int, tokens: int, seconds: float) -> None:
        self.tables.setdefault(batch, CostTable()).observe(tokens, seconds)

    def __bool__(self) -> bool:
        return bool(self.tables)

    def has_plain(self, batch: int) -> bool:
        """Plain decoding (one token per sequence) has been measured at this batch size."""
        return batch in self.tables and batch in self.tables[batch].seconds

    def __call__(self, batch: int, tokens: int) -> float:
        table = self.tables.get(batch)
        if not table:
            raise LookupError(f"nothing measured at batch size {batch}")
        sizes = table.sizes
        if sizes[0] <= tokens <= sizes[-1]:
            return table(tokens)
        edge = sizes[0] if tokens < sizes[0] else sizes[-1]
        return max(table(edge) + self.slope(batch) * (tokens - edge), 1e-9)

    def slope(self, batch: int) -> float:
        """Seconds per extra token in a call at this batch size (see the class doc)."""
        if self._spans(batch):
            return self.tables[batch].slope()
        others = sorted(t.slope() for b, t in self.tables.items() if b != batch and self._spans(b))
        if others:
            return others[len(others) // 2]
        table = self.tables[batch]
        return 0.02 * table(table.sizes[0])

    def _spans(self, batch: int) -> bool:
        sizes = self.tables[batch].sizes
        return len(sizes) >= 2 and sizes[-1] - sizes[0] >= self.min_slope_span


@dataclass
class DraftPlan:
    ks: list[int]  # tokens to draft per sequence
    lookup: list[bool]  # per sequence: drafted by prompt lookup instead of the draft model

    @classmethod
    def from_draft_model(cls, ks: list[int]) -> "DraftPlan":
        return cls(ks, [False] * len(ks))


@dataclass
class LookupAcceptance:
    """How often prompt-lookup drafts are right, by the length of the match behind them: a long match is
    right far more often (HumanEval, Qwen 1.5B greedy: the first token of a 3-token match 76% of the time,
    of a 1-token match 28%). Position l counts only when l-1 was accepted, as for the draft model."""

    prior: float = 0.5
    smoothing: float = 0.01
    counts: dict[tuple[int, int], tuple[float, float]] = field(default_factory=dict)  # (match, l) -> (accepted, tried)

    def gains(self, match: int, available: int, k_max: int) -> list[float]:
        """P(lookup token j is emitted), j = 1 .. min(available, k_max)."""
        gains, p = [], 1.0
        for position in range(1, min(available, k_max) + 1):
            accepted, tried = self.counts.get((match, position), (0.0, 0.0))
            p *= (accepted + self.prior * PRIOR_TRIALS) / (tried + PRIOR_TRIALS)
            gains.append(p)
        return gains

    def observe(self, match: int, drafted: int, accepted: int) -> None:
        keep = 1 - self.smoothing
        for position in range(1, min(drafted, accepted + 1) + 1):
            a, t = self.counts.get((match, position), (0.0, 0.0))
            self.counts[(match, position)] = (keep * a + (accepted >= position), keep * t + 1)


@dataclass
class CostModel:
    target: TargetCost = field(default_factory=TargetCost)  # one verify/decode forward
    draft: CostTable = field(default_factory=CostTable)  # one draft forward, by sequences in it
    # A sequence that has not drafted for a while (or ever) makes the draft read its missed tokens first.
    # Seconds per token of that catch-up (0 until measured: the first sequence that drafts measures it).
    draft_prefill_per_token: float = 0.0
    smoothing: float = 0.3
    _prefill_samples: int = 0

    def observe_draft_prefill(self, tokens: int, seconds: float) -> None:
        per_token = max(0.0, seconds) / tokens
        self._prefill_samples += 1
        if self._prefill_samples == 1:
            self.draft_prefill_per_token = per_token
        else:
            self.draft_prefill_per_token += self.smoothing * (per_token - self.draft_prefill_per_token)

    def step_seconds(self, ks: list[int], lookup: list[bool] | None = None) -> float:
        """Predicted seconds of a step where sequence i drafts ks[i] tokens and the target verifies all;
        lookup[i]: those drafts come from prompt lookup, at no draft-forward cost."""
        drafting = sorted((k for i, k in enumerate(ks) if k and not (lookup and lookup[i])), reverse=True)
        draft = sum(self.draft(sum(1 for k in drafting if k > j)) for j in range(drafting[0])) if drafting else 0.0
        return draft + self.target(len(ks), len(ks) + sum(ks))


@dataclass
class SpeculationPolicy:
    name: str = "adaptive"
    k_max: int = 4
    max_batch_for_speculation: int | None = None  # for disable_by_batch_size
    prior_acceptance: float = 0.7  # before anything is measured; see population_acceptance
    acceptance_smoothing: float = 0.1  # per step, on the first draft position's outcome
    # While a sequence does not draft, its estimate drifts back towards the prior by this fraction per
    # step, so a sequence that turned easy is probed again (a probe costs one draft forward).
    acceptance_recovery: float = 0.02
    # Every this many speculative steps, one plain step re-measures plain decoding's cost.
    refresh_plain_every: int = 32
    # Speculate only when the predicted goodput beats plain decoding's by this fraction: estimates are
    # noisy, and near break-even a wrong "yes" costs more than a wrong "no".
    min_gain: float = 0.1
    # A catch-up must pay for itself within this many steps: drafting may well stop again before the
    # sequence ends (load grows, acceptance drops), and then the catch-up was wasted. (Starting at most
    # one sequence per step was tried, to bound a wrong bet: at batch 4 no single start pays on its own
    # while all four do, so through the server it kept the policy plain at concurrency 4.)
    catch_up_horizon: int = 16
    costs: CostModel = field(default_factory=CostModel)
    acceptance: dict[str, float] = field(default_factory=dict)  # request id -> P(first draft token accepted)
    # Acceptance is bursty: after an accepted token the next is accepted more often than the first one is.
    # So depth is modelled apart, over all sequences: position l -> discounted (accepted, tried) given
    # that position l-1 was accepted. Position 1, pooled the same way, is where a new request starts
    # (see population_acceptance).
    depth: dict[int, tuple[float, float]] = field(default_factory=dict)
    depth_smoothing: float = 0.01
    lookup_acceptance: LookupAcceptance = field(default_factory=LookupAcceptance)
    decisions: Counter = field(default_factory=Counter)  # k chosen -> sequence-steps
    _evidence: dict[str, tuple[float, float]] = field(default_factory=dict)  # discounted (accepted, trials)
    # Measured / predicted seconds of speculative steps, per batch size: what the per-phase tables miss
    # (the draft's bookkeeping, a longer first round) is charged back to the decision. Plain steps need
    # none: their table entry is the measured step. Learned only from steps without a catch-up (whose
    # cost is an estimate of its own), and relaxed back towards 1 while that batch size decodes plainly:
    # a bad stretch at one load must not switch speculation off at another, or for good.
    calibration: dict[int, float] = field(default_factory=dict)
    _predicted: tuple[float, bool] | None = None  # (seconds, no catch-up in the step)
    _spec_steps_since_plain: int = 0

    def __post_init__(self):
        if self.name not in POLICIES:
            raise SpecDecodeError(f"unknown speculation policy {self.name!r}; use one of {', '.join(POLICIES)}")
        if self.name == "disable_by_batch_size" and not self.max_batch_for_speculation:
            raise SpecDecodeError("disable_by_batch_size needs a batch size (speculative_disable_by_batch_size)")

    def choose(self, request_ids: list[str], catch_up: list[int] | None = None,
               remaining: list[int] | None = None, lookups: list[tuple[int, int]] | None = None) -> DraftPlan:
        """k per sequence for this step (the engine still caps each by max_tokens and the context).
        catch_up: tokens the draft must read before it can draft for the sequence; remaining: tokens the
        sequence may still emit (a catch-up is amortised over the steps left); lookups: per sequence, the
        length of its prompt-lookup match and the tokens that match offers ((0, 0): none), if the engine
        has prompt lookup (only the adaptive policy uses it)."""
        n = len(request_ids)
        if self.k_max == 0:
            plan = DraftPlan.from_draft_model([0] * n)
        elif self.name == "fixed":
            plan = DraftPlan.from_draft_model([self.k_max] * n)
        elif self.name == "disable_by_batch_size":
            plan = DraftPlan.from_draft_model([self.k_max if n <= self.max_batch_for_speculation else 0] * n)
        else:
            alphas = [self.acceptance.get(r, self.population_acceptance) for r in request_ids]
            plan = self._adaptive(alphas, catch_up or [0] * n, remaining or [1 << 30] * n, lookups)
        self.decisions.update(plan.ks)
        return plan

    def _adaptive(self, alphas: list[float], catch_up: list[int], remaining: list[int],
                  lookups: list[tuple[int, int]] | None) -> DraftPlan:
        n = len(alphas)
        if not self.costs.target.has_plain(n):
            return DraftPlan.from_draft_model([0] * n)  # measure plain decoding at this batch size first
        if not self.costs.draft:  # then measure drafting, on the sequence that is cheapest to start
            probe = min(range(n), key=lambda i: catch_up[i])
            return DraftPlan.from_draft_model([self.k_max if i == probe else 0 for i in range(n)])
        if self._spec_steps_since_plain >= self.refresh_plain_every:
            self._spec_steps_since_plain = 0
            return DraftPlan.from_draft_model([0] * n)
        plan = self.best_plan(alphas, catch_up, remaining, lookups)
        starting = [c for c, k, lookup in zip(catch_up, plan.ks, plan.lookup) if k and c and not lookup]
        self._predicted = (self.costs.step_seconds(plan.ks, plan.lookup)
                           + sum(starting) * self.costs.draft_prefill_per_token, not starting)
        self._spec_steps_since_plain = self._spec_steps_since_plain + 1 if any(plan.ks) else 0
        return plan

    def best_plan(self, alphas: list[float], catch_up: list[int] | None = None,
                  remaining: list[int] | None = None, lookups: list[tuple[int, int]] | None = None) -> DraftPlan:
        """The draft model for everyone, prompt lookup where a sequence has a match, or lookup there and
        the draft model for the rest: whichever allocation predicts the highest goodput."""
        n = len(alphas)
        draft_gains = [self.token_gains(a) for a in alphas]
        start_cost = [0.0] * n  # a sequence's catch-up, spread over the next few steps it has left
        for i, (tokens, left) in enumerate(zip(catch_up or [0] * n, remaining or [1 << 30] * n)):
            steps = min(self.catch_up_horizon, max(1.0, left / (1 + sum(draft_gains[i]))))
            start_cost[i] = tokens * self.costs.draft_prefill_per_token / steps
        options = [self._allocate(draft_gains, [False] * n, start_cost)]
        if lookups and any(match for match, _ in lookups):
            use = [match > 0 for match, _ in lookups]
            lookup_gains = [self.lookup_acceptance.gains(match, offered, self.k_max) for match, offered in lookups]
            # lookups alone, and lookups with the draft model for the rest (tried apart: the allocation
            # grows most-likely tokens first, so a draft model that does not pay would spoil the mix)
            options.append(self._allocate(lookup_gains, use, start_cost))
            mixed = [lg if u else dg for u, lg, dg in zip(use, lookup_gains, draft_gains)]
            options.append(self._allocate(mixed, use, start_cost))
        return max(options, key=lambda option: option[1])[0]

    def _allocate(self, gains: list[list[float]], lookup: list[bool],
                  start_cost: list[float]) -> tuple[DraftPlan, float]:
        """Grow the drafts one token at a time, most likely accepted first (see token_gains), and keep the
        allocation with the highest predicted goodput; its score is that goodput over the bar it must
        clear (plain decoding's plus min_gain: a 3% bar for lookups alone was tried and cost throughput
        at 16 concurrent requests, through the server)."""
        n = len(gains)
        candidates = sorted(((g, j, i) for i in range(n) for j, g in enumerate(gains[i], 1) if g > 0),
                            key=lambda c: (-c[0], c[1]))
        ks, best, best_score = [0] * n, [0] * n, 1.0
        emitted, extra = float(n), 0.0
        plain_rate = emitted / self.costs.step_seconds(ks)
        calibration = self.calibration.get(n, 1.0)
        for gain, _, i in candidates:
            if ks[i] == 0 and not lookup[i]:
                extra += start_cost[i]
            ks[i] += 1
            emitted += gain
            rate = emitted / ((self.costs.step_seconds(ks, lookup) + extra) * calibration)
            score = rate / ((1 + self.min_gain) * plain_rate)
            if score > best_score:
                best, best_score = list(ks), score
        return DraftPlan(best, [lookup[i] and k > 0 for i, k in enumerate(best)]), best_score

    def observe_step(self, ks: list[int], target_seconds: float, draft_seconds_per_forward: float | None,
                     step_seconds: float | None = None, lookup: list[bool] | None = None) -> None:
        """Measured phases of the step just run; step_seconds is its whole wall time; lookup: which
        sequences drafted by prompt lookup (their drafts cost the draft model nothing)."""
        n = len(ks)
        if any(ks):
            if self._predicted and self._predicted[1] and step_seconds:
                ratio = min(2.0, max(0.5, step_seconds / self._predicted[0]))  # one hiccup must not flip decisions
                current = self.calibration.get(n, 1.0)
                self.calibration[n] = current + self.acceptance_smoothing * (ratio - current)
        elif n in self.calibration:
            self.calibration[n] += self.acceptance_recovery * (1.0 - self.calibration[n])
        self._predicted = None
        self.costs.target.observe(n, n + sum(ks), target_seconds)
        drafting = sum(1 for i, k in enumerate(ks) if k and not (lookup and lookup[i]))
        if draft_seconds_per_forward is not None and drafting:
            self.costs.draft.observe(drafting, draft_seconds_per_forward)

    def conditional_acceptance(self, position: int) -> float:
        """P(draft token `position` is accepted | the one before it was), pooled over all sequences (for
        position 1: P(first draft token accepted))."""
        accepted, tried = self.depth.get(position, (0.0, 0.0))
        return (accepted + self.prior_acceptance * PRIOR_TRIALS) / (tried + PRIOR_TRIALS)

    def token_gains(self, first: float) -> list[float]:
        """Probability that draft token j (1..k_max) is emitted, for a sequence whose first token is
        accepted with probability `first`: first · β_2 · … · β_j."""
        gains, p = [], first
        for j in range(1, self.k_max + 1):
            if j > 1:
                p *= self.conditional_acceptance(j)
            gains.append(p)
        return gains

    def observe_acceptance(self, request_id: str, drafted: int, accepted: int) -> None:
        """Positions after the first rejection are never tried: the first position is tried every step
        that drafts (per sequence), position l only when l-1 was accepted (pooled over sequences).
        Counting accepted/drafted instead would be biased low."""
        successes, trials = self._evidence.get(request_id, self._prior_evidence)
        if drafted:
            keep = 1 - self.acceptance_smoothing
            successes, trials = keep * successes + (accepted >= 1), keep * trials + 1
            keep_depth = 1 - self.depth_smoothing
            for position in range(1, min(drafted, accepted + 1) + 1):
                a, t = self.depth.get(position, (0.0, 0.0))
                self.depth[position] = (keep_depth * a + (accepted >= position), keep_depth * t + 1)
        else:  # drift back towards the prior
            prior_s, prior_t = self._prior_evidence
            r = self.acceptance_recovery
            successes, trials = (1 - r) * successes + r * prior_s, (1 - r) * trials + r * prior_t
        self._evidence[request_id] = (successes, trials)
        self.acceptance[request_id] = successes / trials

    def observe_lookup(self, request_id: str, match: int, drafted: int, accepted: int) -> None:
        """A step drafted by prompt lookup: its outcome says how good lookups of that match length are,
        and nothing about the draft model on this sequence (whose estimate drifts as in a plain step)."""
        self.lookup_acceptance.observe(match, drafted, accepted)
        self.observe_acceptance(request_id, 0, 0)

    @property
    def population_acceptance(self) -> float:
        """P(first draft token accepted) for a sequence not measured yet: pooled over the recent drafts of
        all sequences. A fixed prior is wrong for a whole workload, and it does not correct itself: at
        batch 4 on HumanEval (the Qwen pair accepts ~90%), starting each request from 0.7 kept the policy
        plain on new requests where fixed k = 4 was 1.1-1.3x faster, and a sequence that does not draft
        measures nothing."""
        return self.conditional_acceptance(1)

    @property
    def _prior_evidence(self) -> tuple[float, float]:
        return self.population_acceptance * PRIOR_TRIALS, float(PRIOR_TRIALS)

    def forget(self, request_id: str) -> None:
        self.acceptance.pop(request_id, None)
        self._evidence.pop(request_id, None)

    @property
    def speculating_fraction(self) -> float:
        """Share of sequence-steps that drafted at least one token."""
        total = sum(self.decisions.values())
        return (total - self.decisions[0]) / total if total else 0.0
