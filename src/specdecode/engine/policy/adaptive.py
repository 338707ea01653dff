"""The adaptive policy: k_i in 0..k_max per sequence, maximising expected goodput (emitted tokens per
second of the step) from each sequence's acceptance estimate and the measured cost of draft and target
forwards at the sizes involved. k = 0 for everyone means no draft forward at all, so choosing it costs
nothing over plain decoding. Where the engine also has prompt lookup, a sequence whose recent tokens occur
earlier in its text may take its drafts from there instead: they cost no draft forward, only
verification, which keeps speculation worthwhile at batch sizes where the draft model no longer pays."""

from __future__ import annotations

import numpy as np

from ...config import DEFAULT_K, AdaptiveOptions
from .acceptance import AcceptanceEstimator
from .allocation import allocate, gains_of
from .base import DraftDecision, Lookup, Policy
from .costs import CostModel
from .probes import Probing

BAR_HALVINGS = 4  # halvings of [0, optimistic_acceptance] that find the acceptance under which drafting cannot pay
# the pooled depth acceptance and the costs move between two works of that bar: it is set this far under the highest
# acceptance found not to pay
BAR_MARGIN = 0.1


class AdaptivePolicy(Probing, Policy):
    """options: its knobs (config.AdaptiveOptions; the estimator's priors and smoothing among them)."""

    name = "adaptive"
    wants_draft_costs = True
    chooses_proposers = True

    def __init__(
        self, k_max: int = DEFAULT_K, *, costs: CostModel | None = None, options: AdaptiveOptions | None = None
    ):
        super().__init__(k_max)
        options = options or AdaptiveOptions()
        self.estimator = AcceptanceEstimator(
            options.prior_acceptance, options.acceptance_smoothing, options.acceptance_recovery, options.depth_smoothing
        )
        self.costs = costs or CostModel()
        # Speculate only when the predicted goodput beats plain decoding's by this fraction: estimates are
        # noisy, and near break-even a wrong "yes" for many sequences at once (their verify rows, their
        # catch-ups) costs more than a wrong "no", and a lookup's estimate starts from frequency counts that
        # run high for a path seen once. A lone sequence drafting by the model needs only to beat plain
        # decoding: its decision is re-made every step from its own outcomes, and the margin mostly kept it
        # plain after a few misses through stretches where drafting paid (docs/decisions.md#the-bar-for-drafting).
        self.min_gain = options.min_gain
        # Every this many speculative steps, one plain step re-measures plain decoding's cost; four times as
        # many where the last decision cleared the bar by clear_margin (an error that large in the plain
        # cost would be needed to change it), since each such step gives up what a draft would have added.
        self.refresh_plain_every = options.refresh_plain_every
        self.clear_margin = options.clear_margin
        # A catch-up must pay for itself within this many steps: drafting may well stop again before the
        # sequence ends (load grows, acceptance drops), and then the catch-up was wasted.
        self.catch_up_horizon = options.catch_up_horizon
        self._init_probes(options)
        # Measured / predicted seconds of speculative steps, per batch size: what the per-phase tables miss (the
        # draft's bookkeeping, a longer first round) is charged back to the decision; a plain step's table entry is
        # the step. Learned only from steps without a catch-up (an estimate of its own), relaxed back towards 1 while
        # that batch size decodes plainly: a bad stretch at one load must not switch speculation off at another.
        self.calibration: dict[int, float] = {}
        self._predicted: tuple[float, bool] | None = None  # (seconds, no catch-up in the step)
        self._spec_steps_since_plain = 0
        self._refresh_every = self.refresh_plain_every  # four times as many after a decision that cleared the bar well
        # Steps between two works of a batch size's draft bar, doubled (up to 8 times) while it holds: at 64 sequences
        # a work prices a few whole allocations, which a launch-bound GPU's step would feel if done often.
        self.could_pay_refresh = options.could_pay_refresh
        self._bars: dict[int, tuple[int, float, int]] = {}  # batch size -> (steps since worked out, bar, every)

    def token_gains(self, first: float) -> list[float]:
        return self.estimator.token_gains(first, self.k_max)

    def observe_acceptance(self, request_id: str, drafted: int, accepted: int, allowed: int | None = None) -> None:
        self.estimator.observe_acceptance(request_id, drafted, accepted, allowed)

    def observe_lookup(self, request_id: str, match: int, drafted: int, accepted: int) -> None:
        self.estimator.observe_lookup(request_id, match, drafted, accepted)

    def forget(self, request_id: str) -> None:
        self.estimator.forget(request_id)

    def decide(self, request_ids, catch_up, remaining, lookups, drafter, contexts=None) -> DraftDecision:
        n = len(request_ids)
        contexts = contexts or [0] * n
        if not self.costs.target.has_plain(n):
            return DraftDecision.main_proposer([0] * n)  # measure plain decoding at this batch size first
        estimator = self.estimator
        if drafter and self._probe_now(n, contexts):  # on the sequence cheapest to start
            self._probing = True
            probe = min(range(n), key=lambda i: catch_up[i])
            return DraftDecision([self.k_max if i == probe else 0 for i in range(n)], [False] * n, probe=True)
        if self._spec_steps_since_plain >= self._refresh_every:
            self._spec_steps_since_plain = 0
            return DraftDecision.main_proposer([0] * n)
        alphas = [estimator.first_token_acceptance(r) for r in request_ids]
        # a draft model's costs measured (a lookup as the main proposer costs no forward): where no sequence's drafts
        # are accepted often enough to pay at this batch size, there is no allocation to price
        if drafter and self.costs.draft and max(alphas) <= self._draft_bar(n, contexts):
            drafter = False
        decision = self.best_decision(alphas, catch_up, remaining, lookups, drafter, contexts)
        self._refresh_every = self.refresh_plain_every * (4 if decision.score > self.clear_margin else 1)
        self._settle_probe(converted=any(k and not lookup for k, lookup in zip(decision.ks, decision.by_lookup)))
        starting = [c for c, k, lookup in zip(catch_up, decision.ks, decision.by_lookup) if k and c and not lookup]
        self._predicted = None  # what a speculative step is predicted to cost (a plain step's is measured)
        if any(decision.ks):
            self._predicted = (decision.seconds + sum(starting) * self.costs.draft_prefill_per_token, not starting)
        self._spec_steps_since_plain = self._spec_steps_since_plain + 1 if any(decision.ks) else 0
        return decision

    def plain_next(self) -> bool:
        return self._spec_steps_since_plain >= self._refresh_every

    def expects_drafting(self, batch: int) -> bool:
        """Until the costs at this batch size are measured, yes (the first rounds probe them anyway); after, as long
        as good drafts would pay there (as _draft_bar last found, left as it is)."""
        if self.k_max == 0 or not self.costs.draft or not self.costs.target.has_plain(batch):
            return self.k_max > 0
        bar = self._bars.get(batch, (None, None, None))[1]
        good = self.optimistic_acceptance
        return self._drafts_would_pay(batch, good) if bar is None else bar < good

    def _drafting_could_pay(self, n: int, contexts: list[int] | None = None) -> bool:
        """Whether n sequences whose drafts are good and caught up would draft: a catch-up is the probed
        sequence's one-off cost, which a probe accepts (and refunds once drafting follows)."""
        return self._draft_bar(n, contexts) < self.optimistic_acceptance

    def _draft_bar(self, n: int, contexts: list[int] | None = None) -> float:
        """A first-token acceptance at which caught-up drafts for all n sequences would not pay (optimistic_acceptance
        where not even those pay; else found by a few halvings, less BAR_MARGIN): gains grow with acceptance, so
        where every sequence's is at most this, no allocation pays and none is priced (at 64 sequences a pricing
        costs a launch-bound GPU's step several per cent). It moves only as the measured costs do, so it is worked
        out again every few steps, not every step."""
        age, bar, every = self._bars.get(n, (self.could_pay_refresh, None, self.could_pay_refresh))
        if age >= every:
            before, bar = bar, self._highest_unpaying_acceptance(n, contexts)
            steady = before is not None and abs(bar - before) <= self.optimistic_acceptance / 2**BAR_HALVINGS
            every = min(2 * every, 8 * self.could_pay_refresh) if steady else self.could_pay_refresh
            self._bars[n] = (0, bar, every)
        return bar

    def _highest_unpaying_acceptance(self, n: int, contexts: list[int] | None) -> float:
        if not self._drafts_would_pay(n, self.optimistic_acceptance, contexts):
            return self.optimistic_acceptance
        low, high = 0.0, self.optimistic_acceptance  # drafts at `low` do not pay, at `high` they do
        for _ in range(BAR_HALVINGS):
            middle = (low + high) / 2
            low, high = (low, middle) if self._drafts_would_pay(n, middle, contexts) else (middle, high)
        return max(0.0, low - BAR_MARGIN)

    def _drafts_would_pay(self, n: int, acceptance: float, contexts: list[int] | None = None) -> bool:
        """Whether n caught-up sequences whose first drafts are each accepted this often would draft."""
        return any(self.best_decision([acceptance] * n, [0] * n, [0] * n, None, True, contexts).ks)

    def best_decision(
        self,
        alphas: list[float],
        catch_up: list[int],
        remaining: list[int],
        lookups: list[Lookup] | None,
        drafter: bool = True,
        contexts: list[int] | None = None,
    ) -> DraftDecision:
        """The draft model for everyone, the lookup's drafts where a sequence has them, or those and the
        draft model for the rest: whichever allocation predicts the highest goodput (without a drafter,
        the lookups alone). contexts: each sequence's cached tokens (default: none)."""
        n = len(alphas)
        looked_up = bool(lookups) and any(tokens for _, tokens, _ in lookups)
        if not (drafter or looked_up):
            return DraftDecision([0] * n, [True] * n)
        contexts = contexts or [0] * n
        draft_gains = gains_of(alphas, self.estimator.depth_products(self.k_max))
        start_cost = [0.0] * n  # a sequence's catch-up, spread over the next few steps it has left
        for i, (tokens, left) in enumerate(zip(catch_up, remaining)):
            if tokens:
                steps = min(self.catch_up_horizon, max(1.0, left / (1 + sum(draft_gains[i]))))
                start_cost[i] = tokens * self.costs.draft_prefill_per_token / steps
        options = [self._allocate(draft_gains, [False] * n, start_cost, contexts)] if drafter else []
        if looked_up:
            use = [bool(tokens) for _, tokens, _ in lookups]
            lookup_gains = [self.estimator.lookup_acceptance.gains(m, len(t), p) for m, t, p in lookups]
            # lookups alone, and lookups with the draft model for the rest (tried apart: the allocation
            # grows most-likely tokens first, so a draft model that does not pay would spoil the mix)
            options.append(self._allocate(lookup_gains, use, start_cost, contexts))
            if drafter:
                mixed = [lg if u else dg for u, lg, dg in zip(use, lookup_gains, list(draft_gains))]
                options.append(self._allocate(mixed, use, start_cost, contexts))
        decision, score = max(options, key=lambda option: option[1])
        decision.score = score
        return decision

    def _allocate(
        self, gains: list[list[float]] | np.ndarray, by_lookup: list[bool], start_cost: list[float], contexts: list[int]
    ) -> tuple[DraftDecision, float]:
        """The allocation with the highest predicted goodput (allocation.allocate); the bar it must clear is plain
        decoding's, plus min_gain unless one sequence drafts by the model."""
        n = len(gains)
        margin = 0.0 if n == 1 and not by_lookup[0] else self.min_gain
        reach = self.estimator.draft_reach(self.k_max)
        return allocate(self.costs, gains, by_lookup, start_cost, contexts, reach, margin, self.calibration.get(n, 1.0))

    def observe_step(
        self,
        ks: list[int],
        target_seconds: float,
        draft_seconds_per_forward: float | None,
        step_seconds: float | None = None,
        by_lookup: list[bool] | None = None,
        contexts: list[int] | None = None,
        untimed: bool = False,
    ) -> None:
        """step_seconds is the step's whole wall time; by_lookup: which sequences drafted by prompt lookup
        (their drafts cost the draft model nothing); contexts: each sequence's cached tokens before the step.
        An untimed step (Policy.observe_step) times a prompt's chunk or a graph's capture (0.15-1.5 s on an H100,
        hundreds of steps' time), not the drafts: only its acceptance counts."""
        if untimed:
            self._probing, self._predicted = False, None
        else:
            self._observe_target_time(ks, target_seconds, step_seconds, contexts or [0] * len(ks))
        if len(ks) in self._bars:  # one more step at this batch size since it was worked out
            age, bar, every = self._bars[len(ks)]
            self._bars[len(ks)] = (age + 1, bar, every)
        drafting = sum(1 for i, k in enumerate(ks) if k and not (by_lookup and by_lookup[i]))
        if not drafting:
            self.estimator.fade_population_evidence()
        self.estimator.end_step()
        if draft_seconds_per_forward is not None and drafting:
            self.costs.draft.observe(drafting, draft_seconds_per_forward)

    def _observe_target_time(
        self, ks: list[int], target_seconds: float, step_seconds: float | None, contexts: list[int]
    ) -> None:
        """The target call's and the step's times: the cost model, its calibration, and a probe's cost."""
        n, plain_keys = len(ks), sum(contexts)
        self._charge_probe(n, step_seconds or target_seconds, plain_keys)
        if any(ks):
            if self._predicted and self._predicted[1] and step_seconds:
                ratio = min(2.0, max(0.5, step_seconds / self._predicted[0]))  # one hiccup must not flip decisions
                current = self.calibration.get(n, 1.0)
                self.calibration[n] = current + self.estimator.acceptance_smoothing * (ratio - current)
        elif n in self.calibration:
            self.calibration[n] += self.estimator.acceptance_recovery * (1.0 - self.calibration[n])
        self._predicted = None
        self.costs.target.observe(n, n + sum(ks), target_seconds, plain_keys, sum(k * c for k, c in zip(ks, contexts)))

    def observe_draft_prefill(self, tokens: int, seconds: float) -> None:
        self.costs.observe_draft_prefill(tokens, seconds)

    def record_draft_cost(self, batch: int, seconds: float) -> None:
        self.costs.draft.record(batch, seconds)

    def record_target_cost(self, batch: int, tokens: int, seconds: float, keys: int = 0, extra_keys: int = 0) -> None:
        self.costs.target.record(batch, tokens, seconds, keys, extra_keys)

    def record_attention_cost(self, per_row_key: float, per_extra_row_key: float | None = None) -> None:
        self.costs.target.per_row_key, self.costs.target.per_extra_row_key = per_row_key, per_extra_row_key
