"""What one engine step reports."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..metrics import SpecCounters
from .sequence import Sequence


@dataclass
class StepOutput:
    """What one engine step did: the sequences it gave tokens to (prefilled or decoded), those it finished,
    and the decoding step's speculation counters (empty when the step only admitted)."""

    updated: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)
    counters: SpecCounters = field(default_factory=SpecCounters)  # summed over the decoding batch
    draft_lengths: list[int] = field(default_factory=list)  # tokens drafted per decoding sequence
    lookup_drafts: int = 0  # of those sequences, how many drafted by prompt lookup
    draft_cache_bytes: int = 0  # what the lookup proposer keeps across requests (suffix speculation's cache)

    @property
    def batch_size(self) -> int:
        """Sequences in the decoding step."""
        return len(self.draft_lengths)
