"""Work queued ahead of the host. On a GPU the host only queues work, and every time it waits for a result the device
idles while the host prepares what comes next; so a step waits once, for what it must know:
- a plain decoding step's forward reads the tokens the step before it picked while they are still on the device, and
  is queued before they reach the host: the host's work on a step (its tokens emitted, stop checks, the next step's
  inputs and launch) runs while the device computes the next one, instead of between two forwards
  (docs/decisions.md#one-wait-a-step). The tokens are the same: a plain step's token is the argmax of its
  logits either way; a sequence that finishes where the host sees it leaves one forward's row unused;
- a speculative step's verify reads the drafts a drafter's chained rounds left on the device, queued behind them, and
  for greedy sequences the drafts come back with the target's argmax in one copy; where some sequence samples, the
  drafts are read while the verify runs, then rejection sampling takes one more copy. Drafts past a confidence stop
  are verified and ignored (a row's logits depend on the rows before it alone), so the tokens are those of a verify
  that read them first;
- where the next step will draft as this one does, its drafting is queued behind the verify, on the drafts the device
  counts as kept (verify/on_device.py), before the host reads them: the host's work on the step runs while the device
  drafts, and the next step takes those drafts where the host's own verification agrees
  (docs/decisions.md#drafting-queued-behind-the-verify). The drafts are those drafting after the read would make.
Timing waits for nothing either (timing.py)."""

from __future__ import annotations

import time
from itertools import accumulate

import torch

from ..proposers.base import DraftBatch, TargetFeedback
from ..timing import Mark
from ..transfers import read_at_once, to_device
from ..verify.together import reads_raw_argmax
from ..verify.verifier import verify_argmax_rows, verify_batch
from .ahead import DraftsAhead, Picked, StepAhead, picks_of, rows_of, verify_widths, with_hidden
from .policy import DraftDecision
from .queued_drafts import QueuingDrafts, replaying
from .sequence import Sequence
from .step import StepOutput


