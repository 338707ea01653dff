"""What a request asks of sampling, and the one path from logits to a token that target and draft share:
logits processors (bias, min_tokens, penalties, grammar) -> temperature -> min_p / top-k / top-p -> sample."""

from .grammar import GrammarMatcher, StructuredOutput
from .logprobs import TokenLogprob, token_logprobs
from .params import SamplingParams
from .probs import argmax_probability, logits_to_probs, sample_rows, sample_token
from .processors import process_logits

__all__ = [
    "GrammarMatcher",
    "SamplingParams",
    "StructuredOutput",
    "TokenLogprob",
    "argmax_probability",
    "logits_to_probs",
    "process_logits",
    "sample_rows",
    "sample_token",
    "token_logprobs",
]
