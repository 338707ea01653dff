"""One request's state as it moves through the engine."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from ..metrics import RequestMetrics
from ..proposers.base import TargetFeedback
from ..sampling import SamplingParams

_ids = itertools.count()


@dataclass
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    output_ids: list[int] = field(default_factory=list)
    slot: int = -1  # target KV-cache slot
    feedback: TargetFeedback | None = None  # what the target emitted for it in the last step, for proposers
    finish_reason: str | None = None  # "stop" (EOS or stop string) or "length"
    text: str = ""
    metrics: RequestMetrics = field(default_factory=RequestMetrics)

    @property
    def token_ids(self) -> list[int]:
        """Prompt + output: the whole text so far."""
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining_tokens(self) -> int:
        return self.params.max_tokens - len(self.output_ids)
