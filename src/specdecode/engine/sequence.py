"""One request's state as it moves through the engine."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from ..errors import SpecDecodeError
from ..metrics import RequestMetrics
from ..proposers.base import TargetFeedback
from ..sampling import GrammarMatcher, SamplingParams, TokenLogprob

_ids = itertools.count()
_arrivals = itertools.count()


def sample_stream(seed: int | None, index: int, device) -> torch.Generator | None:
    """A seeded request's i-th output gets a stream of its own, derived from the seed (the first uses it as is)."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed((seed + index * 0x9E3779B97F4A7C15) % 2**64)


class Detokenizer:
    """The text of a growing token list, each token decoded once: by the tokenizer's own incremental decoder where
    it has one (`decode_stream`), else by decoding a short window per token (the incremental decoding of vLLM and
    TGI). Tokens before `read` are text already; a window starts at `prefix`, one emission earlier, because a
    tokenizer may render a token differently at the start of a text (a dropped leading space). Text that ends
    inside a UTF-8 character waits for the next token; a finished sequence's (`flush`) ends in a replacement
    character, as decoding the whole list would. Special tokens are left out of the text unless the options say
    skip_special_tokens=False (options are passed only where set, so a tokenizer without them decodes the default
    way)."""

    def __init__(self, start: int, options: dict | None = None):
        self.prefix = self.read = self.fed = start  # fed: the tokens the incremental decoder has been given
        self.stream = None  # the tokenizer's incremental decoder; False where it has none
        self.options = options or {}  # decoding options other than the defaults (skip_special_tokens=False)

    def new_text(self, tokenizer, ids: list[int], flush: bool = False) -> str:
        if self.stream is None:
            self.stream = getattr(tokenizer, "decode_stream", lambda **_: None)(**self.options) or False
        if not self.stream:
            return self._window(tokenizer, ids, flush)
        text = self._streamed(ids)
        return text + self._window(tokenizer, ids, flush) if flush and self.read < len(ids) else text

    def _streamed(self, ids: list[int]) -> str:
        pieces = []
        for i in range(self.fed, len(ids)):
            piece = self.stream(ids[i])
            if piece is not None:  # None: a character that waits for its next bytes
                pieces.append(piece)
                self.prefix, self.read = self.read, i + 1
        self.fed = len(ids)
        return "".join(pieces)

    def _window(self, tokenizer, ids: list[int], flush: bool) -> str:
        before = tokenizer.decode(ids[self.prefix : self.read], **self.options)
        after = tokenizer.decode(ids[self.prefix :], **self.options)
        if len(after) <= len(before) or (after.endswith("\ufffd") and not flush):
            return ""
        self.prefix, self.read = self.read, len(ids)
        return after[len(before) :]


