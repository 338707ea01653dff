"""The adaptive policy's allocation: drafts grown one token at a time, most likely accepted first, keeping the step
with the highest predicted goodput.

A decision prices one candidate step per draft token it might allow. Up to LOOP_CANDIDATES of them are priced one
after another, each from the one before (StepPrice); more are priced at once as arrays (their verify calls' rows,
the draft forwards at each position, the catch-ups, all as running sums): at 64 sequences drafting up to 4 tokens the
loop took ~0.8 ms a decision, which a GPU step of a few ms would feel. The two give the same decisions (a test holds
them to it): docs/decisions.md#the-policys-own-cost."""

from __future__ import annotations

import numpy as np

from .base import DraftDecision
from .costs import CostModel, TargetCost

LOOP_CANDIDATES = 16  # up to this many candidate steps the loop is the faster (tools/decision_cost.py: n = 4 at k = 4)


class StepPrice:
    """The predicted seconds of one step while its drafts grow one token at a time, each candidate priced from the
    one before (a draft forward's share changes only at the grown position). reach[j]: the chance that the draft
    model drafts position j + 1 of those it is allowed (it may stop early), which prices the draft forwards and
    verify rows a step is expected to make."""

    def __init__(self, costs: CostModel, n: int, reach: list[float], contexts: list[int] | None = None):
        self.costs, self.n, self.reach = costs, n, reach
        self.rows = [0] * len(reach)  # sequences whose model draft reaches each position
        self.forwards = [0.0] * len(reach)  # the expected seconds of the draft forward at each position
        self.forward_seconds = 0.0  # their sum
        self.tokens = float(n)  # expected rows of the verify call
        self.keys = float(sum(contexts or ()))  # cached keys the sequences' first rows read
        self.extra_keys = 0.0  # expected cached keys the further rows read

    def grow(self, length: int, by_lookup: bool, context: int = 0) -> None:
        """One sequence, with `context` tokens cached, drafts to `length` (by prompt lookup: no draft forward)."""
        if by_lookup:
            self.tokens += 1
            self.extra_keys += context
            return
        j = length - 1
        self.rows[j] += 1
        before, self.forwards[j] = self.forwards[j], self.costs.expected_draft_forward(self.rows[j], self.reach[j])
        self.forward_seconds += self.forwards[j] - before
        self.tokens += self.reach[j]
        self.extra_keys += self.reach[j] * context

    @property
    def seconds(self) -> float:
        return self.forward_seconds + self.costs.target(self.n, self.tokens, self.keys, self.extra_keys)


def gains_of(alphas: list[float], depth: list[float]) -> list[list[float]] | np.ndarray:
    """Each sequence's token gains, alphas[i] · depth[j], as lists where the loop will price them, else as an array."""
    if len(alphas) * len(depth) <= LOOP_CANDIDATES:
        return [[alpha * d for d in depth] for alpha in alphas]
    return np.multiply.outer(np.asarray(alphas, dtype=float), depth)


def allocate(
    costs: CostModel,
    gains: list[list[float]] | np.ndarray,
    by_lookup: list[bool],
    start_cost: list[float],
    contexts: list[int],
    reach: list[float],
    margin: float,
    calibration: float,
) -> tuple[DraftDecision, float]:
    """The drafts (per sequence i, gains[i][j]: the chance its token j + 1 is emitted; start_cost[i]: its catch-up's
    seconds, paid once it drafts at all) whose step predicts the highest goodput, and that goodput over the bar it must
    clear: plain decoding's, raised by `margin`, with predicted seconds scaled by `calibration`. A score of 1: none."""
    if sum(map(len, gains)) <= LOOP_CANDIDATES:
        gains = gains.tolist() if isinstance(gains, np.ndarray) else gains
        return _by_loop(costs, gains, by_lookup, start_cost, contexts, reach, margin, calibration)
    return _by_arrays(costs, gains, by_lookup, start_cost, contexts, reach, margin, calibration)


def _by_loop(costs, gains, by_lookup, start_cost, contexts, reach, margin, calibration) -> tuple[DraftDecision, float]:
    n = len(gains)
    candidates = sorted(
        ((g, j, i) for i in range(n) for j, g in enumerate(gains[i], 1) if g > 0), key=lambda c: (-c[0], c[1])
    )
    ks, best, best_score, best_seconds = [0] * n, [0] * n, 1.0, 0.0
    emitted, extra = float(n), 0.0
    step = StepPrice(costs, n, reach, contexts)
    bar = (1 + margin) * emitted / step.seconds  # plain decoding's rate, raised by the margin
    if 1 + sum(g for g, _, _ in candidates) / n <= (1 + margin) * calibration:
        # not even at a plain step's price (drafting only adds to it) would these gains clear the bar
        return DraftDecision(best, [False] * n), best_score
    for gain, _, i in candidates:
        if ks[i] == 0 and not by_lookup[i]:
            extra += start_cost[i]
        ks[i] += 1
        step.grow(ks[i], by_lookup[i], contexts[i])
        emitted += gain
        seconds = step.seconds
        score = emitted / ((seconds + extra) * calibration) / bar
        if score > best_score:
            best, best_score, best_seconds = list(ks), score, seconds
    return DraftDecision(best, [by_lookup[i] and k > 0 for i, k in enumerate(best)], seconds=best_seconds), best_score


