"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the last n tokens."""

from __future__ import annotations

from .base import DraftBatch, Preview, Proposer
from .catch_up import catch_up
from .registry import ProposerSetup

# An index entry on CPython 3.11, a tuple of a few ids and its dict slot: 82-131 bytes measured where every n-gram is
# new (tests/test_ngram_proposer.py), the most just after a dict has grown its table
ENTRY_BYTES = 160


class NgramIndex:
    """Of one sequence, the latest start of each n-gram that a token follows (n from min to max), brought up to date
    as the sequence grows: a match is then a lookup per n, not a scan backwards through the sequence, whose cost
    each step would grow with its length (docs/decisions.md#what-grows-with-a-run)."""

    def __init__(self, sizes: range, tokens: list[int]):
        self.tokens = tokens  # the sequence's tokens: one list, grown in place
        self.latest: dict[int, dict[tuple, int]] = {n: {} for n in sizes}
        self.read = 0  # tokens of the sequence indexed
        self.caught_up = False

    @property
    def behind(self) -> int:
        return len(self.tokens) - self.read

    def index(self, max_tokens: int) -> None:
        ids, end = self.tokens, min(len(self.tokens), self.read + max_tokens)
        for n, latest in self.latest.items():
            for start in range(max(0, self.read - n), end - n):  # the n-grams a token now follows
                latest[tuple(ids[start : start + n])] = start
        self.read = end
        self.caught_up = self.caught_up or not self.behind

    def start_of(self, n: int) -> int | None:
        """Where the latest earlier occurrence of the sequence's last n tokens starts, in the part indexed."""
        return self.latest[n].get(tuple(self.tokens[-n:]))


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
        catch_up(map(self._index_of, seqs))
        return DraftBatch([self._matched(s, k).tokens if k > 0 else [] for s, k in zip(seqs, ks)], [None] * len(seqs))

    def preview(self, seqs, k: int) -> list[Preview]:
        catch_up(map(self._index_of, seqs))
        return [self._matched(s, k) for s in seqs]

    def release(self, seq) -> None:
        self._indexes.pop(seq.request_id, None)

    def match(self, seq, k: int) -> Preview:
        """The up to k tokens that followed the match, and its length n (0 and no tokens without one).
        Longest n first; the most recent match wins (it reflects the current context best)."""
        catch_up([self._index_of(seq)])
        return self._matched(seq, k)

    def _matched(self, seq, k: int) -> Preview:
        ids, index = seq.token_ids, self._index_of(seq)
        for n in range(min(self.max_ngram, len(ids) - 1), self.min_ngram - 1, -1):
            start = index.start_of(n)
            if start is not None:
                return Preview(n, ids[start + n : start + n + k])
        return Preview(0, [])

    def _index_of(self, seq) -> NgramIndex:
        index = self._indexes.get(seq.request_id)
        if index is None or index.tokens is not seq.token_ids:
            index = self._indexes[seq.request_id] = NgramIndex(range(self.min_ngram, self.max_ngram + 1), seq.token_ids)
        return index
