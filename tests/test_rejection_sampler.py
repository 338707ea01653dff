"""The rejection sampler on synthetic tensors: greedy rules, and losslessness checked statistically.

Lossless means: whatever the draft distribution q, every emitted token is distributed as the target's p.
With 1e5 samples a chi-square test must accept p and reject deliberately broken samplers.
"""

import pytest
import torch
from host_reads import HostReads
from scipy.stats import chisquare
from stats import PASS_P, seeded

from specdecode.sampling import logits_to_probs
from specdecode.sampling.logprobs import logprob_table
from specdecode.verify import rejection_sampler as rs
from specdecode.verify import together as one_pass
from specdecode.verify.rejection_sampler import greedy_verify, rejection_sample

N = 100_000
V = 12


def test_greedy_accepts_matching_prefix_then_recovers():
    drafts = torch.tensor([[5, 7, 9, 1]])
    argmax = torch.tensor([[5, 7, 3, 1, 8]])  # disagrees at position 2
    out = greedy_verify(drafts, [4], argmax)
    assert out.num_accepted == [2]
    assert out.tokens == [[5, 7, 3]]  # accepted drafts + the target's token, nothing after the mismatch


def test_greedy_all_accepted_gets_bonus_and_ragged_rows():
    drafts = torch.tensor([[5, 7, 9], [4, 0, 0], [0, 0, 0]])
    argmax = torch.tensor([[5, 7, 9, 2], [4, 6, 6, 6], [3, 3, 3, 3]])
    out = greedy_verify(drafts, [3, 1, 0], argmax)
    assert out.num_accepted == [3, 1, 0]
    assert out.tokens == [[5, 7, 9, 2], [4, 6], [3]]


def _random_dist(gen, peaky=False):
    logits = torch.randn(V, generator=gen) * (3.0 if peaky else 1.0)
    return logits.softmax(-1)


def _emitted(p: torch.Tensor, q: torch.Tensor | None, k: int, seed: int = 0):
    """Run N independent verifications of k drafts; p [k+1, V] per position, q [k, V] or None (one-hot).
    Returns the emitted tokens of every row and the number accepted."""
    gen = seeded(seed)
    if q is None:  # a deterministic proposer: always proposes the same tokens
        drafts = torch.arange(1, k + 1).repeat(N, 1)
        draft_probs = None
    else:
        drafts = torch.multinomial(q, N, replacement=True, generator=gen).T.contiguous()
        draft_probs = q.expand(N, k, V)
    out = rejection_sample(drafts, [k] * N, p.expand(N, k + 1, V), draft_probs, gen)
    return out


def _chi2_pvalue(tokens: list[int], p: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(tokens), minlength=V).double()
    expected = p.double() / p.double().sum() * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "emitted a token the target gives probability 0"
    return chisquare(counts[keep].numpy(), expected[keep].numpy()).pvalue


CASES = ["random_q", "one_hot_q", "peaky_q"]


def _case(name: str, k: int):
    gen = seeded(CASES.index(name) * 1000 + k)
    p = torch.stack([_random_dist(gen) for _ in range(k + 1)])
    if name == "one_hot_q":
        return p, None
    q = torch.stack([_random_dist(gen, peaky=name == "peaky_q") for _ in range(k)])
    return p, q


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("k", [1, 3])
def test_emitted_tokens_follow_target_distribution(name, k):
    p, q = _case(name, k)
    out = _emitted(p, q, k)
    # every position that was emitted is distributed as p at that position
    for pos in range(2 if k > 1 else 1):
        tokens = [t[pos] for t in out.tokens if len(t) > pos]
        assert _chi2_pvalue(tokens, p[pos]) > PASS_P, f"position {pos} deviates from p"
    # and the acceptance rate matches theory: E[accept first] = sum(min(p, q))
    if q is not None:
        first_accepted = sum(n >= 1 for n in out.num_accepted) / N
        assert abs(first_accepted - torch.minimum(p[0], q[0]).sum().item()) < 0.01


def test_a_draw_of_zero_accepts_no_token_the_target_excludes():
    """torch.rand may return exactly 0: a draft of p = 0 must still be rejected, one of p >= q accepted."""
    u = torch.tensor([0.0, 0.0, 0.999999])
    p, q = torch.tensor([0.0, 0.3, 0.5]), torch.tensor([0.4, 0.3, 0.5])
    assert rs.accept_draft(u, p, q).tolist() == [False, True, True]


