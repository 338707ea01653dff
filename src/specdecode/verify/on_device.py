"""Greedy verification where the verify's argmax lies, for drafting queued behind a verify before the host reads it
(engine/queued_drafts.py): how many drafts each sequence keeps, and the tokens its drafter reads next. The host
verifies from the same argmax once it is read (verifier.verify_argmax_rows), and drafting queued on these counts is
taken only where the two agree, so the tokens never depend on this computation: at worst its drafts go unused."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from ..transfers import to_device


@dataclass
class VerifiedOnDevice:
    """A verify's outcome on the device, W = its widest sequence's rows: `accepted` [n], the drafts each sequence
    keeps; `tokens` [n, W], the token each of its rows chose (the kept drafts, then the target's pick: row
    accepted[i] holds the bonus token; rows past it are the target's picks, read by no one); `rows` [n, W], each of
    its rows in the verify's output (past its own width, its last)."""

    accepted: torch.Tensor
    tokens: torch.Tensor
    rows: torch.Tensor

    @property
    def width(self) -> int:
        return self.tokens.shape[1]


def verified_on_device(
    argmax: torch.Tensor,
    drafts: torch.Tensor,
    probs: torch.Tensor,
    widths: list[int],
    threshold: float = 0.0,
    kept: list[int] | None = None,
) -> VerifiedOnDevice:
    """argmax: the verify's pick at every row, sequence i's widths[i] rows after those of the sequences before it (its
    last token, then its drafts); drafts, probs: [n, >= max(widths) - 1], sequence i's first widths[i] - 1 its drafts
    and the drafter's probability of each. A sequence keeps its drafts while they equal the target's pick, up to the
    first under `threshold` (the confidence stop: drafts past it were verified and are ignored); `kept`: as many as
    an imposed acceptance keeps instead."""
    device, width = argmax.device, max(widths)
    rows = [[start + min(j, w - 1) for j in range(width)] for start, w in zip(accumulate(widths, initial=0), widths)]
    rows = to_device(rows, device)
    picks = argmax[rows]
    drafts = drafts[:, : width - 1]
    if kept is not None:
        accepted = to_device(kept, device)
    else:
        columns = torch.arange(width - 1, device=device)
        stood = _stood_by(probs[:, : width - 1], to_device([w - 1 for w in widths], device), threshold)
        match = (drafts == picks[:, :-1]) & (columns < stood[:, None])
        accepted = match.long().cumprod(1).sum(1)
    own = torch.arange(width, device=device) < accepted[:, None]
    tokens = torch.where(own, torch.nn.functional.pad(drafts, (0, 1)), picks)
    return VerifiedOnDevice(accepted, tokens, rows)


def _stood_by(probs: torch.Tensor, counts: torch.Tensor, threshold: float) -> torch.Tensor:
    """Each sequence's drafts up to and with its first under the threshold (drafter._stood_by), of its `counts`."""
    if threshold <= 0.0 or probs.shape[1] == 0:
        return counts
    unsure = probs < threshold
    first = unsure.long().argmax(1) + 1
    return torch.where(unsure.any(1), torch.minimum(first, counts), counts)
