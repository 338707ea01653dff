"""Logits processors: what a request changes in the model's logits before temperature. In vLLM's order:
logit_bias and min_tokens, then the repetition, frequency and presence penalties.

They depend on the tokens generated so far, so a verify window's row j sees the output followed by the
first j drafted tokens, exactly what plain decoding would have seen at that position if those drafts are
accepted. The draft samples through the same function, so target and draft distributions are processed
alike and rejection sampling stays lossless with respect to the processed target distribution.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from ..transfers import to_device
from .params import SamplingParams


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
    logits = logits.float().clone()
    rows, vocab = logits.shape
    if params.logit_bias:
        add_logit_bias(logits, params.logit_bias)
    if params.min_tokens and not params.ignore_eos:
        ban_eos_while_short(logits, params.min_tokens - len(output_ids), eos_ids)
    if params.has_penalties:
        counts = output_counts(output_ids, drafts[: rows - 1], rows, vocab, logits.device)
        if params.repetition_penalty != 1:
            seen = (counts > 0) | token_mask(prompt_ids, vocab, logits.device)
            penalised = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
            logits = torch.where(seen, penalised, logits)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    return logits


def add_logit_bias(logits: torch.Tensor, bias: dict[int, float]) -> None:
    inside = {i: v for i, v in bias.items() if i < logits.shape[-1]}  # a draft's head may cover fewer ids
    if inside:
        values = to_device(list(inside.values()), logits.device, logits.dtype)
        logits[:, to_device(list(inside), logits.device)] += values


def ban_eos_while_short(logits: torch.Tensor, tokens_missing: int, eos_ids: Collection[int]) -> None:
    """Row j is the (len(output) + j)-th output token: rows before `tokens_missing` may not end the text."""
    eos = [e for e in eos_ids if e < logits.shape[-1]]
    if tokens_missing > 0 and eos:
        logits[:tokens_missing, to_device(eos, logits.device)] = float("-inf")


def output_counts(
    output_ids: Sequence[int], drafts: Sequence[int], rows: int, vocab: int, device: torch.device
) -> torch.Tensor:
    """[rows, vocab]: how often each token occurs in output_ids + drafts[:j], for row j."""
    counts = torch.zeros(vocab, device=device)
    ids = [i for i in output_ids if i < vocab]
    if ids:
        counts.index_add_(0, to_device(ids, device), torch.ones(len(ids), device=device))
    counts = counts.repeat(rows, 1)
    for j, token in enumerate(drafts):
        if token < vocab:
            counts[j + 1 :, token] += 1
    return counts


def token_mask(ids: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor:
    mask = torch.zeros(vocab, dtype=torch.bool, device=device)
    ids = [i for i in ids if i < vocab]
    if ids:
        mask[to_device(ids, device)] = True
    return mask
