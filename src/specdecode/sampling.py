"""Sampling parameters (vLLM's names) and the logits -> probabilities transform shared by target and draft."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .errors import SpecDecodeError


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): no top-k
    max_tokens: int = 16
    seed: int | None = None
    stop: list[str] | str | None = None
    ignore_eos: bool = False
    stop_strings: list[str] = field(init=False, default_factory=list)

    def __post_init__(self):
        self.stop_strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise SpecDecodeError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise SpecDecodeError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise SpecDecodeError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise SpecDecodeError(f"top_k must be -1 (off) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not -2 ** 63 <= self.seed < 2 ** 64):
            raise SpecDecodeError(f"seed must be an integer from -2**63 to 2**64 - 1, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise SpecDecodeError("stop must be a non-empty string or a list of non-empty strings")


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p, then softmax: the distribution a token is sampled from.

    Applied identically to the target's and the draft's logits, so rejection sampling stays lossless
    with respect to this (processed) target distribution. Greedy requests get a one-hot argmax.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
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


def sample_token(logits: torch.Tensor, params: SamplingParams,
                 generator: torch.Generator | None) -> tuple[int, torch.Tensor | None]:
    """Draw one token from a logits row [V]: the argmax for greedy requests (probs None, i.e. one-hot),
    else a sample from the processed distribution, which is returned for rejection sampling."""
    if params.greedy:
        return int(logits.argmax()), None
    probs = logits_to_probs(logits[None], params)[0]
    return int(torch.multinomial(probs, 1, generator=generator)), probs