def test_q_equal_p_accepts_everything():
    gen = seeded(1)
    p = torch.stack([_random_dist(gen) for _ in range(4)])
    out = _emitted(p, p[:3].clone(), 3)
    assert all(n == 3 for n in out.num_accepted)
    assert _chi2_pvalue([t[3] for t in out.tokens], p[3]) > PASS_P  # the bonus token comes from p


def test_same_seed_same_result():
    p, q = _case("random_q", 3)
    a, b = _emitted(p, q, 3, seed=7), _emitted(p, q, 3, seed=7)
    assert a.tokens == b.tokens


BROKEN = {
    # accept only when u < q/p: inverted ratio
    "inverted_ratio": ("accept_draft", lambda u, p, q: u * p <= q),
    # always accept (what forced_accept does): the draft distribution leaks through
    "always_accept": ("accept_draft", lambda u, p, q: torch.ones_like(u, dtype=torch.bool)),
    # resample from p instead of max(0, p - q) after a rejection: over-weights q's tokens
    "resample_from_p": ("residual_distribution", lambda p, q: p),
}


@pytest.mark.parametrize("broken", list(BROKEN))
def test_broken_sampler_is_detected(monkeypatch, broken):
    """The same statistical test must fail for a deliberately wrong implementation."""
    name, impl = BROKEN[broken]
    monkeypatch.setattr(rs, name, impl)
    p, q = _case("peaky_q", 1)
    out = _emitted(p, q, 1)
    assert _chi2_pvalue([t[0] for t in out.tokens], p[0]) < 1e-6


def test_one_argmax_for_the_call_verifies_as_each_sequence_alone():
    """verify_batch shares one argmax among plain greedy sequences; each sequence's result must be what
    verifying it alone gives, beside sequences that need their own processing (a penalty, a sample)."""
    from specdecode.engine.sequence import Sequence
    from specdecode.sampling import SamplingParams
    from specdecode.verify.verifier import verify_batch, verify_drafts

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 50, generator=gen)
    drafts = [[int(logits[0].argmax()), 7], [], [int(logits[4].argmax()), int(logits[5].argmax())], [3]]
    kinds = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, repetition_penalty=1.5),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, seed=1),
    ]
    seqs = [Sequence([1, 2, 3], params, torch.Generator().manual_seed(1)) for params in kinds]
    together = verify_batch(seqs, drafts, [None] * 4, logits, eos_ids=[])
    alone, row = [], 0
    seqs = [Sequence([1, 2, 3], params, torch.Generator().manual_seed(1)) for params in kinds]
    for seq, tokens in zip(seqs, drafts):
        alone.append(verify_drafts(seq, tokens, None, logits[row : row + len(tokens) + 1], eos_ids=[]))
        row += len(tokens) + 1
    assert [r.tokens for r, _ in together] == [r.tokens for r, _ in alone]
    assert [r.num_accepted for r, _ in together] == [r.num_accepted for r, _ in alone]
    assert together[0][0].num_accepted == [1] and together[2][0].num_accepted == [2]  # matches, then a miss


def _mixed_batch(trial: int, device: str = "cpu"):
    """Sequences of several settings (sampled with one-hot and real draft q, penalties, logprobs, no drafts at all;
    greedy with processors, and plain), each seeded but the last: a function making them afresh, their drafts, the
    drafts' q and the call's logits."""
    from specdecode.engine.sequence import Sequence
    from specdecode.sampling import SamplingParams

    gen = seeded(500 + trial)
    kinds = [
        SamplingParams(temperature=0.8, seed=1),
        SamplingParams(temperature=0.8, seed=2),
        SamplingParams(temperature=0.8, seed=3, repetition_penalty=1.5, logprobs=2),
        SamplingParams(temperature=1.0, top_k=5, seed=4),
        SamplingParams(temperature=1.0, top_k=5, seed=5),
        SamplingParams(temperature=0.8, seed=6),
        SamplingParams(temperature=0.9, seed=7, repetition_penalty=1.3, presence_penalty=0.5),
        SamplingParams(temperature=0, seed=8, repetition_penalty=1.2, logprobs=1),
        SamplingParams(temperature=0, seed=9, logit_bias={3: 2.0}),
        SamplingParams(temperature=0),  # plain greedy: the raw argmax
        SamplingParams(temperature=1.0, top_p=0.8),  # no seed: drawn from the default generator, not compared
    ]
    counts = [2, 3, 2, 1, 3, 0, 2, 3, 1, 2, 2]
    logits = torch.randn(sum(counts) + len(counts), V, generator=gen) * 2
    qs = [torch.stack([_random_dist(gen) for _ in range(n)]) if i in (1, 4) else None for i, n in enumerate(counts)]
    drafts, row = [], 0
    for n, q in zip(counts, qs):  # mostly the target's likely tokens, so some steps accept every draft
        likely = logits[row : row + n].argmax(-1) if q is None else torch.multinomial(q, 1, generator=gen)[:, 0]
        drafts.append(likely.tolist())
        row += n + 1

    def fresh():
        generators = [None if p.seed is None else torch.Generator(device).manual_seed(p.seed + trial) for p in kinds]
        return [Sequence([1, 2, 3], params, g) for params, g in zip(kinds, generators)]

    return fresh, drafts, [None if q is None else q.to(device) for q in qs], logits.to(device)


