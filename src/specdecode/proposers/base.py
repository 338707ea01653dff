"""The proposer interface: guess up to k next tokens for each sequence of a batch."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class DraftBatch:
    tokens: list[list[int]]  # ragged: up to k_i tokens per sequence (0 allowed)
    # Per sequence, the distribution each token was sampled from [n_i, V], or None when the proposer is
    # deterministic (n-gram, greedy drafting): the rejection sampler then treats q as one-hot.
    probs: list[torch.Tensor | None]

    @property
    def num_tokens(self) -> list[int]:
        return [len(t) for t in self.tokens]


class Proposer(Protocol):
    name: str

    def propose(self, seqs: list, ks: list[int]) -> DraftBatch: ...

    # seconds of each drafting round of the last propose() call (empty when the proposer runs no model)
    last_round_seconds: list[float]

    def unseen_tokens(self, seq) -> int:
        """Tokens of the sequence the proposer must read before it can draft for it (0 for lookups)."""

    def commit(self, seq, num_valid_tokens: int) -> None:
        """The first `num_valid_tokens` of seq.token_ids are final; forget anything drafted past them."""

    def release(self, seq) -> None:
        """The sequence finished; free what the proposer holds for it."""
