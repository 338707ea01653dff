"""Logits processors: what a request changes in the model's logits before temperature. In vLLM's order:
allowed_token_ids, logit_bias, min_tokens and bad_words, then the repetition, frequency and presence penalties.

They depend on the tokens generated so far, so a verify window's row j sees the output followed by the
first j drafted tokens, exactly what plain decoding would have seen at that position if those drafts are
accepted. The draft samples through the same function, so target and draft distributions are processed
alike and rejection sampling stays lossless with respect to the processed target distribution.

A batch's rows are processed together, each request's by its own settings, in a fixed number of tensor
operations however many requests share it; one request alone goes through the same operations, so a row gets
the same bits either way.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from itertools import accumulate

import numpy as np
import torch

from ..errors import SpecDecodeError
from ..transfers import to_device
from .params import SamplingParams, processor_arguments
from .penalties import penalise


@dataclass
class History:
    """What one request's rows are processed by: its settings and tokens; its `rows` rows follow the output, row j
    followed by drafts[:j]."""

    params: SamplingParams
    prompt_ids: Sequence[int] | np.ndarray  # its distinct tokens will do: penalties read only which occur
    output_ids: Sequence[int]
    drafts: Sequence[int]
    rows: int
    thinking_from_prompt: bool = False  # the prompt left the reply inside its thinking (see thinking_token_budget)
    prompt: Sequence[int] = ()  # the whole prompt, for the request's own processors that read it


def process_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_ids: Sequence[int] | np.ndarray,
    output_ids: Sequence[int],
    drafts: Sequence[int] = (),
    eos_ids: Collection[int] = (),
    thinking_from_prompt: bool = False,
    prompt: Sequence[int] = (),
) -> torch.Tensor:
    """logits [P, V], row j following output_ids + drafts[:j]; returned unchanged without processors. prompt: the
    whole prompt, where the request's own processors read it (prompt_ids: its distinct tokens will do otherwise)."""
    if not params.has_processors:
        return logits
    history = History(params, prompt_ids, output_ids, drafts, logits.shape[0], thinking_from_prompt, prompt)
    return process_rows(logits.float().clone(), [history], eos_ids)


def process_rows(logits: torch.Tensor, histories: list[History], eos_ids: Collection[int] = ()) -> torch.Tensor:
    """Float32 rows [N, V] of several requests, in order (history i's rows after those before it), each request's
    processors applied to its own rows: in place where the operation allows, the result returned."""
    starts = list(accumulate((h.rows for h in histories), initial=0))
    vocab, device = logits.shape[-1], logits.device
    for history, start in zip(histories, starts):
        if history.params.logits_processors:
            logits[start : start + history.rows] = custom_processed(logits[start : start + history.rows], history)
    _keep_allowed(logits, histories, starts)
    bias = [(start + j, i, v) for h, start in zip(histories, starts) for i, v in _bias(h, vocab) for j in range(h.rows)]
    if bias:
        rows, ids, values = zip(*bias)
        at = (to_device(list(rows), device), to_device(list(ids), device))
        logits.index_put_(at, to_device(list(values), device, logits.dtype), accumulate=True)
    banned = [
        (start + j, e)
        for h, start in zip(histories, starts)
        for j in _short_rows(h)
        for e in _ends(h, eos_ids)
        if e < vocab
    ]
    banned += [(start + j, t) for h, start in zip(histories, starts) for j, t in _bad_word_ends(h) if t < vocab]
    if banned:
        rows, ids = zip(*banned)
        logits[to_device(list(rows), device), to_device(list(ids), device)] = float("-inf")
    penalised = [i for i, h in enumerate(histories) if h.params.has_penalties]
    if penalised:
        penalise(logits, [histories[i] for i in penalised], [starts[i] for i in penalised])
    return logits


def custom_processed(rows: torch.Tensor, history: History) -> torch.Tensor:
    """A request's own processors (SamplingParams.logits_processors), in order, row by row: row j is given the tokens
    before it, the output then drafts[:j], as plain decoding would give them at that position; so the processed rows
    are plain decoding's wherever the function depends on those tokens alone, and speculation stays lossless."""
    rows, prompt = rows.clone(), list(history.prompt)
    for processor in history.params.logits_processors:
        reads_prompt = processor_arguments(processor) == 3
        for j in range(history.rows):
            seen = [*history.output_ids, *history.drafts[:j]]
            row = processor(prompt, seen, rows[j]) if reads_prompt else processor(seen, rows[j])
            if not isinstance(row, torch.Tensor) or row.shape != rows[j].shape:
                raise SpecDecodeError(
                    f"logits_processors: {getattr(processor, '__name__', processor)!r} returned "
                    f"{type(row).__name__} {tuple(getattr(row, 'shape', ()))}; return the row of logits it was given "
                    f"({rows.shape[-1]} values), changed"
                )
            rows[j] = row
    return rows


