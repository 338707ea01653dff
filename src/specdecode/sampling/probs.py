"""Processed logits -> the distribution a token is drawn from, and the draw."""

from __future__ import annotations

import math

import torch

from ..transfers import to_device
from .params import SamplingParams

# One random stream a row, or None: PyTorch's default generator (requests without a seed); a list gives each row its own
Generators = torch.Generator | list[torch.Generator | None] | None


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
    probs = logits.softmax(-1)
    if params.top_p < 1:
        probs = nucleus(probs, params.top_p)
    return probs


def probs_of_rows(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits_to_probs for rows [N, V] that each follow their own request's settings (params[i] for row i): rows of
    the same settings in one call, whatever their order, so a batch costs a call per setting, not per sequence. A
    row gets what logits_to_probs gives it alone."""
    groups: dict[tuple, list[int]] = {}
    for row, p in enumerate(params):
        groups.setdefault(_distribution(p), []).append(row)
    if len(groups) == 1:
        return logits_to_probs(logits, params[0])
    probs = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for rows in groups.values():
        at = to_device(rows, logits.device)
        probs[at] = logits_to_probs(logits[at], params[rows[0]])
    return probs


def _distribution(params: SamplingParams) -> tuple:
    """What logits_to_probs reads of a request's settings."""
    if params.greedy:
        return ("greedy",)
    return params.temperature, max(params.top_k, 0), params.top_p, params.min_p


# Tokens ranked by topk before any whole-row sort: on a CPU, sorting a 152k vocabulary costs tens of times what
# ranking its first 256 does (docs/decisions.md#the-sampling-api-under-speculation).
NUCLEUS_CANDIDATES = 256


def argmax_probability(logits: torch.Tensor) -> torch.Tensor:
    """The softmax probability of each row's largest logit (a greedy draft's confidence): 1 / sum(exp(x - max))."""
    logits = logits.float()
    return 1.0 / torch.exp(logits - logits.amax(-1, keepdim=True)).sum(-1)


def nucleus(probs: torch.Tensor, top_p: float, sort_rows: bool | None = None) -> torch.Tensor:
    """Top-p on probability rows [R, V]: keep the fewest highest-ranked tokens whose mass reaches top_p (a token
    is dropped when the tokens ranked above it already reach it), renormalised. sort_rows (default: on a GPU) sorts
    whole rows at once: there, asking whether the first-ranked candidates suffice would cost a synchronisation,
    where the sort costs little."""
    if probs.is_cuda if sort_rows is None else sort_rows:
        return nucleus_of_ranked(probs, *probs.sort(-1, descending=True), top_p)
    width = min(NUCLEUS_CANDIDATES, probs.shape[-1])
    top, order = probs.topk(width, dim=-1)
    kept = nucleus_of_ranked(probs, top, order, top_p)
    if width < probs.shape[-1]:
        wide = top.sum(-1) < top_p
        if wide.any():  # the nucleus may reach past the candidates
            rows = probs[wide]
            kept[wide] = nucleus_of_ranked(rows, *rows.sort(-1, descending=True), top_p)
    return kept


def nucleus_of_ranked(probs: torch.Tensor, ranked: torch.Tensor, order: torch.Tensor, top_p: float) -> torch.Tensor:
    keep_ranked = (ranked.cumsum(-1) - ranked) < top_p
    kept = torch.zeros_like(probs).scatter(-1, order, ranked * keep_ranked)
    return kept / kept.sum(-1, keepdim=True)


def sample_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[int, torch.Tensor | None]:
    """Draw one token from a logits row [V]: the argmax for greedy requests (probs None, i.e. one-hot),
    else a sample from the processed distribution, which is returned for rejection sampling."""
    if params.greedy:
        return int(logits.argmax()), None
    probs = logits_to_probs(logits[None], params)[0]
    return int(sample_rows(probs[None], generator)[0]), probs


def sample_rows(probs: torch.Tensor, generators: Generators = None) -> torch.Tensor:
    """One token per row of (unnormalised) probabilities [R, V], by inverting each row's cumulative sum at a
    uniform draw: one pass over the row, where torch.multinomial draws a random number per token. Accumulated
    in float64, so rounding moves no measurable mass; a zero-probability token spans an empty interval and is
    never drawn. With a generator per row, each row draws what it draws sampled alone (see uniform_rows)."""
    return sample_at(probs, uniform_rows(generators, [1] * probs.shape[0], 1, probs.device, torch.float64)[:, 0])


def sample_at(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """sample_rows at given uniform draws u [R] (float64, in [0, 1)): the token whose cumulative interval holds u."""
    cdf = probs.double().cumsum(-1)
    tokens = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True)[:, 0]
    return tokens.clamp(max=probs.shape[-1] - 1)  # u * total rounding up to total itself


def uniform_rows(generators: Generators, counts: list[int], width: int, device, dtype=torch.float32) -> torch.Tensor:
    """[rows, width] uniform draws, row i's first counts[i] its own. A list of generators gives each row its own
    stream: a seeded row draws exactly counts[i] numbers from it, what it would draw in a batch of one (the rest of
    its row is zeros), and the rows without a generator share one draw from the default generator. Otherwise
    (one generator or None) one draw fills the whole block."""
    if not isinstance(generators, list):
        return torch.rand(len(counts), width, generator=generators, device=device, dtype=dtype)
    if all(g is None for g in generators):
        return torch.rand(len(counts), width, device=device, dtype=dtype)
    common = torch.rand(sum(g is None for g in generators), width, device=device, dtype=dtype)
    rows, taken = [], 0
    for g, n in zip(generators, counts):
        if g is None:
            rows.append(common[taken : taken + 1])
            taken += 1
        else:
            own = torch.rand(n, generator=g, device=device, dtype=dtype)
            rows.append((own if n == width else torch.nn.functional.pad(own, (0, width - n)))[None])
    return torch.cat(rows)
