"""Speculation policies: fixed, vLLM's disable-by-batch-size, and the adaptive goodput policy."""

import random

import numpy as np
import pytest
from conftest import priced_without_timing, run_as_one_batch

from specdecode import LLM, SamplingParams, SpecDecodeError
from specdecode.config import AdaptiveOptions
from specdecode.engine.policy import AdaptivePolicy, CostTable, TargetCost, make_policy
from specdecode.engine.policy.allocation import StepPrice


def test_token_gains_of_a_fresh_policy_follow_the_prior():
    p = make_policy("adaptive", 3, prior_acceptance=0.5)
    assert p.token_gains(1.0) == pytest.approx([1.0, 0.5, 0.25])
    assert p.token_gains(0.0) == [0.0, 0.0, 0.0]


def test_fixed_and_disable_by_batch_size():
    assert make_policy("fixed", 3).choose(["a"] * 10).ks == [3] * 10
    p = make_policy("disable_by_batch_size", 3, max_batch_for_speculation=4)
    assert p.choose(["a"] * 4).ks == [3] * 4
    assert p.choose(["a"] * 5).ks == [0] * 5
    with pytest.raises(SpecDecodeError):
        make_policy("disable_by_batch_size", 3)
    with pytest.raises(SpecDecodeError, match="unknown speculation policy"):
        make_policy("sometimes", 3)


def step_seconds(
    costs, ks: list[int], by_lookup: list[bool] | None = None, reach: list[float] | None = None, contexts=None
) -> float:
    """The predicted seconds of a step where sequence i (contexts[i] tokens cached) may draft ks[i] tokens, by prompt
    lookup where by_lookup[i], the draft model reaching position j + 1 with chance reach[j] (default: always): its
    drafts grown sequence by sequence, where the allocation grows them most likely first."""
    contexts = contexts or [0] * len(ks)
    step = StepPrice(costs, len(ks), reach or [1.0] * max(ks, default=0), contexts)
    for i, k in enumerate(ks):
        for length in range(1, k + 1):
            step.grow(length, bool(by_lookup and by_lookup[i]), contexts[i])
    return step.seconds


def _measured(alphas: list[float], c: float, k_max: int = 4, verify_growth: float = 0.0) -> AdaptivePolicy:
    """A policy that has measured: target forward 1 s at the batch size, +verify_growth s per extra token;
    a draft forward c s at any drafting batch size."""
    p = make_policy("adaptive", k_max)
    n = len(alphas)
    for i, a in enumerate(alphas):
        p.estimator.acceptance[str(i)] = a
    for tokens in range(n, n * (k_max + 1) + 1):
        for _ in range(2):  # a size's first sample is provisional
            p.costs.target.observe(n, tokens, 1.0 + verify_growth * (tokens - n))
    for m in range(1, n + 1):
        p.costs.draft.observe(m, c)
    p.probe_trials = 0  # the estimates are trusted as they are (no probing); later positions stay at the prior
    return p


def _choose(p: AdaptivePolicy, n: int) -> list[int]:
    return p.choose([str(i) for i in range(n)]).ks


def test_adaptive_explores_then_decides():
    p = make_policy("adaptive", 4)
    assert p.choose(["r"]).ks == [0]  # nothing measured: plain first
    p.costs.target.observe(1, 1, 3.0)
    assert p.choose(["r"]).ks == [0]  # the first sample carries one-off work: plain again
    p.costs.target.observe(1, 1, 1.0)
    assert p.probes_next([0]) and p.choose(["r"]).ks == [4]  # plain measured: try speculating once
    assert p.choose(["r", "s"]).ks == [0, 0]  # a new batch size: measure plain there first
    p.costs.target.observe(2, 2, 1.0)
    p.costs.target.observe(2, 2, 1.0)
    assert p.choose(["r", "s"], catch_up=[300, 2]).ks == [0, 4]  # probe where the draft has least to catch up


@pytest.mark.parametrize(
    "alpha, c, expected",
    [
        (0.9, 0.1, [4]),  # good draft, cheap: draft the most
        (0.2, 0.5, [0]),  # poor draft, costly: do not speculate
        (0.0, 0.05, [0]),  # nothing is ever accepted
    ],
)
def test_adaptive_picks_goodput_maximising_k(alpha, c, expected):
    assert _choose(_measured([alpha], c), 1) == expected


def test_adaptive_chooses_k_per_sequence():
    """An easy sequence drafts, a hopeless one in the same batch does not."""
    ks = _choose(_measured([0.9, 0.0], 0.1, verify_growth=0.05), 2)
    assert ks[0] >= 2 and ks[1] == 0


def test_adaptive_stops_when_verification_gets_expensive():
    """Under load a wide verify call stops being free (compute-bound): speculation must switch off."""
    assert _choose(_measured([0.8] * 16, 0.1, verify_growth=0.2), 16) == [0] * 16
    assert any(_choose(_measured([0.8] * 16, 0.1, verify_growth=0.0), 16))


def test_slow_speculation_at_one_batch_size_does_not_switch_it_off_at_another():
    """Speculative steps at batch 4 measured twice as slow as predicted: batch 4 stops speculating, batch 1
    keeps going (a single calibration shared by all batch sizes froze it here: it blocked batch 1 too, and
    never relearned because nothing speculated any more). While batch 4 decodes plainly its calibration
    relaxes, so it is tried again later."""
    p = _measured([0.9] * 4, 0.25, verify_growth=0.01)  # predicted ~1.5x at either batch size
    assert any(_choose(p, 4))
    for _ in range(20):  # twenty steady speculative steps at batch 4, each twice as slow as predicted
        ks = [4] * 4
        p._predicted = (step_seconds(p.costs, ks), True)
        p.observe_step(ks, 1.2, None, step_seconds=2 * p._predicted[0])
    assert _choose(p, 4) == [0] * 4
    p.costs.target.observe(1, 1, 1.0)
    p.costs.target.observe(1, 1, 1.0)
    assert any(_choose(p, 1))
    p.observe_step([4], 1.2, None, step_seconds=p._predicted[0])  # batch 1 ran as predicted
    for _ in range(200):
        p.observe_step([0] * 4, 1.0, None, step_seconds=1.0)
    assert p.calibration.get(4, 1.0) < 1.05
    assert any(_choose(p, 4))


@pytest.mark.parametrize("carried", [True, False])
def test_steps_that_carry_a_prompt_chunk_leave_the_cost_model_as_it_was(carried):
    """While a long prompt prefills, its chunk rides in the verify's call and every step takes many verifies'
    time. Timed as any other step, they make a verify row look nearly free against the chunk, and once the prompt
    is in, the policy drafts deeper than the target's real costs pay for (the variant with carried False)."""
    p = _measured([0.6], 0.05, verify_growth=0.3)
    before = _choose(p, 1)
    for _ in range(30):
        k = _choose(p, 1)[0]
        p.observe_step([k], 8.0 + 0.3 * k, 0.05 if k else None, step_seconds=8.5 + 0.3 * k, untimed=carried)
    assert (_choose(p, 1) == before) == carried


def test_cost_table_interpolates_and_replaces_the_warmup_sample():
    t = CostTable()
    t.observe(1, 10.0)  # first call: warm-up
    t.observe(1, 1.0)
    t.observe(2, 2.0)
    t.observe(2, 2.0)
    t.observe(5, 2.0)
    t.observe(5, 2.0)
    assert t(1) == 1.0 and t(4) == 2.0
    # outside the measured sizes never cheaper per unit than the nearest one: in proportion above (the
    # slope of 1, 2, 5 would say 2.6), flat below
    assert t(10) == pytest.approx(4.0)
    t = CostTable()
    t.observe(4, 1.0)
    t.observe(4, 1.0)
    assert t(1) == 1.0 and t(8) == 2.0


