"""The adaptive policy's cost model: measured seconds of target and draft forwards, by size."""

from __future__ import annotations

import bisect
import statistics
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np


@dataclass
class CostTable:
    """Seconds of a forward by size (tokens in the call, or sequences drafting): the median of the most
    recent samples of each size. A median, because steps stall now and then on a shared CPU, and a mean
    would carry one stall for many steps: a plain step priced high makes speculation look better than it
    is until plain decoding is measured again, which under speculation is rare.

    The first sample of a size is provisional (a first call for a new shape often carries one-off work):
    the second replaces it, and while other sizes have two samples it is not used at all. Otherwise a
    pessimistic first sample would keep the policy from choosing that size again, and so from correcting
    it. Unmeasured sizes are interpolated between the trusted neighbours.

    Outside them the estimate never gets cheaper per unit than the nearest measured size: above the
    largest it grows in proportion, below the smallest it stays at the smallest's cost. Costs jump where
    kernels change tiling, so a slope can be far too optimistic; a pessimistic guess costs little, since
    the policy then drafts for fewer sequences and measures larger sizes as it grows into them."""

    window: int = 7  # recent samples per size that the median is taken over
    seconds: dict[int, float] = field(default_factory=dict)
    samples: Counter = field(default_factory=Counter)
    _recent: dict[int, deque] = field(default_factory=dict)
    _known: dict[int, float] = field(default_factory=dict)  # what lookups use (see above), by size
    _sizes: list[int] = field(default_factory=list)  # its sizes, sorted
    _slope: float | None = None  # slope() of _known, once asked for
    _points: tuple | None = None  # points, once asked for

    def observe(self, size: int, seconds: float) -> bool:
        """Whether the table changed: a new sample moves the median only now and then."""
        self.samples[size] += 1
        recent = self._recent.setdefault(size, deque(maxlen=self.window))
        if self.samples[size] == 2:
            recent.clear()  # the warm-up sample
        recent.append(seconds)
        before, self.seconds[size] = self.seconds.get(size), statistics.median_low(recent)  # of two, the lower
        if self.seconds[size] == before and self.samples[size] > 2:
            return False
        self._refresh()
        return True

    def record(self, size: int, seconds: float) -> None:
        """A profiled measurement (its warm-up call already left out): trusted at once, like a size seen
        twice; later observations refine it as usual."""
        self.samples[size] = max(self.samples[size], 2)
        self._recent[size] = deque([seconds], maxlen=self.window)
        self.seconds[size] = seconds
        self._refresh()

    def _refresh(self) -> None:
        # the policy looks sizes up many times per step: decide once here which samples it trusts
        self._known = {s: v for s, v in self.seconds.items() if self.trusts(s)} or dict(self.seconds)
        self._sizes = sorted(self._known)
        self._slope = self._points = None  # worked out when asked for: a table changes every step

    def trusts(self, size: int) -> bool:
        """`size` has been measured past its provisional first sample (or profiled)."""
        return self.samples[size] >= 2

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

    @property
    def points(self) -> tuple[np.ndarray, np.ndarray]:
        """The trusted sizes (sorted) and their seconds as arrays, for pricing many sizes at once."""
        if self._points is None:
            self._points = (np.array(self._sizes, dtype=float), np.array([self._known[s] for s in self._sizes]))
        return self._points

    def at(self, sizes: np.ndarray) -> np.ndarray:
        """__call__ at many sizes (each > 0) at once."""
        if not self._sizes:
            raise LookupError("nothing measured yet")
        xs, ys = self.points
        seconds = np.interp(sizes, xs, ys)
        return np.where(sizes > xs[-1], ys[-1] * sizes / xs[-1], seconds)

    def slope(self) -> float:
        """Least-squares seconds per unit of size over the trusted sizes (0 with fewer than two)."""
        if self._slope is None:
            self._slope = _least_squares_slope(self._known)
        return self._slope


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
    and the weights are streamed once per call, so 8 sequences x 2 tokens cost more than 16 x 1.
    Within a batch size the measured token counts are interpolated; beyond them the cost grows by a
    per-token slope: the batch size's own once its measurements span a few tokens, else the median of
    the other batch sizes', else 2% of its plain step.

    The slope is trusted only up to one token past the largest call measured at any batch size; beyond
    that the cost grows in proportion to the tokens: low-bit CPU kernels get dearer per row as calls grow,
    and a slope learned on small calls priced large ones so cheaply that the policy drafted at a loss.
    Calls grow one token past what has been measured at a time, which is how they learn.

    Attention is priced apart per cached key, so costs learned at one context length price another: a sequence's
    first row by `keys` at `per_row_key`, its further rows by `extra_keys` at `per_extra_row_key` (the kernel reads
    the keys once for all rows, so a further row pays mostly arithmetic; priced as first rows, a long context's
    verify looks far dearer than it is: docs/decisions.md#adaptive-policy-the-cost-model)."""

    tables: dict[int, CostTable] = field(default_factory=dict)  # batch size -> cost by tokens in the call
    per_row_key: float = 0.0  # seconds of attention per sequence and cached key, its first row (profiled; 0: unknown)
    per_extra_row_key: float | None = None  # the same for each further row of the sequence (None: as the first)
    min_slope_span: int = 4  # tokens a batch size's measurements must span for its own slope to count
    explore_tokens: int = 1  # tokens past the largest measured call that the slope is trusted for

    # prices asked since the tables last changed: the policy asks for the same few calls many times a step
    _prices: dict[tuple[int, float], float] = field(default_factory=dict)
    # what prices are made of that does not depend on the tokens priced (slopes, spans over all batch sizes),
    # worked out once while the tables stay as they are: a decision at 64 sequences prices hundreds of calls
    _parts: dict = field(default_factory=dict)

    def observe(self, batch: int, tokens: int, seconds: float, keys: float = 0.0, extra_keys: float = 0.0) -> None:
        table = self.tables.setdefault(batch, CostTable())
        if table.observe(tokens, self._beside_attention(seconds, keys, extra_keys)):
            self._changed()

    def record(self, batch: int, tokens: int, seconds: float, keys: float = 0.0, extra_keys: float = 0.0) -> None:
        """A profiled measurement (see CostTable.record)."""
        self.tables.setdefault(batch, CostTable()).record(tokens, self._beside_attention(seconds, keys, extra_keys))
        self._changed()

    def _beside_attention(self, seconds: float, keys: float, extra_keys: float) -> float:
        return max(seconds - self.attention(keys, extra_keys), 1e-9)

    def attention(self, keys: float, extra_keys: float = 0.0) -> float:
        """Seconds of a call's attention: first rows read `keys` cached keys, further rows `extra_keys`."""
        extra = self.per_row_key if self.per_extra_row_key is None else self.per_extra_row_key
        return self.per_row_key * keys + extra * extra_keys

    def _changed(self) -> None:
        self._prices.clear()
        self._parts.clear()

    def _part(self, key, make):
        if key not in self._parts:
            self._parts[key] = make()
        return self._parts[key]

    def __bool__(self) -> bool:
        return bool(self.tables)

    def has_plain(self, batch: int) -> bool:
        """Plain decoding (one token per sequence) has been measured at this batch size past its first sample,
        which is provisional (CostTable): priced from verify calls instead, plain looks as dear as a draft."""
        return batch in self.tables and self.tables[batch].trusts(batch)

    def __call__(self, batch: int, tokens: float, keys: float = 0.0, extra_keys: float = 0.0) -> float:
        """Seconds of a call of `batch` sequences and `tokens` rows in all, whose first rows read `keys` cached
        keys and further rows `extra_keys`."""
        key = (batch, tokens)
        if key not in self._prices:
            self._prices[key] = self._price(batch, tokens)
        return self._prices[key] + self.attention(keys, extra_keys)

    def _price(self, batch: int, tokens: float) -> float:
        table = self.tables.get(batch)
        if not table:
            raise LookupError(f"nothing measured at batch size {batch}")
        sizes = table.sizes
        if sizes[0] <= tokens <= sizes[-1]:
            return table(tokens)
        if tokens < sizes[0]:
            return max(table(sizes[0]) + self.slope(batch) * (tokens - sizes[0]), 1e-9)
        edge, seconds = sizes[-1], table(sizes[-1])
        borrowed = self._borrowed_growth(batch, edge, tokens)
        if borrowed:
            edge, growth = borrowed
            seconds += growth
        trusted = min(tokens, max(edge, self.largest_call()) + self.explore_tokens)
        seconds += self.slope(batch) * (trusted - edge)
        return seconds * tokens / trusted

    def _borrowed_growth(self, batch: int, edge: int, tokens: float) -> tuple[float, float] | None:
        """(reach, seconds): how much dearer a call of `reach` tokens is than one of `edge`, as measured at
        other batch sizes over that very span (the median), reach being as close to `tokens` as they go.
        The linear layers cost by the rows in the call whatever the batch, so this follows the kernels'
        cost per row where a slope averages it out (1 -> 5 tokens cost 3.25 ms a token on average, 2 -> 5
        4.2)."""
        others, farthest = self.spanning(batch, edge)
        if not others:
            return None
        reach = min(tokens, farthest)
        growth = [t(reach) - t(edge) for t in others if t.sizes[-1] >= reach]
        return reach, statistics.median(growth)

    def spanning(self, batch: int, edge: int) -> tuple[list[CostTable], int]:
        """The other batch sizes' tables that measured calls from `edge` tokens on, and the farthest they reach."""

        def make():
            others = [t for b, t in self.tables.items() if b != batch and t.sizes[0] <= edge < t.sizes[-1]]
            return others, max((t.sizes[-1] for t in others), default=edge)

        return self._part(("spanning", batch, edge), make)

    def largest_call(self) -> int:
        return self._part("largest", lambda: max(t.sizes[-1] for t in self.tables.values()))

    def slope(self, batch: int) -> float:
        """Seconds per extra token in a call at this batch size (see the class doc)."""
        return self._part(("slope", batch), lambda: self._slope(batch))

    def _slope(self, batch: int) -> float:
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
        weight = 1.0 if self._prefill_samples == 1 else self.smoothing  # the first sample is taken as it is
        self.draft_prefill_per_token += weight * (per_token - self.draft_prefill_per_token)

    def expected_draft_forward(self, rows: int, reach: float) -> float:
        """Expected seconds of a draft forward that each of `rows` sequences joins with chance `reach`:
        it runs if any does, over as many rows as join."""
        if reach >= 1.0:
            return self.draft(rows)
        runs = 1.0 - (1.0 - reach) ** rows
        return runs * self.draft(rows * reach / runs) if runs > 0 else 0.0
