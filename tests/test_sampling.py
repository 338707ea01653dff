"""Temperature / top-k / top-p: the processed distribution that both target and draft use."""

import pytest
import torch
from scipy.stats import chisquare
from stats import PASS_P, SEED, seeded

from specdecode.sampling import SamplingParams, logits_to_probs, probs_of_rows, sample_rows, uniform_rows
from specdecode.sampling import probs as probs_module
from specdecode.sampling.probs import NUCLEUS_CANDIDATES, nucleus

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])


def test_greedy_is_one_hot_argmax():
    probs = logits_to_probs(LOGITS, SamplingParams(temperature=0))
    assert probs.tolist() == [[1.0, 0, 0, 0, 0, 0]]


def test_temperature_scales_logits():
    probs = logits_to_probs(LOGITS, SamplingParams(temperature=0.5))
    torch.testing.assert_close(probs, (LOGITS / 0.5).softmax(-1))


def test_top_k_keeps_k_largest_renormalised():
    probs = logits_to_probs(LOGITS, SamplingParams(top_k=2))
    torch.testing.assert_close(probs[0, :2], LOGITS[0, :2].softmax(-1))
    assert probs[0, 2:].sum() == 0


def test_top_p_keeps_smallest_prefix_reaching_p():
    full = LOGITS.softmax(-1)[0]  # ~[0.56, 0.21, 0.13, 0.08, 0.03, 0.004]
    probs = logits_to_probs(LOGITS, SamplingParams(top_p=0.7))[0]
    assert (probs[:2] > 0).all() and probs[2:].sum() == 0  # 0.56 < 0.7 <= 0.56 + 0.21
    torch.testing.assert_close(probs[:2], full[:2] / full[:2].sum())


def test_top_p_one_and_top_k_off_leave_distribution_unchanged():
    torch.testing.assert_close(logits_to_probs(LOGITS, SamplingParams(top_p=1.0, top_k=-1)), LOGITS.softmax(-1))


