"""The adaptive policy's probes of drafting: a sequence that does not draft measures nothing, so while the evidence
on the first draft position is thin, drafting is tried on one sequence, within a budget
(docs/decisions.md#probes-budget-start-up-allowance-and-gate). A probe drafts k_max: a good drafter's deeper positions
are measured too, where a probe of one draft would leave them at the prior, and drafting short for good."""

from __future__ import annotations

from ...config import AdaptiveOptions


class Probing:
    """AdaptivePolicy's probes (a part of it, apart for its length: it reads the policy's estimator, costs and draft
    bar)."""

    def _init_probes(self, options: AdaptiveOptions) -> None:
        # Below this much pooled evidence on the first draft position (in trials, faded while nobody drafts; see
        # AcceptanceEstimator), drafting is probed on one sequence instead of trusting the estimate: one early
        # rejection must not switch speculation off for good.
        self.probe_trials = options.probe_trials
        # Probes that do not lead to drafting may cost at most this fraction of the time spent decoding
        # (a probe's cost: its step's seconds beyond a plain step's). At batch 8 a probe step (a draft
        # forward, often a catch-up, and verify rows) costs ~1.6 plain ones, and probing whenever the
        # evidence was thin spent 18% of an agent-loop run there without ever leading to drafting. A probe
        # after which the policy drafts by the model is refunded: at batch 1 the probe is what pays a new
        # request's catch-up, and drafting then goes on (budgeted, new requests there decoded plainly).
        self.probe_budget = options.probe_budget
        # ... beyond a first probe_allowance_steps plain steps' time: at start-up there is no decoding time to take 2%
        # of, and one rejected first probe (the prior and a single miss: an estimate of 0.47) would otherwise keep a
        # good draft off for dozens of steps. In plain steps: the same share of a run whatever the device and model.
        self.probe_allowance_steps = options.probe_allowance_steps
        # No probe where drafting would not pay even if the draft's first token were accepted this often
        # (catch-ups aside): at a batch size where the measured costs rule drafting out, a probe can only lose.
        self.optimistic_acceptance = options.optimistic_acceptance
        self._probe_seconds, self._decode_seconds = 0.0, 0.0  # what probes that did not convert have cost; decoding
        self._probing = False
        self._unconverted_probe = 0.0  # the last probe's cost until the next decision says whether it converted
        self._probe_held = False  # the next decision does not probe (probes_next said so)

    def _probe_limit(self, n: int, decoding: float = 0.0) -> float:
        """Seconds that probes which did not lead to drafting may have cost, probing at n sequences (after `decoding`
        more seconds of decoding)."""
        decoded = self._decode_seconds + decoding
        return self.probe_allowance_steps * self.costs.target(n, n) + self.probe_budget * decoded

    def probes_next(self, contexts: list[int]) -> bool:
        """As after the plain step now running (the pooled evidence faded once more, a plain step's time decoded);
        where not, the next decision does not probe whatever that step's timing shows: the budget's edge moves with
        each step's time, and a step queued for the next would otherwise go unused."""
        n, probing = len(contexts), False
        if self.k_max and self.costs.target.has_plain(n):
            faded = self.estimator.first_position_trials * (1 - self.estimator.acceptance_recovery)
            probing = self._should_probe(n, contexts, faded, self.costs.target(n, n))
        self._probe_held = not probing
        return probing

    def _probe_now(self, n: int, contexts: list[int]) -> bool:
        """Whether this decision probes: as _should_probe says, unless the last plain step was queued on the word
        that it would not."""
        held, self._probe_held = self._probe_held, False
        return not held and self._should_probe(n, contexts)

    def _should_probe(self, n: int, contexts: list[int], trials: float | None = None, decoding: float = 0.0) -> bool:
        """Measure drafting (its cost, unless profiled, and whether it is accepted at all: a prior that
        predicts no gain would otherwise never be tested) while the evidence is thin and the probes'
        budget lasts, at batch sizes where good drafts would pay."""
        if not self.costs.draft:
            return True
        return (
            (self.estimator.first_position_trials if trials is None else trials) < self.probe_trials
            and self._probe_seconds <= self._probe_limit(n, decoding)
            and self._drafting_could_pay(n, contexts)
        )

    def _charge_probe(self, n: int, step_seconds: float, plain_keys: int) -> None:
        """A timed step's seconds (n sequences, plain_keys cached): decoding's, and where it probed, what it cost
        beyond a plain step."""
        self._decode_seconds += step_seconds
        if self._probing:
            self._unconverted_probe = max(0.0, step_seconds - self.costs.target(n, n, plain_keys))
            self._probe_seconds += self._unconverted_probe
            self._probing = False

    def _settle_probe(self, converted: bool) -> None:
        """The decision after a probe: one that led to drafting was no loss."""
        if converted:
            self._probe_seconds -= self._unconverted_probe
        self._unconverted_probe = 0.0
