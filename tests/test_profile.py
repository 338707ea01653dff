"""Step-cost profile at start-up: the adaptive policy prices sizes it has not run yet from measurements,
not from extrapolation."""
import pytest

from specdecode import LLM
from specdecode.engine.policy import CostTable, SpeculationPolicy
from specdecode.engine.profile import profile_step_costs, profiled_batch_sizes


def test_profiled_batch_sizes_are_powers_of_two_and_the_limit():
    assert profiled_batch_sizes(1) == [1]
    assert profiled_batch_sizes(8) == [1, 2, 4, 8]
    assert profiled_batch_sizes(12) == [1, 2, 4, 8, 12]


def test_profile_measures_every_size_the_policy_weighs_and_leaves_the_engine_untouched(target, random_draft):
    llm = LLM(target=target, draft=random_draft, num_speculative_tokens=4, speculation_policy="adaptive",
              max_num_seqs=6, max_model_len=256)
    engine, costs = llm.engine, llm.engine.policy.costs
    assert profile_step_costs(engine) > 0
    for b in (1, 2, 4, 6):
        for tokens in (b, 3 * b, 5 * b):  # plain, half and full drafts (k_max = 4)
            assert costs.target.samples[tokens] >= 2 and costs.target.seconds[tokens] > 0
    assert sorted(costs.draft.seconds) == [1, 2, 3, 4, 5, 6]
    assert all(costs.draft.samples[n] >= 2 for n in range(1, 7))
    assert costs.draft_prefill_per_token > 0
    # the forwards ran in caches of their own: every slot of the engine's is still free and empty
    assert engine.cache.num_free == engine.cache.num_slots and not any(engine.cache.lengths)
    assert engine.proposer.cache.num_free == engine.proposer.cache.num_slots


def test_plain_decoding_and_prompt_lookup_have_nothing_to_profile(target):
    plain = LLM(target=target, num_speculative_tokens=0, max_model_len=128)
    ngram = LLM(target=target, speculative_model="ngram", num_speculative_tokens=4, max_model_len=128)
    for llm in (plain, ngram):
        assert profile_step_costs(llm.engine) == 0.0
        assert not llm.engine.policy.costs.target


def test_a_recorded_size_is_trusted_at_once():
    t = CostTable()
    t.observe(1, 1.0)
    t.observe(1, 1.0)
    t.record(8, 3.0)  # a lone observed sample would be ignored while size 1 has two (see the policy tests)
    assert t(8) == 3.0
    t.observe(8, 4.0)  # later steps refine it like any trusted size
    assert t(8) == pytest.approx(3.0 + 0.3 * (4.0 - 3.0))


def _target_seconds(tokens: int) -> float:
    """Shaped like the Qwen 1.5B target on this project's CPU: flat-ish up to 20 tokens, then compute-bound."""
    return 0.28 + 0.007 * min(tokens, 20) + 0.013 * max(0, tokens - 20)


def _learned_online() -> SpeculationPolicy:
    """What a server has learned after serving up to 4 concurrent requests (the draft, like the int8
    Qwen 0.5B, costs 55-70 ms per forward for 1-4 sequences); acceptance ~0.9."""
    p = SpeculationPolicy("adaptive", 4)
    p.depth = {position: (9.0, 10.0) for position in range(1, 5)}
    for _ in range(2):
        for tokens in list(range(1, 21)) + [8]:
            p.costs.target.observe(tokens, _target_seconds(tokens))
        for m in range(1, 5):
            p.costs.draft.observe(m, 0.055 + 0.005 * (m - 1))
    p.costs.draft_prefill_per_token = 0.003
    return p


def test_profiled_costs_stop_a_bet_that_extrapolation_would_make():
    """Through the server at concurrency 8, costs learned at batches 1-4 were extrapolated to 8: the policy
    started the draft on all 8 new requests at once (a 5 s step of catch-ups), for drafting that did not
    pay. Here, as measured, the draft's cost doubles at 8 sequences (its floating-point GEMM takes over)
    and the target turns compute-bound beyond 20 tokens: without the profile the policy bets, with it it
    decodes plainly, and new requests at batch 4 still draft."""
    new_requests = [str(i) for i in range(8)]
    catch_up, remaining = [120] * 8, [128] * 8
    assert all(_learned_online().choose(new_requests, catch_up, remaining).ks)

    profiled = _learned_online()
    for m in range(5, 9):
        profiled.costs.draft.record(m, 0.075 if m < 8 else 0.14)
    for tokens in range(21, 41):
        profiled.costs.target.record(tokens, _target_seconds(tokens))
    assert profiled.choose(new_requests, catch_up, remaining).ks == [0] * 8
    assert all(profiled.choose(new_requests[:4], catch_up[:4], remaining[:4]).ks)