def _keep_allowed(logits: torch.Tensor, histories: list[History], starts: list[int]) -> None:
    """-inf, in place, at every token outside the allowed ones of the rows that limit them (allowed_token_ids; </think>
    where a thinking budget runs out), ids past the rows' vocabulary (a draft's narrower one) dropped."""
    limited = [(start + j, tokens) for h, start in zip(histories, starts) for j, tokens in _limited_rows(h)]
    if not limited:
        return
    vocab, device = logits.shape[-1], logits.device
    rows, kept = [], []  # kept: (n, token) for the n-th of those rows
    for row, tokens in limited:
        kept += [(len(rows), t) for t in tokens if t < vocab]
        rows.append(row)
    keep = torch.zeros((len(rows), vocab), dtype=torch.bool, device=device)
    if kept:
        at, ids = zip(*kept)
        keep[to_device(list(at), device), to_device(list(ids), device)] = True
    at = to_device(rows, device)
    logits[at] = logits[at].masked_fill(~keep, float("-inf"))


def _limited_rows(history: History) -> list[tuple[int, Sequence[int]]]:
    """(row, the only tokens it may take) for each of the request's rows that limits them."""
    if history.params.allowed_token_ids:
        return [(j, history.params.allowed_token_ids) for j in range(history.rows)]
    return [(j, [history.params.thinking_ids[1]]) for j in _thinking_run_out(history)]


def _thinking_run_out(history: History) -> list[int]:
    """The row (one at most) where the thinking has taken thinking_token_budget tokens without </think>: a thinking
    that the prompt opened or that the reply's first token (<think>) opened, counted from there (a reply that does
    not begin inside its thinking has none to bound). Its place is known, so only that row's tokens are read."""
    params = history.params
    if params.thinking_token_budget is None:
        return []
    opener, closer = params.thinking_ids
    output, drafts = history.output_ids, history.drafts
    begin = 0 if history.thinking_from_prompt else 1
    end = begin + params.thinking_token_budget  # the row that must close it, as an output position
    j = end - len(output)
    if not 0 <= j < history.rows:
        return []
    seen = [*output, *drafts[:j]]
    if begin == 1 and seen[0] != opener:
        return []
    return [] if closer in seen[begin:end] else [j]


def _bad_word_ends(history: History) -> list[tuple[int, int]]:
    """(row, token) for each bad word's last token where the tokens before that row end with the word's others
    (a one-token word: every row)."""
    words = history.params.bad_words_ids
    if not words:
        return []
    longest = max(map(len, words)) - 1  # the most tokens a word's match reads before its row
    seen = [*(history.output_ids[-longest:] if longest else ()), *history.drafts]
    before = len(seen) - len(history.drafts)
    return [
        (j, word[-1])
        for j in range(history.rows)
        for word in words
        if len(word) - 1 <= before + j and seen[before + j - len(word) + 1 : before + j] == word[:-1]
    ]


def _bias(history: History, vocab: int) -> list[tuple[int, float]]:
    """The request's logit bias on ids the rows cover (a draft's head may cover fewer)."""
    return [(i, v) for i, v in (history.params.logit_bias or {}).items() if i < vocab]


def _short_rows(history: History) -> range:
    """Rows before min_tokens output tokens: they may not end the text (row j is output token len(output) + j)."""
    params = history.params
    if not params.min_tokens:
        return range(0)
    return range(min(max(params.min_tokens - len(history.output_ids), 0), history.rows))


def _ends(history: History, eos_ids: Collection[int]) -> Collection[int]:
    """The tokens that would end the request's text: its stop tokens, and EOS unless it ignores EOS."""
    params = history.params
    if params.ignore_eos:
        return params.stop_ids
    return params.stop_ids | frozenset(eos_ids) if params.stop_ids else eos_ids