def _by_arrays(
    costs, gains, by_lookup, start_cost, contexts, reach, margin, calibration
) -> tuple[DraftDecision, float]:
    """As _by_loop: candidate m's step holds candidates 0..m, so each of its sums is a running sum."""
    n = len(gains)
    g, i, j = _candidates(gains)
    emitted = n + g.cumsum()
    if not len(g) or emitted[-1] / n <= (1 + margin) * calibration:  # as the loop: not even at a plain step's price
        return DraftDecision([0] * n, [False] * n), 1.0
    keys = float(sum(contexts))
    bar = (1 + margin) * n / costs.target(n, float(n), keys)
    lookup = np.asarray(by_lookup)[i] if any(by_lookup) else None
    seconds = _step_prices(costs, n, i, j, lookup, np.asarray(contexts, dtype=float), reach, keys)
    extra = 0.0
    if any(start_cost):
        first = j == 0 if lookup is None else (j == 0) & ~lookup
        extra = np.where(first, np.asarray(start_cost)[i], 0.0).cumsum()
    score = emitted / ((seconds + extra) * calibration) / bar
    m = int(score.argmax())  # the first of equal scores, as the loop keeps
    if score[m] <= 1.0:
        return DraftDecision([0] * n, [False] * n), 1.0
    best = np.bincount(i[: m + 1], minlength=n).tolist()
    decision = DraftDecision(best, [by_lookup[q] and k > 0 for q, k in enumerate(best)], seconds=float(seconds[m]))
    return decision, float(score[m])


def _candidates(gains: list[list[float]] | np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each draft token's gain, sequence and position (from 0), in the loop's order: gain down, then position,
    then sequence; tokens that would never be emitted are left out."""
    table = gains
    if not isinstance(gains, np.ndarray):  # lookup drafts differ in length
        table = np.zeros((len(gains), max(map(len, gains))))
        for i, row in enumerate(gains):
            table[i, : len(row)] = row
    width = table.shape[1]
    flat = table.ravel()
    index = np.flatnonzero(flat > 0)
    order = np.lexsort((index % width, -flat[index]))  # stable: equal keys stay in sequence order
    i, j = np.divmod(index[order], width)
    return flat[index[order]], i, j


def _step_prices(costs, n, i, j, lookup, contexts, reach, keys) -> np.ndarray:
    """The predicted seconds of the step after each candidate (StepPrice.seconds after each grow)."""
    positions = int(j.max()) + 1
    at = np.ones(positions)
    at[: min(len(reach), positions)] = reach[:positions]  # a lookup may run past k; its rows are 1 each
    rows = at[j] if lookup is None else np.where(lookup, 1.0, at[j])
    seconds = target_prices(costs.target, n, n + rows.cumsum()) + costs.target.attention(
        keys, (rows * contexts[i]).cumsum()
    )
    drafting = j[:, None] == np.arange(positions)
    if lookup is not None:
        if lookup.all():
            return seconds
        drafting &= ~lookup[:, None]
    counts = drafting.cumsum(0)  # sequences whose model draft reaches each position, after each candidate
    return seconds + _draft_forwards(costs, n, at)[np.arange(positions), counts].sum(1)


def _draft_forwards(costs: CostModel, n: int, reach: np.ndarray) -> np.ndarray:
    """[position, r]: CostModel.expected_draft_forward of r = 0..n sequences at each position's reach."""
    rows = np.arange(1, n + 1, dtype=float)
    runs = 1.0 - (1.0 - np.minimum(reach, 1.0)[:, None]) ** rows  # the chance the forward runs at all
    forwards = np.zeros((len(reach), n + 1))
    forwards[:, 1:] = runs * costs.draft.at(rows * reach[:, None] / runs)
    return forwards


def target_prices(target: TargetCost, batch: int, tokens: np.ndarray) -> np.ndarray:
    """TargetCost's price of a call of `batch` sequences at each of `tokens` (attention aside), at once."""
    table = target.tables.get(batch)
    if not table:
        raise LookupError(f"nothing measured at batch size {batch}")
    xs, ys = table.points
    first, edge = xs[0], xs[-1]
    seconds = np.interp(tokens, xs, ys)
    below, above = tokens < first, tokens > edge
    if below.any():
        seconds[below] = np.maximum(ys[0] + target.slope(batch) * (tokens[below] - first), 1e-9)
    if above.any():
        seconds[above] = _beyond_measured(target, batch, tokens[above], int(edge), ys[-1])
    return seconds


def _beyond_measured(target: TargetCost, batch: int, tokens: np.ndarray, edge: int, at_edge: float) -> np.ndarray:
    """TargetCost._price past the batch size's largest measured call: the growth other batch sizes measured from
    there (their median), then the slope up to one token past the largest call measured, then in proportion."""
    others, farthest = target.spanning(batch, edge)
    reached, seconds = np.full_like(tokens, float(edge)), np.full_like(tokens, at_edge)
    if others:
        reached = np.minimum(tokens, farthest)
        growth = np.full((len(others), len(tokens)), np.inf)  # inf: that table does not reach so far
        for row, other in zip(growth, others):
            measured = reached <= other.sizes[-1]
            row[measured] = other.at(reached[measured]) - other(edge)
        growth.sort(axis=0)
        middle, columns = (np.isfinite(growth).sum(0) - 1) / 2, np.arange(len(tokens))
        seconds += (growth[np.floor(middle).astype(int), columns] + growth[np.ceil(middle).astype(int), columns]) / 2
    trusted = np.minimum(tokens, np.maximum(reached, target.largest_call()) + target.explore_tokens)
    return (seconds + target.slope(batch) * (trusted - reached)) * tokens / trusted
