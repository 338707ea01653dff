"""The engine's prompts prefilled a chunk a step: a long prompt arriving while others decode, so that their streams
do not wait for its whole prefill; the chunk rides in the verify's call where the runner packs any width."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..proposers.base import DraftBatch
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


class ChunkedPrefilling:
    """Engine's chunked prefill (a part of Engine, apart for its length: it reads the engine's queues, runner and
    proposers)."""

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
        self._finish_prefill([([seq], logits, torch.cat(task.hidden) if task.hidden else None, task.cached)])