def test_one_bad_sample_cannot_lock_a_size_out():
    """A pessimistic sample of a size the policy then avoids would never be corrected (in a server sweep
    one catch-up-laden draft round set the draft cost to 4x its real value and speculation stayed off at
    batch 1 for good). A lone first sample is not trusted while other sizes are known, and a stall among
    steady samples does not move the estimate at all (a plain step at batch 2 that stalled to 2.4x once
    kept speculation on at a loss until plain decoding was measured again)."""
    t = CostTable()
    t.observe(1, 1.0)
    t.observe(1, 1.0)
    t.observe(5, 50.0)  # first call with a new shape
    assert t(5) == pytest.approx(5.0)  # from size 1, until a second sample of size 5 arrives
    t.observe(5, 2.0)
    assert t(5) == 2.0
    t.observe(5, 20.0)
    assert t(5) == 2.0
    for _ in range(3):
        t.observe(5, 2.2)
    t.observe(5, 20.0)
    assert t(5) == 2.2


def test_cost_table_follows_a_lasting_change():
    """Load or the host's speed changes for good: the estimate follows within a few samples."""
    t = CostTable()
    for _ in range(10):
        t.observe(1, 1.0)
    for _ in range(4):
        t.observe(1, 3.0)
    assert t(1) == 3.0


def test_target_cost_is_per_batch_size():
    """Tokens in the call are not enough: on this project's CPU 8 sequences x 2 tokens cost 437 ms, 16 x 1
    347 ms. Beyond a batch size's measurements the cost grows by a per-token slope, its own once it has
    one, else borrowed from the other batch sizes, else 2% of the plain step per token; the slope holds
    up to one token past the largest call measured anywhere, and the cost grows in proportion beyond."""
    t = TargetCost()
    for _ in range(2):
        t.observe(16, 16, 0.347)
        t.observe(8, 8, 0.334)
        t.observe(8, 16, 0.437)
        t.observe(8, 24, 0.511)
    assert t(8, 16) == 0.437 and t(16, 16) == 0.347
    assert t.has_plain(8) and t.has_plain(16) and not t.has_plain(4)
    slope_at_8 = t.tables[8].slope()
    assert slope_at_8 == pytest.approx((0.511 - 0.334) / 16)
    assert t(8, 25) == pytest.approx(0.511 + slope_at_8)
    assert t(8, 40) == pytest.approx((0.511 + slope_at_8) * 40 / 25)  # in proportion past 25 tokens
    # batch 8's growth from 16 to 24 tokens, as it measured it, then its slope for one token more
    assert t(16, 25) == pytest.approx(0.347 + (0.511 - 0.437) + slope_at_8)
    t.observe(2, 2, 0.3)
    t.observe(2, 3, 0.31)  # spans one token: too little for a slope of its own
    assert t(2, 10) == pytest.approx(0.31 + 7 * slope_at_8)
    lone = TargetCost()
    lone.observe(1, 1, 0.3)
    assert lone(1, 2) == pytest.approx(0.3 * 1.02)
    assert lone(1, 5) == pytest.approx(0.3 * 1.02 * 5 / 2)
    with pytest.raises(LookupError):
        lone(2, 2)


def test_a_slope_learned_on_small_calls_does_not_price_large_ones():
    """This project's CPU after concurrency 1 (1 x 1..5 tokens: 30 ms + 3.25 ms a token) meets batch 2,
    where 2 x 5 tokens cost 80 ms. Along batch 1's slope that call would cost 56 ms; priced in proportion
    past 6 tokens it costs 72. Calls one token past the largest measured still follow the slope, so
    drafting grows into larger calls as they are measured."""
    t = TargetCost()
    for _ in range(2):
        for tokens in range(1, 6):
            t.observe(1, tokens, 0.030 + 0.00325 * (tokens - 1))
        t.observe(2, 2, 0.030)
    assert t(2, 6) == pytest.approx(0.030 + 4 * 0.00325)
    assert t(2, 10) == pytest.approx((0.030 + 4 * 0.00325) * 10 / 6)


def test_verify_growth_is_borrowed_over_the_span_another_batch_size_measured():
    """Batch 1 measured calls of 1-5 tokens, dearer per token past 2 (kernels' cost per row grows with
    the rows): batch 2's call of 5 tokens costs its plain step plus batch 1's growth from 2 to 5 tokens,
    not a slope averaged over 1-5."""
    t = TargetCost()
    batch_1 = {1: 0.0300, 2: 0.0304, 3: 0.0348, 4: 0.0377, 5: 0.0430}
    for _ in range(2):
        for tokens, seconds in batch_1.items():
            t.observe(1, tokens, seconds)
        t.observe(2, 2, 0.0300)
    assert t(2, 5) == pytest.approx(0.0300 + 0.0430 - 0.0304)
    assert t(2, 5) > 0.0300 + 3 * t.slope(1)
    t.observe(2, 6, 0.049)
    t.observe(2, 6, 0.049)
    assert t(2, 7) == pytest.approx(0.049 + t.slope(2))


def _served(batch_sizes: list[int]) -> AdaptivePolicy:
    """A policy that has drafted at batch_sizes (and decoded plainly at 1, 2, 4, 8), with what this
    project's CPU measured (Qwen 1.5B target, int8 0.5B draft, HumanEval): the target's plain step at
    each batch size and 11.5 ms per verified token; a draft round of 55, 63, 69 ms for 1, 2, 4 sequences
    (it costs 129 ms at 8: the int8 layers take their bf16 GEMM at 8 rows); first tokens accepted 90% of
    the time, later ones 93%; 2.5 ms per token of draft catch-up."""
    plain = {1: 0.296, 2: 0.285, 4: 0.279, 8: 0.334}
    draft = {1: 0.055, 2: 0.063, 4: 0.069}
    p = make_policy("adaptive", 4)
    for _ in range(2):
        for n in plain:  # the next batch size has run a few plain steps already
            for extra in (0, n, 4 * n) if n in batch_sizes else (0,):
                p.costs.target.observe(n, n + extra, plain[n] + 0.0115 * extra)
        for n in batch_sizes:
            p.costs.draft.observe(n, draft[n])
    p.costs.draft_prefill_per_token = 0.0025
    p.estimator.depth = {1: (90.0, 100.0), 2: (93.0, 100.0), 3: (93.0, 100.0), 4: (93.0, 100.0)}
    return p


def test_new_requests_at_batch_4_draft_but_not_at_batch_8():
    """The server sweep's concurrency 8, seen from the policy: 8 new requests whose prompts (~115 tokens)
    the draft has not read, after concurrency 1, 2 and 4 measured the draft at up to 4 sequences. Drafting
    for all 8 predicts at most break-even once the draft round is priced at its real size and the
    catch-ups are paid, so the policy decodes plainly (extrapolating the draft along its slope to ~87 ms
    made it start all 8 catch-ups in one 5 s step). At batch 4, new requests still draft."""
    ids = [str(i) for i in range(8)]
    p = _served([1, 2, 4])
    assert sum(p.choose(ids[:4], catch_up=[115] * 4, remaining=[127] * 4).ks) >= 4
    assert p.choose(ids, catch_up=[115] * 8, remaining=[127] * 8).ks == [0] * 8


def _simulate(
    p: AdaptivePolicy, first: float, then: float, steps: int = 20000, request_id: str = "r", goes_on: float = 1.0
) -> None:
    """Steps allowed 4 draft tokens: the first accepted with probability `first`, each later one (given
    the one before was accepted) with probability `then`. After each drafted token the draft goes on with
    probability `goes_on` (below 1: it stops early, as under the draft's confidence stop)."""
    rng = random.Random(0)
    for _ in range(steps):
        drafted = 1
        # at 1 no draw: the outcome stream stays the same
        while drafted < 4 and (goes_on == 1.0 or rng.random() < goes_on):
            drafted += 1
        accepted = 0
        while accepted < drafted and rng.random() < (first if accepted == 0 else then):
            accepted += 1
        p.observe_acceptance(request_id, drafted, accepted, allowed=4)


def test_acceptance_estimates_are_unbiased():
    """i.i.d. acceptance 0.6 at k = 4: first-position and conditional estimates approach 0.6
    (accepted/drafted would approach 0.34)."""
    p = make_policy("adaptive", 4, acceptance_smoothing=0.01, depth_smoothing=0.001)
    _simulate(p, 0.6, 0.6)
    assert p.estimator.acceptance["r"] == pytest.approx(0.6, abs=0.05)
    for position in (2, 3, 4):
        assert p.estimator.conditional_acceptance(position) == pytest.approx(0.6, abs=0.05)
    assert 1 + sum(p.token_gains(0.6)) == pytest.approx((1 - 0.6**5) / (1 - 0.6), rel=0.05)  # i.i.d. formula


