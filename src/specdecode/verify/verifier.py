"""One sequence's verification: the target's logits over the verify window, processed as the request
asks (row j after the output and the first j drafts), then greedy matching or rejection sampling, and
the logprobs of the emitted tokens where the request asks for them. A structured-output grammar is one
more processor: its mask at row j is the grammar's state after the first j drafts."""

from __future__ import annotations

from collections.abc import Callable, Collection
from itertools import accumulate
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..sampling import TokenLogprob, logits_to_probs, probs_of_rows, process_logits, sample_token, token_logprobs
from ..sampling.grammar import mask_grammars
from ..sampling.logprobs import logprobs_of_rows
from ..sampling.processors import History, process_rows
from ..transfers import to_device
from .rejection_sampler import VerifyResult, greedy_verify, match_greedy, rejection_sample

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
    logits = process_logits(logits, seq.params, seq.prompt_ids, seq.output_ids, drafts, eos_ids)
    return logits if seq.grammar is None else seq.grammar.mask_rows(logits, drafts)


def emitted_logprobs(seq: Sequence, processed: torch.Tensor, tokens: list[int]) -> list[TokenLogprob] | None:
    if seq.params.logprobs is None:
        return None
    return token_logprobs(processed, tokens, seq.params.logprobs)


def prompt_logprobs(prompt_ids: list[int], logits: torch.Tensor, num_top: int) -> list[TokenLogprob | None]:
    """Each prompt token's logprob under the target given the tokens before it (raw logits: the request's
    processors apply to what it generates), from a prefill's logits for every prompt row; the first token
    has none."""
    return [None] + token_logprobs(logits[:-1], prompt_ids[1:], num_top)


def sample_first(
    seq: Sequence, logits: torch.Tensor, eos_ids: Collection[int]
) -> tuple[int, list[TokenLogprob] | None]:
    """The token after the prompt, from the prefill's last logits row [1, V]."""
    processed = processed_logits(seq, logits, [], eos_ids)
    token = sample_token(processed[0], seq.params, seq.generator)[0]
    if seq.grammar is not None:
        seq.grammar.advance([token])
    return token, emitted_logprobs(seq, processed, [token])


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
    sequences before it (its drafts + 1). Greedy sequences with nothing to apply to their logits share one
    argmax over the whole call: one pass, and on a GPU one synchronisation instead of one per sequence. The others
    are verified in one pass too where `together` (default: on a GPU, where a synchronisation per sequence is what
    verification costs; a CPU pays nothing for them, and would pay for the padded rows): see verify_together."""
    together = logits.is_cuda if together is None else together
    plain = [not forced_accept and seq.takes_argmax and seq.params.logprobs is None for seq in seqs]
    argmax = logits.argmax(-1).tolist() if any(plain) else []
    starts = list(accumulate((len(d) + 1 for d in drafts), initial=0))  # sequence i's rows begin at starts[i]
    joint = [i for i in range(len(seqs)) if together and not forced_accept and not plain[i]]
    verified = {}
    if joint:

        def pick(items):
            return [items[i] for i in joint]

        verified = dict(
            zip(joint, verify_together(pick(seqs), pick(drafts), pick(draft_probs), logits, pick(starts), eos_ids))
        )
    results = []
    for i, (seq, tokens, q, start) in enumerate(zip(seqs, drafts, draft_probs, starts)):
        end = start + len(tokens) + 1
        if plain[i]:
            accepted, emitted = match_greedy(tokens, argmax[start:end])
            results.append((VerifyResult([accepted], [emitted]), None))
        elif i in verified:
            results.append(verified[i])
        else:
            results.append(verify_drafts(seq, tokens, q, logits[start:end], eos_ids, forced_accept))
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


def verify_together(
    seqs: list[Sequence],
    drafts: list[list[int]],
    draft_probs: list[torch.Tensor | None],
    logits: torch.Tensor,
    starts: list[int],
    eos_ids: Collection[int],
) -> list[tuple[VerifyResult, list[TokenLogprob] | None]]:
    """verify_drafts for every sequence at once (its rows at starts[i] in `logits`): all rows processed together
    (logits processors, grammar masks), the greedy sequences' argmax in one copy, the sampled ones' rejection sampling
    in one pass; then each grammar advances along its tokens and logprobs are read where asked. Each sequence's
    generator draws what it draws verified alone, so the tokens are verify_drafts', whatever shares the batch."""
    counts = [len(d) for d in drafts]
    processed = _processed_rows(seqs, drafts, logits, _rows(starts, counts, range(len(seqs))), eos_ids)
    at = list(accumulate((n + 1 for n in counts), initial=0))  # sequence i's rows in `processed`
    greedy = [i for i, seq in enumerate(seqs) if seq.params.greedy]
    sampled = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
    results: dict[int, VerifyResult] = {}
    for picked, verify in ((greedy, _greedy_matched), (sampled, _rejection_sampled)):
        if picked:
            rows = _subset(processed, at, counts, picked)
            verified = verify(
                [seqs[i] for i in picked], [drafts[i] for i in picked], [draft_probs[i] for i in picked], rows
            )
            results.update(zip(picked, verified))
    for i, seq in enumerate(seqs):
        if seq.grammar is not None:
            seq.grammar.advance(results[i].tokens[0])
    asking = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
    emitted = [results[i].tokens[0] for i in asking]
    read = logprobs_of_rows(processed, [at[i] for i in asking], emitted, [seqs[i].params.logprobs for i in asking])
    logprobs = dict(zip(asking, read))
    return [(results[i], logprobs.get(i)) for i in range(len(seqs))]


