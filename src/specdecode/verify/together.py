"""A batch's verification in one pass, for a GPU, where every copy to the host idles the device until it is read:
the rows of the sequences that apply something to their logits processed together (logits processors, grammar
masks), greedy matching and rejection sampling for all of them, the logprobs asked for, and everything the host
needs read in one copy. Each sequence's generator draws what it draws verified alone, so a sequence gets
verify_drafts' tokens whatever shares its batch."""

from __future__ import annotations

from collections.abc import Collection
from itertools import accumulate
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

from ..sampling import TokenLogprob, probs_of_rows
from ..sampling.grammar import mask_grammars
from ..sampling.logprobs import logprob_table, logprobs_of_table, top_width
from ..sampling.processors import History, process_rows
from ..transfers import read_at_once, to_device
from .rejection_sampler import VerifyResult, match_greedy, match_vocab, rejection_sample_on_device

if TYPE_CHECKING:
    from ..engine.sequence import Sequence


def reads_raw_argmax(seq: Sequence) -> bool:
    """Whether a sequence's verification is its raw logits' argmax matched against its drafts (nothing applied to
    its logits, no logprobs): such sequences share one argmax over the whole call."""
    return seq.takes_argmax and seq.params.logprobs is None


class _Pass(NamedTuple):
    """One pass's outcome on the device, over the rows of the sequences it processed (one after another)."""

    picks: torch.Tensor  # each row's token: its argmax (greedy), else the draft or the token drawn at it
    accepted: torch.Tensor  # each sampled sequence's accepted drafts
    logprobs: torch.Tensor  # logprob_table of the rows of the sequences asking for logprobs
    widest: int  # the table's alternatives a row


def verify_together(
    seqs: list[Sequence],
    drafts: list[list[int]],
    draft_probs: list[torch.Tensor | None],
    logits: torch.Tensor,
    eos_ids: Collection[int],
) -> list[tuple[VerifyResult, list[TokenLogprob] | None]]:
    """verify_drafts for every sequence, sequence i's rows in `logits` following those of the sequences before it
    (its drafts + 1); one copy to the host for all. Grammars then advance along their tokens."""
    starts = list(accumulate((len(d) + 1 for d in drafts), initial=0))
    plain = [i for i, seq in enumerate(seqs) if reads_raw_argmax(seq)]
    others = [i for i, seq in enumerate(seqs) if not reads_raw_argmax(seq)]
    argmax = logits.argmax(-1) if plain else logits.new_empty(0)
    done = _pass(*([items[i] for i in others] for items in (seqs, drafts, draft_probs, starts)), logits, eos_ids)
    argmax, picks, accepted, table = read_at_once([argmax, done.picks, done.accepted, done.logprobs])
    results = {i: _matched(drafts[i], argmax[starts[i] : starts[i + 1]]) for i in plain}
    at = list(accumulate((len(drafts[i]) + 1 for i in others), initial=0))  # their rows in the pass
    sampled = iter(accepted)
    for i, row, end in zip(others, at, at[1:]):
        mine = picks[row:end]
        results[i] = _matched(drafts[i], mine) if seqs[i].params.greedy else _drawn(drafts[i], mine, next(sampled))
        if seqs[i].grammar is not None:
            seqs[i].grammar.advance(results[i].tokens[0])
    logprobs = _logprobs_read([seqs[i] for i in others], [results[i] for i in others], at, table, done.widest)
    logprobs = {others[m]: read for m, read in logprobs.items()}
    return [(results[i], logprobs.get(i)) for i in range(len(seqs))]


def _matched(drafts: list[int], argmax: list[float]) -> VerifyResult:
    """Greedy matching of a sequence's drafts against the argmax of its rows (read as floats)."""
    accepted, emitted = match_greedy(drafts, [int(t) for t in argmax])
    return VerifyResult([accepted], [emitted])


def _drawn(drafts: list[int], picks: list[float], accepted: float) -> VerifyResult:
    """A sampled sequence's outcome: its accepted drafts, then the token drawn at the row after them."""
    n = int(accepted)
    return VerifyResult([n], [drafts[:n] + [int(picks[n])]])


