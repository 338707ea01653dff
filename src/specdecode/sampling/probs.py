"""Processed logits -> the distribution a token is drawn from, and the draw."""

from __future__ import annotations

import math

import torch

from .params import SamplingParams


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then min_p, top-k and top-p, then softmax: the distribution a token is sampled from
    (the logits processors, see processors.py, come before).

    Applied identically to the target's and the draft's logits, so rejection sampling stays lossless
    with respect to this (processed) target distribution. Greedy requests get a one-hot argmax.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.min_p > 0:
        # p(x) < min_p * p_max  <=>  logit(x) < logit_max + log(min_p): no softmax needed
        floor = logits.max(-1, keepdim=True).values + math.log(params.min_p)
        logits = logits.masked_fill(logits < floor, float("-inf"))
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already reach top_p
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[int, torch.Tensor | None]:
    """Draw one token from a logits row [V]: the argmax for greedy requests (probs None, i.e. one-hot),
    else a sample from the processed distribution, which is returned for rejection sampling."""
    if params.greedy:
        return int(logits.argmax()), None
    probs = logits_to_probs(logits[None], params)[0]
    return int(torch.multinomial(probs, 1, generator=generator)), probs
