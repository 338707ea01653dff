"""Plain decoding steps queued ahead: where nothing drafts, a step's forward reads the tokens the step before it
picked while they are still on the device, so that it is queued before they reach the host. The host's work on a
step (its tokens emitted, stop checks, the next step's inputs and launch) then runs while the device computes the
next one, instead of between two forwards (docs/decisions.md#plain-steps-queued-ahead). The tokens are the same:
a plain step's token is the argmax of its logits either way; a sequence that finishes where the host sees it
leaves one forward's row unused."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..metrics import now
from ..proposers.base import TargetFeedback
from .policy import DraftDecision
from .sequence import Sequence
from .step import StepOutput


@dataclass
class StepAhead:
    """A plain step queued on the device: its sequences, each as it stood (slot, preemptions, tokens), the tokens it
    picks ([n], on the device, in the sequences' order) and, where a proposer reads them, its rows' hidden states."""

    seqs: list[Sequence]
    stood: list[tuple[int, int, int]]
    picked: torch.Tensor
    hidden: torch.Tensor | None

    @classmethod
    def queued(cls, seqs: list[Sequence], picked: torch.Tensor, hidden: torch.Tensor | None) -> "StepAhead":
        return cls(seqs, [_standing(s, 1) for s in seqs], picked, hidden)

    def rows(self, seqs: list[Sequence]) -> list[int | None]:
        """Each sequence's row, None where this step was not queued for it as it stands now (admitted or resumed
        since: preempted, it was recomputed into a new slot)."""
        row_of = {id(s): i for i, s in enumerate(self.seqs)}
        rows = [row_of.get(id(s)) for s in seqs]
        return [r if r is not None and self.stood[r] == _standing(s) else None for s, r in zip(seqs, rows)]


def _standing(seq: Sequence, emitted: int = 0) -> tuple[int, int, int]:
    """Where a sequence stands: its slot, its preemptions, and its tokens once `emitted` more are out."""
    return seq.slot, seq.metrics.num_preemptions, seq.num_tokens + emitted


class QueuingAhead:
    """Engine's plain steps (a part of Engine, apart for its length: it reads the engine's runner, queues, policy
    and proposers). `overlap`: whether plain steps are queued ahead (the default: where the runner replays graphs,
    so a forward runs while the host goes on; on a CPU the host computes the forward itself, and a step queued
    ahead would only delay the tokens before it)."""

    def _plain(self, seqs: list[Sequence], decision: DraftDecision) -> bool:
        """Whether this decoding step is plain and may queue the next: nothing drafts, and each sequence's token is
        its logits' argmax with nothing more to compute from them (logprobs), which the device picks alone."""
        return (
            self.overlap
            and not any(decision.ks)
            and self.runner.vocab_ids is None
            and all(s.takes_argmax and s.params.logprobs is None for s in seqs)
        )

    def _plain_step(self, seqs: list[Sequence], out: StepOutput, step_start: float) -> None:
        """One token for each sequence the step is for: from the forward queued by the last step where there is one
        (sequences admitted since sit this step out), else from a forward now; the next step's forward is queued
        before these tokens are read."""
        self._plain_run += 1
        with self.timer.measure("target"):
            seqs, picked, hidden, everyone = self._picked(seqs)
            contexts = [s.num_tokens - 1 for s in seqs]
            for seq in seqs:  # the row of each input token is final: the next forward continues after it
                self.runner.commit(seq.slot, seq.num_tokens)
                for proposer in self.proposers:
                    proposer.commit(seq, seq.num_tokens)
            read = _copied_to_host(picked)  # queued before the next forward: reading it waits for this one alone
            self._ahead = self._queue_next(seqs, picked) if everyone else None
            tokens = read()
        queued = set() if self._ahead is None else {id(s) for s in self._ahead.seqs}
        for i, (seq, token, start) in enumerate(zip(seqs, tokens, contexts)):
            if id(seq) in queued:
                self.runner.settle(seq.slot, start + 1, token)
            self._feed_back(seq, TargetFeedback([token], None if hidden is None else hidden[i : i + 1], start))
            seq.metrics.spec.record_step(0, 0, 1)
            out.counters.record_step(0, 0, 1)
            self.policy.observe_acceptance(seq.request_id, 0, 0, 0)
            self._emit(seq, [token])
        out.draft_lengths = [0] * len(seqs)
        seconds = now() - step_start
        self.policy.observe_step(out.draft_lengths, seconds, None, seconds, contexts=contexts)

    def _picked(self, seqs: list[Sequence]) -> tuple[list[Sequence], torch.Tensor, torch.Tensor | None, bool]:
        """The sequences this step is for, their tokens on the device (and their rows' hidden states where a proposer
        reads them), and whether they are all of `seqs`."""
        ahead, self._ahead = self._ahead, None
        rows = ahead.rows(seqs) if ahead is not None else [None]
        if any(r is not None for r in rows):
            kept = [r for r in rows if r is not None]
            every = kept == list(range(len(ahead.seqs)))
            picked, hidden = (ahead.picked, ahead.hidden) if every else _rows((ahead.picked, ahead.hidden), kept)
            return [s for s, r in zip(seqs, rows) if r is not None], picked, hidden, len(kept) == len(seqs)
        logits, hidden = self._target_forward([s.slot for s in seqs], [[s.token_ids[-1]] for s in seqs], "last")
        return seqs, logits.argmax(-1), hidden, True

    def _queue_next(self, seqs: list[Sequence], picked: torch.Tensor) -> StepAhead | None:
        """The next step's forward, queued for the sequences that will still decode after this step's token (as far
        as the host knows now: EOS and stop strings show only once the tokens are read), where the next step will be
        this one's again: no prompt waits to be admitted or prefilled, the pools hold one more token of each, and
        this is not a lone plain step (a policy that drafts re-measures plain decoding with one now and then, and the
        step after it drafts: it would not take a plain step queued for it)."""
        if self.waiting or self.prefilling or self._plain_run < 2:
            return None
        going = [i for i, s in enumerate(seqs) if s.remaining_tokens > 1 and s.num_tokens + 1 < self.max_model_len]
        if not going or not self.blocks.fits(self._active(), lookahead=1):
            return None
        next_seqs = [seqs[i] for i in going]
        picked = picked if next_seqs == seqs else picked[going]
        out = self.runner.forward_picked([s.slot for s in next_seqs], picked, hidden=self.wants_hidden_states)
        logits, hidden = out if isinstance(out, tuple) else (out, None)
        return StepAhead.queued(next_seqs, logits.argmax(-1), hidden)


def _rows(tensors, rows: list[int]):
    return tuple(None if t is None else t[rows] for t in tensors)


def _copied_to_host(picked: torch.Tensor):
    """A copy of `picked` to the host queued now, and a function that waits for it and gives its values: on a GPU,
    waiting for this copy alone, not for work queued after it."""
    if picked.device.type != "cuda":
        return picked.tolist
    host = torch.empty(picked.shape, dtype=picked.dtype, pin_memory=True)
    host.copy_(picked, non_blocking=True)
    done = torch.cuda.Event()
    done.record()

    def read() -> list[int]:
        done.synchronize()
        return host.tolist()

    return read
