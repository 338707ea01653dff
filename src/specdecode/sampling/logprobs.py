"""Log-probabilities returned to the client: log-softmax of the target's logits after the request's
logits processors (bias, min_tokens, penalties) and before temperature and truncation (min_p, top-k,
top-p), so a greedy request gets real numbers and every token, accepted draft, recovered or bonus, gets
what plain decoding returns for the same token at the same position."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..transfers import to_device


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely tokens at this position, best first
    rank: int | None = None  # where the token stands in the vocabulary by logprob (1: first), where it was asked for


def token_logprobs(processed_logits: torch.Tensor, tokens: list[int], num_top: int) -> list[TokenLogprob]:
    """processed_logits [>= len(tokens), V]: row i is the distribution tokens[i] was drawn from."""
    return logprobs_of_rows(processed_logits, [0], [tokens], [num_top])[0]


def logprobs_of_rows(
    processed: torch.Tensor, starts: list[int], tokens: list[list[int]], num_tops: list[int]
) -> list[list[TokenLogprob]]:
    """token_logprobs for several sequences at once: sequence i's tokens drawn from the rows of `processed` from
    starts[i], its num_tops[i] most likely alternatives each; one pass and one copy to the host for all of them (a
    row's numbers are those it gets alone)."""
    rows = [start + j for start, emitted in zip(starts, tokens) for j in range(len(emitted))]
    if not rows:
        return [[] for _ in tokens]
    flat = [t for emitted in tokens for t in emitted]
    widest = top_width(num_tops, processed.shape[-1])
    copied = logprob_table(processed, rows, to_device(flat, processed.device), widest).tolist()
    out = []
    for emitted, num_top in zip(tokens, num_tops):
        mine, copied = copied[: len(emitted)], copied[len(emitted) :]
        out.append(logprobs_of_table(mine, emitted, num_top, widest))
    return out


def top_width(num_tops: list[int], vocab: int) -> int:
    """How many alternatives a table of rows holds: the most any of its sequences asks for."""
    return min(max(num_tops, default=0), vocab)


def logprob_table(processed: torch.Tensor, rows: list[int], tokens: torch.Tensor, widest: int) -> torch.Tensor:
    """Float64 [len(rows), 1 + 2 * widest], left on the device: for each of the rows of `processed`, the logprob of
    its token (tokens[i] for rows[i]), then the `widest` largest logprobs, then their ids (exact in float64)."""
    logp = torch.log_softmax(processed[to_device(rows, processed.device)].float(), dim=-1)
    columns = [logp.gather(-1, tokens[:, None]).double()]
    if widest:
        values, ids = logp.topk(widest, dim=-1)
        columns += [values.double(), ids.double()]
    return torch.cat(columns, 1)


def logprobs_of_table(table: list[list[float]], tokens: list[int], num_top: int, widest: int) -> list[TokenLogprob]:
    """The logprobs of tokens drawn from a logprob_table's rows, as read on the host, row i for tokens[i]."""
    return [
        TokenLogprob(token, row[0], [(int(i), v) for v, i in zip(row[1 : 1 + num_top], row[1 + widest :][:num_top])])
        for token, row in zip(tokens, table)
    ]