def _together_and_alone(trial: int, in_one_pass: bool | None = False, device: str = "cpu"):
    """_mixed_batch's sequences verified in one batch (in_one_pass: all in one pass; False: plain greedy ones share
    an argmax, the others one by one; None: the device's way) and one at a time."""
    from specdecode.verify.verifier import verify_batch, verify_drafts

    fresh, drafts, qs, logits = _mixed_batch(trial, device)
    together = verify_batch(fresh(), drafts, qs, logits, eos_ids=[], together=in_one_pass)
    alone, row = [], 0
    for seq, tokens, q in zip(fresh(), drafts, qs):
        alone.append(verify_drafts(seq, tokens, q, logits[row : row + len(tokens) + 1], eos_ids=[]))
        row += len(tokens) + 1
    return together, alone, [len(d) for d in drafts]


def _differences(trials: int, in_one_pass: bool | None = False, device: str = "cpu") -> tuple[int, list[int]]:
    """Trials where the batch's results differ from each sequence's own, and each sequence's accepted counts."""
    differ, accepted = 0, []
    for trial in range(trials):
        together, alone, counts = _together_and_alone(trial, in_one_pass, device)
        differ += [(r.tokens, r.num_accepted, lp) for r, lp in together[:-1]] != [
            (r.tokens, r.num_accepted, lp) for r, lp in alone[:-1]
        ]
        accepted += [r.num_accepted[0] - n for (r, _), n in zip(together, counts)]
    return differ, accepted


GPU = [pytest.param("cuda", None, id="cuda")] if torch.cuda.is_available() else []


@pytest.mark.parametrize("device, together", [("cpu", False), ("cpu", True), *GPU])
def test_sequences_verified_together_draw_as_each_alone(device, together):
    """Each seeded sequence's tokens, accepted counts and logprobs are those it gets verified alone, whatever
    shares its batch: sequence by sequence (a CPU's way) and in one pass for all that can (a GPU's)."""
    differ, shortfalls = _differences(trials=30, in_one_pass=together, device=device)
    assert differ == 0
    assert 0 in shortfalls and any(s < 0 for s in shortfalls)  # every draft accepted, and rejections


def test_a_pass_reads_the_host_once_however_mixed_its_batch():
    """One pass over a batch of every kind (plain greedy, greedy with processors, seeded and unseeded sampled,
    logprobs, real and one-hot q) copies to the host once (on a GPU: one wait a verify); one by one, a sequence that
    is not plain greedy copies at least once of its own."""
    from specdecode.verify.verifier import verify_batch

    fresh, drafts, qs, logits = _mixed_batch(0)
    reads = {}
    for in_one_pass in (True, False):
        with HostReads() as reads[in_one_pass]:
            verify_batch(fresh(), drafts, qs, logits, eos_ids=[], together=in_one_pass)
    assert reads[True].total == 1
    assert reads[False].total >= len(drafts)


BROKEN_TOGETHER = {
    # every row made a distribution under the first sequence's settings
    "one setting for all": ("probs_of_rows", lambda logits, params: logits_to_probs(logits, params[0])),
    # every draft taken as deterministic (one-hot q), the draft model's own distributions dropped
    "draft distributions dropped": ("_draft_distributions", lambda *args: None),
    # the pass's rows left unprocessed (penalties, logit bias), greedy and sampled alike
    "processors dropped": ("process_rows", lambda processed, histories, eos_ids=(): processed),
    # each sequence's logprobs read from the row after the token's
    "logprobs a row late": (
        "logprob_table",
        lambda rows, at, tokens, widest: logprob_table(rows, [min(r + 1, len(rows) - 1) for r in at], tokens, widest),
    ),
}


@pytest.mark.parametrize("broken", list(BROKEN_TOGETHER))
def test_a_pass_that_mixes_up_sequences_is_caught(monkeypatch, broken):
    name, impl = BROKEN_TOGETHER[broken]
    monkeypatch.setattr(one_pass, name, impl)
    assert _differences(trials=10, in_one_pass=True)[0] > 0
