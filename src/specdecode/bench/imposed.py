"""Acceptance imposed on a benchmark run: each step keeps as many drafts as a run of the real models kept, on
average, whatever the models at hand compute. A GPU without the real weights (they do not travel to it) then times
speculation at the real shapes, with random weights, as the real pair would verify it: the acceptance measured with
the real weights (`bench latency`, fixed k, no confidence stop), the speed on the device."""

from __future__ import annotations

import json
import random


class MeasuredAcceptance:
    """survival[i]: the fraction of steps that kept more than i of their drafts (a fixed-k run's acceptance per
    position). Each call draws how many of n drafts a step keeps, from a stream of its own (seeded: runs compare)."""

    def __init__(self, survival: list[float], seed: int = 0):
        if not survival or not all(0.0 <= p <= 1.0 for p in survival):
            raise ValueError(f"per-position acceptance must be fractions, one per draft position: {survival}")
        self.survival = [min(survival[: i + 1]) for i in range(len(survival))]  # a step keeps i + 1 only if it keeps i
        self._random = random.Random(seed)

    def __call__(self, drafts: int) -> int:
        u = self._random.random()  # one draw a step: P(keeps > i) = survival[i]
        return sum(1 for p in self.survival[:drafts] if u < p)

    @classmethod
    def from_latency(cls, path: str, k: int, seed: int = 0) -> "MeasuredAcceptance":
        """From a `bench latency --out` file: its row of this k (its acceptance per position)."""
        with open(path) as f:
            rows = json.load(f)["results"]
        row = next((r for r in rows if r.get("k") == k and r.get("acceptance_per_position")), None)
        if row is None:
            raise ValueError(f"{path} has no row with k = {k} and its acceptance per position")
        return cls(row["acceptance_per_position"], seed)

    @property
    def mean_accepted(self) -> float:
        """Drafts kept a step, on average, of len(survival)."""
        return sum(self.survival)
