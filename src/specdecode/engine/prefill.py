"""The engine's admission half: requests admitted while their slots and KV blocks fit, the prompts admitted in a
step prefilled together (or, for a long prompt arriving while others decode, a chunk a step beside them:
chunked_prefill.py); the newest sequences preempted while the KV cache cannot hold the next step of all; finished
and aborted ones released."""

from __future__ import annotations

import time

import torch

from ..proposers.base import TargetFeedback
from ..verify.verifier import prompt_logprobs, verify_batch
from .chunked_prefill import ChunkedPrefill
from .sequence import Sequence


class Prefilling:
    """Engine's prefill steps (a part of Engine, apart for its length: it reads the engine's queues, runner and
    proposers)."""

    def _admit(self) -> list[Sequence]:
        """Prefill the waiting groups that fit, in arrival order (a preempted sequence first), their prompts
        together (the weights read once for all); the sequences admitted."""
        admitted: list[Sequence] = []
        together: list[tuple[list[Sequence], int]] = []  # (group, its cached tokens) prefilled in one forward
        blocks: set[tuple[int, ...]] = set()  # their prompts' first blocks
        while self.waiting:
            group = self._next_group()
            first_block = self._first_block(self._reusable_prompt(group[0]))
            if first_block is not None and first_block in blocks:  # those are computed first, for it to find
                self._prefill_together(together)
                together, blocks = [], set()
            cached = self._take_slots(group)
            if cached is None:
                break  # the group waits for slots or KV blocks
            for seq in group:
                self.waiting.remove(seq)
            if self._in_chunks(group):
                self.prefilling.append(ChunkedPrefill(group[0], cached))
                continue
            self.running += group
            admitted += group
            if group[0].params.prompt_logprobs is None or group[0].resuming:
                together.append((group, cached))
                blocks.add(self._first_block(group[0].context_ids))  # None among them finds nothing
            else:  # every row's logits
                self._prefill(group, cached)
        self._prefill_together(together)
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
        found = self.runner.cached_prefix(self._reusable_prompt(first) or [], first.tenant, first.adapter)
        if self.runner.num_free < len(group) or not self.blocks.may_fit(before, group, found):
            return None
        for seq in group:
            seq.slot = self.runner.allocate(self._reusable_prompt(seq), seq.tenant, seq.adapter)
            seq.adapter_set = self.runner.adapter_set(seq.slot)
        cached = [self._kept_prefix(seq) for seq in group][0]  # the others keep nothing: they copy the first's
        if self.blocks.fits(before + group):
            return cached
        for seq in group:  # it waits on, as a preempted sequence does: nothing of its output is kept as finished
            for proposer in self.proposers:
                proposer.suspend(seq)
            self.runner.free(seq.slot)
            seq.slot = -1
        return None

    def _decoding(self) -> bool:
        return any(not s.finished for s in self.running)

    def _busy(self) -> bool:
        """Whether sequences decode or a prompt is being prefilled in chunks."""
        return bool(self.prefilling) or self._decoding()

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

    def _first_block(self, prompt: list[int] | None) -> tuple[int, ...] | None:
        """The tokens of the prompt's first KV block, where a later prompt could find it computed (prefix caching; a
        prompt that starts with them may find the rest of what they share: a system prompt). Whether its tenant may
        is the prefix index's to say."""
        size = self.runner.block_size
        return tuple(prompt[:size]) if self.runner.reuse_prefixes and prompt and len(prompt) > size else None

    def _prefill_together(self, together: list[tuple[list[Sequence], int]]) -> None:
        """Each group's shared prompt past the `cached` tokens its first slot holds, in as few forwards as the
        runner packs them; the others of a group get a copy of its KV."""
        if not together:
            return
        inputs = [group[0].context_ids[cached:] for group, cached in together]
        logits, hidden = self._target_forward([group[0].slot for group, _ in together], inputs, "last", every_row=True)
        rows = [None] * len(inputs) if hidden is None else hidden.split([len(tokens) for tokens in inputs])
        for group, _ in together:
            self.runner.commit(group[0].slot, len(group[0].context_ids))
        self._finish_prefill([(g, logits[i : i + 1], rows[i], cached) for i, (g, cached) in enumerate(together)])

    def _prefill(self, group: list[Sequence], cached: int) -> None:
        """A prompt whose every row's logits are scored (prompt logprobs), in a forward of its own."""
        first = group[0]
        logits, hidden = self._target_forward([first.slot], [first.context_ids[cached:]], "all", every_row=True)
        scored = prompt_logprobs(first.prompt_ids, logits, first.params.prompt_logprobs)
        for seq in group:
            seq.prompt_logprobs = scored
        self.runner.commit(first.slot, len(first.context_ids))
        self._finish_prefill([(group, logits[-1:], hidden, cached)])

    def _finish_prefill(self, prefilled: list[tuple[list[Sequence], torch.Tensor, torch.Tensor | None, int]]) -> None:
        """Prompts are in their groups' first slots (each group with its prompt's last logits row, its rows' hidden
        states and the tokens it kept from before): the other sequences of a group copy it, each sequence samples its
        first token (a resuming one has its next: the next step reads it, as after any step), proposers read the
        prompts, and the tokens go out."""
        sampling, rows = [], []  # (sequence, its prompt's hidden states, cached tokens); the logits row of each
        for group, logits, hidden, cached in prefilled:
            if group[0].resuming:
                self._feed_back(group[0], TargetFeedback([group[0].token_ids[-1]], hidden, cached))
                continue
            group[0].metrics.num_cached_prompt_tokens = cached
            for seq in group[1:]:
                self.runner.copy_slot(group[0].slot, seq.slot)
            sampling += [(seq, hidden, cached) for seq in group]
            rows.append(logits[:1].expand(len(group), -1))
        firsts = self._first_tokens([seq for seq, _, _ in sampling], rows)
        for (seq, hidden, cached), (token, _) in zip(sampling, firsts):
            self._feed_back(seq, TargetFeedback([token], hidden, cached))
        self._read_ahead([seq for group, *_ in prefilled for seq in group])
        for (seq, _, _), (token, logprobs) in zip(sampling, firsts):
            self._emit(seq, [token], logprobs)

    def _first_tokens(self, seqs: list[Sequence], rows: list[torch.Tensor]) -> list[tuple[int, list | None]]:
        """Each sequence's token after its prompt, from its prompt's last logits row (`rows`: [sequences, V] per
        group, in order), and its logprobs: a verification without drafts (one pass for all where verification takes
        one: a GPU waits once)."""
        if not seqs:
            return []
        eos = self.tokenizer.eos_token_ids
        results = verify_batch(seqs, [[] for _ in seqs], [None] * len(seqs), torch.cat(rows), eos)
        return [(result.tokens[0][0], logprobs) for result, logprobs in results]

    def _read_ahead(self, seqs: list[Sequence]) -> None:
        """Proposers read the new prompts now, where drafting is likely soon: their cost is then part of the time
        to the first token, not a pause after it."""
        reading = [seq for seq in seqs if seq.params.max_tokens > 1]
        if reading and self.policy.expects_drafting(self.num_running):
            for proposer in self.proposers:
                proposer.read_ahead(reading)
