"""The engine's admission half: requests admitted while their slots and KV blocks fit, and their prompts
prefilled, at once or, for a long prompt arriving while others decode, a chunk a step beside them; the newest
sequences preempted while the KV cache cannot hold the next step of all; finished and aborted ones released."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..proposers.base import DraftBatch, TargetFeedback
from ..verify.verifier import prompt_logprobs, verify_batch
from .sequence import Sequence


@dataclass
class PromptChunk:
    """The next tokens of a prompt being prefilled in chunks: its prompt[start:end]."""

    task: ChunkedPrefill
    start: int
    end: int

    @property
    def tokens(self) -> list[int]:
        return self.task.seq.context_ids[self.start : self.end]


@dataclass
class ChunkedPrefill:
    """A sequence whose prompt is prefilled a chunk a step beside the decoding batch."""

    seq: Sequence
    cached: int  # prompt tokens its slot kept from an earlier request (the chunks continue after its length)
    hidden: list[torch.Tensor] = field(default_factory=list)  # the prompt rows' hidden states, for proposers


class Prefilling:
    """Engine's prefill steps (a part of Engine, apart for its length: it reads the engine's queues, runner and
    proposers)."""

    def _admit(self) -> list[Sequence]:
        """Prefill the waiting groups that fit, in arrival order (a preempted sequence first); the sequences
        admitted."""
        admitted: list[Sequence] = []
        while self.waiting:
            group = self._next_group()
            cached = self._take_slots(group)
            if cached is None:
                break  # the group waits for slots or KV blocks
            for seq in group:
                self.waiting.remove(seq)
            if self._in_chunks(group):
                self.prefilling.append(ChunkedPrefill(group[0], cached))
                continue
            self.running += group
            self._prefill(group, cached)
            admitted += group
        return admitted

    def abort(self, seq: Sequence) -> None:
        """The sequence stops where it is, whatever stage it is in, and gives back what it holds."""
        seq.finish_reason = seq.finish_reason or "abort"  # before its proposers let go: an aborted output is not kept
        prefilling = next((p for p in self.prefilling if p.seq is seq), None)
        if seq in self.waiting:
            self.waiting.remove(seq)
            self.policy.forget(seq.request_id)  # a preempted sequence's estimates (its proposers' went at suspend)
            self.totals.merge(seq.metrics.spec)  # a preempted sequence's steps so far
        elif seq in self.running:
            self._release(seq)
            self.running.remove(seq)
        elif prefilling is not None:
            self._release(seq)
            self.prefilling.remove(prefilling)

    def _release(self, seq: Sequence) -> None:
        seq.metrics.finish_time = seq.metrics.finish_time or time.perf_counter()
        seq.feedback = None  # its hidden rows view a whole step's batch, which a caller holding seq would keep
        self.runner.free(seq.slot)
        self.policy.forget(seq.request_id)
        for proposer in self.proposers:
            proposer.release(seq)
        self.totals.merge(seq.metrics.spec)

    def _next_group(self) -> list[Sequence]:
        """The first waiting sequence with its siblings still waiting (the samples of one prompt share its prefill);
        a preempted sequence comes back alone, since its output is its own."""
        first = self.waiting[0]
        if first.resuming:
            return [first]
        return [s for s in first.siblings if s in self.waiting and not s.resuming]

    def _make_room(self) -> int:
        """Preempt the newest sequences while the pools cannot hold the next step of all; how many. The oldest
        always runs: a request that could not fit alone was refused."""
        preempted = 0
        while True:
            active = self._active()
            if len(active) < 2 or self.blocks.fits(active, lookahead=0):
                return preempted
            self._preempt(max(active, key=lambda s: (s.arrival, s.index)))
            preempted += 1

    def _active(self) -> list[Sequence]:
        """The sequences admitted and not finished: decoding, or their prompts prefilled in chunks."""
        return [*(s for s in self.running if not s.finished), *(p.seq for p in self.prefilling)]

    def _preempt(self, seq: Sequence) -> None:
        """seq gives back every block it holds and waits at the front of the queue; it resumes by recomputing its
        tokens (from what the prefix cache still holds), its output so far kept (docs/decisions.md#preemption)."""
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.prefilling = [p for p in self.prefilling if p.seq is not seq]
        self._drop_ahead([seq])  # the row queued for it is its no more: it resumes in another slot
        self.runner.free(seq.slot)
        for proposer in self.proposers:
            proposer.suspend(seq)
        seq.slot, seq.feedback = -1, None
        seq.metrics.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _take_slots(self, group: list[Sequence]) -> int | None:
        """Slots for the group, started from the blocks they find computed, if every KV pool then holds it beside
        the sequences admitted before: the prompt tokens its prefill skips (None: nothing taken, it waits)."""
        first, before = group[0], self._active()
        found = self.runner.cached_prefix(self._reusable_prompt(first) or [], first.tenant)
        if self.runner.num_free < len(group) or not self.blocks.may_fit(before, group, found):
            return None
        for seq in group:
            seq.slot = self.runner.allocate(self._reusable_prompt(seq), seq.tenant)
        cached = [self._kept_prefix(seq) for seq in group][0]  # the others keep nothing: they copy the first's
        if self.blocks.fits(before + group):
            return cached
        for seq in group:  # it waits on, as a preempted sequence does: nothing of its output is kept as finished
            for proposer in self.proposers:
                proposer.suspend(seq)
            self.runner.free(seq.slot)
            seq.slot = -1
        return None

    def _in_chunks(self, group: list[Sequence]) -> bool:
        """Whether this group's prompt is prefilled in chunks beside decoding sequences: a long prompt of one
        sequence (n > 1 samples share one prefill; prompt logprobs need every row's logits at once)."""
        seq = group[0]
        return bool(
            self.prefill_chunk
            and self._busy()
            and len(group) == 1
            and (seq.params.prompt_logprobs is None or seq.resuming)
            and len(seq.context_ids) > self.prefill_chunk
        )

    def _decoding(self) -> bool:
        return any(not s.finished for s in self.running)

    def _busy(self) -> bool:
        """Whether sequences decode or a prompt is being prefilled in chunks."""
        return bool(self.prefilling) or self._decoding()

    def _next_chunk(self) -> PromptChunk:
        """The next chunk of the oldest prompt being prefilled (the rest of it, where nothing else decodes any
        more)."""
        task = self.prefilling[0]
        done, prompt = self.runner.length(task.seq.slot), task.seq.context_ids
        alone = not self._decoding() and len(self.prefilling) == 1
        return PromptChunk(task, done, len(prompt) if alone else min(len(prompt), done + self.prefill_chunk))

    def _prefill_chunk(self) -> None:
        """The next chunk in a forward of its own."""
        chunk = self._next_chunk()
        logits, hidden = self._target_forward([chunk.task.seq.slot], [chunk.tokens], "last", every_row=True)
        self._chunk_done(chunk, logits, hidden)

    def _verify_forward(
        self, seqs: list[Sequence], drafts: DraftBatch, chunk: PromptChunk | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, tuple | None]:
        """The verify's logits of every row (and hidden states where a proposer reads them), a prompt's chunk
        riding in the same call where one is given: the weights are read once for both, and each row's result
        is its own (docs/decisions.md#chunked-prefill-beside-decoding). Third: the chunk's outputs. Drafts left on
        the device are read there where the verification allows (engine/overlap.py), else read here first."""
        if chunk is None and self._verifies_on_device(seqs, drafts):
            return *self._verify_drafts_on_device(seqs, drafts), None
        drafts.read()
        inputs = [[seq.token_ids[-1]] + d for seq, d in zip(seqs, drafts.tokens)]
        slots = [s.slot for s in seqs]
        if chunk is None:
            return *self._target_forward(slots, inputs, logits="all"), None
        rows = sum(map(len, inputs))
        logits, hidden = self._target_forward(
            [*slots, chunk.task.seq.slot], [*inputs, chunk.tokens], [*map(len, inputs), 1], every_row=True
        )
        if hidden is None:
            return logits[:rows], None, (logits[rows:], None)
        return logits[:rows], hidden[:rows], (logits[rows:], hidden[rows:])

    def _chunk_done(self, chunk: PromptChunk, logits: torch.Tensor, hidden: torch.Tensor | None) -> None:
        """A chunk was computed: once its prompt is done, the first token is sampled (a resuming sequence has its
        next one) and the sequence decodes from the next step."""
        task, seq = chunk.task, chunk.task.seq
        self.runner.commit(seq.slot, chunk.end)
        if hidden is not None:
            task.hidden.append(hidden)
        if chunk.end < len(seq.context_ids):
            return
        self.prefilling.remove(task)
        self.running.append(seq)
        self._finish_prefill([seq], logits, torch.cat(task.hidden) if task.hidden else None, task.cached)

    def _reusable_prompt(self, seq: Sequence) -> list[int] | None:
        """The prompt, where it may start from a kept prefix: not for a group's later sequences (they copy
        the first's), prompt logprobs (every row's logits), or the first of a group whose proposers read
        the target's features (each sequence's reader needs the rows the shared prefill computes)."""
        if seq.resuming:  # alone, and its prompt was scored before
            return seq.context_ids
        shared = self.wants_hidden_states and len(seq.siblings) > 1
        return None if seq.index or seq.params.prompt_logprobs is not None or shared else seq.prompt_ids

    def _kept_prefix(self, seq: Sequence) -> int:
        """Prompt tokens the prefill skips: those its slot kept, as far as every proposer holds its own state."""
        kept = self.runner.length(seq.slot)
        for proposer in self.proposers:
            kept = min(kept, proposer.keep_prefix(seq, kept))
        self.runner.rollback(seq.slot, kept)
        return kept

    def _prefill(self, group: list[Sequence], cached: int) -> None:
        """One forward over the shared prompt past the `cached` tokens its slot holds; the others get a copy of
        its KV."""
        first = group[0]
        top = None if first.resuming else first.params.prompt_logprobs
        logits, hidden = self._target_forward(
            [first.slot], [first.context_ids[cached:]], "last" if top is None else "all", every_row=True
        )
        if top is not None:  # every prompt row's logits came back: score the prompt, keep the last row
            scored = prompt_logprobs(first.prompt_ids, logits, top)
            for seq in group:
                seq.prompt_logprobs = scored
            logits = logits[-1:]
        self.runner.commit(first.slot, len(first.context_ids))
        self._finish_prefill(group, logits, hidden, cached)

    def _finish_prefill(
        self, group: list[Sequence], logits: torch.Tensor, hidden: torch.Tensor | None, cached: int
    ) -> None:
        """The prompt is in the first sequence's slot, `cached` of its tokens kept from before: the others copy
        it, and each samples its first token from the last row's logits (a resuming sequence samples nothing)."""
        first = group[0]
        if first.resuming:  # its last token is known: the next step reads it, as after any step
            self._feed_back(first, TargetFeedback([first.token_ids[-1]], hidden, cached))
            self._read_ahead(group)
            return
        first.metrics.num_cached_prompt_tokens = cached
        for seq in group[1:]:
            self.runner.copy_slot(first.slot, seq.slot)
        firsts = self._first_tokens(group, logits[:1])
        for seq, (token, _) in zip(group, firsts):
            self._feed_back(seq, TargetFeedback([token], hidden, cached))
        self._read_ahead(group)
        for seq, (token, logprobs) in zip(group, firsts):
            self._emit(seq, [token], logprobs)

    def _first_tokens(self, group: list[Sequence], last: torch.Tensor) -> list[tuple[int, list | None]]:
        """Each sibling's token after the prompt, from the prompt's last logits row [1, V], and its logprobs: a
        verification without drafts (one pass for all siblings where verification takes one)."""
        rows = last.expand(len(group), -1)
        results = verify_batch(group, [[] for _ in group], [None] * len(group), rows, self.tokenizer.eos_token_ids)
        return [(result.tokens[0][0], logprobs) for result, logprobs in results]

    def _read_ahead(self, group: list[Sequence]) -> None:
        """Proposers read the new prompt now, where drafting is likely soon: its cost is then part of the time
        to the first token, not a pause after it."""
        reading = [seq for seq in group if seq.params.max_tokens > 1]
        if reading and self.policy.expects_drafting(self.num_running):
            for proposer in self.proposers:
                proposer.read_ahead(reading)