@pytest.mark.parametrize("earlier, draft_cost, drafts", [(0.95, 0.75, True), (0.3, 0.3, False)])
def test_a_new_request_starts_from_the_acceptance_of_earlier_ones(earlier, draft_cost, drafts):
    """Costs where the fixed prior (0.7) decides one way and the acceptance earlier requests measured
    the other: a new request follows the measured one from its first step. (A fresh policy probes once
    first: with a prior that predicts no gain, drafting would otherwise never be measured.)"""
    p = make_policy("adaptive", 4)
    for _ in range(2):
        p.costs.target.observe(1, 1, 1.0)
        p.costs.draft.observe(1, draft_cost)
    assert p.choose(["fresh"]).ks[0] > 0  # drafting never tried: one probe, whatever the prior predicts
    p.probe_trials = 0  # suppose that probe told nothing, and the policy trusted the prior
    assert (p.choose(["fresh"]).ks[0] > 0) != drafts  # what the prior alone would do
    for i in range(20):  # earlier requests, each forgotten when it ends; later positions as the prior
        _simulate(p, earlier, p.estimator.prior_acceptance, steps=40, request_id=f"old{i}")
        p.forget(f"old{i}")
    assert p.estimator.population_acceptance == pytest.approx(earlier, abs=0.1)
    assert (p.choose(["new"]).ks[0] > 0) == drafts


def test_bursty_acceptance_makes_long_drafts_worth_more():
    """First token 0.6, later ones 0.95: the model must see that the 4th token is nearly as likely as
    the 2nd (an i.i.d. model at the mean rate would not)."""
    p = make_policy("adaptive", 4, acceptance_smoothing=0.01, depth_smoothing=0.001)
    _simulate(p, 0.6, 0.95)
    gains = p.token_gains(p.estimator.acceptance["r"])
    assert gains[0] == pytest.approx(0.6, abs=0.05)
    assert gains[3] == pytest.approx(0.6 * 0.95**3, abs=0.05)


def test_a_draft_that_stops_early_is_priced_by_what_it_drafts():
    """Drafts allowed 4 tokens that go on past each token half of the time: position j is drafted with
    probability 0.5^(j-1) and emitted with 0.9 · (0.5 · 0.95)^(j-1). Counting only the positions that were
    drafted would promise 0.9 · 0.95^(j-1), as if the draft never stopped."""
    p = make_policy("adaptive", 4, acceptance_smoothing=0.001, depth_smoothing=0.001)
    _simulate(p, 0.9, 0.95, goes_on=0.5)
    assert p.estimator.draft_reach(4) == pytest.approx([1.0, 0.5, 0.25, 0.125], abs=0.03)
    assert p.token_gains(p.estimator.acceptance["r"]) == pytest.approx(
        [0.9 * (0.5 * 0.95) ** j for j in range(4)], abs=0.03
    )


def test_a_draft_that_never_stops_reaches_every_position():
    p = make_policy("adaptive", 4)
    _simulate(p, 0.6, 0.6, steps=500)
    assert p.estimator.draft_reach(4) == [1.0] * 4


def test_step_cost_counts_the_drafts_a_stop_leaves_out():
    """One sequence allowed 4 drafts that reach positions 1-4 with 1, 0.5, 0.25, 0.125: 1.875 draft
    forwards and 1.875 verify rows expected, not 4 of each. Two sequences: a forward runs if either
    joins it, over the rows that do."""
    reach = [1.0, 0.5, 0.25, 0.125]
    p = _measured([0.9], 0.1, verify_growth=0.01)
    assert step_seconds(p.costs, [4], None, reach) == pytest.approx(0.1 * 1.875 + 1.0 + 0.01 * 1.875)
    assert step_seconds(p.costs, [4]) == pytest.approx(0.1 * 4 + 1.0 + 0.01 * 4)
    p = _measured([0.9, 0.9], 0.1, verify_growth=0.01)
    runs = [1.0] + [1 - (1 - r) ** 2 for r in reach[1:]]  # a draft forward costs 0.1 s at 1 or 2 rows
    assert step_seconds(p.costs, [4, 4], None, reach) == pytest.approx(0.1 * sum(runs) + p.costs.target(2, 2 + 3.75))


def test_a_draft_that_stops_after_its_unsure_first_token_is_not_worth_it():
    """Two sequences whose draft mostly drafts one token: it goes on 10% of the time, and its first token
    is accepted 40% of the time. Priced as four tokens at the acceptance of those drafted (0.4, then 0.99
    each) it looks worth 1.17x plain; what it yields (≈1.44 tokens a step for ≈1.11 draft forwards at 0.3
    of a target step: 1.08x) is under the 10% margin that several sequences must clear, so the policy
    decodes plainly."""
    p = _measured([0.4, 0.4], 0.3)
    p.estimator.depth, p.estimator.acceptance_smoothing = {}, 0.001
    _simulate(p, 0.4, 0.99, steps=3000, request_id="0", goes_on=0.1)
    p.estimator.acceptance["1"] = p.estimator.acceptance["0"]
    assert _choose(p, 2) == [0, 0]
    p.estimator.reach = {}  # forget the stops and count only the positions drafted, as if the draft never stopped
    p.estimator.depth = {}
    _simulate(p, 0.4, 0.99, steps=3000, request_id="0")
    assert _choose(p, 2) == [4, 4]


def test_alone_a_sequence_drafts_wherever_drafting_beats_plain_decoding():
    """Predicted 1.06x plain (a first token accepted 35% of the time, a draft forward at 0.27 of a target
    step, verify rows free): one sequence drafts, its decision re-made every step from its own outcomes;
    two such sequences stay under the 10% margin that several must clear."""
    assert _choose(_measured([0.35], 0.27), 1) == [1]
    assert _choose(_measured([0.35, 0.35], 0.27), 2) == [0, 0]


def test_a_draft_that_stops_itself_is_allowed_its_full_k():
    """A good first token (90%) and a draft that rarely goes on (10%): allowing it 4 tokens costs little
    more than allowing 1, because the stop, not k, ends most drafts; priced as 4 forwards and 4 verify
    rows, k = 4 would look worse than k = 1."""
    p = _measured([0.9], 0.3)
    p.estimator.depth, p.estimator.acceptance_smoothing = {}, 0.001
    _simulate(p, 0.9, 0.99, steps=3000, request_id="0", goes_on=0.1)
    assert _choose(p, 1) == [4]


def test_a_rejected_sequence_is_probed_again_later():
    p = _measured([0.0], 0.3)
    assert _choose(p, 1) == [0]
    for _ in range(200):  # plain steps: the estimate drifts back towards the prior
        p.observe_acceptance("0", 0, 0)
    assert _choose(p, 1)[0] > 0


def test_a_new_request_drafts_again_after_one_unlucky_probe():
    """A fresh engine's first probe rejected (one token): the pooled estimate new requests start from
    falls below break-even, and without a draft nothing would measure it again. It fades back towards
    the prior while nobody drafts, so a later request drafts."""
    p = make_policy("adaptive", 3, prior_acceptance=0.7)
    p.observe_acceptance("probe", 1, 0)
    unlucky = p.estimator.population_acceptance
    assert unlucky < 0.5
    for _ in range(100):  # plain steps
        p.observe_acceptance("other", 0, 0)
        p.observe_step([0], 1.0, None, 1.0)
    assert p.estimator.population_acceptance > 0.6 > unlucky
    assert p.estimator.first_token_acceptance("new") == p.estimator.population_acceptance


def _steps_until_deeper_drafts(p: AdaptivePolicy, steps: int) -> int | None:
    """Decode `steps` steps on which every allowed draft token is accepted (a verify row costs 0.3 of a plain
    step, a draft forward 0.05); the first step allowed more than one token, or None."""
    for step in range(steps):
        k = _choose(p, 1)[0]
        if k > 1:
            return step
        p.observe_acceptance("0", k, k, allowed=k)
        p.observe_step([k], 1.0 + 0.3 * k, 0.05 if k else None, 1.0 + 0.35 * k)
    return None


