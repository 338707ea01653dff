"""Logits processors: what a request changes in the model's logits before temperature. In vLLM's order:
logit_bias and min_tokens, then the repetition, frequency and presence penalties.

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

import torch

from ..transfers import to_device
from .params import SamplingParams


@dataclass
class History:
    """What one request's rows are processed by: its settings and tokens; its `rows` rows follow the output, row j
    followed by drafts[:j]."""

    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    drafts: Sequence[int]
    rows: int


def process_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    drafts: Sequence[int] = (),
    eos_ids: Collection[int] = (),
) -> torch.Tensor:
    """logits [P, V], row j following output_ids + drafts[:j]; returned unchanged without processors."""
    if not params.has_processors:
        return logits
    history = History(params, prompt_ids, output_ids, drafts, logits.shape[0])
    return process_rows(logits.float().clone(), [history], eos_ids)


def process_rows(logits: torch.Tensor, histories: list[History], eos_ids: Collection[int] = ()) -> torch.Tensor:
    """Float32 rows [N, V] of several requests, in order (history i's rows after those before it), each request's
    processors applied to its own rows: in place where the operation allows, the result returned."""
    starts = list(accumulate((h.rows for h in histories), initial=0))
    vocab, device = logits.shape[-1], logits.device
    bias = [(start + j, i, v) for h, start in zip(histories, starts) for i, v in _bias(h, vocab) for j in range(h.rows)]
    if bias:
        rows, ids, values = zip(*bias)
        at = (to_device(list(rows), device), to_device(list(ids), device))
        logits.index_put_(at, to_device(list(values), device, logits.dtype), accumulate=True)
    banned = [
        (start + j, e) for h, start in zip(histories, starts) for j in _short_rows(h) for e in eos_ids if e < vocab
    ]
    if banned:
        rows, ids = zip(*banned)
        logits[to_device(list(rows), device), to_device(list(ids), device)] = float("-inf")
    penalised = [(h, start) for h, start in zip(histories, starts) if h.params.has_penalties]
    if penalised:
        logits = _penalised(logits, penalised)
    return logits


def _bias(history: History, vocab: int) -> list[tuple[int, float]]:
    """The request's logit bias on ids the rows cover (a draft's head may cover fewer)."""
    return [(i, v) for i, v in (history.params.logit_bias or {}).items() if i < vocab]


def _short_rows(history: History) -> range:
    """Rows before min_tokens output tokens: they may not end the text (row j is output token len(output) + j)."""
    params = history.params
    if not params.min_tokens or params.ignore_eos:
        return range(0)
    return range(min(max(params.min_tokens - len(history.output_ids), 0), history.rows))


def _penalised(logits: torch.Tensor, penalised: list[tuple[History, int]]) -> torch.Tensor:
    """The repetition, frequency and presence penalties on the rows of the requests that have them, each row by its
    request's values (a value that leaves a row as it is where a request sets only some)."""
    vocab, device = logits.shape[-1], logits.device
    requests, rows = [h for h, _ in penalised], [(h, start, j) for h, start in penalised for j in range(h.rows)]
    whole = len(rows) == logits.shape[0]
    at = None if whole else to_device([start + j for _, start, j in rows], device)
    part = logits if whole else logits[at]
    one = len(requests) == 1  # a request alone: its rows read its counts and prompt as they are (no gather)
    owner = None if one else to_device([k for k, h in enumerate(requests) for _ in range(h.rows)], device)
    counts = _counts([h.output_ids for h in requests], vocab, device)
    counts = counts.repeat(len(rows), 1) if one else counts[owner]
    drafted = [(row, t) for row, (h, _, j) in enumerate(rows) for t in _drafts_before(h, j) if t < vocab]
    if drafted:
        row_ids, token_ids = zip(*drafted)
        at_drafts = (to_device(list(row_ids), device), to_device(list(token_ids), device))
        counts.index_put_(at_drafts, torch.ones(len(drafted), device=device), accumulate=True)
    values = [[h.params.repetition_penalty, h.params.frequency_penalty, h.params.presence_penalty] for h, _, _ in rows]
    repetition, frequency, presence = to_device(values, device, logits.dtype).T[:, :, None]
    present, in_prompt = counts > 0, _counts([h.prompt_ids for h in requests], vocab, device) > 0
    seen = present | (in_prompt if one else in_prompt[owner])
    part = torch.where(seen, torch.where(part > 0, part / repetition, part * repetition), part)
    part -= frequency * counts + presence * present
    if whole:
        return part
    logits[at] = part
    return logits


def _drafts_before(history: History, row: int) -> Sequence[int]:
    """The drafts the request's row follows."""
    return history.drafts[:row]


def _counts(token_lists: list[Sequence[int]], vocab: int, device) -> torch.Tensor:
    """[lists, vocab]: how often each token occurs in each list."""
    pairs = [(k, i) for k, tokens in enumerate(token_lists) for i in tokens if i < vocab]
    counts = torch.zeros(len(token_lists), vocab, device=device)
    if pairs:
        owners, ids = zip(*pairs)
        at = (to_device(list(owners), device), to_device(list(ids), device))
        counts.index_put_(at, torch.ones(len(pairs), device=device), accumulate=True)
    return counts
