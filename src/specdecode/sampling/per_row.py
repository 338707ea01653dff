"""Each row's distribution by its own settings, held in tensors: the same operations whatever the settings, so a
captured CUDA graph can hold them (a drafter's sampled rounds chained on the device) where logits_to_probs takes a
call per setting and branches on it. A row gets what logits_to_probs gives it, by the same operations on the same
values (tested bit for bit); the work a batch pays for is that of the truncations any of its rows asks for."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..transfers import copy_into
from .params import SamplingParams
from .probs import nucleus_of_ranked


@dataclass
class RowSettings:
    """Sampling settings a row, [rows, 1] each on the device; a truncation no row asks for is None (not computed).
    Greedy rows and rows past a batch's own hold neutral values (their distributions go unused)."""

    temperature: torch.Tensor  # float32
    log_min_p: torch.Tensor | None  # float32, log(min_p); -inf where a row has none
    top_k: torch.Tensor | None  # long; the vocabulary's size where a row has none
    top_p: torch.Tensor | None  # float32; 1 where a row has none

    @classmethod
    def allocate(cls, rows: int, kinds: frozenset[str], vocab: int, device) -> RowSettings:
        """Buffers for `rows` rows of the truncations `kinds` (see kinds_of), neutral until filled (what a graph's
        capture computes with: every value valid)."""

        def column(value, dtype=torch.float32):
            return torch.full((rows, 1), value, dtype=dtype, device=device)

        return cls(
            column(1.0),
            column(-math.inf) if "min_p" in kinds else None,
            column(vocab, torch.long) if "top_k" in kinds else None,
            column(1.0) if "top_p" in kinds else None,
        )

    @classmethod
    def of(cls, params: list[SamplingParams], vocab: int, device) -> RowSettings:
        settings = cls.allocate(len(params), kinds_of(params, vocab), vocab, device)
        settings.fill(params, vocab)
        return settings

    def fill(self, params: list[SamplingParams], vocab: int) -> None:
        """The first len(params) rows' settings, the rest neutral, copied from the host without waiting."""
        pad = [SamplingParams(temperature=1.0)] * (self.temperature.shape[0] - len(params))
        rows = [_neutral_if_greedy(p) for p in params] + pad
        copy_into(self.temperature, [[p.temperature] for p in rows])
        if self.log_min_p is not None:
            copy_into(self.log_min_p, [[math.log(p.min_p) if p.min_p > 0 else -math.inf] for p in rows])
        if self.top_k is not None:
            copy_into(self.top_k, [[p.top_k if 0 < p.top_k < vocab else vocab] for p in rows])
        if self.top_p is not None:
            copy_into(self.top_p, [[p.top_p] for p in rows])


def kinds_of(params: list[SamplingParams], vocab: int) -> frozenset[str]:
    """The truncations any sampled row asks for: what a batch's distributions must compute."""
    sampled = [p for p in params if not p.greedy]
    kinds = {"min_p": any(p.min_p > 0 for p in sampled), "top_k": any(0 < p.top_k < vocab for p in sampled)}
    kinds["top_p"] = any(p.top_p < 1 for p in sampled)
    return frozenset(kind for kind, asked in kinds.items() if asked)


def _neutral_if_greedy(params: SamplingParams) -> SamplingParams:
    return SamplingParams(temperature=1.0) if params.greedy else params


def probs_of_settings(logits: torch.Tensor, settings: RowSettings) -> torch.Tensor:
    """logits_to_probs for rows [R, V] of sampled requests, each by its row of `settings`: temperature, then min_p,
    top-k and top-p, then softmax, each truncation a no-op on a row that does not ask for it."""
    logits = logits.float() / settings.temperature
    if settings.log_min_p is not None:
        floor = logits.max(-1, keepdim=True).values + settings.log_min_p
        logits = logits.masked_fill(logits < floor, float("-inf"))
    if settings.top_k is not None:
        ranked = logits.sort(-1, descending=True).values
        kth = ranked.gather(-1, settings.top_k - 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if settings.top_p is not None:
        kept = nucleus_of_ranked(probs, *probs.sort(-1, descending=True), settings.top_p)
        probs = torch.where(settings.top_p < 1, kept, probs)
    return probs
