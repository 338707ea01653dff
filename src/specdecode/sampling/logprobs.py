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
    index = to_device(rows, processed.device)
    logp = torch.log_softmax(processed[index].float(), dim=-1)
    flat = [t for emitted in tokens for t in emitted]
    columns = [logp.gather(-1, to_device(flat, logp.device)[:, None]).double()]
    widest = min(max(num_tops), logp.shape[-1])
    if widest:
        values, ids = logp.topk(widest, dim=-1)
        columns += [values.double(), ids.double()]
    copied = torch.cat(columns, 1).tolist()  # ids as float64: exact below 2**53
    out = []
    for emitted, num_top in zip(tokens, num_tops):
        mine, copied = copied[: len(emitted)], copied[len(emitted) :]
        top = [
            [(int(i), v) for v, i in zip(row[1 : 1 + num_top], row[1 + widest : 1 + widest + num_top])] for row in mine
        ]
        out.append([TokenLogprob(t, row[0], alt) for t, row, alt in zip(emitted, mine, top)])
    return out
