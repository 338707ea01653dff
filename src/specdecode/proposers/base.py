"""The proposer interface: guess up to k next tokens for each sequence of a batch.

A proposer is built by its registry entry (see registry.py), then told how many sequences it must serve
(`reserve`), and called once per decoding step with what the target emitted in the step before."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..timing import Span
from ..transfers import read_at_once

if TYPE_CHECKING:
    from ..engine.sequence import Sequence
    from ..executor.runner import ModelRunner
    from ..models.loader import LoadedModel
    from ..models.runtime import Transformer


@dataclass
class DraftsOnDevice:
    """Drafts that a drafter's chained rounds left on the device, not read yet: sequences `rows` of the batch
    drafted `counts[j]` each, `tokens` their target ids and `probs` the drafter's probability of each ([len(rows),
    max(counts)], row j's first counts[j] its own). `settle`, called with them once read (as lists), does the
    drafter's bookkeeping and gives the drafts it stands by: each row's cut after its first under the confidence
    threshold (a cut that depends on the drafts alone, so verifying the rows past it changes nothing)."""

    rows: list[int]
    counts: list[int]
    tokens: torch.Tensor
    probs: torch.Tensor
    settle: Callable[[list[list[int]], list[list[float]]], list[list[int]]]
    q: torch.Tensor | None = None  # each draft's distribution [len(rows), max(counts), V], where some row samples
    sampled: list[bool] | None = None  # the rows whose drafts were drawn from q (the others are greedy: one-hot)

    def values(self) -> list[torch.Tensor]:
        """Tokens and probabilities, to copy to the host in one copy (transfers.read_at_once, with whatever else is
        copied then)."""
        return [self.tokens, self.probs]

    def read_from(self, tokens: list[float], probs: list[float]) -> list[list[int]]:
        """The drafts stood by, from `values()` as read on the host (each flat)."""
        width = self.tokens.shape[1]
        rows = [tokens[at : at + width] for at in range(0, len(tokens), width)]
        chances = [probs[at : at + width] for at in range(0, len(probs), width)]
        return self.settle(
            [[int(t) for t in r[:c]] for r, c in zip(rows, self.counts)], [p[:c] for p, c in zip(chances, self.counts)]
        )


@dataclass
class DraftBatch:
    tokens: list[list[int]]  # ragged: up to k_i tokens per sequence (0 allowed)
    # Per sequence, the distribution each token was sampled from [n_i, V], or None when the proposer is
    # deterministic (n-gram, greedy drafting): the rejection sampler then treats q as one-hot.
    probs: list[torch.Tensor | None]
    # The drafting rounds (forwards of the drafter) the call ran, timed: each span and how many rounds it timed (a
    # round alone, or a chain of them), the first with whatever it read first; empty where no model runs. The
    # policy's cost model learns a round's cost from them.
    round_spans: list[tuple[Span, int]] = field(default_factory=list)
    # Drafts still on the device (their sequences' `tokens` are empty until read): the verify may read them there
    on_device: DraftsOnDevice | None = None

    @classmethod
    def empty(cls, n: int) -> "DraftBatch":
        return cls([[] for _ in range(n)], [None] * n)

    @property
    def num_tokens(self) -> list[int]:
        return [len(t) for t in self.tokens]

    def round_seconds(self) -> list[float]:
        """Each drafting round's seconds (on a GPU, to be read once the step's results are: it waits for them)."""
        return [span.seconds / rounds for span, rounds in self.round_spans for _ in range(rounds)]

    def read(self) -> None:
        """Drafts left on the device copied to the host (waiting for the drafter) and settled."""
        if self.on_device is not None:
            self.settle(*read_at_once(self.on_device.values()))

    def settle(self, tokens: list[float], probs: list[float]) -> None:
        """The drafts left on the device, from their values as read on the host (DraftsOnDevice.values)."""
        pending, self.on_device = self.on_device, None
        for row, (i, drafts) in enumerate(zip(pending.rows, pending.read_from(tokens, probs))):
            self.tokens[i] = drafts
            if pending.sampled and pending.sampled[row]:
                self.probs[i] = pending.q[row, : len(drafts)]


@dataclass
class QueuedDrafts:
    """Drafting for the next step queued on the device behind a verify, before the host read it
    (Proposer.queue_drafts): for sequence i, from `starts[i]` (its last token's position), ks[i] drafts, left on the
    device as a chain leaves them (`tokens`, `probs`: [n, max(ks)]), drafted on the drafts of that verify each
    sequence kept as the device counted them (verify/on_device.py); `kept`: those counts once the host has verified
    them itself and found the same."""

    starts: list[int]
    ks: list[int]
    tokens: torch.Tensor
    probs: torch.Tensor
    round_spans: list[tuple[Span, int]]
    kept: list[int] | None = None


@dataclass
class TargetFeedback:
    """What the target produced for one sequence in the step before: the tokens it emitted (accepted
    drafts, then the recovered or bonus token; after prefill, the first token) and, for proposers that
    ask for them, the target's final hidden states (before the last norm), one row per position from
    position `start` on: what a draft head trained on the target's features reads. The last
    len(tokens) rows are those whose logits chose the tokens; after prefill the rows before them are
    the prompt's (row p read token p and predicted token p + 1)."""

    tokens: list[int]
    hidden: torch.Tensor | None = None
    start: int = 0


@dataclass
class Preview:
    """Drafts a proposer knows before the step at no forward cost (a prompt-lookup match): the policy
    weighs them against the draft model per sequence. `match`: the length of the context match behind
    them, which predicts how often they are right; `probs`: where the proposer has one, its estimate per
    token that it follows given the ones before it did (what the policy assumes until it has measured)."""

    match: int
    tokens: list[int]
    probs: list[float] | None = None


class Proposer:
    """Defaults for a proposer that holds no per-sequence state; subclasses implement propose()."""

    model: Transformer | None = None  # the weights it runs, if any: the memory plan and cost profile size them
    loaded: LoadedModel | None = None  # the same as loaded by name (its name and load time, for the start-up summary)
    wants_hidden_states = False  # the engine then passes the target's hidden states in TargetFeedback
    previews = False  # it implements preview(): drafts known before the step, free of forward cost
    max_draft: int | None = None  # a previewing proposer's own cap on a draft's length (None: the engine's k)
    cache_bytes = 0  # memory held across requests (suffix speculation's cache of earlier outputs)
    host_bytes_per_token = 0  # host memory held for each token of a running sequence (an index of its text)
    confidence_threshold = 0.0  # a drafter's confidence stop: it stands by its drafts up to the first under this

    def graphs_captured(self) -> int:
        """How many graphs its model's forwards have captured so far."""
        return 0

    def read_ahead(self, seqs: list[Sequence]) -> None:
        """Read now what the next drafting round would first have to catch up on, but its last position (the
        round drafts from there): called as a prompt is prefilled, so that its one-off cost falls before the
        first token rather than between the first and the second (a no-op for proposers without a model)."""

    def reserve(
        self, num_slots: int, max_model_len: int, reuse_prefixes: bool = False, num_blocks: int | None = None
    ) -> None:
        """Size per-sequence state for at most `num_slots` sequences of `max_model_len` tokens (KV caches: pools of
        num_blocks blocks, as the target's); with reuse_prefixes, a sequence may start from what a finished one of
        its tenant had computed."""

    def forget_prefixes(self) -> None:
        """Nothing computed for finished sequences is reused from now on."""

    def keep_prefix(self, seq: Sequence, kept: int) -> int:
        """seq's prompt starts with `kept` tokens that its slot in the target's cache kept from a finished
        sequence (prefix caching): of these, how many the target may skip in its prefill. The target's
        hidden states come from there on, so a proposer that reads them gets the whole prompt's unless it
        holds its own state for the rest."""
        return 0 if self.wants_hidden_states else kept

    def propose(self, seqs: list[Sequence], ks: list[int], feedback: list[TargetFeedback | None]) -> DraftBatch:
        """Up to ks[i] tokens for seqs[i]; feedback[i] is what the target emitted for it last step."""
        raise NotImplementedError

    def queue_drafts(self, seqs: list[Sequence], ks: list[int], verified, hidden: torch.Tensor) -> QueuedDrafts | None:
        """Drafts for the step after a verify that is queued and not read yet, queued on the device behind it: for
        sequence i, ks[i] drafts after the tokens `verified` (verify/on_device.VerifiedOnDevice) says that verify
        chose, reading its `hidden` states where a proposer reads them. None where this proposer does not queue."""
        return None

    def take_queued(self, queued: QueuedDrafts, seqs: list[Sequence], ks: list[int]) -> DraftBatch:
        """The first ks[i] (<= queued.ks[i]) of the queued drafts of each of these sequences (those queued for), now
        that the host knows what the verify kept (queued.kept) and has given it to them: the proposer's state as if
        it had drafted them now."""
        raise NotImplementedError

    def drop_queued(self, queued: QueuedDrafts, seqs: list[Sequence]) -> None:
        """The queued drafts go unused (the next step drafts otherwise): the proposer's state as if they had never
        been queued, for those of these sequences it still serves."""

    def preview(self, seqs: list[Sequence], k: int) -> list[Preview]:
        raise NotImplementedError(f"{type(self).__name__} does not preview drafts")

    def observe(self, seq: Sequence, feedback: TargetFeedback) -> None:
        """Called with every target output for the sequence, also in steps where it was not asked to
        draft (a proposer that reads hidden states keeps them here)."""

    def unseen_tokens(self, seq: Sequence) -> int:
        """Tokens of the sequence the proposer must read before it can draft for it."""
        return 0

    def commit(self, seq: Sequence, num_valid_tokens: int) -> None:
        """The first `num_valid_tokens` of seq.token_ids are final; forget anything drafted past them."""

    def kv_pool(self) -> ModelRunner | None:
        """The runner whose KV blocks the proposer's sequences hold, for admission to count (None: it holds none)."""
        return None

    def kv_slot(self, seq: Sequence) -> int | None:
        """seq's slot in kv_pool(), once it has one."""
        return None

    def suspend(self, seq: Sequence) -> None:
        """The sequence is preempted: free what the proposer holds for it; it comes back later with its tokens so far,
        as a prompt does (its prefill feeds the target's rows again)."""
        self.release(seq)

    def release(self, seq: Sequence) -> None:
        """The sequence finished; free what the proposer holds for it."""
