"""What a request asks of sampling, and the one path from logits to a token that target and draft share:
logits processors (bias, min_tokens, penalties, grammar) -> temperature -> min_p / top-k / top-p -> sample."""

from .grammar import GrammarMatcher, StructuredOutput
from .logprobs import TokenLogprob, token_logprobs
from .params import SamplingParams
from .probs import (
    Generators,
    argmax_probability,
    logits_to_probs,
    probs_of_rows,
    sample_at,
    sample_rows,
    sample_token,
    uniform_rows,
)
from .processors import process_logits

__all__ = [
    "Generators",
    "GrammarMatcher",
    "SamplingParams",
    "StructuredOutput",
    "TokenLogprob",
    "argmax_probability",
    "logits_to_probs",
    "probs_of_rows",
    "process_logits",
    "sample_at",
    "sample_rows",
    "sample_token",
    "token_logprobs",
    "uniform_rows",
]