def test_a_deeper_position_priced_low_by_early_misses_is_tried_again():
    """A few early misses at position 2 price it low; where a verify row is dear (a long context) the policy then
    allows one token only, which never tries position 2 again: its evidence must fade towards the prior while
    untried, or the early misses decide for good (the 1.5B's head at 16k tokens: allowed 1 token a step,
    0.90x the rate of a fixed k = 3 under the head's confidence stop). Without the fade, it stays at 1."""
    for fades in (True, False):
        p = _measured([0.8], 0.05, k_max=3, verify_growth=0.3)
        for _ in range(5):  # the second token drafted and rejected
            p.observe_acceptance("0", 2, 1, allowed=2)
        assert _choose(p, 1) == [1]
        if not fades:
            p.estimator.end_step = lambda: None
        step = _steps_until_deeper_drafts(p, 300)
        assert (step is not None) == fades and (step is None or step > 20)  # not at once either


def test_a_deeper_position_priced_low_by_many_misses_is_tried_again_within_a_request():
    """Thick evidence recovers as fast as thin: after 40 misses at position 2 (a long first request), deeper drafts are
    allowed again within 100 steps (one 128-token request), not at once. Fading its hits and trials alike (the broken
    variant) keeps the ratio where the misses left it, and the policy at one token a step for ~190 steps (the 1.5B's
    head at 16k tokens with AVX2: 0.94x fixed k = 3)."""
    for moves_the_ratio in (True, False):
        p = _measured([0.8], 0.05, k_max=3, verify_growth=0.3)
        for _ in range(40):
            p.observe_acceptance("0", 2, 1, allowed=2)
        if not moves_the_ratio:

            def fade_weight(e=p.estimator, keep=1 - p.estimator.acceptance_recovery):
                for position, (hits, tried) in e.depth.items():
                    if position > 1 and position not in e._tried:
                        e.depth[position] = hits * keep, tried * keep
                e._tried.clear()

            p.estimator.end_step = fade_weight
        step = _steps_until_deeper_drafts(p, 300)
        assert step is not None and step > 20
        assert (step < 100) == moves_the_ratio, step


@pytest.mark.parametrize("batch", [1, 8])
def test_the_pooled_evidence_fades_per_step_whatever_the_batch_size(batch):
    """Steps in which nobody drafts fade the pooled first-position evidence by the same amount at batch 8
    as at batch 1 (fading once per sequence-step, batch 8 lost it 8 times as fast and probed every other
    step). Lookup steps measure nothing about the draft model, so they fade it too."""
    p = make_policy("adaptive", 3)
    for _ in range(10):
        p.observe_acceptance("probe", 1, 1)
    before = p.estimator.first_position_trials
    ids = [str(i) for i in range(batch)]
    for _ in range(20):
        for i in ids:
            p.observe_acceptance(i, 0, 0)
        p.observe_step([0] * batch, 1.0, None, 1.0)
    p.observe_lookup("0", 3, 3, 3)  # a lookup step
    p.observe_step([3] + [0] * (batch - 1), 1.0, None, 1.0, by_lookup=[True] * batch)
    assert p.estimator.first_position_trials == pytest.approx(before * 0.98**21)


def _probe_steps(p: AdaptivePolicy, batch: int, steps: int, plain_s: float, probe_s: float) -> int:
    """Run `steps` decisions at `batch` where every draft is rejected (so the evidence stays thin and
    drafting never pays); a step that drafts costs probe_s, a plain one plain_s. Returns the probes."""
    ids, probes = [str(i) for i in range(batch)], 0
    for _ in range(steps):
        ks = p.choose(ids).ks
        for i, k in zip(ids, ks):
            p.observe_acceptance(i, k, 0)
        probes += any(ks)
        p.observe_step(ks, probe_s if any(ks) else plain_s, 0.1 if any(ks) else None, probe_s if any(ks) else plain_s)
    return probes


def _batch_8_costs(p: AdaptivePolicy, drafting_could_pay: bool) -> AdaptivePolicy:
    """A plain step of 90 ms at batch 8, and either cheap verify rows and draft forwards (drafting pays if
    the drafts are good) or a draft forward of 30 ms a row with verify rows priced by the default slope
    (it pays at no acceptance)."""
    p.costs.target.record(8, 8, 0.09)
    if drafting_could_pay:
        p.costs.target.record(8, 32, 0.11)
        p.costs.draft.record(8, 0.01)
    else:
        p.costs.draft.record(1, 0.03)
    return p


@pytest.mark.parametrize("held", [True, False])
def test_the_next_probe_is_said_ahead_and_a_decision_said_not_to_probe_does_not(held, monkeypatch):
    """probes_next tells a plain step whether the next decision probes (a step queued for it would go unused), before
    the step's time is known. At the budget's edge that time decides (here a plain step takes 90 ms or, a hiccup,
    500): where it said no, the next decision does not probe. Broken (`held` False: the word not kept) probes where
    it said it would not."""
    import random

    p = _batch_8_costs(make_policy("adaptive", 3, probe_allowance_steps=0.0), drafting_could_pay=True)
    if not held:
        monkeypatch.setattr(p, "_probe_now", lambda n, contexts: p._should_probe(n, contexts))
    ids, rng, probes, unsaid, said = [str(i) for i in range(8)], random.Random(0), 0, 0, None
    for _ in range(600):  # every draft rejected: the evidence stays thin, probes are budgeted
        decision = p.choose(ids)
        probes += decision.probe
        unsaid += decision.probe and said is False
        for i, k in zip(ids, decision.ks):
            p.observe_acceptance(i, k, 0)
        if any(decision.ks):  # the target's call as priced, the step's whole time dearer (the draft's catch-up)
            said = None
            p.observe_step(decision.ks, 0.11, 0.01, 0.3)
        else:  # a plain step asks before its time is known (as it queues the next)
            said, seconds = p.probes_next([0] * 8), rng.choice((0.09, 0.09, 0.09, 0.5))
            p.observe_step(decision.ks, seconds, None, seconds)
    assert probes >= 5 and (unsaid == 0) is held


def test_probes_cost_at_most_their_budget():
    """At batch 8 a probe step costs 1.6 plain ones. With evidence that stays thin, probes are limited
    to probe_budget of the decoding time (here 2%: one probe per ~30 steps, not one in ten) beyond
    a first allowance of probe_allowance_steps plain steps."""
    p = _batch_8_costs(make_policy("adaptive", 3), drafting_could_pay=True)
    probes = _probe_steps(p, 8, 1000, 0.09, 0.145)
    spent, decoding = probes * (0.145 - 0.09), (1000 - probes) * 0.09 + probes * 0.145
    assert 1 <= probes and spent <= p.probe_allowance_steps * 0.09 + p.probe_budget * decoding + (0.145 - 0.09)
    unlimited = _batch_8_costs(make_policy("adaptive", 3, probe_budget=float("inf")), drafting_could_pay=True)
    assert _probe_steps(unlimited, 8, 1000, 0.09, 0.145) > 2 * probes


def test_the_probes_start_up_allowance_is_the_same_share_of_a_run_on_a_faster_device():
    """The same costs 30 times smaller (a GPU's step beside a CPU's): as many probes that lead nowhere, the allowance
    being counted in plain steps; a fixed half second (300 of the faster device's steps) lets it probe more."""
    cpu = _unconverted_probes(1.0)
    assert cpu == _unconverted_probes(1 / 30) and cpu <= 12
    assert _unconverted_probes(1 / 30, probe_allowance_steps=0.5 / (0.05 / 30)) > 1.5 * cpu


def _unconverted_probes(scale: float, **options) -> int:
    """Probes in 200 steps at batch 8 where every draft is rejected: a plain step of 50 ms, four rows 60, a draft
    forward 5, a probe step 150, all times `scale`."""
    p = make_policy("adaptive", 3, **options)
    p.costs.target.record(8, 8, 0.05 * scale)
    p.costs.target.record(8, 32, 0.06 * scale)
    p.costs.draft.record(8, 0.005 * scale)
    return _probe_steps(p, 8, 200, 0.05 * scale, 0.15 * scale)


