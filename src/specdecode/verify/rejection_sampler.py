"""Model-free verification of draft tokens against target probabilities.

Greedy: accept draft tokens while they equal the target's argmax; emit the target's argmax at the
first mismatch (recovered token) or after the last draft (bonus token).

Stochastic (Leviathan et al. / Chen et al.): accept draft token x with probability min(1, p(x)/q(x));
on the first rejection emit a sample of norm(max(0, p - q)); when every draft is accepted emit a
bonus sample of p at the next position. The emitted tokens are then distributed exactly as p.
A deterministic proposer (n-gram, greedy draft) has a one-hot q.

Layout: drafts padded to [B, K] with per-sequence counts `num_draft` (ragged, 0 allowed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..sampling import Generators, sample_rows, uniform_rows
from ..transfers import to_device


@dataclass
class VerifyResult:
    num_accepted: list[int]  # accepted draft tokens per sequence
    tokens: list[list[int]]  # emitted per sequence: accepted drafts + one recovered/bonus token


def greedy_verify(draft_tokens: torch.Tensor, num_draft: list[int], target_argmax: torch.Tensor) -> VerifyResult:
    """draft_tokens [B, K], target_argmax [B, K+1] (the target's choice after each prefix)."""
    accepted, tokens = [], []
    for drafts, argmax, n_draft in zip(draft_tokens.tolist(), target_argmax.tolist(), num_draft):
        n, emitted = match_greedy(drafts[:n_draft], argmax)
        accepted.append(n)
        tokens.append(emitted)
    return VerifyResult(accepted, tokens)


def match_greedy(drafts: list[int], argmax: list[int]) -> tuple[int, list[int]]:
    """One sequence: its drafts accepted while they equal the target's argmax after each prefix, then the
    argmax. Returns (accepted, emitted tokens)."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == argmax[accepted]:
        accepted += 1
    return accepted, drafts[:accepted] + [argmax[accepted]]


def rejection_sample(
    draft_tokens: torch.Tensor,
    num_draft: list[int],
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generators: Generators = None,
) -> VerifyResult:
    """draft_tokens [B, K]; target_probs [B, K+1, V]; draft_probs [B, K, V] or None (one-hot q)."""
    num_accepted, extra = rejection_sample_on_device(draft_tokens, num_draft, target_probs, draft_probs, generators)
    # one device-to-host copy: per row, how many drafts were accepted, the token after them, the drafts
    copied = torch.cat([num_accepted[:, None], extra[:, None].to(draft_tokens.dtype), draft_tokens], 1).tolist()
    return VerifyResult([row[0] for row in copied], [row[2 : 2 + row[0]] + [row[1]] for row in copied])


def rejection_sample_on_device(
    draft_tokens: torch.Tensor,
    num_draft: list[int],
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generators: Generators = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rejection_sample's outcome left on the device: each row's number of accepted drafts [B] and the token drawn
    after them [B] (recovered or bonus)."""
    batch, k = draft_tokens.shape
    counts = to_device(num_draft, draft_tokens.device)
    in_range = torch.arange(k, device=draft_tokens.device)[None, :] < counts[:, None]
    safe_tokens = draft_tokens.clamp(min=0)[..., None]
    p = target_probs[:, :k].gather(-1, safe_tokens).squeeze(-1)
    q = torch.ones_like(p) if draft_probs is None else draft_probs.gather(-1, safe_tokens).squeeze(-1)
    u = uniform_rows(generators, num_draft, k, draft_tokens.device)
    accept = accept_draft(u, p, q) & in_range
    num_accepted = accept.int().cumprod(dim=1).sum(dim=1)

    rows = torch.arange(batch, device=draft_tokens.device)
    final = target_probs[rows, num_accepted]  # p at the first rejected position, or the bonus position
    rejected = num_accepted < counts
    if k and (final.is_cuda or rejected.any()):  # on a GPU the test would wait for the device: the residual costs less
        at = num_accepted.clamp(max=max(k - 1, 0))
        if draft_probs is None:
            q_at = torch.zeros_like(final).scatter_(-1, safe_tokens[rows, at], 1.0)
        else:
            q_at = draft_probs[rows, at]
        residual = residual_distribution(final, q_at)
        # p == q makes rejection impossible in exact arithmetic; fall back to p if rounding leaves nothing
        has_mass = residual.sum(-1, keepdim=True) > 0
        residual = torch.where(has_mass, residual, final)
        final = torch.where(rejected[:, None], residual, final)
    return num_accepted, sample_rows(final, generators)


def accept_draft(u: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Accept with probability min(1, p/q): u < p/q for u in [0, 1), written without dividing by q. Strictly: a
    draw of exactly 0 must not accept a token the target gives probability 0."""
    return u * q < p


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Unnormalised max(0, p - q): where to resample after a rejection."""
    return (p - q).clamp(min=0)


def match_vocab(q: torch.Tensor, vocab: int) -> torch.Tensor:
    """Draft and target embedding tables may be padded differently; q must cover the target's rows."""
    if q.shape[-1] == vocab:
        return q
    return F.pad(q, (0, vocab - q.shape[-1])) if q.shape[-1] < vocab else q[..., :vocab]
