"""A plain step queued on the device ahead of the host (engine/overlap.py): what it was queued for, the tokens it
picks there (and their logprobs, where asked), and their copy to the host, which waits for that step alone."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..proposers.base import DraftBatch, QueuedDrafts
from ..sampling import probs_of_rows, sample_rows
from ..sampling.logprobs import TokenLogprob, logprob_table, logprobs_of_table, top_width
from ..timing import Mark, Span
from ..transfers import copied_to_host, to_device
from .sequence import Sequence


@dataclass
class StepAhead:
    """A plain step queued on the device: its sequences, each as it stood (slot, preemptions, tokens), the tokens it
    picks ([n], on the device, in the sequences' order), where a proposer reads them its rows' hidden states, and
    where a sequence asks for logprobs every row's logprob table."""

    seqs: list[Sequence]
    stood: list[tuple[int, int, int]]
    picked: torch.Tensor
    hidden: torch.Tensor | None
    table: torch.Tensor | None
    streams: list  # each seeded sampled sequence's stream as it was before this step drew its token (else None)
    after: float = 0.0  # the host's time when it had read the step before (this step's time runs from there)

    @classmethod
    def queued(cls, seqs: list[Sequence], logits: torch.Tensor, hidden: torch.Tensor | None) -> StepAhead:
        streams = [s.generator.get_state() if not s.params.greedy and s.generator else None for s in seqs]
        tokens, table = picks_of(seqs, logits)
        return cls(seqs, [standing(s, 1) for s in seqs], tokens, hidden, table, streams)

    def undraw(self, seqs: list[Sequence] | None = None) -> None:
        """The draws this step made for these sequences (default: all) given back to their streams: they will not
        take it (preempted, or drafting instead), and a seeded stream goes on as if it had never been queued."""
        chosen = None if seqs is None else {id(s) for s in seqs}
        for i, (seq, stream) in enumerate(zip(self.seqs, self.streams)):
            if stream is not None and (chosen is None or id(seq) in chosen):
                seq.generator.set_state(stream)
                self.streams[i] = None  # given back once: the stream may have drawn again since

    def rows(self, seqs: list[Sequence]) -> list[int | None]:
        """Each sequence's row, None where this step was not queued for it as it stands now (admitted or resumed
        since: preempted, it was recomputed into a new slot)."""
        row_of = {id(s): i for i, s in enumerate(self.seqs)}
        rows = [row_of.get(id(s)) for s in seqs]
        return [r if r is not None and self.stood[r] == standing(s) else None for s, r in zip(seqs, rows)]


class VerifyAhead(NamedTuple):
    """The next step's verify, queued behind its drafting: its logits and hidden states (every row), each sequence's
    rows (its bonus token and its drafts), the span it runs in, and where the step's work began on the device (its
    drafting). The runner keeps the blocks it writes until its rows are taken (`ModelRunner.queued_end`)."""

    logits: torch.Tensor
    hidden: torch.Tensor | None
    width: int
    span: Span
    since: Mark


class DraftsAhead(NamedTuple):
    """The next step's drafting, queued behind a verify (engine/overlap.py): the sequences, each as it stood
    (`standing`), the drafter's queued drafts (None where it queued none), the verify's read queued before them, and
    where an imposed acceptance keeps drafts, how many it kept of each sequence's; `verified`: a mark when the
    verify's work was queued, before the drafting (the step's own work ends there); `verify`: the next step's verify,
    where it was queued too."""

    seqs: list[Sequence]
    stood: list[tuple[int, int, int]]
    queued: QueuedDrafts | None
    read: Callable[[], list[list[float]]]
    kept: list[int] | None
    verified: Mark
    verify: VerifyAhead | None = None


class Picked(NamedTuple):
    """A plain step's sequences, their tokens on the device (and hidden states, and the logprob table where asked),
    whether they are all the sequences it was asked for, and the host's time its forward's time runs from."""

    seqs: list[Sequence]
    tokens: torch.Tensor
    hidden: torch.Tensor | None
    table: torch.Tensor | None
    everyone: bool
    since: float

    def copied_to_host(self):
        """A copy of the tokens (and logprob table) queued now, and a function that waits for it and gives each
        sequence's token and its logprobs (None unless asked): on a GPU, waiting for this copy alone."""
        if self.table is None:
            read = copied_to_host(self.tokens)
            return lambda: [(int(token), None) for token in read()]
        read = copied_to_host(torch.cat([self.tokens.double()[:, None], self.table], 1))
        widest = (self.table.shape[1] - 1) // 2
        return lambda: [_with_logprobs(seq, row, widest) for seq, row in zip(self.seqs, read())]


def _with_logprobs(seq: Sequence, row: list[float], widest: int) -> tuple[int, list[TokenLogprob] | None]:
    token = int(row[0])
    if seq.params.logprobs is None:
        return token, None
    return token, logprobs_of_table([row[1:]], [token], seq.params.logprobs, widest)


def standing(seq: Sequence, emitted: int = 0) -> tuple[int, int, int]:
    """Where a sequence stands: its slot, its preemptions, and its tokens once `emitted` more are out."""
    return seq.slot, seq.metrics.num_preemptions, seq.num_tokens + emitted


def picks_of(seqs: list[Sequence], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each sequence's token from its row of `logits` (tokens_of), and where any sequence asks for logprobs, every
    row's logprob table (the token's logprob and the most likely ones': sampling/logprobs.py), both on the device."""
    tokens = tokens_of(seqs, logits)
    asking = [s.params.logprobs for s in seqs if s.params.logprobs is not None]
    if not asking:
        return tokens, None
    return tokens, logprob_table(logits, list(range(len(seqs))), tokens, top_width(asking, logits.shape[-1]))


def tokens_of(seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
    """Each sequence's token from its row of `logits`, on the device: the argmax where greedy, else a draw from its
    own stream, the one its verification would make (a plain step's token is its bonus token); the sampled rows'
    distributions a call per sampling setting, their draws together."""
    sampled = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
    if not sampled:
        return logits.argmax(-1)
    every = len(sampled) == len(seqs)
    at = None if every else to_device(sampled, logits.device)
    probs = probs_of_rows(logits if every else logits[at], [seqs[i].params for i in sampled])
    drawn = sample_rows(probs, [seqs[i].generator for i in sampled])
    if every:
        return drawn
    tokens = logits.argmax(-1)
    tokens[at] = drawn
    return tokens


def rows_of(tensors, rows: list[int]):
    """The given rows of each tensor (None stays None)."""
    return tuple(None if t is None else t[to_device(rows, t.device)] for t in tensors)


def with_hidden(out) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A forward's logits and hidden states (None where it was not asked for them)."""
    return out if isinstance(out, tuple) else (out, None)


def verify_widths(drafts: DraftBatch) -> list[int]:
    """Each sequence's rows in a verify that reads drafts left on the device: its last token and every draft."""
    widths = [1] * len(drafts.tokens)
    for i, count in zip(drafts.on_device.rows, drafts.on_device.counts):
        widths[i] += count
    return widths