def _rows(starts: list[int], counts: list[int], chosen) -> list[int]:
    """The rows of the chosen sequences, sequence i's counts[i] + 1 from starts[i]."""
    return [starts[i] + j for i in chosen for j in range(counts[i] + 1)]


def _subset(processed: torch.Tensor, at: list[int], counts: list[int], picked: list[int]) -> torch.Tensor:
    """The picked sequences' rows of `processed` (sequence i's counts[i] + 1 from at[i]): all of it where all are."""
    if len(picked) == len(counts):
        return processed
    return processed[to_device(_rows(at, counts, picked), processed.device)]


def _greedy_matched(
    seqs: list[Sequence], drafts: list[list[int]], draft_probs, processed: torch.Tensor
) -> list[VerifyResult]:
    """Greedy verification of sequences whose processed rows follow one another in `processed`: one argmax, one copy
    (their draft distributions are one-hot: unused)."""
    return verify_argmax_rows(drafts, [len(d) + 1 for d in drafts], processed.argmax(-1).tolist())


def _rejection_sampled(
    seqs: list[Sequence], drafts: list[list[int]], draft_probs: list[torch.Tensor | None], processed: torch.Tensor
) -> list[VerifyResult]:
    """Rejection sampling for sampled sequences whose processed rows follow one another in `processed`: their
    distributions made a call per sampling setting, padded to the longest draft, accepted and drawn together, one
    device-to-host copy in all."""
    k, vocab, counts = max(map(len, drafts)), processed.shape[-1], [len(d) for d in drafts]
    padded = to_device([d + [0] * (k - len(d)) for d in drafts], processed.device)
    places = _rows([i * (k + 1) for i in range(len(seqs))], counts, range(len(seqs)))  # each row's place in p
    p = processed.new_zeros(len(seqs) * (k + 1), vocab, dtype=torch.float32)
    params = [s.params for s, n in zip(seqs, counts) for _ in range(n + 1)]
    p[to_device(places, processed.device)] = probs_of_rows(processed, params)
    q = _draft_distributions(padded, counts, draft_probs, vocab)
    both = rejection_sample(padded, counts, p.view(len(seqs), k + 1, vocab), q, [seq.generator for seq in seqs])
    return [VerifyResult([n], [tokens]) for n, tokens in zip(both.num_accepted, both.tokens)]


def _processed_rows(
    seqs: list[Sequence], drafts: list[list[int]], logits: torch.Tensor, rows: list[int], eos_ids: Collection[int]
) -> torch.Tensor:
    """The sequences' rows of `logits`, in order, float32 (what distributions are made from), each request's logits
    processors and grammar applied to its own, all together (one request alone takes processed_logits' operations)."""
    processed = logits[to_device(rows, logits.device)].float()
    if any(seq.params.has_processors for seq in seqs):
        histories = [History(s.params, s.prompt_ids, s.output_ids, d, len(d) + 1) for s, d in zip(seqs, drafts)]
        processed = process_rows(processed, histories, eos_ids)
    return mask_grammars(processed, [seq.grammar for seq in seqs], drafts)


def _draft_distributions(
    padded: torch.Tensor, counts: list[int], draft_probs: list[torch.Tensor | None], vocab: int
) -> torch.Tensor | None:
    """q [B, k, V] for padded drafts [B, k]: each draft's distribution where its proposer gave one, else one-hot at
    the draft (a deterministic proposer). None where no proposer gave any (all one-hot)."""
    if all(q is None for q in draft_probs):
        return None
    batch, k = padded.shape
    q = padded.new_zeros(batch * k, vocab, dtype=torch.float32)
    given = [i for i, (qi, n) in enumerate(zip(draft_probs, counts)) if qi is not None and n]
    one_hot = [i * k + j for i, (qi, n) in enumerate(zip(draft_probs, counts)) if qi is None for j in range(n)]
    if given:
        places = to_device([i * k + j for i in given for j in range(counts[i])], padded.device)
        q[places] = torch.cat([match_vocab(draft_probs[i][: counts[i]], vocab) for i in given]).float()
    if one_hot:
        places = to_device(one_hot, padded.device)
        q[places, padded.view(-1)[places]] = 1.0
    return q.view(batch, k, vocab)


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


def match_vocab(q: torch.Tensor, vocab: int) -> torch.Tensor:
    """Draft and target embedding tables may be padded differently; q must cover the target's rows."""
    if q.shape[-1] == vocab:
        return q
    return F.pad(q, (0, vocab - q.shape[-1])) if q.shape[-1] < vocab else q[..., :vocab]
