"""The repetition, frequency and presence penalties. They change only the tokens a request has seen (its prompt,
its output, and for a verify row the drafts before it), so each row's logits at those tokens are gathered,
penalised and written back: the work grows with the tokens seen, not with the vocabulary, where a pass over a
152k vocabulary costs about a millisecond a row on a CPU. Which entries those are is worked out on the host, in NumPy
(no value waits for the device), and expanded on the device, all requests together in a fixed number of tensor
operations; each entry's arithmetic is a dense pass's, so a row gets the same bits alone or beside others."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..transfers import tensor_to_device, to_device

if TYPE_CHECKING:
    from .processors import History


@dataclass
class _Seen:
    """The requests' seen tokens as keys (request index × vocab + token), sorted and distinct, on the host."""

    keys: np.ndarray  # [U] int64
    in_prompt: np.ndarray  # [U] bool
    output_counts: np.ndarray  # [U] float32: occurrences in the output
    starts: list[int]  # request r's keys are keys[starts[r]:starts[r + 1]]


@dataclass
class _Entries:
    """Every penalised row's entries, one per token its request has seen, on the device."""

    row: torch.Tensor  # the penalised row (0 = the first request's first)
    token: torch.Tensor
    counts: torch.Tensor  # occurrences in the output and the drafts before the row
    seen: torch.Tensor  # in the prompt, the output or the drafts before the row: what the repetition penalty changes


def penalise(logits: torch.Tensor, requests: list[History], first_rows: list[int]) -> None:
    """Apply each request's penalties, in place, to its rows of `logits` (request r's from first_rows[r])."""
    device, vocab = logits.device, logits.shape[-1]
    entries = _entries(requests, vocab, device)
    rows = [(h, first + j) for h, first in zip(requests, first_rows) for j in range(h.rows)]
    values = [[h.params.repetition_penalty, h.params.frequency_penalty, h.params.presence_penalty] for h, _ in rows]
    repetition, frequency, presence = to_device(values, device, logits.dtype)[entries.row].T
    at = (to_device([row for _, row in rows], device)[entries.row], entries.token)
    part = logits[at]
    part = torch.where(entries.seen, torch.where(part > 0, part / repetition, part * repetition), part)
    part -= frequency * entries.counts + presence * (entries.counts > 0)
    logits.index_put_(at, part)


def _entries(requests: list[History], vocab: int, device: torch.device) -> _Entries:
    seen = _seen_tokens(requests, vocab)
    row_requests = [r for r, h in enumerate(requests) for _ in range(h.rows)]
    lengths = [seen.starts[r + 1] - seen.starts[r] for r in row_requests]  # a row's entries: its request's keys
    firsts = list(accumulate(lengths, initial=0))
    shifts = [seen.starts[r] - first for r, first in zip(row_requests, firsts)]  # entry e of row g: key e + shifts[g]
    hits = _draft_hits(requests, seen, shifts, vocab)
    total = firsts[-1]
    row = torch.arange(len(lengths), device=device).repeat_interleave(to_device(lengths, device), output_size=total)
    at = to_device(shifts, device)[row] + torch.arange(total, device=device)
    counts = _on(seen.output_counts, device)[at]
    if len(hits):
        counts.index_put_((_on(hits, device),), counts.new_ones(len(hits)), accumulate=True)
    token = _on(seen.keys % vocab, device)[at]
    in_prompt = _on(seen.in_prompt, device)[at]
    return _Entries(row, token, counts, in_prompt | (counts > 0))


def _seen_tokens(requests: list[History], vocab: int) -> _Seen:
    prompts = np.concatenate([_keys(h.prompt_ids, r, vocab) for r, h in enumerate(requests)])
    outputs = np.concatenate([_keys(h.output_ids, r, vocab) for r, h in enumerate(requests)])
    drafts = np.concatenate([_keys(_drafts_before(h, h.rows - 1), r, vocab) for r, h in enumerate(requests)])
    keys, where = np.unique(np.concatenate([prompts, outputs, drafts]), return_inverse=True)  # sorted
    in_prompt = np.zeros(len(keys), dtype=bool)
    in_prompt[where[: len(prompts)]] = True
    output_counts = np.bincount(where[len(prompts) : len(prompts) + len(outputs)], minlength=len(keys))
    starts = np.searchsorted(keys, np.arange(len(requests) + 1) * vocab).tolist()
    return _Seen(keys, in_prompt, output_counts.astype(np.float32), starts)


def _keys(tokens: Sequence[int] | np.ndarray, request: int, vocab: int) -> np.ndarray:
    """The tokens the rows cover (a draft's head may cover fewer) as keys of the request."""
    ids = np.asarray(tokens, dtype=np.int64)
    return ids[ids < vocab] + request * vocab


def _on(host: np.ndarray, device: torch.device) -> torch.Tensor:
    return tensor_to_device(torch.from_numpy(host), device)


def _drafts_before(history: History, row: int) -> Sequence[int]:
    """The drafts the request's row follows."""
    return history.drafts[:row]


def _draft_hits(requests: list[History], seen: _Seen, shifts: list[int], vocab: int) -> np.ndarray:
    """The entries that a draft before their row adds an occurrence to (an entry once per such draft)."""
    rows, keys, g = [], [], 0
    for r, h in enumerate(requests):
        for j in range(h.rows):
            drafted = [r * vocab + t for t in _drafts_before(h, j) if t < vocab]
            keys += drafted
            rows += [g] * len(drafted)
            g += 1
    return np.searchsorted(seen.keys, np.array(keys, dtype=np.int64)) - np.array(shifts, dtype=np.int64)[rows]
