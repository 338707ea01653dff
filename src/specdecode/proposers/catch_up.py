"""Lookup proposers (n-gram, suffix) index each sequence's text as it grows. A sequence's whole prompt indexed in
the step it first drafts in would stall that step for every stream in the batch (tens of milliseconds at 32k
tokens), so a step indexes a bounded share of what waits; until an index is whole, lookups find what the part
indexed holds."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

INDEX_TOKENS = 256  # tokens a step indexes at least: a few milliseconds at most
BACKLOG_SHARE = 8  # where more waits, an eighth of it: the backlog drains rather than growing


class GrowingIndex(Protocol):
    caught_up: bool  # indexed whole once: from then on a step's few new tokens are indexed as they come

    @property
    def behind(self) -> int:
        """Tokens of its text not indexed yet."""

    def index(self, max_tokens: int) -> None:
        """Index up to max_tokens more of its text, from where it stopped."""


def share(backlog: int) -> int:
    """The tokens a step indexes of a backlog."""
    return max(INDEX_TOKENS, backlog // BACKLOG_SHARE)


def catch_up(indexes: Iterable[GrowingIndex]) -> None:
    """Index the step's tokens of those caught up, and a share of the others' backlog, fewest behind first."""
    waiting = []
    for index in indexes:
        if index.caught_up:
            index.index(index.behind)
        elif index.behind:
            waiting.append(index)
    budget = share(sum(index.behind for index in waiting))
    for index in sorted(waiting, key=lambda index: index.behind):
        n = min(index.behind, budget)
        index.index(n)
        budget -= n
