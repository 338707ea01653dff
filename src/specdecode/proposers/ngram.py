"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the last n tokens."""

from __future__ import annotations

from .base import DraftBatch, Preview, Proposer
from .registry import ProposerSetup


class NgramProposer(Proposer):
    previews = True  # a match is known before the step and costs no forward

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("n-gram sizes need 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    @classmethod
    def from_setup(cls, setup: ProposerSetup) -> "NgramProposer":
        return cls(setup.config.ngram_prompt_lookup_max, setup.config.ngram_prompt_lookup_min)

    def propose(self, seqs, ks, feedback=None) -> DraftBatch:
        return DraftBatch(
            [self.match(s.token_ids, k).tokens if k > 0 else [] for s, k in zip(seqs, ks)], [None] * len(seqs)
        )

    def preview(self, seqs, k: int) -> list[Preview]:
        return [self.match(s.token_ids, k) for s in seqs]

    def match(self, ids: list[int], k: int) -> Preview:
        """The up to k tokens that followed the match, and its length n (0 and no tokens without one).
        Longest n first; the most recent match wins (it reflects the current context best)."""
        for n in range(min(self.max_ngram, len(ids) - 1), self.min_ngram - 1, -1):
            tail = ids[-n:]
            for start in range(len(ids) - n - 1, -1, -1):
                if ids[start : start + n] == tail:
                    return Preview(n, ids[start + n : start + n + k])
        return Preview(0, [])