class QueuingAhead(QueuingDrafts):
    """Engine's steps queued ahead of the host (a part of Engine, apart for its length: it reads the engine's runner,
    queues, policy and proposers). `overlap`: whether they are (the default: where the runner replays graphs, so a
    forward runs while the host goes on; on a CPU the host computes each forward itself: a step queued ahead would only
    delay the tokens before it, and a verify of every drafted row would pay for the rows past a confidence stop)."""

    def _plain(self, seqs: list[Sequence], decision: DraftDecision) -> bool:
        """Whether this decoding step is plain and may queue the next: nothing drafts, and each sequence's token
        follows from its logits row on the device alone (ahead.picks_of)."""
        return (
            self.overlap
            and not any(decision.ks)
            and self.runner.vocab_ids is None
            and all(s.picks_by_settings for s in seqs)
        )

    def _drop_ahead(self, seqs: list[Sequence] | None = None) -> None:
        """The step queued ahead, not taken by these sequences (default: by any), its draws for them given back."""
        if self._ahead is not None:
            self._ahead.undraw(seqs)
            if seqs is None:
                self._ahead = None

    def _graphs_captured(self) -> int:
        """Graphs the target's and the proposers' runners have captured so far: a step in which one was captured took
        one-off time, which the policy must not take for the step's cost."""
        return self.runner.graphs_captured() + sum(p.graphs_captured() for p in self.proposers)

    def _plain_step(self, seqs: list[Sequence], out: StepOutput, step_start: Mark, captured: int) -> None:
        """One token for each sequence the step is for: from the forward queued by the last step where there is one
        (sequences admitted since sit this step out), else from a forward now; the next step's forward is queued
        before these tokens are read. Its time: from the step's start, or for a forward queued ahead from the read
        before it (reads a forward apart: the time a token takes while the host keeps up, and while it does not)."""
        self._plain_run += 1
        self._drop_drafts_ahead()
        got = self._picked(seqs, step_start.host)
        seqs, contexts = got.seqs, [s.num_tokens - 1 for s in got.seqs]
        for seq in seqs:  # the row of each input token is final: the next forward continues after it
            self.runner.commit(seq.slot, seq.num_tokens)
            for proposer in self.proposers:
                proposer.commit(seq, seq.num_tokens)
        read = got.copied_to_host()  # queued before the next forward: reading it waits for this one alone
        self._ahead = self._queue_next(seqs, got.tokens) if got.everyone else None
        picks, read_at = read(), time.perf_counter()
        seconds = read_at - got.since
        self.timer.record("target", seconds)
        queued = set()
        if self._ahead is not None:
            self._ahead.after = read_at
            queued = {id(s) for s in self._ahead.seqs}
        for i, (seq, (token, logprobs), start) in enumerate(zip(seqs, picks, contexts)):
            if id(seq) in queued:
                self.runner.settle(seq.slot, start + 1, [token])
            self._feed_back(seq, TargetFeedback([token], None if got.hidden is None else got.hidden[i : i + 1], start))
            seq.metrics.spec.record_step(0, 0, 1)
            out.counters.record_step(0, 0, 1)
            self.policy.observe_acceptance(seq.request_id, 0, 0, 0)
            self._emit(seq, [token], logprobs)
        out.draft_lengths = [0] * len(seqs)
        untimed = self._graphs_captured() != captured
        self.policy.observe_step(out.draft_lengths, seconds, None, seconds, contexts=contexts, untimed=untimed)
        self.timer.settle()  # spans queued on the device (a drafter's prompt reads) are not kept past their end

    def _picked(self, seqs: list[Sequence], start: float) -> Picked:
        """The sequences this step is for, their tokens on the device (and their rows' hidden states where a proposer
        reads them), whether they are all of `seqs`, and when their forward's time began (`start`, this step's, unless
        it was queued by the step before)."""
        ahead, self._ahead = self._ahead, None
        rows = ahead.rows(seqs) if ahead is not None else [None]
        if any(r is not None for r in rows):
            kept = [r for r in rows if r is not None]
            every = kept == list(range(len(ahead.seqs)))
            picked = (ahead.picked, ahead.hidden, ahead.table)
            mine = [s for s, r in zip(seqs, rows) if r is not None]
            return Picked(mine, *(picked if every else rows_of(picked, kept)), len(kept) == len(seqs), ahead.after)
        logits, hidden = self._target_forward([s.slot for s in seqs], [[s.token_ids[-1]] for s in seqs], "last")
        tokens, table = picks_of(seqs, logits)
        return Picked(seqs, tokens, hidden, table, True, start)

    def _queue_next(self, seqs: list[Sequence], picked: torch.Tensor) -> StepAhead | None:
        """The next step's forward, queued for the sequences that will still decode after this step's token (as far
        as the host knows now: EOS and stop strings show only once the tokens are read), where the next step will be
        this one's again: no prompt is admitted or prefilled, the pools hold one more token of each, and this is not
        a lone plain step (a policy that drafts re-measures plain decoding with one now and then, and the step after
        it drafts: it would not take a plain step queued for it) nor one before the policy probes drafting."""
        if self.prefilling or self._plain_run < 2:
            return None
        going = [i for i, s in enumerate(seqs) if s.remaining_tokens > 1 and s.num_tokens + 1 < self.max_model_len]
        if not going or self._may_admit_next(len(seqs) - len(going)):
            return None
        next_seqs = [seqs[i] for i in going]
        if self.proposer is not None and self.policy.probes_next([s.num_tokens for s in next_seqs]):
            return None
        if not self.blocks.fits(self._active(), lookahead=1):
            return None
        picked = picked if next_seqs == seqs else picked[to_device(going, picked.device)]
        out = self.runner.forward_picked([s.slot for s in next_seqs], picked[:, None], hidden=self.wants_hidden_states)
        return StepAhead.queued(next_seqs, *with_hidden(out))

    def _may_admit_next(self, leaving: int = 0) -> bool:
        """Whether the next step may admit a waiting request: the slots free now and those of the `leaving` sequences
        (stopping at their length this step) hold the first waiting group. With every slot taken, as a busy server's
        are, a step still queues the next; a sequence stopped by EOS or a stop string frees a slot unforeseen, and
        the request admitted into it sits one step out."""
        return bool(self.waiting) and self.runner.num_free + leaving >= len(self._next_group())

    def _verifies_on_device(self, seqs: list[Sequence], drafts: DraftBatch) -> bool:
        """Whether the verify's forward reads the drafts where the drafter left them, queued before they are read:
        every draft is there (none is a lookup's), and each sequence's token follows from its logits row and
        settings alone (no processor or grammar, which need the drafts on the host before the forward's logits)."""
        return (
            self.overlap
            and drafts.on_device is not None
            and not any(drafts.tokens)
            and self.runner.vocab_ids is None
            and all(s.picks_by_settings for s in seqs)
        )

    def _verify_drafts_on_device(self, seqs: list[Sequence], drafts: DraftBatch):
        """The verify's logits of every row (and hidden states where a proposer reads them), its inputs each
        sequence's last token and its drafts on the device."""
        got, self._verify_ahead = self._verify_ahead, None
        if got is not None:  # queued by the step before: its rows are each sequence's last token and its drafts
            for seq in seqs:
                start = seq.num_tokens - 1
                self.runner.wrote_again(seq.slot, start, [seq.token_ids[-1]], start + got.width)
            return got.logits, got.hidden
        pending = drafts.on_device
        picked = pending.tokens
        if len(pending.rows) < len(seqs):  # each sequence's drafts on its own row, none for those that drafted none
            rows = to_device(pending.rows, picked.device)
            picked = picked.new_zeros(len(seqs), picked.shape[1]).index_copy_(0, rows, picked)
        last = [s.token_ids[-1] for s in seqs]
        out = self.runner.forward_picked(
            [s.slot for s in seqs],
            picked,
            verify_widths(drafts),
            first=last,
            logits="all",
            hidden=self.wants_hidden_states,
        )
        return with_hidden(out)

    def _verified(self, seqs: list[Sequence], drafts: DraftBatch, logits: torch.Tensor, ahead: DraftsAhead | None):
        """Each sequence's verification and the number of its rows in the verify's logits. Drafts still on the device
        (the verify read them there) come back with the target's argmax, in one copy, where every sequence is greedy
        without logprobs (queued before the next step's drafting where that was queued: `ahead`); otherwise they are
        read (the verify's forward queued behind them keeps the device busy meanwhile) and each sequence's rows up to
        its drafts stood by are verified (rows past a confidence stop are ignored: a row's logits depend on the rows
        before it alone)."""
        if drafts.on_device is None:
            return self._verify_batch(seqs, drafts, logits), [n + 1 for n in drafts.num_tokens]
        widths = verify_widths(drafts)
        if not all(reads_raw_argmax(seq) for seq in seqs):
            drafts.read()
            self._settle_verified_rows(seqs, drafts)
            rows = to_device(_stood_by_rows(widths, drafts.tokens), logits.device)
            return self._verify_batch(seqs, drafts, logits[rows]), widths
        if ahead is None:
            argmax, *values = read_at_once([logits.argmax(-1), *drafts.on_device.values()])
        else:
            argmax, *values, accepted = ahead.read()
        drafts.settle(*values)
        self._settle_verified_rows(seqs, drafts)
        forced = self.forced_accept if ahead is None or ahead.kept is None else replaying(ahead.kept)
        results = verify_argmax_rows(drafts.tokens, widths, [int(v) for v in argmax], forced)
        if ahead is not None and ahead.queued is not None:
            self._keep_queued(ahead, [r.num_accepted[0] for r in results], [int(a) for a in accepted])
        return [(result, None) for result in results], widths

    def _verify_batch(self, seqs: list[Sequence], drafts: DraftBatch, logits: torch.Tensor):
        return verify_batch(seqs, drafts.tokens, drafts.probs, logits, self.tokenizer.eos_token_ids, self.forced_accept)

    def _settle_verified_rows(self, seqs: list[Sequence], drafts: DraftBatch) -> None:
        """The ids of the rows the verify read on the device, now the drafts are on the host."""
        for seq, tokens in zip(seqs, drafts.tokens):
            self.runner.settle(seq.slot, seq.num_tokens, tokens)


def _stood_by_rows(widths: list[int], drafts: list[list[int]]) -> list[int]:
    """The rows verifying each sequence's drafts stood by, of a verify that read widths[i] rows of sequence i: the
    first drafts + 1 of them."""
    starts = accumulate(widths, initial=0)
    return [start + j for start, tokens in zip(starts, drafts) for j in range(len(tokens) + 1)]
