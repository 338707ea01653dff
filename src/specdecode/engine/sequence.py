"""One request's state as it moves through the engine."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from ..errors import SpecDecodeError
from ..metrics import RequestMetrics
from ..proposers.base import TargetFeedback
from ..sampling import GrammarMatcher, SamplingParams, TokenLogprob

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
    logprobs: list[TokenLogprob] | None = None  # one per output token, when the request asks for them
    index: int = 0  # which of the request's n outputs this is
    grammar: GrammarMatcher | None = None  # structured output: where the output stands in its grammar
    # The request's n sequences (this one included): admitted together, they share one prefill.
    siblings: list["Sequence"] = field(default_factory=list)

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


def check_token_ids(ids: list[int], vocab_size: int, where: str = "the prompt") -> None:
    """Token ids must index the embedding: checked per request, since a bad one would fail the whole step."""
    bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise SpecDecodeError(f"token id {bad!r} in {where} is not in this model's vocabulary: ids are integers "
                              f"from 0 to {vocab_size - 1}")
