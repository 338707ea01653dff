"""What one engine step reports."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..metrics import SpecCounters
from ..sampling import TokenLogprob
from .sequence import Sequence


@dataclass(frozen=True)
class SequenceUpdate:
    """What one step gave one sequence: its new output tokens (a prefill's first, a decoding step's accepted
    drafts and the token after them, as far as EOS, a stop string or max_tokens kept them), their logprobs
    where the request asked for them, and its finish reason once it has finished."""

    seq: Sequence
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None

    @classmethod
    def since(cls, seq: Sequence, start: int) -> "SequenceUpdate":
        """seq's output tokens from index `start` on."""
        logprobs = seq.logprobs[start:] if seq.logprobs is not None else None
        new = seq.token_ids[seq.num_prompt_tokens + start :]  # a slice of the new tokens, not a copy of all output
        return cls(seq, new, logprobs, seq.finish_reason)


@dataclass
class StepOutput:
    """What one engine step did: per sequence it gave tokens to (prefilled or decoded), what it gave; the
    sequences it finished; and the decoding step's speculation counters (empty when the step only admitted)."""

    outputs: list[SequenceUpdate] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)
    counters: SpecCounters = field(default_factory=SpecCounters)  # summed over the decoding batch
    draft_lengths: list[int] = field(default_factory=list)  # tokens drafted per decoding sequence
    lookup_drafts: int = 0  # of those sequences, how many drafted by prompt lookup
    draft_cache_bytes: int = 0  # what the lookup proposer keeps across requests (suffix speculation's cache)
    preempted: int = 0  # sequences that gave their KV blocks back, to be recomputed (the cache was full)

    @property
    def updated(self) -> list[Sequence]:
        """The sequences the step gave tokens to, in the order it first did."""
        return [update.seq for update in self.outputs]

    @property
    def batch_size(self) -> int:
        """Sequences in the decoding step."""
        return len(self.draft_lengths)
