"""Log-probabilities returned to the client: log-softmax of the target's logits after the request's
logits processors (bias, min_tokens, penalties) and before temperature and truncation (min_p, top-k,
top-p), so a greedy request gets real numbers and every token, accepted draft, recovered or bonus, gets
what plain decoding returns for the same token at the same position."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely tokens at this position, best first


def token_logprobs(processed_logits: torch.Tensor, tokens: list[int], num_top: int) -> list[TokenLogprob]:
    """processed_logits [>= len(tokens), V]: row i is the distribution tokens[i] was drawn from."""
    if not tokens:
        return []
    logp = torch.log_softmax(processed_logits[: len(tokens)].float(), dim=-1)
    chosen = logp.gather(-1, torch.tensor(tokens, device=logp.device)[:, None]).squeeze(-1).tolist()
    if num_top:
        values, ids = logp.topk(min(num_top, logp.shape[-1]), dim=-1)
        top = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        top = [[] for _ in tokens]
    return [TokenLogprob(t, lp, alt) for t, lp, alt in zip(tokens, chosen, top)]