def _top_p_by_sorting(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The definition, on whole sorted rows: a token is dropped when the tokens ranked above it reach top_p."""
    ranked, order = probs.sort(-1, descending=True)
    drop = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, (ranked.cumsum(-1) - ranked) >= top_p)
    kept = probs.masked_fill(drop, 0)
    return kept / kept.sum(-1, keepdim=True)


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99])
def test_top_p_over_a_large_vocabulary_keeps_what_sorting_every_row_keeps(top_p):
    """Peaked rows (their nucleus among the first-ranked candidates) and flat ones (wider than the candidates)."""
    gen = seeded(31)
    vocab = 4 * NUCLEUS_CANDIDATES
    logits = torch.randn(12, vocab, generator=gen) * torch.tensor([8.0] * 6 + [0.5] * 6)[:, None]
    params = SamplingParams(temperature=1.0, top_p=top_p)
    got, expected = logits_to_probs(logits, params), _top_p_by_sorting(logits.softmax(-1), top_p)
    assert torch.equal(got > 0, expected > 0)
    torch.testing.assert_close(got, expected)
    assert (expected[6:] > 0).sum(-1).min() > NUCLEUS_CANDIDATES  # the flat rows needed more than the candidates
    sorted_whole = nucleus(logits.softmax(-1), top_p, sort_rows=True)  # a GPU's way
    assert torch.equal(sorted_whole > 0, expected > 0)
    torch.testing.assert_close(sorted_whole, expected)


def _draws_follow(sampler, probs: torch.Tensor, n: int = 200_000) -> float:
    """Chi-square p-value of n draws from one unnormalised row; fails outright on a zero-probability token."""
    tokens = sampler(probs.expand(n, -1), seeded(7))
    counts = torch.bincount(tokens, minlength=probs.shape[-1]).double()
    assert counts[probs == 0].sum() == 0, "drew a token of probability 0"
    keep = probs > 0
    return chisquare(counts[keep].numpy(), (probs[keep].double() / probs.sum() * n).numpy()).pvalue


# unnormalised, as a rejection's residual max(0, p - q) is, with zeros inside and at both ends
RESIDUAL = torch.tensor([0.0, 0.05, 0.0, 0.12, 0.003, 0.0, 0.09, 0.04, 0.0])


def test_drawn_tokens_follow_an_unnormalised_row():
    assert _draws_follow(sample_rows, RESIDUAL) > PASS_P


def test_a_draw_that_ignores_the_row_s_total_is_caught():
    def broken(probs, generator):
        cdf = probs.double().cumsum(-1)
        u = torch.rand(probs.shape[0], 1, generator=generator, dtype=torch.float64)
        return torch.searchsorted(cdf, u, right=True)[:, 0].clamp(max=probs.shape[-1] - 1)

    with pytest.raises(AssertionError, match="probability 0"):
        _draws_follow(broken, RESIDUAL)


# Pairs that differ in one setting each (temperature, top-k, top-p, min-p), and greedy
SETTINGS = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3),
    SamplingParams(temperature=0.7, top_k=3),
    SamplingParams(temperature=0.7, top_p=0.6),
    SamplingParams(temperature=0.7, min_p=0.2),
    SamplingParams(temperature=0),
]


def _rows_differing_from_alone() -> int:
    """Rows of interleaved settings made distributions together that differ, in any bit, from each made alone."""
    gen = seeded(41)
    logits = torch.randn(24, 40, generator=gen) * 2
    params = [SETTINGS[i % len(SETTINGS)] for i in torch.randperm(24, generator=gen).tolist()]
    together = probs_of_rows(logits, params)
    return sum(not torch.equal(together[i], logits_to_probs(logits[i : i + 1], p)[0]) for i, p in enumerate(params))


def test_rows_of_different_settings_get_what_each_gets_alone():
    assert _rows_differing_from_alone() == 0


@pytest.mark.parametrize("forgotten", range(4))
def test_settings_that_differ_in_one_field_are_told_apart(monkeypatch, forgotten):
    """Broken variants: rows grouped by a key that leaves out temperature, top-k, top-p or min-p."""
    told = probs_module._distribution
    monkeypatch.setattr(
        probs_module, "_distribution", lambda p: tuple(v for i, v in enumerate(told(p)) if i != forgotten)
    )
    assert _rows_differing_from_alone() > 0


def _streams(rows: int) -> list:
    """Every third row seeded (a stream of its own), the rest drawing from the default generator."""
    return [None if i % 3 else torch.Generator().manual_seed(SEED + 100 + i) for i in range(rows)]


def test_a_seeded_row_draws_what_it_draws_alone_beside_rows_without_a_seed():
    counts = [i % 4 for i in range(30)]
    torch.manual_seed(SEED)
    u = uniform_rows(_streams(30), counts, 3, "cpu")
    for i, g in enumerate(_streams(30)):
        if g is not None:
            assert torch.equal(u[i, : counts[i]], torch.rand(counts[i], generator=g))
            assert (u[i, counts[i] :] == 0).all()
    unseeded = u[[i for i in range(30) if i % 3]]
    assert len(set(unseeded.flatten().tolist())) == unseeded.numel()  # draws of their own, none shared


def test_rows_without_a_seed_beside_seeded_ones_follow_their_row():
    n = 60_000
    torch.manual_seed(SEED + 7)
    tokens = sample_rows(RESIDUAL.expand(n, -1), _streams(n))
    unseeded = tokens[[i for i in range(n) if i % 3]]
    counts = torch.bincount(unseeded, minlength=len(RESIDUAL)).double()
    assert counts[RESIDUAL == 0].sum() == 0
    keep = RESIDUAL > 0
    expected = RESIDUAL[keep].double() / RESIDUAL.sum() * len(unseeded)
    assert chisquare(counts[keep].numpy(), expected.numpy()).pvalue > PASS_P


# Rows for settings held in tensors: SETTINGS, combinations of truncations, a top-k past the vocabulary
PER_ROW = SETTINGS + [
    SamplingParams(temperature=0.9, top_k=40, top_p=0.8, min_p=0.01),
    SamplingParams(temperature=1.1, top_k=7, top_p=0.95),
    SamplingParams(temperature=0.5, top_k=5000),
]


def _rows_by_settings_differing_from_logits_to_probs() -> int:
    """Sampled rows of interleaved PER_ROW settings whose distribution by probs_of_settings differs, in any bit, from
    logits_to_probs' (over a vocabulary wider than the nucleus's first-ranked candidates)."""
    from specdecode.sampling.per_row import RowSettings, probs_of_settings

    gen = seeded(43)
    logits = torch.randn(30, 3 * NUCLEUS_CANDIDATES, generator=gen) * torch.logspace(-1, 1, 30)[:, None]
    params = [PER_ROW[i % len(PER_ROW)] for i in torch.randperm(30, generator=gen).tolist()]
    got = probs_of_settings(logits, RowSettings.of(params, logits.shape[-1], "cpu"))
    return sum(
        not torch.equal(got[i], logits_to_probs(logits[i : i + 1], p)[0]) for i, p in enumerate(params) if not p.greedy
    )


def test_settings_held_in_tensors_give_each_row_what_logits_to_probs_gives():
    """A drafter's chained rounds make every row's distribution in the same operations, its settings in tensors:
    each sampled row's, bit for bit, is the one logits_to_probs makes for its settings alone."""
    assert _rows_by_settings_differing_from_logits_to_probs() == 0


def _filled_then(change):
    from specdecode.sampling.per_row import RowSettings

    fill = RowSettings.fill

    def broken(self, params, vocab):
        fill(self, params, vocab)
        change(self, vocab)

    return broken


BROKEN_PER_ROW = {
    # each row's top-k one wider
    "top-k one wider": lambda s, vocab: s.top_k.copy_((s.top_k + 1).clamp(max=vocab)),
    # rows without top-p given a value just under 1: their rows renormalised
    "no top-p not neutral": lambda s, vocab: s.top_p.masked_fill_(s.top_p == 1, 0.9999999),
    # each row's min-p floor the next row's
    "min-p of another row": lambda s, vocab: s.log_min_p.copy_(s.log_min_p.roll(1, 0)),
}


@pytest.mark.parametrize("broken", list(BROKEN_PER_ROW))
def test_settings_in_tensors_that_stray_are_caught(monkeypatch, broken):
    from specdecode.sampling.per_row import RowSettings

    monkeypatch.setattr(RowSettings, "fill", _filled_then(BROKEN_PER_ROW[broken]))
    assert _rows_by_settings_differing_from_logits_to_probs() > 0
