"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the last n tokens."""
from __future__ import annotations

from .base import DraftBatch


class NgramProposer:
    name = "ngram"

    last_round_seconds: list[float] = []  # no model, no rounds

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("n-gram sizes need 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, seqs, ks: list[int]) -> DraftBatch:
        tokens = [self.lookup(seq.token_ids, k) if k > 0 else [] for seq, k in zip(seqs, ks)]
        return DraftBatch(tokens, [None] * len(seqs))

    def lookup(self, ids: list[int], k: int) -> list[int]:
        return self.match(ids, k)[1]

    def match(self, ids: list[int], k: int) -> tuple[int, list[int]]:
        """(n, the up to k tokens that followed the match), or (0, []) without one. Longest n first; the
        most recent match wins (it reflects the current context best)."""
        for n in range(min(self.max_ngram, len(ids) - 1), self.min_ngram - 1, -1):
            tail = ids[-n:]
            for start in range(len(ids) - n - 1, -1, -1):
                if ids[start:start + n] == tail:
                    return n, ids[start + n:start + n + k]
        return 0, []

    def unseen_tokens(self, seq) -> int:
        return 0

    def commit(self, seq, num_valid_tokens: int) -> None:
        pass

    def release(self, seq) -> None:
        pass
