"""The next step's drafting, and its verify, queued behind a verify before the host reads it (a part of the engine's
QueuingAhead, engine/overlap.py): the device counts the drafts each sequence keeps (verify/on_device.py), the drafter
drafts from there (Proposer.queue_drafts), and the next verify reads those drafts where they lie, at positions the
device places; the host's work on a step then runs while the device drafts and verifies the next. The next step takes
them where the host's own verification agrees (docs/decisions.md#drafting-queued-behind-the-verify): the drafts and
tokens are those of drafting after the read."""

from __future__ import annotations

import logging

import torch

from ..proposers.base import DraftBatch
from ..timing import Span, mark
from ..transfers import read_later
from ..verify.on_device import verified_on_device
from ..verify.together import reads_raw_argmax
from ..verify.verifier import forced_kept
from .ahead import DraftsAhead, VerifyAhead, standing, verify_widths, with_hidden
from .policy import DraftDecision
from .sequence import Sequence

log = logging.getLogger(__name__)


class QueuingDrafts:
    """The engine's drafting (and verifies) queued ahead of the host; `overlap_drafting` and `verify_ahead` switch
    each off."""

    overlap_drafting = True  # with overlap: the next step's drafting queued behind a verify where it may be
    verify_ahead = True  # with it: the next step's verify queued behind that drafting too
    queued_drafts_taken = 0  # steps that took drafting queued ahead
    verifies_taken_ahead = 0  # and of those, the steps whose verify was queued ahead too
    _drafts_ahead: DraftsAhead | None = None
    _verify_ahead: VerifyAhead | None = None  # this step's verify, queued by the step before

    def _queue_drafts(self, seqs: list[Sequence], drafts: DraftBatch, decision: DraftDecision, logits, hidden):
        """Where the next step will likely draft for these sequences as this one does (greedy, each by the drafter's
        chained rounds; no request the next step may admit; the pools hold two steps' rows), this verify's read queued
        now and the drafter's next rounds behind it, on what the verify kept as counted on the device
        (verify/on_device.py): the host's work on this step's tokens then runs while the device drafts for the next
        step, not between the read and the next drafting. Drafts the next step does not take (the policy chose
        otherwise; a sequence finished, or was preempted) go unused. None where nothing was queued."""
        if not self._drafts_may_queue(seqs, drafts):
            return None
        verified_at, pending, widths = mark(), drafts.on_device, verify_widths(drafts)
        kept = [forced_kept(self.forced_accept, c) for c in pending.counts] if self.forced_accept else None
        argmax = logits.argmax(-1)
        stop = self.proposer.confidence_threshold
        verified = verified_on_device(argmax, pending.tokens, pending.probs, widths, stop, kept)
        read = read_later([argmax, *pending.values(), verified.accepted])
        queued = self.proposer.queue_drafts(seqs, decision.ks, verified, hidden)
        verify = self._queue_verify(seqs, queued, verified) if queued is not None else None
        return DraftsAhead(seqs, [standing(s) for s in seqs], queued, read, kept, verified_at, verify)

    def _queue_verify(self, seqs: list[Sequence], queued, verified) -> VerifyAhead | None:
        """The next step's verify, queued behind its drafting (every sequence drafting as many): each sequence's
        bonus token and its queued drafts, at positions the device places after what this verify keeps. The host's
        work on this step then runs while the device drafts and verifies the next."""
        if not self.verify_ahead or len(set(queued.ks)) > 1:
            return None
        width, reach = queued.ks[0] + 1, verified.width - 1
        picked = torch.cat([verified.tokens.gather(1, verified.accepted[:, None]), queued.tokens[:, : width - 1]], 1)
        starts, span = [s.num_tokens for s in seqs], Span(mark())
        out = self.runner.forward_after(
            [s.slot for s in seqs],
            starts,
            picked,
            verified.accepted,
            reach,
            logits="all",
            hidden=self.wants_hidden_states,
        )
        if out is None:
            return None
        span.end = mark()
        return VerifyAhead(*with_hidden(out), width, span, queued.round_spans[0][0].start)

    def _drafts_may_queue(self, seqs: list[Sequence], drafts: DraftBatch) -> bool:
        """Whether to queue the next step's drafting behind this verify (see _queue_drafts)."""
        k = self.k
        return (
            self.overlap_drafting
            and self._verifies_on_device(seqs, drafts)
            and len(drafts.on_device.rows) == len(seqs)
            and all(reads_raw_argmax(s) for s in seqs)
            and not (self.forced_accept and self.proposer.confidence_threshold)  # kept counts the drafts stood by
            and not self._may_admit_next()
            and not self.prefilling
            and not self.policy.plain_next()
            and all(s.remaining_tokens > 2 * k + 1 and s.num_tokens + 2 * (k + 1) <= self.max_model_len for s in seqs)
            and self.blocks.fits(self._active(), lookahead=k + 1)
        )

    def _keep_queued(self, ahead: DraftsAhead, kept: list[int], counted: list[int]) -> None:
        """The queued drafting kept for the next step where the device counted the kept drafts as the host did."""
        if kept != counted:
            log.warning("queued drafting dropped: the device counted %s drafts kept, the host %s", counted, kept)
            self.proposer.drop_queued(ahead.queued, ahead.seqs)
            return
        ahead.queued.kept = kept
        self._drafts_ahead = ahead

    def _drop_drafts_ahead(self) -> None:
        """Drafting queued ahead and not taken: the drafter's state as if it had not been queued."""
        ahead, self._drafts_ahead = self._drafts_ahead, None
        if ahead is not None:
            self.proposer.drop_queued(ahead.queued, ahead.seqs)

    def _queued_drafts(self, seqs: list[Sequence], decision: DraftDecision, chunk=None):
        """The drafts queued for this step and a function giving a drafting round's seconds, where they were queued
        for these sequences as they stand now and the policy has the drafter draft for them: each sequence's first
        as many as the policy chose (at most as many as were queued); else None. The verify queued behind them is
        this step's where it verifies them all and no prompt's chunk rides in this step's verify."""
        ahead, self._verify_ahead = self._drafts_ahead, None
        if ahead is None:
            return None
        queued = ahead.queued
        moved = [standing(s, -kept - 1) for s, kept in zip(seqs, queued.kept)]
        same = [id(s) for s in ahead.seqs] == [id(s) for s in seqs] and moved == ahead.stood
        if not same or any(decision.by_lookup) or not any(decision.ks):
            return self._drop_drafts_ahead()
        self._drafts_ahead = None
        ks = [min(k, q) for k, q in zip(decision.ks, queued.ks)]
        drafts = self.proposer.take_queued(queued, seqs, ks)
        self.queued_drafts_taken += 1
        if ahead.verify is not None and ks == queued.ks and chunk is None:  # it verifies them as taken
            self._verify_ahead = ahead.verify
            self.verifies_taken_ahead += 1
            self.timer.record("target", ahead.verify.span)
        rounds = drafts.round_seconds  # read once the step's results are: on a GPU reading them waits for them
        return drafts, lambda: self._draft_round_seconds(sum(rounds()), max(queued.ks), 0, rounds())


def replaying(kept: list[int]):
    """An imposed acceptance that keeps, sequence after sequence, what it kept already (drawn once a step)."""
    counts = iter(kept)
    return lambda drafts: next(counts)
