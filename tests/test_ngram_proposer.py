"""Prompt lookup on its own: which match it takes, what it offers, and that the engine's preview and
its drafts agree."""

import pytest

from specdecode.engine.sequence import Sequence
from specdecode.proposers import NgramProposer, Preview
from specdecode.proposers.catch_up import share
from specdecode.sampling import SamplingParams


def _seq(ids):
    return Sequence(list(ids), SamplingParams(temperature=0), None)


def test_longest_match_first_and_the_most_recent_occurrence_wins():
    ngram = NgramProposer(max_ngram=3)
    # "1 2 3" occurred twice; the later occurrence is followed by 7 8, the earlier by 4 5
    ids = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 0, 1, 2, 3]
    assert ngram.match(_seq(ids), 2) == Preview(3, [7, 8])
    # only a 1-token match: the last 6 is preceded by nothing longer that repeats
    assert ngram.match(_seq([6, 5, 4, 2, 6]), 3) == Preview(1, [5, 4, 2])


def test_offers_at_most_k_tokens_and_nothing_without_a_match():
    ngram = NgramProposer(max_ngram=2)
    assert ngram.match(_seq([1, 2, 3, 1, 2]), 1) == Preview(2, [3])
    assert ngram.match(_seq([1, 2, 3, 4]), 3) == Preview(0, [])
    assert ngram.match(_seq([5]), 3) == Preview(0, [])


def test_min_ngram_refuses_short_matches():
    assert NgramProposer(max_ngram=3, min_ngram=2).match(_seq([6, 5, 4, 2, 6]), 3) == Preview(0, [])
    with pytest.raises(ValueError):
        NgramProposer(max_ngram=1, min_ngram=2)


def test_propose_drafts_what_preview_offered_capped_per_sequence():
    ngram = NgramProposer()
    seqs = [_seq([1, 2, 3, 4, 1, 2]), _seq([9, 8, 7]), _seq([4, 4, 4, 4])]
    previews = ngram.preview(seqs, 4)
    drafts = ngram.propose(seqs, [2, 4, 0], [None] * 3)
    assert drafts.tokens == [previews[0].tokens[:2], [], []]
    assert drafts.probs == [None, None, None]  # deterministic: the verifier treats q as one-hot
    assert ngram.unseen_tokens(seqs[0]) == 0  # nothing to catch up on


def _scanned(ids: list[int], k: int, sizes: range, indexed: int | None = None) -> Preview:
    """The match by a scan backwards through the sequence (an occurrence followed by a token of its first `indexed`):
    what the index must find."""
    indexed = len(ids) if indexed is None else indexed
    for n in range(min(sizes.stop - 1, len(ids) - 1), sizes.start - 1, -1):
        for start in range(min(len(ids), indexed) - n - 1, -1, -1):
            if ids[start : start + n] == ids[-n:]:
                return Preview(n, ids[start + n : start + n + k])
    return Preview(0, [])


def _first_occurrence_kept(self, max_tokens):
    ids, end = self.tokens, min(len(self.tokens), self.read + max_tokens)
    for n, latest in self.latest.items():
        for start in range(max(0, self.read - n), end - n):
            latest.setdefault(tuple(ids[start : start + n]), start)
    self.read, self.caught_up = end, end == len(ids)


def _last_token_indexed(self, max_tokens):
    ids, end = self.tokens, min(len(self.tokens), self.read + max_tokens)
    for n, latest in self.latest.items():
        for start in range(max(0, self.read - n + 1), end - n + 1):
            latest[tuple(ids[start : start + n])] = start
    self.read, self.caught_up = end, end == len(ids)


BROKEN_INDEX = {
    "the first occurrence kept": _first_occurrence_kept,
    "the last token's n-gram indexed": _last_token_indexed,
}


@pytest.mark.parametrize("broken", [None, *BROKEN_INDEX])
def test_the_index_finds_the_match_a_scan_finds_as_the_sequence_grows(broken, monkeypatch):
    """The n-gram index, updated as tokens arrive one or several at a time, finds at every length the match a scan
    backwards finds. Broken: an index that keeps each n-gram's first occurrence, and one that also indexes the n-gram
    ending at the last token (nothing follows it yet, and the tail would match itself)."""
    import random

    from specdecode.proposers import ngram as ngram_module

    if broken:
        monkeypatch.setattr(ngram_module.NgramIndex, "index", BROKEN_INDEX[broken])
    rng, agree = random.Random(0), True
    for sizes in (range(1, 4), range(2, 5)):
        proposer, seq = NgramProposer(max_ngram=sizes.stop - 1, min_ngram=sizes.start), _seq([1])
        while len(seq.token_ids) < 400:
            seq.token_ids += [rng.randrange(6) for _ in range(rng.choice([1, 1, 3]))]  # few ids: many repeats
            agree &= proposer.match(seq, 4) == _scanned(seq.token_ids, 4, sizes)
    assert agree == (broken is None)


@pytest.mark.parametrize("broken", [None, *BROKEN_INDEX])
def test_a_long_prompt_is_indexed_in_bounded_shares_and_matched_in_the_part_indexed(broken, monkeypatch):
    import random

    from specdecode.proposers import ngram as ngram_module

    if broken:
        monkeypatch.setattr(ngram_module.NgramIndex, "index", BROKEN_INDEX[broken])
    rng, agree, steps = random.Random(1), True, 0
    proposer, seq = NgramProposer(), _seq([rng.randrange(12) for _ in range(5000)])
    index = proposer._index_of(seq)
    while not index.caught_up:
        behind = index.behind
        (preview,) = proposer.preview([seq], 4)
        assert behind - index.behind <= share(behind)
        agree &= preview == _scanned(seq.token_ids, 4, range(1, 4), index.read)
        seq.token_ids += [rng.randrange(12) for _ in range(2)]
        steps += 1
    assert steps > 5 and index.read == len(seq.token_ids) - 2
    assert agree == (broken is None)


def test_a_released_sequence_leaves_no_index_behind():
    ngram, seq = NgramProposer(), _seq([1, 2, 1, 2])
    ngram.preview([seq], 2)
    assert ngram._indexes
    ngram.release(seq)
    assert not ngram._indexes


def test_the_index_holds_no_more_than_it_declares_a_token():
    """What the memory plan counts for the index (host_bytes_per_token) bounds what it holds, for sequences whose
    n-grams are all new (the most entries), at lengths on both sides of the index's dicts growing their tables."""
    import random
    import tracemalloc

    rng = random.Random(1)
    for length in (1000, 2800, 5600, 11000):
        proposer, seq = NgramProposer(), _seq([rng.randrange(1 << 20) for _ in range(length)])
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        while not proposer._index_of(seq).caught_up:
            proposer.preview([seq], 4)
        held = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        assert held <= proposer.host_bytes_per_token * length
