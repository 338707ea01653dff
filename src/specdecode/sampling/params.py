"""Sampling parameters, with vLLM's names and OpenAI's ranges."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import SpecDecodeError
from .grammar import StructuredOutput

MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI's top_logprobs allows
MAX_N = 16  # outputs per request: each holds a sequence slot of its own


@dataclass
class SamplingParams:
    n: int = 1  # outputs per prompt: one prefill, then n sequences, each with its own random stream
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): no top-k
    min_p: float = 0.0  # drop tokens below min_p x the most likely token's probability
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    # divides (positive) / multiplies (negative) logits of tokens seen in prompt or output
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    min_tokens: int = 0  # end-of-sequence tokens are banned until this many tokens are generated
    max_tokens: int = 16
    seed: int | None = None
    stop: list[str] | str | None = None
    include_stop_str_in_output: bool = False  # the text ends after the stop string that ended it, not before
    stop_token_ids: list[int] | None = None  # end the text as EOS does (kept in the output), ignore_eos or not
    ignore_eos: bool = False
    skip_special_tokens: bool = True  # special tokens (a chat's end of turn) left out of the text
    spaces_between_special_tokens: bool = True  # a Python (slow) tokenizer's; the Rust ones' decoding has none
    allowed_token_ids: list[int] | None = None  # only these tokens may be generated
    bad_words: list[str] | None = None  # words that may not be generated (update_from_tokenizer gives their ids)
    # keep only the prompt's last N tokens (-1: as many as fit beside max_tokens); see engine.sequence.truncate_prompt
    truncate_prompt_tokens: int | None = None
    # vLLM's: the most tokens a reasoning model's thinking may take; then </think> is its next token
    thinking_token_budget: int | None = None
    logprobs: int | None = None  # None: none; N >= 0: each token's logprob and its N most likely alternatives
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (scored by the prefill)
    structured_output: StructuredOutput | None = None  # a grammar the output must follow
    # functions of the tokens so far that change a row's logits (vLLM's first API's, transformers' in spirit):
    # fn(output_ids, logits) or fn(prompt_ids, output_ids, logits) -> logits; see processors.custom_processed
    logits_processors: list[Callable] | None = None
    stop_strings: list[str] = field(init=False, default_factory=list)
    stop_ids: frozenset[int] = field(init=False, default=frozenset())
    # each bad word's token ids, spelled alone and after a space, as vLLM's; set by update_from_tokenizer
    bad_words_ids: list[list[int]] = field(init=False, default_factory=list)
    # the thinking tags' token ids (<think>, </think>; Magistral's [THINK], [/THINK]) where thinking_token_budget is
    # set; set by update_from_tokenizer
    thinking_ids: tuple[int, int] | None = field(init=False, default=None)

    def __post_init__(self):
        self.stop_strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_ids = frozenset(self.stop_token_ids or ())
        if isinstance(self.logit_bias, dict):
            self.logit_bias = {_token_id(k): v for k, v in self.logit_bias.items()}
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    @property
    def has_processors(self) -> bool:
        """Whether the logits are changed before temperature (bias, min_tokens, penalties, allowed tokens, bad
        words, a thinking budget)."""
        return bool(
            self.logit_bias
            or self.min_tokens
            or self.has_penalties
            or self.allowed_token_ids
            or self.bad_words_ids
            or self.thinking_token_budget is not None
            or self.logits_processors
        )

    def update_from_tokenizer(self, tokenizer) -> None:
        """The bad words' token ids, as vLLM finds them: each word's spelling alone, and after a space where that
        begins with another token and is as long (how it is written inside a text)."""
        self.bad_words_ids = []
        for word in self.bad_words or ():
            alone = tokenizer.encode_fragment(word.lstrip())
            spaced = tokenizer.encode_fragment(" " + word.lstrip())
            self.bad_words_ids.append(alone)
            if spaced[0] != alone[0] and len(spaced) == len(alone):
                self.bad_words_ids.append(spaced)
        if self.thinking_token_budget is not None:
            self.thinking_ids = getattr(tokenizer, "think_ids", None)
            if self.thinking_ids is None:
                raise SpecDecodeError(
                    "thinking_token_budget needs a reasoning model whose thinking tags (<think> and </think>, or "
                    "[THINK] and [/THINK]) are tokens of their own; leave it out for this model"
                )

    def validate(self) -> None:
        _check_int("n", self.n, 1, MAX_N)
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise SpecDecodeError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        _check_number("temperature", self.temperature, 0, None, "(0 = greedy)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise SpecDecodeError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise SpecDecodeError(f"top_k must be -1 (off) or a positive integer, got {self.top_k!r}")
        _check_number("min_p", self.min_p, 0, 1)
        _check_number("presence_penalty", self.presence_penalty, -2, 2)
        _check_number("frequency_penalty", self.frequency_penalty, -2, 2)
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= 10:
            raise SpecDecodeError(f"repetition_penalty must be in (0, 10] (1 = off), got {self.repetition_penalty!r}")
        for token, bias in (self.logit_bias or {}).items():
            _check_number(f"logit_bias[{token}]", bias, -100, 100)
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens, f" (at most max_tokens={self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 0, MAX_LOGPROBS)
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool) or not -(2**63) <= self.seed < 2**64
        ):
            raise SpecDecodeError(f"seed must be an integer from -2**63 to 2**64 - 1, got {self.seed!r}")
        if self.structured_output is not None and (self.ignore_eos or self.min_tokens):
            raise SpecDecodeError(
                "structured output ends the text when its grammar is complete; it cannot be "
                "combined with ignore_eos or min_tokens"
            )
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise SpecDecodeError("stop must be a non-empty string or a list of non-empty strings")
        for token in self.stop_token_ids or ():
            _check_int("stop_token_ids[]", token, 0)
        self._validate_vocabulary_limits()
        for processor in self.logits_processors or ():
            processor_arguments(processor)

    def _validate_vocabulary_limits(self) -> None:
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids:
                raise SpecDecodeError("allowed_token_ids must be a non-empty list of token ids (None: all allowed)")
            for token in self.allowed_token_ids:
                _check_int("allowed_token_ids[]", token, 0)
        if self.bad_words is not None and (
            not isinstance(self.bad_words, list) or any(not isinstance(w, str) or not w.strip() for w in self.bad_words)
        ):
            raise SpecDecodeError("bad_words must be a list of non-empty strings")
        if self.structured_output is not None and (self.allowed_token_ids or self.bad_words):
            raise SpecDecodeError(
                "structured output chooses the tokens allowed at each step; it cannot be combined with "
                "allowed_token_ids or bad_words"
            )
        if self.thinking_token_budget is not None:
            _check_int("thinking_token_budget", self.thinking_token_budget, 0)
            if self.allowed_token_ids or self.bad_words:
                raise SpecDecodeError(
                    "thinking_token_budget ends the thinking with </think>, which allowed_token_ids or bad_words could "
                    "ban; send one or the other"
                )


def processor_arguments(processor) -> int:
    """How many arguments a logits processor takes: 2 (output ids, logits) or 3 (prompt ids first)."""
    try:
        parameters = inspect.signature(processor).parameters.values()
    except (TypeError, ValueError):
        raise SpecDecodeError(f"logits_processors: {processor!r} is not a function") from None
    positional = [
        p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]
    if len(positional) not in (2, 3):
        raise SpecDecodeError(
            f"logits_processors: {getattr(processor, '__name__', processor)!r} takes {len(positional)} arguments; a "
            "processor takes (output_ids, logits) or (prompt_ids, output_ids, logits) and returns the logits"
        )
    return len(positional)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_number(name: str, value, low: float, high: float | None, note: str = "") -> None:
    if not _is_number(value) or value < low or (high is not None and value > high):
        span = f"from {low} to {high}" if high is not None else f">= {low}"
        raise SpecDecodeError(f"{name} must be a finite number {span}{' ' + note if note else ''}, got {value!r}")


def _check_int(name: str, value, low: int, high: int | None = None, note: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        span = f"from {low} to {high}" if high is not None else f">= {low}"
        raise SpecDecodeError(f"{name} must be an integer {span}{note}, got {value!r}")


def _token_id(key) -> int:
    """logit_bias keys arrive as strings over JSON ("50256": -100)."""
    try:
        return int(key)
    except (TypeError, ValueError):
        raise SpecDecodeError(f"logit_bias keys must be token ids, got {key!r}") from None
