"""A drafter's greedy rounds chained on the device, replayed as one CUDA graph.

Each drafting round after the first reads one token per sequence: the argmax of the round before (and, for a draft
head, the features that round estimated). Driven from the host, every round waits for its argmax to be copied back
before the next is launched, and k rounds pay k launches and k synchronisations. Here the rounds after the first run
in one replay: each round's argmax is written into the next round's input on the device, and every round's draft
and its probability come back together. Sequences that draft fewer rounds than the longest write their extra
rounds' keys into the scratch block, never past the rows they would have written round by round; their extra drafts
are dropped, as are the drafts after one under the confidence threshold (a stop that depends on the drafts alone, so
verification stays exact).

Without capture (a CPU, in tests) the same rounds run at the same fixed shapes.
"""

from __future__ import annotations

import logging

import torch

from ..sampling import argmax_probability
from ..transfers import copy_into
from .cuda_graphs import Bucket, BucketedForward, StaticBatch, bucket_for

log = logging.getLogger(__name__)


class _Chain:
    """One bucket's rounds: its batch, how many rounds each sequence drafts, and every round's drafts and their
    probabilities ([B, rounds], written by each run or replay)."""

    def __init__(self, batch: StaticBatch, rounds: int):
        device, seqs = batch.ints.device, batch.bucket.seqs
        self.batch, self.rounds, self.graph = batch, rounds, None
        self.limits = torch.zeros(seqs, dtype=torch.long, device=device)
        self.tokens = torch.zeros(seqs, rounds, dtype=torch.long, device=device)
        self.probs = torch.zeros(seqs, rounds, dtype=torch.float32, device=device)


class GreedyChain:
    """The chained rounds of a runner's fixed-shape forwards: one graph per bucket and number of rounds, captured the
    first time it is met."""

    def __init__(self, forward: BucketedForward, vocab_ids: torch.Tensor | None):
        """vocab_ids: the target's ids of the logits' columns, where the drafter's LM head covers a subset."""
        self.forward, self.vocab_ids = forward, vocab_ids
        self._chains: dict[tuple[Bucket, int], _Chain] = {}
        self._refused: set[tuple[Bucket, int]] = set()

    def prepare(self, starts: list[int], rounds: list[int]) -> _Chain | None:
        """The chain for sequences whose rounds start at these positions (None where they fit no bucket)."""
        longest = max(rounds)
        bucket = bucket_for([1] * len(starts), max(starts) + longest, self.forward.max_keys)
        key = (bucket, longest)
        if bucket is None or key in self._refused:
            return None
        return self._chains.get(key) or self._prepare(key)

    def run(self, chain: _Chain, slots, starts, first: torch.Tensor, features: torch.Tensor | None, rounds: list[int]):
        """Each sequence's drafts after `first` (its draft of the round before, a target id on the device) and their
        probabilities, [n, max(rounds)] on the device (sequence i's first rounds[i] are its own). features: each
        sequence's features estimated in the round before (a draft head's)."""
        n, batch = len(slots), chain.batch
        batch.fill(slots, starts, [[0]] * n, self.forward.cache.scratch_row)
        batch.tokens[:n, 0] = first
        if features is not None:
            batch.features[:n, 0] = features
        copy_into(chain.limits, rounds + [0] * (batch.bucket.seqs - n))
        if chain.graph is not None:
            chain.graph.replay()
        else:
            self._run(chain)
        return chain.tokens[:n], chain.probs[:n]

    @torch.inference_mode()
    def _run(self, chain: _Chain) -> None:
        batch = chain.batch
        own = batch.slots[:, 0].clone()
        for r in range(chain.rounds):
            # past its own rounds a sequence writes into the scratch block
            batch.slots[:, 0] = torch.where(chain.limits > r, own, self.forward.cache.scratch_row)
            batch.forget()
            logits, hidden = self.forward.run(batch)
            chain.tokens[:, r], chain.probs[:, r] = self.pick(logits)
            self._next_round(batch, chain.tokens[:, r], hidden)

    def pick(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's greedy draft (a target id) and the drafter's probability of it, on the device."""
        picked = logits.argmax(-1)
        return picked if self.vocab_ids is None else self.vocab_ids[picked], argmax_probability(logits)

    @staticmethod
    def _next_round(batch: StaticBatch, drafts: torch.Tensor, estimates: torch.Tensor) -> None:
        """The next round reads each sequence's draft (beside the features a head estimated) one position on."""
        batch.tokens[:, 0] = drafts
        if batch.features is not None:
            batch.features[:, 0] = estimates
        batch.positions += 1

    def _prepare(self, key: tuple[Bucket, int]) -> _Chain | None:
        bucket, rounds = key
        chain = _Chain(self.forward.new_batch(bucket), rounds)
        if self.forward.capture:
            try:
                chain.graph, _ = self.forward.capture_graph(chain.batch, lambda: self._run(chain))
            except RuntimeError as e:  # a forward that waits on the host cannot be captured: rounds one by one
                log.warning("drafting rounds of %s run one by one: their capture failed (%s)", bucket, e)
                self._refused.add(key)
                return None
        self._chains[key] = chain
        return chain