@dataclass
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    slot: int = -1  # target KV-cache slot
    feedback: TargetFeedback | None = None  # what the target emitted for it in the last step, for proposers
    finish_reason: str | None = None  # "stop" (EOS or stop string) or "length"
    stop_reason: str | int | None = None  # as vLLM's: the stop string or stop token that ended it (None: EOS, length)
    text: str = ""
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    logprobs: list[TokenLogprob] | None = None  # one per output token, when the request asks for them
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token (None for the first)
    index: int = 0  # which of the request's n outputs this is
    grammar: GrammarMatcher | None = None  # structured output: where the output stands in its grammar
    # The request's n sequences (this one included): admitted together, they share one prefill.
    siblings: list["Sequence"] = field(default_factory=list)
    tenant: str = ""  # who asked (the server's API key and `user`): whose earlier outputs it may draft from
    adapter: str = ""  # the served LoRA adapter the target computes it with ("": the target as loaded)
    adapter_set: int = 0  # that adapter's set in its slot (models/lora.py's AdapterRoute): a name's set may change
    arrival: int = field(default_factory=lambda: next(_arrivals))  # queue order: the newest is preempted first

    def __post_init__(self):
        self.token_ids = list(self.prompt_ids)  # prompt + output: the one list that grows, in place
        self.num_prompt_tokens = len(self.prompt_ids)
        self.detokenizer = Detokenizer(self.num_prompt_tokens, decoding_options(self.params))  # the output's text

    @property
    def output_ids(self) -> list[int]:
        """The generated tokens (a copy)."""
        return self.token_ids[self.num_prompt_tokens :]

    @cached_property
    def thinking_from_prompt(self) -> bool:
        """Whether the prompt leaves the reply inside a thinking its budget bounds (its last <think> after its last
        </think>, read from the end)."""
        if self.params.thinking_ids is None:
            return False
        opener, closer = self.params.thinking_ids
        return next((token == opener for token in reversed(self.prompt_ids) if token in (opener, closer)), False)

    @cached_property
    def distinct_prompt_ids(self) -> np.ndarray:
        """The prompt's tokens, each once: all that penalties read of it (made once, not converted again each step)."""
        return np.unique(np.asarray(self.prompt_ids, dtype=np.int64))

    def processed_output(self, drafts: list[int] = ()) -> list[int]:
        """The tokens the request's logits processors see before its next row (its output, then `drafts`): a copy
        where it has processors, else none (nothing else reads them, and the copy grows with the output)."""
        return [*self.token_ids[self.num_prompt_tokens :], *drafts] if self.params.has_processors else []

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def resuming(self) -> bool:
        """Whether its prefill recomputes a preempted sequence (it has output already) rather than a new prompt."""
        return self.num_output_tokens > 0

    @property
    def context_ids(self) -> list[int]:
        """The tokens its prefill computes: the prompt, or all but the last token of a preempted sequence (the next
        decoding step reads that one, as it reads the token a sequence emitted last)."""
        return self.token_ids[:-1] if self.resuming else self.prompt_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def takes_argmax(self) -> bool:
        """Greedy with nothing applied to its logits (no processor, no grammar): its token is the raw argmax, which
        a draft round and a verify take for all such sequences in one copy to the host."""
        return self.params.greedy and self.picks_by_settings

    @property
    def picks_by_settings(self) -> bool:
        """Nothing applied to its logits (no processor, no grammar): its token follows from its logits row and its
        sampling settings alone, which the device applies to a batch without the host (a drafter's chained rounds)."""
        return not self.params.has_processors and self.grammar is None

    @property
    def remaining_tokens(self) -> int:
        return self.params.max_tokens - self.num_output_tokens

    def append(self, tokens: list[int], logprobs: list[TokenLogprob] | None, tokenizer, max_model_len: int) -> None:
        """Append emitted tokens one by one (with their logprobs); EOS, a stop token or string, max_tokens or the
        context end finish the sequence and drop whatever follows inside the chunk. As in vLLM, the text leaves out
        the EOS or stop token that ended it (include_stop_str_in_output keeps it), and a stop string counts only where
        it ends after the first min_tokens tokens."""
        m, cut, shown = self.metrics, False, None
        for i, token in enumerate(tokens):
            self.token_ids.append(token)
            if logprobs is not None:
                self.logprobs.append(logprobs[i])
            m.num_output_tokens += 1
            if m.first_token_time is None:
                m.first_token_time = time.perf_counter()
            eos = token in tokenizer.eos_token_ids and not self.params.ignore_eos
            if eos or token in self.params.stop_ids:
                self.finish_reason, self.stop_reason = "stop", None if eos else token
                shown = None if self.params.include_stop_str_in_output else self.num_tokens - 1
            elif self.params.stop_strings and self._hit_stop_string(tokenizer):
                self.finish_reason, cut = "stop", True
            elif self.remaining_tokens <= 0 or self.num_tokens >= max_model_len:
                self.finish_reason = "length"
            if self.finished:
                m.finish_time = time.perf_counter()
                break
        if not cut:
            self._extend_text(tokenizer, shown)

    def _extend_text(self, tokenizer, shown: int | None = None) -> int:
        """Decode the tokens not yet in the text (those before `shown` only, where it is set); how many characters
        came."""
        ids = self.token_ids if shown is None else self.token_ids[:shown]
        new = self.detokenizer.new_text(tokenizer, ids, flush=self.finished)
        self.text += new
        return len(new)

    def _hit_stop_string(self, tokenizer) -> bool:
        """Searches only the text a stop string ending in the newest characters could span; on a hit the
        text is cut before the first stop string found (after it, with include_stop_str_in_output)."""
        added = self._extend_text(tokenizer)
        if self.num_output_tokens <= self.params.min_tokens:
            return False
        start = max(0, len(self.text) - added - max(map(len, self.params.stop_strings)) + 1)
        hits = [(i, len(s), s) for s in self.params.stop_strings if (i := self.text.find(s, start)) >= 0]
        if hits:
            at, length, self.stop_reason = min(hits)
            self.text = self.text[: at + (length if self.params.include_stop_str_in_output else 0)]
        return bool(hits)


