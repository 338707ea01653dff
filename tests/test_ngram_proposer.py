"""Prompt lookup on its own: which match it takes, what it offers, and that the engine's preview and
its drafts agree."""

import pytest

from specdecode.engine.sequence import Sequence
from specdecode.proposers import NgramProposer, Preview
from specdecode.sampling import SamplingParams


def _seq(ids):
    return Sequence(list(ids), SamplingParams(temperature=0), None)


def test_longest_match_first_and_the_most_recent_occurrence_wins():
    ngram = NgramProposer(max_ngram=3)
    # "1 2 3" occurred twice; the later occurrence is followed by 7 8, the earlier by 4 5
    ids = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 0, 1, 2, 3]
    assert ngram.match(ids, 2) == Preview(3, [7, 8])
    # only a 1-token match: the last 6 is preceded by nothing longer that repeats
    assert ngram.match([6, 5, 4, 2, 6], 3) == Preview(1, [5, 4, 2])


def test_offers_at_most_k_tokens_and_nothing_without_a_match():
    ngram = NgramProposer(max_ngram=2)
    assert ngram.match([1, 2, 3, 1, 2], 1) == Preview(2, [3])
    assert ngram.match([1, 2, 3, 4], 3) == Preview(0, [])
    assert ngram.match([5], 3) == Preview(0, [])


def test_min_ngram_refuses_short_matches():
    assert NgramProposer(max_ngram=3, min_ngram=2).match([6, 5, 4, 2, 6], 3) == Preview(0, [])
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
