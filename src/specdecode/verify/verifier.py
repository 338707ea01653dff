"""One sequence's verification: the target's logits over the verify window, processed as the request
asks (row j after the output and the first j drafts), then greedy matching or rejection sampling, and
the logprobs of the emitted tokens where the request asks for them. A structured-output grammar is one
more processor: its mask at row j is the grammar's state after the first j drafts."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

import torch

from ..sampling import TokenLogprob, logits_to_probs, process_logits, sample_token, token_logprobs
from ..transfers import to_device
from .rejection_sampler import VerifyResult, greedy_verify, match_greedy, match_vocab, rejection_sample
from .together import reads_raw_argmax, verify_together

if TYPE_CHECKING:
    from ..engine.sequence import Sequence

# A benchmark's acceptance, not the models': True keeps every draft (the upper bound), a function of the number of
# drafts says how many to keep (bench/imposed.py: as often as a run with the real weights kept them)
ForcedAcceptance = bool | Callable[[int], int]


def forced_kept(forced_accept: ForcedAcceptance, drafts: int) -> int:
    """How many of a step's drafts an imposed acceptance keeps (True: every one)."""
    return drafts if forced_accept is True else forced_accept(drafts)


def processed_logits(seq: Sequence, logits: torch.Tensor, drafts: list[int], eos_ids: Collection[int]) -> torch.Tensor:
    """The request's logits processors and grammar on rows [P, V], row j after seq's output and drafts[:j]."""
    logits = process_logits(
        logits,
        seq.params,
        seq.distinct_prompt_ids,
        seq.processed_output(),
        drafts,
        eos_ids,
        seq.thinking_from_prompt,
        seq.prompt_ids,
    )
    return logits if seq.grammar is None else seq.grammar.mask_rows(logits, drafts)


def emitted_logprobs(seq: Sequence, processed: torch.Tensor, tokens: list[int]) -> list[TokenLogprob] | None:
    if seq.params.logprobs is None:
        return None
    return token_logprobs(processed, tokens, seq.params.logprobs)


def prompt_logprobs(prompt_ids: list[int], logits: torch.Tensor, num_top: int) -> list[TokenLogprob | None]:
    """Each prompt token's logprob under the target given the tokens before it (raw logits: the request's
    processors apply to what it generates) and its rank among the vocabulary's (1 + the tokens more likely, as
    vLLM counts), from a prefill's logits for every prompt row; the first token has none."""
    scored = token_logprobs(logits[:-1], prompt_ids[1:], num_top)
    rows = logits[: len(scored)]
    chosen = rows.gather(-1, to_device(prompt_ids[1:], rows.device)[:, None])
    for token, rank in zip(scored, ((rows > chosen).sum(-1) + 1).tolist()):
        token.rank = rank
    return [None, *scored]


def verify_batch(
    seqs: list[Sequence],
    drafts: list[list[int]],
    draft_probs: list[torch.Tensor | None],
    logits: torch.Tensor,
    eos_ids: Collection[int],
    forced_accept: ForcedAcceptance = False,
    together: bool | None = None,
) -> list[tuple[VerifyResult, list[TokenLogprob] | None]]:
    """Every sequence's verification from one call's logits, sequence i's rows following the rows of the
    sequences before it (its drafts + 1). Where `together` (default: on a GPU, where each copy to the host idles
    the device; a CPU pays nothing for them, and would pay for the padded rows), all in one pass and one copy: see
    verify_together. Otherwise greedy sequences with nothing to apply to their logits share one argmax over the whole
    call and the others are verified one by one."""
    if (logits.is_cuda if together is None else together) and not forced_accept:
        return verify_together(seqs, drafts, draft_probs, logits, eos_ids)
    plain = [not forced_accept and reads_raw_argmax(seq) for seq in seqs]
    argmax = logits.argmax(-1).tolist() if any(plain) else []
    results, start = [], 0
    for i, (seq, tokens, q) in enumerate(zip(seqs, drafts, draft_probs)):
        end = start + len(tokens) + 1
        if plain[i]:
            accepted, emitted = match_greedy(tokens, argmax[start:end])
            results.append((VerifyResult([accepted], [emitted]), None))
        else:
            results.append(verify_drafts(seq, tokens, q, logits[start:end], eos_ids, forced_accept))
        start = end
    return results


def verify_argmax_rows(
    drafts: list[list[int]], widths: list[int], argmax: list[int], forced_accept: ForcedAcceptance = False
) -> list[VerifyResult]:
    """Greedy verification of sequences with nothing to apply to their logits, from the argmax of every verified row
    (read already): sequence i's widths[i] rows follow those of the sequences before it, its drafts + 1 or more (rows
    past a draft cut after they were verified are ignored: a row's argmax depends on the rows before it alone).
    forced_accept as in verify_drafts."""
    results, row = [], 0
    for tokens, width in zip(drafts, widths):
        picks = argmax[row : row + len(tokens) + 1]
        if forced_accept:
            kept = forced_kept(forced_accept, len(tokens))
            accepted, emitted = kept, tokens[:kept] + [picks[kept]]
        else:
            accepted, emitted = match_greedy(tokens, picks)
        results.append(VerifyResult([accepted], [emitted]))
        row += width
    return results


def verify_drafts(
    seq: Sequence,
    drafts: list[int],
    draft_probs: torch.Tensor | None,
    logits: torch.Tensor,
    eos_ids: Collection[int],
    forced_accept: ForcedAcceptance = False,
) -> tuple[VerifyResult, list[TokenLogprob] | None]:
    """logits [n + 1, V]: the target's raw logits after each prefix of the n drafts. The grammar, if any,
    advances along the emitted tokens. forced_accept keeps every draft, or as many as it says (benchmarks; not
    lossless)."""
    processed = processed_logits(seq, logits, drafts, eos_ids)
    result = _accept(seq, drafts, draft_probs, processed, forced_accept)
    if seq.grammar is not None:
        seq.grammar.advance(result.tokens[0])
    return result, emitted_logprobs(seq, processed, result.tokens[0])


def _accept(
    seq: Sequence, drafts: list[int], q: torch.Tensor | None, processed: torch.Tensor, forced_accept: ForcedAcceptance
) -> VerifyResult:
    n = len(drafts)
    draft = to_device([drafts], processed.device)
    if forced_accept:
        kept = forced_kept(forced_accept, n)
        bonus = sample_token(processed[kept], seq.params, seq.generator)[0]
        return VerifyResult([kept], [drafts[:kept] + [bonus]])
    if seq.params.greedy:
        return greedy_verify(draft, [n], processed.argmax(-1)[None])
    p = logits_to_probs(processed, seq.params)[None]
    q = None if q is None else match_vocab(q, p.shape[-1])[None]
    return rejection_sample(draft, [n], p, q, seq.generator)
