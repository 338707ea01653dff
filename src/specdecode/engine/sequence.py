"""One request's state as it moves through the engine."""
from __future__ import annotations

import itertools
import time
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
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token (None for the first)
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

    def append(self, tokens: list[int], logprobs: list[TokenLogprob] | None, tokenizer, max_model_len: int) -> None:
        """Append emitted tokens one by one (with their logprobs); EOS, a stop string, max_tokens or the
        context end finish the sequence and drop whatever follows inside the chunk."""
        m, stopped_by_string = self.metrics, False
        for i, token in enumerate(tokens):
            self.output_ids.append(token)
            if logprobs is not None:
                self.logprobs.append(logprobs[i])
            m.num_output_tokens += 1
            if m.first_token_time is None:
                m.first_token_time = time.perf_counter()
            if token in tokenizer.eos_token_ids and not self.params.ignore_eos:
                self.finish_reason = "stop"
            elif self.params.stop_strings and self._hit_stop_string(tokenizer):
                self.finish_reason, stopped_by_string = "stop", True
            elif self.remaining_tokens <= 0 or self.num_tokens >= max_model_len:
                self.finish_reason = "length"
            if self.finished:
                m.finish_time = time.perf_counter()
                break
        if not stopped_by_string:
            self.text = tokenizer.decode(self.output_ids)

    def _hit_stop_string(self, tokenizer) -> bool:
        """On a hit, the text is cut before the stop string (it is not part of the output)."""
        text = tokenizer.decode(self.output_ids)
        hits = [i for i in (text.find(s) for s in self.params.stop_strings) if i >= 0]
        if hits:
            self.text = text[:min(hits)]
        return bool(hits)


def check_token_ids(ids: list[int], vocab_size: int, where: str = "the prompt") -> None:
    """Token ids must index the embedding: checked per request, since a bad one would fail the whole step."""
    bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise SpecDecodeError(f"token id {bad!r} in {where} is not in this model's vocabulary: ids are integers "
                              f"from 0 to {vocab_size - 1}")