def test_a_long_catch_up_does_not_stop_the_probe_of_a_draft_that_would_pay():
    """Batch 1, a 150-token prompt the draft has not read and 24 tokens to go: spread over those tokens the
    catch-up outweighs any gain, but it is the probe's one-off cost, and once caught up a good draft pays,
    so the policy probes (with the catch-up in that check it would never draft for a short request)."""
    p = make_policy("adaptive", 3)
    p.costs.target.record(1, 1, 0.05)
    for tokens in range(2, 5):
        p.costs.target.record(1, tokens, 0.05 + 0.003 * tokens)
    p.costs.draft.record(1, 0.017)
    p.costs.draft_prefill_per_token = 0.004
    assert not any(p.best_decision([p.optimistic_acceptance], [150], [24], None).ks)
    assert p.choose(["a"], catch_up=[150], remaining=[24]).probe


def test_no_probe_where_drafting_could_not_pay_even_with_good_drafts(monkeypatch):
    """Where the measured costs rule drafting out even at a first-token acceptance of 0.95, the policy
    never probes (each probe would be a pure loss: a short benchmark cell at batch 8 lost 5% to them);
    without that check the start-up allowance is spent on probes."""
    p = _batch_8_costs(make_policy("adaptive", 3), drafting_could_pay=False)
    assert _probe_steps(p, 8, 1000, 0.09, 0.145) == 0
    unchecked = _batch_8_costs(make_policy("adaptive", 3), drafting_could_pay=False)
    monkeypatch.setattr(unchecked, "_drafting_could_pay", lambda n, contexts=None: True)
    assert _probe_steps(unchecked, 8, 1000, 0.09, 0.145) >= 5


def test_a_probe_that_leads_to_drafting_costs_no_budget():
    """Where drafting pays (every draft accepted, a cheap draft), a probe is followed by drafting and is
    refunded, so probing stays possible whenever the evidence asks for it (at batch 1 the probe is what
    pays a new request's catch-up). Without the refund the expensive probes (3x a plain step) would be
    cut to the 2% budget."""
    p = make_policy("adaptive", 3, probe_trials=1e9)  # the evidence always asks for a probe
    p.costs.target.record(1, 1, 0.03)
    for tokens in range(2, 5):
        p.costs.target.record(1, tokens, 0.035)
    p.costs.draft.record(1, 0.002)
    probes = drafting = 0
    for _ in range(200):
        decision = p.choose(["a"])
        ks, probing = decision.ks, decision.probe
        p.observe_acceptance("a", ks[0], ks[0])
        probes += probing
        drafting += ks[0] > 0
        p.observe_step(ks, 0.09 if probing else 0.035, 0.002 if ks[0] else None, 0.09 if probing else 0.035)
    assert drafting >= 195 and probes >= 50


def test_thin_evidence_is_probed_rather_than_trusted():
    """A draft that costs half a target forward: at the unlucky estimate (< 0.5) drafting would not pay,
    but one trial is not evidence enough to stop, so the policy probes; with evidence, it trusts it."""
    p = make_policy("adaptive", 3)
    p.costs.target.record(1, 1, 1.0)
    p.costs.draft.record(1, 0.5)
    p.observe_acceptance("probe", 1, 0)
    assert p.choose(["a"]).ks == [3]
    for _ in range(10):
        p.observe_acceptance("probe", 1, 0)
    assert p.choose(["a"]).ks == [0]