def _pass(
    seqs: list[Sequence],
    drafts: list[list[int]],
    draft_probs: list[torch.Tensor | None],
    starts: list[int],
    logits: torch.Tensor,
    eos_ids: Collection[int],
) -> _Pass:
    """The device's side of verifying sequences that apply something to their logits (rows at starts[i])."""
    if not seqs:
        nothing = logits.new_empty(0)
        return _Pass(nothing, nothing, nothing, 0)
    counts = [len(d) for d in drafts]
    processed = _processed_rows(seqs, drafts, logits, _rows(starts, counts, range(len(seqs))), eos_ids)
    at = list(accumulate((n + 1 for n in counts), initial=0))  # sequence i's rows in `processed`
    picks = processed.argmax(-1)
    sampled = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
    accepted = picks.new_empty(0)
    if sampled:
        rows = _subset(processed, at, counts, sampled)
        picked = [seqs[i] for i in sampled], [drafts[i] for i in sampled], [draft_probs[i] for i in sampled]
        accepted, tokens = _rejection_sampled(*picked, rows)
        picks[to_device(_rows(at, counts, sampled), picks.device)] = tokens
    asking = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
    widest = top_width([seqs[i].params.logprobs for i in asking], processed.shape[-1])
    table = processed.new_empty(0, dtype=torch.float64)
    if asking:
        rows = _rows(at, counts, asking)
        table = logprob_table(processed, rows, picks[to_device(rows, picks.device)], widest)
    return _Pass(picks, accepted, table, widest)


def _logprobs_read(
    seqs: list[Sequence], results: list[VerifyResult], at: list[int], table: list[float], widest: int
) -> dict[int, list[TokenLogprob]]:
    """Each asking sequence's logprobs (by its place in seqs) from the table as read: the table holds every row of
    theirs, one after another; a sequence's emitted tokens take its first rows."""
    logprobs, taken, width = {}, 0, 1 + 2 * widest
    for i, (seq, result) in enumerate(zip(seqs, results)):
        if seq.params.logprobs is None:
            continue
        emitted, rows = result.tokens[0], at[i + 1] - at[i]
        mine = [table[(taken + j) * width : (taken + j + 1) * width] for j in range(len(emitted))]
        logprobs[i] = logprobs_of_table(mine, emitted, seq.params.logprobs, widest)
        taken += rows
    return logprobs


def _rows(starts: list[int], counts: list[int], chosen) -> list[int]:
    """The rows of the chosen sequences, sequence i's counts[i] + 1 from starts[i]."""
    return [starts[i] + j for i in chosen for j in range(counts[i] + 1)]


def _subset(processed: torch.Tensor, at: list[int], counts: list[int], picked: list[int]) -> torch.Tensor:
    """The picked sequences' rows of `processed` (sequence i's counts[i] + 1 from at[i]): all of it where all are."""
    if len(picked) == len(counts):
        return processed
    return processed[to_device(_rows(at, counts, picked), processed.device)]


def _processed_rows(
    seqs: list[Sequence], drafts: list[list[int]], logits: torch.Tensor, rows: list[int], eos_ids: Collection[int]
) -> torch.Tensor:
    """The sequences' rows of `logits`, in order, float32 (what distributions are made from), each request's logits
    processors and grammar applied to its own, all together (one request alone takes processed_logits' operations)."""
    processed = logits[to_device(rows, logits.device)].float()
    if any(seq.params.has_processors for seq in seqs):
        histories = [
            History(
                s.params,
                s.distinct_prompt_ids,
                s.processed_output(),
                d,
                len(d) + 1,
                s.thinking_from_prompt,
                s.prompt_ids,
            )
            for s, d in zip(seqs, drafts)
        ]
        processed = process_rows(processed, histories, eos_ids)
    return mask_grammars(processed, [seq.grammar for seq in seqs], drafts)


def _rejection_sampled(
    seqs: list[Sequence], drafts: list[list[int]], draft_probs: list[torch.Tensor | None], processed: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling for sampled sequences whose processed rows follow one another in `processed`, left on the
    device: each one's accepted drafts, and each of its rows' token (the draft where accepted, the token drawn after
    them at the first row that is not, anything past it). Distributions are made a call per sampling setting,
    padded to the longest draft, accepted and drawn together."""
    k, vocab, counts = max(map(len, drafts)), processed.shape[-1], [len(d) for d in drafts]
    padded = to_device([d + [0] * (k - len(d)) for d in drafts], processed.device)
    places = to_device(_rows([i * (k + 1) for i in range(len(seqs))], counts, range(len(seqs))), processed.device)
    p = processed.new_zeros(len(seqs) * (k + 1), vocab, dtype=torch.float32)
    p[places] = probs_of_rows(processed, [s.params for s, n in zip(seqs, counts) for _ in range(n + 1)])
    q = _draft_distributions(padded, counts, draft_probs, vocab)
    generators = [seq.generator for seq in seqs]
    accepted, extra = rejection_sample_on_device(padded, counts, p.view(len(seqs), k + 1, vocab), q, generators)
    before = torch.arange(k + 1, device=padded.device)[None, :] < accepted[:, None]
    tokens = torch.where(before, F.pad(padded, (0, 1)), extra[:, None].to(padded.dtype))
    return accepted, tokens.view(-1)[places]


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
