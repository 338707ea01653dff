"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the last n tokens."""

from __future__ import annotations

from .base import DraftBatch, Preview, Proposer
from .registry import ProposerSetup

# An index entry on CPython 3.11, a tuple of a few ids and its dict slot: 82-131 bytes measured where every n-gram is
# new (tests/test_ngram_proposer.py), the most just after a dict has grown its table
ENTRY_BYTES = 160


class NgramIndex:
    """Of one sequence, the latest start of each n-gram that a token follows (n from min to max), brought up to date
    as the sequence grows: a match is then a lookup per n, not a scan backwards through the sequence, whose cost
    each step would grow with its length (docs/decisions.md#what-grows-with-a-run)."""

    def __init__(self, sizes: range):
        self.sizes = sizes
        self.latest: dict[int, dict[tuple, int]] = {n: {} for n in sizes}
        self.read = 0  # tokens of the sequence indexed

    def update(self, ids: list[int]) -> None:
        if len(ids) < self.read:  # not the sequence it indexed: start again
            self.latest, self.read = {n: {} for n in self.sizes}, 0
        for n, latest in self.latest.items():
            for start in range(max(0, self.read - n), len(ids) - n):  # the n-grams a token now follows
                latest[tuple(ids[start : start + n])] = start
        self.read = len(ids)

    def start_of(self, ids: list[int], n: int) -> int | None:
        """Where the latest earlier occurrence of the last n tokens starts."""
        return self.latest[n].get(tuple(ids[-n:]))


class NgramProposer(Proposer):
    previews = True  # a match is known before the step and costs no forward

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("n-gram sizes need 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._indexes: dict[str, NgramIndex] = {}  # request id -> its sequence's index
        self.host_bytes_per_token = ENTRY_BYTES * (max_ngram - min_ngram + 1)

    @classmethod
    def from_setup(cls, setup: ProposerSetup) -> "NgramProposer":
        return cls(setup.config.ngram_prompt_lookup_max, setup.config.ngram_prompt_lookup_min)

    def propose(self, seqs, ks, feedback=None) -> DraftBatch:
        return DraftBatch([self.match(s, k).tokens if k > 0 else [] for s, k in zip(seqs, ks)], [None] * len(seqs))

    def preview(self, seqs, k: int) -> list[Preview]:
        return [self.match(s, k) for s in seqs]

    def release(self, seq) -> None:
        self._indexes.pop(seq.request_id, None)

    def match(self, seq, k: int) -> Preview:
        """The up to k tokens that followed the match, and its length n (0 and no tokens without one).
        Longest n first; the most recent match wins (it reflects the current context best)."""
        ids = seq.token_ids
        index = self._indexes.get(seq.request_id)
        if index is None:
            index = self._indexes[seq.request_id] = NgramIndex(range(self.min_ngram, self.max_ngram + 1))
        index.update(ids)
        for n in range(min(self.max_ngram, len(ids) - 1), self.min_ngram - 1, -1):
            start = index.start_of(ids, n)
            if start is not None:
                return Preview(n, ids[start + n : start + n + k])
        return Preview(0, [])
