"""A small draft model proposes k tokens autoregressively, keeping its own KV cache in step with the
accepted text. Tokens it has not seen yet (the last emitted token, a bonus token, or a stretch decoded
without speculation) are fed in its first forward, so its cache catches up lazily."""
from __future__ import annotations

import torch

from ..executor.runner import ModelRunner
from ..metrics import StepTimer
from ..sampling import sample_token
from .base import DraftBatch


class DraftModelProposer:
    name = "draft"

    def __init__(self, runner: ModelRunner, timer: StepTimer | None = None):
        self.runner = runner
        self.timer = timer or StepTimer()
        # seconds of each drafting round of the last propose() call; the first round also feeds whatever
        # the draft had not seen (a whole prompt, after a stretch without drafting), so it can be long
        self.last_round_seconds: list[float] = []

    def propose(self, seqs, ks: list[int]) -> DraftBatch:
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = [i for i, k in enumerate(ks) if k > 0]
        self.last_round_seconds = []
        for i in active:
            if seqs[i].draft_state is None:
                seqs[i].draft_state = self.runner.allocate()
        for step in range(max((ks[i] for i in active), default=0)):
            rows = [i for i in active if ks[i] > step]
            if step == 0:  # catch up on everything the draft has not seen, then draft the first token
                inputs = [seqs[i].token_ids[self.runner.length(seqs[i].draft_state):] for i in rows]
            else:
                inputs = [[tokens[i][-1]] for i in rows]
            logits = self._forward([seqs[i].draft_state for i in rows], inputs)
            for row, i in enumerate(rows):
                seqs[i].metrics.spec.num_draft_forwards += 1
                token, q = self._sample(logits[row], seqs[i])
                tokens[i].append(token)
                if q is not None:
                    probs[i].append(q)
        return DraftBatch(tokens, [torch.stack(p) if p else None for p in probs])

    def _forward(self, slots: list[int], inputs: list[list[int]]) -> torch.Tensor:
        before = self.timer.draft_time
        with self.timer.measure("draft"):
            logits = self.runner.forward(slots, inputs, logits="last")
        self.last_round_seconds.append(self.timer.draft_time - before)
        for slot, tokens in zip(slots, inputs):
            self.runner.commit(slot, self.runner.length(slot) + len(tokens))
        return logits

    def _sample(self, logits: torch.Tensor, seq) -> tuple[int, torch.Tensor | None]:
        """Greedy requests draft the argmax (a one-hot q); sampled ones draw from q, returned for verification."""
        vocab_ids = self.runner.vocab_ids
        if vocab_ids is None:
            return sample_token(logits, seq.params, seq.generator)
        if seq.params.greedy:
            return int(vocab_ids[int(logits.argmax())]), None
        # back to the full vocabulary; tokens outside the subset get q = 0
        full = torch.full((self.runner.cfg.vocab_size,), float("-inf"), device=logits.device)
        return sample_token(full.index_copy_(0, vocab_ids, logits), seq.params, seq.generator)

    def unseen_tokens(self, seq) -> int:
        """Tokens of the sequence the draft's cache has not read yet (its next round feeds them)."""
        cached = self.runner.length(seq.draft_state) if seq.draft_state is not None else 0
        return seq.num_tokens - cached

    def commit(self, seq, num_valid_tokens: int) -> None:
        slot = seq.draft_state
        if slot is not None:
            self.runner.rollback(slot, min(self.runner.length(slot), num_valid_tokens))

    def release(self, seq) -> None:
        if seq.draft_state is not None:
            self.runner.free(seq.draft_state)
            seq.draft_state = None