def decoding_options(params: SamplingParams) -> dict:
    """The request's decoding options that differ from the tokenizer's defaults."""
    options = {"skip_special_tokens": params.skip_special_tokens}
    options["spaces_between_special_tokens"] = params.spaces_between_special_tokens
    return {name: value for name, value in options.items() if value is not True}


def prepare_request(
    prompt_ids: list[int], params: SamplingParams, tokenizer, vocab_size: int, max_len: int
) -> list[int]:
    """The prompt a request is served with (truncated as it asks), once the token ids it names are checked and its
    bad words' ids found."""
    prompt_ids = truncate_prompt(prompt_ids, params.truncate_prompt_tokens, max_len, params.max_tokens)
    check_token_ids(prompt_ids, vocab_size)
    check_token_ids(list(params.logit_bias or ()), vocab_size, "logit_bias")
    check_token_ids(list(params.stop_ids), vocab_size, "stop_token_ids")
    check_token_ids(params.allowed_token_ids or [], vocab_size, "allowed_token_ids")
    params.update_from_tokenizer(tokenizer)
    check_token_ids([t for word in params.bad_words_ids for t in word], vocab_size, "bad_words (as tokenized)")
    grammar = params.structured_output
    if params.thinking_token_budget is not None and grammar is not None and grammar.after_thinking is None:
        raise SpecDecodeError(
            "thinking_token_budget with structured output needs the grammar to start after the thinking: serve with "
            "--reasoning-parser"
        )
    if params.allowed_token_ids and not set(params.allowed_token_ids) - _tokens_it_may_ban(params, tokenizer):
        raise SpecDecodeError(
            "allowed_token_ids leaves no token to generate once bad_words (and, before min_tokens, the end tokens) "
            "are banned; allow more tokens"
        )
    return prompt_ids


def truncate_prompt(prompt_ids: list[int], keep: int | None, max_len: int, max_tokens: int | None) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens; -1: as many as the context holds beside
    max_tokens."""
    if keep is None:
        return prompt_ids
    if isinstance(keep, bool) or not isinstance(keep, int) or keep == 0 or keep < -1:
        raise SpecDecodeError(
            f"truncate_prompt_tokens must be a positive number of tokens, or -1 for as many as fit beside "
            f"max_tokens; got {keep!r}"
        )
    if keep == -1:
        if max_tokens is None:
            raise SpecDecodeError("truncate_prompt_tokens=-1 keeps what fits beside max_tokens: set max_tokens")
        keep = max(max_len - max_tokens, 1)
    return prompt_ids[-keep:]


def _tokens_it_may_ban(params: SamplingParams, tokenizer) -> set[int]:
    """Every token a row of the request could have banned: its bad words' last tokens, its end tokens under
    min_tokens."""
    banned = {word[-1] for word in params.bad_words_ids}
    if params.min_tokens:
        banned |= params.stop_ids | (set() if params.ignore_eos else set(tokenizer.eos_token_ids))
    return banned


def check_token_ids(ids: list[int], vocab_size: int, where: str = "the prompt") -> None:
    """Token ids must index the embedding: checked per request, since a bad one would fail the whole step."""
    bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise SpecDecodeError(
            f"token id {bad!r} in {where} is not in this model's vocabulary: ids are integers "
            f"from 0 to {vocab_size - 1}"
        )