def test_useless_draft_turns_speculation_off_and_stays_lossless(target, random_draft):
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    plain = LLM(target=target, num_speculative_tokens=0, max_model_len=256).generate("hello world", params)
    llm = LLM(
        target=target,
        draft=random_draft,
        num_speculative_tokens=4,
        speculation_policy="adaptive",
        max_model_len=256,
        prompt_lookup=None,
    )
    policy = llm.engine.policy
    # Forget the start-up timing of the draft, so that the policy probes it (as without a profile): with
    # the profile, a draft as costly as the target may never be tried at all, and this test is about
    # what measured acceptance does once it is.
    policy.costs.draft = CostTable()
    out = llm.generate("hello world", params)
    assert out[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert out[0].spec["acceptance_rate"] < 0.2
    # Whatever the timings, drafting stops once the estimate has fallen: α ≤ 0.2 pays only if a draft
    # forward costs under a fifth of a target forward, and here both models are the same size.
    drafted = sum(policy.decisions.values()) - policy.decisions[0]
    assert policy.decisions[0] > 2 * drafted
    assert out[0].spec["num_draft_forwards"] < 120  # k = 0 steps ran no draft forward


def test_adaptive_batch_drafts_per_sequence_and_matches_solo_greedy(target, monkeypatch):
    """n-gram lookup on a repetitive prompt next to one where lookup fails: the adaptive policy drafts for
    one and not the other within the same step, and the batched output equals each request run alone."""
    prompts = ["abcabcabcabcabcabcabc", "the quick brown fox", "hello world, hello world, hello"]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    plain = LLM(target=target, num_speculative_tokens=0, max_model_len=256)
    alone = [plain.generate(p, params)[0].outputs[0].token_ids for p in prompts]
    llm = LLM(
        target=target,
        speculative_model="ngram",
        num_speculative_tokens=4,
        speculation_policy="adaptive",
        max_model_len=256,
    )
    priced_without_timing(llm.engine.policy, monkeypatch, len(prompts))
    outputs, step_ks, _ = run_as_one_batch(llm.engine, [target.tokenizer.encode(p) for p in prompts], params)
    assert outputs == alone
    assert any(len(set(ks)) > 1 for ks in step_ks)  # ragged: different k within one step


def test_catch_up_is_amortised_over_the_tokens_left():
    """Starting to draft for a sequence makes the draft read its whole history first: worth it for a long
    generation, not for one about to end."""
    p = _measured([0.8], 0.1)
    p.costs.draft_prefill_per_token = 0.01  # a target step is 1 s: reading 500 tokens costs 5 steps
    assert p.choose(["0"], catch_up=[500], remaining=[4]).ks == [0]
    assert p.choose(["0"], catch_up=[500], remaining=[100_000]).ks[0] > 0
    assert p.choose(["0"], catch_up=[0], remaining=[4]).ks[0] > 0


def test_a_single_draft_round_with_a_catch_up_is_not_a_round_cost(target):
    """With k = 1 the draft runs one round, and if that round read a whole prompt first, its time says
    nothing about a draft round: it must not enter the cost table."""
    engine = LLM(target=target, draft=target, num_speculative_tokens=1, max_model_len=256).engine
    assert engine._draft_round_seconds(0.71, rounds=1, catch_up=150, timed=[0.7]) is None
    assert engine._draft_round_seconds(0.05, rounds=1, catch_up=1, timed=[0.05]) == 0.05
    # allowed 4 tokens, the draft stopped after its first (unsure of it): one round's cost, not a quarter
    assert engine._draft_round_seconds(0.05, rounds=4, catch_up=1, timed=[0.05]) == 0.05


def test_lookup_acceptance_is_learned_per_match_length():
    p = make_policy("adaptive", 4)
    assert p.estimator.lookup_acceptance.gains(3, 4) == pytest.approx([0.5, 0.25, 0.125, 0.0625])  # the prior
    assert p.estimator.lookup_acceptance.gains(3, 2) == pytest.approx([0.5, 0.25])  # only what the match offers
    for _ in range(500):
        p.observe_lookup("r", 3, 4, 3)  # 3-token matches: the first three right, the fourth wrong
        p.observe_lookup("r", 1, 4, 0)  # 1-token matches: always wrong
    assert p.estimator.lookup_acceptance.gains(3, 4) == pytest.approx([1, 1, 1, 0], abs=0.05)
    assert p.estimator.lookup_acceptance.gains(1, 4)[0] == pytest.approx(0, abs=0.05)
    # says nothing about the draft model
    assert p.estimator.acceptance["r"] == pytest.approx(p.estimator.prior_acceptance)


def test_prompt_lookup_takes_over_where_the_draft_model_does_not_pay():
    """Batch 16, a draft forward costing 60% of a target step: the draft model does not pay, but a
    verified token costs only 2% of the step, so good lookups do, and only those."""
    p = _measured([0.8] * 16, 0.6, verify_growth=0.02)
    for _ in range(200):
        p.observe_lookup("x", 3, 4, 4)
        p.observe_lookup("x", 1, 4, 0)
    ids = [str(i) for i in range(16)]
    assert p.choose(ids).ks == [0] * 16
    lookups = [(3, [1] * 4, None)] * 8 + [(1, [1] * 4, None)] * 4 + [(0, [], None)] * 4
    plan = p.choose(ids, lookups=lookups)
    assert all(k > 0 for k in plan.ks[:8]) and plan.by_lookup[:8] == [True] * 8
    assert plan.ks[8:] == [0] * 8 and not any(plan.by_lookup[8:])


def test_draft_model_still_wins_where_it_pays_more_than_lookups():
    """Batch 1, a cheap draft with α 0.9 against lookups that are right half the time."""
    p = _measured([0.9], 0.05)
    plan = p.choose(["0"], lookups=[(1, [1] * 4, None)])
    assert plan.ks == [4] and plan.by_lookup == [False]


def test_one_rejected_first_probe_is_followed_by_another_not_by_plain_decoding():
    """A fresh engine whose first probe is rejected (the prior and one miss: an estimate below break-even)
    probes again on its next steps, within the start-up allowance, instead of decoding plainly until the
    estimate fades back; without the allowance (0 steps) it decodes plainly."""
    for allowance, expected in ((10, True), (0, False)):
        p = make_policy("adaptive", 3, probe_allowance_steps=allowance, prior_acceptance=0.7)
        p.costs.target.record(1, 1, 0.05)
        for tokens in range(2, 5):
            p.costs.target.record(1, tokens, 0.05 + 0.003 * tokens)
        p.costs.draft.record(1, 0.03)
        assert p.choose(["a"], catch_up=[120]).probe
        p.observe_acceptance("a", 3, 0)
        p.observe_step([3], 0.11, 0.03, 0.3)  # a probe with a catch-up: 0.25 s over a plain step
        assert not any(p.best_decision([p.estimator.first_token_acceptance("a")], [0], [100], None).ks)
        assert p.choose(["a"], catch_up=[1]).probe is expected


def test_a_step_priced_token_by_token_costs_the_same_in_any_order():
    """The allocation grows drafts one token at a time and prices each step from the one before
    (StepPrice); whatever the order of growth, the price is the step's, as priced whole."""
    reach = [1.0, 0.5, 0.25, 0.125]
    p = _measured([0.9, 0.9, 0.9], 0.1, verify_growth=0.01)
    ks, by_lookup = [4, 2, 6], [False, False, True]
    growth = [(i, length) for i, k in enumerate(ks) for length in range(1, k + 1)]
    for order in (growth, sorted(growth, key=lambda g: (g[1], -g[0]))):
        step = StepPrice(p.costs, 3, reach)
        for i, length in order:
            step.grow(length, by_lookup[i])
        assert step.seconds == pytest.approx(step_seconds(p.costs, ks, by_lookup, reach))
    assert step_seconds(p.costs, ks, by_lookup, reach) > step_seconds(p.costs, [4, 2, 0], by_lookup, reach)


def test_drafts_that_cannot_clear_the_bar_are_ruled_out_without_pricing_a_step(monkeypatch):
    """At 64 sequences whose drafts are hardly ever accepted, a decision must cost next to nothing beside a GPU step
    of a few milliseconds: gains that would not clear the bar even at a plain step's price price no candidate step.
    Decisions where drafting might pay still price them (and draft)."""
    from specdecode.engine.policy import allocation

    priced = []
    grow, prices = allocation.StepPrice.grow, allocation._step_prices
    monkeypatch.setattr(allocation.StepPrice, "grow", lambda self, *a: (priced.append(a), grow(self, *a))[1])
    monkeypatch.setattr(allocation, "_step_prices", lambda *a: (priced.append(a), prices(*a))[1])
    p = make_policy("adaptive", 4)
    for tokens, seconds in ((64, 0.005), (128, 0.0052), (320, 0.006)):  # a GPU's: verify rows come cheap
        p.costs.target.record(64, tokens, seconds)
    p.costs.draft.record(64, 0.0005)
    assert p.best_decision([0.01] * 64, [0] * 64, [100] * 64, None).ks == [0] * 64
    assert not priced
    assert any(p.best_decision([0.9] * 64, [0] * 64, [100] * 64, None).ks)
    assert priced


def _gpu_costs_at_64(p: AdaptivePolicy, draft_seconds: float) -> AdaptivePolicy:
    """A GPU's costs at 64 sequences: a 5 ms plain step, cheap verify rows, a draft forward of draft_seconds."""
    for tokens, seconds in ((64, 0.005), (128, 0.0052), (320, 0.006)):
        p.costs.target.record(64, tokens, seconds)
    p.costs.draft.record(64, draft_seconds)
    return p


def test_where_even_good_drafts_would_not_pay_a_decision_prices_nothing(monkeypatch):
    """A draft forward of 4 ms beside a 5 ms step (the 0.5B beside the 1.5B on a launch-bound GPU): not even drafts
    accepted at 0.95 would pay at 64 sequences, so a decision drafts nothing without pricing an allocation (which
    at 64 sequences cost about a millisecond), once whether drafting could pay is known; and the answer is the
    full pricing's. Where the draft is cheap, good drafts would pay, and decisions are priced (and draft)."""
    priced = []
    allocate = AdaptivePolicy._allocate
    monkeypatch.setattr(AdaptivePolicy, "_allocate", lambda self, *a: (priced.append(1), allocate(self, *a))[1])
    ids = [str(i) for i in range(64)]
    p = _gpu_costs_at_64(make_policy("adaptive", 4), 0.004)
    assert p.choose(ids).ks == [0] * 64  # works out whether drafting could pay: one allocation priced
    assert len(priced) == 1
    for _ in range(7):
        p.observe_step([0] * 64, 0.005, None, 0.005)
        assert p.choose(ids).ks == [0] * 64
    assert len(priced) == 1  # worked out again after 8 steps
    alphas = [p.estimator.first_token_acceptance(i) for i in ids]
    assert p.best_decision(alphas, [0] * 64, [100] * 64, None).ks == [0] * 64  # what pricing every step decides
    cheap = _gpu_costs_at_64(make_policy("adaptive", 4), 0.0003)
    assert cheap._drafting_could_pay(64)
    priced.clear()
    assert any(cheap.best_decision(alphas, [0] * 64, [100] * 64, None).ks) and priced


def test_where_no_sequence_drafts_well_enough_to_pay_a_decision_prices_nothing(monkeypatch):
    """A cheap draft on a GPU at 64 sequences (good drafts would pay) whose drafts are seldom accepted (a draft that
    does not fit the target): once the acceptance under which drafting cannot pay is worked out, a decision drafts
    nothing without pricing an allocation, as full pricing decides; drafts accepted often are priced, and drafted."""
    priced = []
    allocate = AdaptivePolicy._allocate
    monkeypatch.setattr(AdaptivePolicy, "_allocate", lambda self, *a: (priced.append(1), allocate(self, *a))[1])
    ids = [str(i) for i in range(64)]
    p = _gpu_costs_at_64(make_policy("adaptive", 4), 0.0003)
    for _ in range(20):
        for i in ids:
            p.observe_acceptance(i, 4, 0)
    alphas = [p.estimator.first_token_acceptance(i) for i in ids]
    assert p.best_decision(alphas, [0] * 64, [100] * 64, None).ks == [0] * 64  # what full pricing decides
    priced.clear()
    assert p.choose(ids).ks == [0] * 64
    worked_out = len(priced)  # the bar: a few allocations of 64 sequences alike
    for _ in range(7):
        p.observe_step([0] * 64, 0.005, None, 0.005)
        assert p.choose(ids).ks == [0] * 64
    assert len(priced) == worked_out <= 1 + 4
    assert p._draft_bar(64) >= max(alphas)
    p.estimator.acceptance.update({i: 0.9 for i in ids})
    assert any(p.choose(ids).ks) and len(priced) > worked_out


def test_under_the_bar_no_mix_of_acceptances_would_draft():
    """The skip is sound: wherever every sequence's acceptance is at most the bar, however they differ, full pricing
    drafts nothing (drafts' gains grow with their acceptance)."""
    gen = np.random.default_rng(0)
    for draft_seconds in (0.0003, 0.001, 0.002):
        p = _gpu_costs_at_64(make_policy("adaptive", 4), draft_seconds)
        bar = p._draft_bar(64)
        assert 0 < bar < p.optimistic_acceptance  # good drafts pay, bad ones do not
        for _ in range(20):
            alphas = list(gen.uniform(0, bar, 64))
            assert p.best_decision(alphas, [0] * 64, [100] * 64, None).ks == [0] * 64
        assert any(p.best_decision([bar + 0.1 + 0.95 / 16] * 64, [0] * 64, [100] * 64, None).ks)


def test_whether_drafting_could_pay_is_worked_out_less_often_while_the_answer_holds(monkeypatch):
    """Worked out after 8 steps, then 16, 32, 64 and 64 while the answer stays no; after 8 again once it changes."""
    p = _gpu_costs_at_64(make_policy("adaptive", 4), 0.004)
    works = []
    no, yes = p.optimistic_acceptance, 0.3  # acceptances under which drafting cannot pay

    def bar(n, contexts=None):
        works.append(n)
        return yes if len(works) == 6 else no

    monkeypatch.setattr(p, "_highest_unpaying_acceptance", bar)
    steps_at = []
    for step in range(1 + 8 + 16 + 32 + 64 + 64 + 8 + 1):
        before = len(works)
        p._drafting_could_pay(64)
        p._drafting_could_pay(64)  # asked twice a step (whether to probe, whether to price): counted once
        p.observe_step([0] * 64, 0.005, None, 0.005)
        if len(works) > before:
            steps_at.append(step)
    assert steps_at == [0, 8, 24, 56, 120, 184, 192]


def _plain_steps(draft_seconds: float, steps: int = 256) -> tuple[int, float]:
    """(plain steps among `steps` decisions for one sequence whose drafts are always accepted, the score of its
    drafting decisions), a plain step costing 30 ms, a verify of 4 rows 33 ms, a draft forward draft_seconds."""
    p = make_policy("adaptive", 3)
    p.costs.target.record(1, 1, 0.030)
    p.costs.target.record(1, 4, 0.033)
    p.costs.draft.record(1, draft_seconds)
    plain, score = 0, 0.0
    for _ in range(steps):
        decision = p.choose(["0"])
        plain += not decision.ks[0]
        score = decision.score or score
        p.observe_acceptance("0", decision.ks[0], decision.ks[0])
        target = 0.033 if decision.ks[0] else 0.030
        p.observe_step(
            decision.ks, target, draft_seconds if decision.ks[0] else None, target + decision.ks[0] * draft_seconds
        )
    return plain, score


def test_plain_decoding_is_measured_again_less_often_where_drafting_clears_the_bar_by_far():
    """Every plain step that re-measures plain decoding's cost gives up what a draft would have added: where
    drafting is predicted to beat the bar by more than CLEAR_MARGIN, it comes every 128 speculative steps, where
    the decision is close every 32."""
    clear_plain, clear_score = _plain_steps(0.001)
    close_plain, close_score = _plain_steps(0.022)
    assert clear_score > AdaptiveOptions().clear_margin > close_score > 1
    assert clear_plain <= 3 and close_plain >= 6


def _plain_steps_after_two_misses() -> int:
    """Plain steps among 20 decisions for a request whose first two drafts are rejected and every later one
    accepted, after a request whose drafts' first tokens were accepted 7 times in 10 (the pooled estimate a new
    request starts from, on thick evidence), where a verify row is dear (a 16k context with AVX2: plain 74 ms,
    2-4 rows 96-150 ms: a one-token draft pays above an estimate of 0.35)."""
    p = make_policy("adaptive", 3)
    seconds = {0: 0.074, 1: 0.096, 2: 0.124, 3: 0.150}
    for k, target in seconds.items():
        p.costs.target.record(1, k + 1, target)
    p.costs.draft.record(1, 0.004)

    def step(request: str, accepted) -> int:
        k = p.choose([request]).ks[0]
        p.observe_acceptance(request, k, k if k and accepted() else 0)
        p.observe_step([k], seconds[k], 0.004 if k else None, seconds[k] + 0.004 * k)
        return k

    for i in range(60):
        step("before", lambda i=i: i % 10 < 7)
    p.forget("before")
    rejected = []

    def after() -> bool:
        rejected.append(len(rejected) < 2)
        return not rejected[-1]

    return sum(not step("after", after) for _ in range(20))


def test_two_early_misses_do_not_stop_a_request_drafting():
    """A request's first-token estimate starts from the pooled one, which two misses must not outweigh: where a
    one-token draft pays only above ~0.35, the old weight (two trials) put the estimate at 0.33 and the sequence
    decoded plainly for steps while its text accepted well (docs/decisions.md#adaptive-policy-acceptance-estimates)."""
    assert _plain_steps_after_two_misses() <= 1  # at most the step that re-measures plain decoding


def test_the_adaptive_knobs_reach_the_policy_from_llm_the_cli_and_ray_s_plain_data(target):
    """One dataclass holds the knobs: LLM(adaptive=...), serve's --adaptive flags and the dict Ray ships all set
    the policy's; an unknown knob is refused with the valid ones, by LLM and by the CLI."""
    from specdecode.cli import build_parser
    from specdecode.config import EngineConfig
    from specdecode.server.serve_cmd import llm_options

    llm = LLM(target=target, num_speculative_tokens=3, adaptive={"min_gain": 0.3, "prior_acceptance": 0.5})
    policy = llm.engine.policy
    assert policy.min_gain == 0.3 and policy.estimator.prior_acceptance == 0.5
    assert policy.probe_budget == AdaptiveOptions().probe_budget  # the rest keep their defaults
    with pytest.raises(SpecDecodeError, match="unknown adaptive policy option.*min_gainz.*valid: min_gain"):
        LLM(target=target, adaptive={"min_gainz": 1})
    args = build_parser().parse_args(["serve", "--adaptive", "min_gain=0.25", "--adaptive", "refresh_plain_every=64"])
    shipped = llm_options(args)  # plain data, as Ray sends it to a replica
    assert EngineConfig(**shipped).adaptive == AdaptiveOptions(min_gain=0.25, refresh_plain_every=64)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--adaptive", "min_gainz=1"])


FIRST_ROW_KEY = 2e-5  # seconds per cached key of a sequence's first verify row, in the tests below


def _seconds_at(tokens: int, context: int, further_row_key: float = FIRST_ROW_KEY) -> float:
    """A target call of one sequence: its weights (1 s, +0.05 s a row) and its rows' attention over the context."""
    return 1.0 + 0.05 * (tokens - 1) + (FIRST_ROW_KEY + further_row_key * (tokens - 1)) * context


def _policy_learnt_at(context: int, further_row_key: float, priced_further_row_key: float | None):
    """A policy whose target costs were learnt over verifies of 1-5 tokens after `context` cached ones, whose
    attention was profiled at FIRST_ROW_KEY and `priced_further_row_key` (None: further rows as the first)."""
    p = make_policy("adaptive", 4)
    p.record_attention_cost(FIRST_ROW_KEY, priced_further_row_key)
    p.estimator.acceptance["r"] = 0.8
    p.probe_trials = 0
    for tokens in range(1, 6):
        for _ in range(2):  # a size's first sample is provisional
            seconds = _seconds_at(tokens, context, further_row_key)
            p.costs.target.observe(1, tokens, seconds, keys=context, extra_keys=(tokens - 1) * context)
    p.costs.draft.observe(1, 0.05)
    return p


def _best_k(gains: list[float], context: int, further_row_key: float = FIRST_ROW_KEY) -> int:
    return max(range(5), key=lambda k: (1 + sum(gains[:k])) / (_seconds_at(k + 1, context, further_row_key) + 0.05 * k))


def test_costs_learned_at_a_short_context_price_a_long_one():
    """A verify's rows each read the whole context, so drafts that pay at 1k tokens may not at 32k. Costs the
    policy learned at 1k must price a step at 32k, not carry 1k's over: tables keyed by call size alone had
    the 1.5B's head drafting at 0.84x plain decoding at 32k tokens after learning at 16k."""
    p = _policy_learnt_at(1000, FIRST_ROW_KEY, None)
    gains = p.token_gains(0.8)
    assert _best_k(gains, 32000) < _best_k(gains, 1000)  # the two contexts want different drafts
    for context in (1000, 32000):
        for k in range(5):
            priced = step_seconds(p.costs, [k], contexts=[context])
            assert priced == pytest.approx(_seconds_at(k + 1, context) + 0.05 * k)
        assert p.choose(["r"], contexts=[context]).ks == [_best_k(gains, context)]


def test_a_verify_s_further_rows_are_priced_at_their_own_rate_per_key():
    """The attention kernel reads a sequence's keys once for all its verify rows, so a further row costs a
    fraction of the first per key (the 1.5B on a Xeon: a third). Priced at the first row's rate, the policy
    drafts less at long contexts than pays: the head drafted 1 token a step at 16k where 3 ran faster."""
    further = FIRST_ROW_KEY / 3
    for learnt_at in (1000, 16000):
        p = _policy_learnt_at(learnt_at, further, further)
        gains = p.token_gains(0.8)
        for context in (1000, 32000):
            for k in range(5):
                priced = step_seconds(p.costs, [k], contexts=[context])
                assert priced == pytest.approx(_seconds_at(k + 1, context, further) + 0.05 * k)
            assert p.choose(["r"], contexts=[context]).ks == [_best_k(gains, context, further)]
    one_rate = _policy_learnt_at(1000, further, None)
    assert one_rate.choose(["r"], contexts=[32000]).ks[0] < _best_k(gains, 32000, further)


def test_the_engine_tells_the_policy_each_sequence_s_cached_tokens(target):
    """What the policy prices and learns by: the tokens each sequence has cached before the step."""
    llm = LLM(target=target, speculative_model="ngram", num_speculative_tokens=3, max_model_len=256)
    policy, seen = llm.engine.policy, []
    decide, observe = policy.decide, policy.observe_step
    policy.decide = lambda *args: seen.append(("decide", args[-1])) or decide(*args)
    policy.observe_step = lambda *args, **kw: seen.append(("observe", kw["contexts"])) or observe(*args, **kw)
    prompts = ["abcabcabcabcabc", "hello world, hello"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ids = [target.tokenizer.encode(p) for p in prompts]
    run_as_one_batch(llm.engine, ids, params)
    assert seen[:4] == [
        ("decide", [len(i) for i in ids]),  # the first decoding step: each prompt cached
        ("observe", [len(i) for i in ids]),
        ("decide", seen[2][1]),
        ("observe", seen[2][1]),
    ]
    assert all(b > a for a, b in zip(seen[0][1], seen[2][1]))  # then what each emitted too


def _random_costs(rng: random.Random) -> AdaptivePolicy:
    """A policy whose tables hold a few calls at each of several batch sizes (some reaching further than others, so
    prices run below, between and past what each measured), a draft cost per drafting batch, attention per key."""
    p = make_policy("adaptive", rng.choice([3, 4, 6]))
    for batch in (1, 2, 3, 5, 8, 13, 32, 64):
        plain = 0.004 + 0.00002 * batch * rng.uniform(0.5, 2)
        span = batch * rng.randint(2, 6)
        for tokens in [batch, *sorted(rng.sample(range(batch + 1, span + 1), min(rng.randint(1, 3), span - batch)))]:
            p.costs.target.record(batch, tokens, plain * (1 + rng.uniform(0, 0.02) * (tokens - batch)))
        if rng.random() < 0.7:
            p.costs.draft.record(batch, plain * rng.uniform(0.05, 0.9))
    p.record_attention_cost(rng.uniform(0, 1e-8), rng.choice([None, rng.uniform(0, 1e-9)]))
    for position in range(2, p.k_max + 1):  # deeper positions accepted and drafted as measured
        p.estimator.depth[position] = (rng.uniform(0, 30), 30.0)
        p.estimator.reach[position] = (rng.uniform(20, 30), 30.0)
    return p


def _random_allocation(rng: random.Random, p: AdaptivePolicy, n: int) -> tuple:
    """gains, by_lookup, start costs, contexts, reach, margin, calibration for n sequences, some drafting by lookup
    (drafts of their own lengths, past k too), some with a catch-up to pay."""
    lookup = [rng.random() < 0.3 for _ in range(n)]
    gains = [
        sorted((rng.random() ** 2 for _ in range(rng.randint(1, 8))), reverse=True)
        if looked_up
        else p.token_gains(rng.choice([0.05, 0.3, 0.6, 0.9, rng.random()]))
        for looked_up in lookup
    ]
    start = [rng.choice([0.0, 0.0, rng.uniform(0, 0.004)]) for _ in range(n)]
    contexts = [rng.randint(0, 4000) for _ in range(n)]
    margin = 0.0 if n == 1 and not lookup[0] else p.min_gain
    return gains, lookup, start, contexts, p.estimator.draft_reach(p.k_max), margin, rng.uniform(0.8, 1.3)


def test_an_allocation_priced_as_arrays_is_the_one_priced_candidate_by_candidate():
    """Many candidate steps are priced at once as arrays, few one after another (allocation.py): over random
    costs, estimates, lookups, catch-ups and batch sizes the two choose the same drafts, with the same score and
    predicted seconds."""
    from specdecode.engine.policy.allocation import _by_arrays, _by_loop

    rng, drafted = random.Random(7), 0
    for trial in range(300):
        p = _random_costs(rng)
        n = rng.choice([1, 2, 3, 5, 8, 13, 32, 64])
        args = _random_allocation(rng, p, n)
        if not p.costs.draft and not all(args[1]):
            continue  # nothing measured for the draft model: the policy probes instead of allocating
        (by_loop, loop_score), (by_arrays, arrays_score) = _by_loop(p.costs, *args), _by_arrays(p.costs, *args)
        assert (by_arrays.ks, by_arrays.by_lookup) == (by_loop.ks, by_loop.by_lookup), trial
        assert arrays_score == pytest.approx(loop_score, rel=1e-9)
        assert by_arrays.seconds == pytest.approx(by_loop.seconds, rel=1e-9)
        drafted += any(by_loop.ks)
    assert 50 < drafted < 250  # both kinds of answer were compared


def test_target_prices_as_arrays_are_the_prices_one_by_one():
    """TargetCost's price of many calls at once (allocation.target_prices) is its price of each: below, between and
    past a batch size's measured calls, past them by other batch sizes' growth or by the slope."""
    from specdecode.engine.policy.allocation import target_prices

    rng = random.Random(3)
    for _ in range(50):
        p = _random_costs(rng)
        for batch in p.costs.target.tables:
            tokens = [rng.uniform(batch * 0.5, batch * 8) for _ in range(40)] + [float(batch), batch * 5.0]
            one_by_one = [p.costs.target(batch, t) for t in tokens]
            assert target_prices(p.costs.target, batch, np.array(tokens)).tolist() == pytest.approx(
                one_by_one, rel=1e-12
            )


def test_an_allocation_of_drafts_never_emitted_is_none_either_way():
    """Gains of 0 (lookups whose tokens cannot be right) leave no candidate step: both pricings decide nothing."""
    from specdecode.engine.policy.allocation import _by_arrays, _by_loop

    p = _random_costs(random.Random(1))
    args = ([[0.0] * 8] * 5, [True] * 5, [0.0] * 5, [100] * 5, p.estimator.draft_reach(p.k_max), p.min_gain, 1.0)
    for allocation in (_by_loop, _by_arrays):
        decision, score = allocation(p.costs, *args)
        assert (decision.ks, score) == ([0] * 5, 1.0)
