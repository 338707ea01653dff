"""Draft-cost profile at start-up: the adaptive policy prices every number of drafting sequences from
measurements, not from extrapolation."""

from conftest import tiny_model
from test_policy import _served

from specdecode import LLM
from specdecode.engine.policy import CostTable
from specdecode.engine.profile import profile_draft_costs


def test_an_adaptive_llm_times_the_draft_at_every_batch_size_and_leaves_the_engine_untouched(target, random_draft):
    llm = LLM(
        target=target,
        draft=random_draft,
        num_speculative_tokens=4,
        speculation_policy="adaptive",
        max_num_seqs=6,
        max_model_len=256,
    )
    engine, costs = llm.engine, llm.engine.policy.costs
    assert llm.profile_seconds > 0
    assert sorted(costs.draft.seconds) == [1, 2, 3, 4, 5, 6]
    assert all(costs.draft.samples[n] >= 2 and costs.draft.seconds[n] > 0 for n in range(1, 7))
    assert costs.draft_prefill_per_token > 0
    assert not costs.target  # the target is measured by the steps themselves
    # the forwards ran in caches of their own: every slot of the engine's is still free and empty
    assert engine.runner.num_free == engine.runner.num_slots
    assert not any(engine.runner.length(s) for s in range(engine.runner.num_slots))
    assert engine.proposer.runner.num_free == engine.proposer.runner.num_slots


def test_suffix_drafts_beside_the_drafter_have_their_verify_widths_timed(target, random_draft):
    """Suffix speculation beside an adaptive drafter drafts up to 32 tokens, past what the draft's steps
    measure, so the target's verify calls are timed at start-up at batch 1 for 1 .. 33 tokens."""
    llm = LLM(
        target=target,
        draft=random_draft,
        num_speculative_tokens=4,
        max_num_seqs=2,
        max_model_len=256,
        prompt_lookup="suffix",
    )
    assert [type(p).__name__ for p in llm.engine.proposers] == ["DraftModelProposer", "SuffixProposer"]
    assert llm.engine.lookup_cap == 32
    assert sorted(llm.engine.policy.costs.target.tables[1].seconds) == [1, 2, 4, 8, 16, 32, 33]


def test_plain_decoding_prompt_lookup_and_fixed_k_profile_nothing(target, random_draft):
    plain = LLM(target=target, num_speculative_tokens=0, max_model_len=128)
    ngram = LLM(
        target=target,
        speculative_model="ngram",
        num_speculative_tokens=4,
        max_model_len=128,
        speculation_policy="adaptive",
    )
    fixed = LLM(
        target=target, draft=random_draft, num_speculative_tokens=4, max_model_len=128, speculation_policy="fixed"
    )
    for llm in (plain, ngram, fixed):
        assert llm.profile_seconds == 0.0
    for llm in (plain, ngram):
        assert not llm.engine.policy.costs.draft
    assert profile_draft_costs(plain.engine) == 0.0


def test_a_recorded_size_is_trusted_at_once():
    t = CostTable()
    t.observe(1, 1.0)
    t.observe(1, 1.0)
    t.record(8, 3.0)  # a lone observed sample would be ignored while size 1 has two (see the policy tests)
    assert t(8) == 3.0
    t.observe(8, 4.0)  # later steps refine it like any trusted size: the profiled sample is one of them
    assert t(8) == 3.0
    t.observe(8, 4.0)
    assert t(8) == 4.0


def test_a_profiled_draft_lets_batch_4_start_where_extrapolation_would_not():
    """Concurrency 4 straight after 1: the draft was measured at one sequence only, and priced in
    proportion beyond it (220 ms at 4, where it costs 69): 4 new requests stay plain. With the profile's
    69 ms they draft; at batch 8 (129 ms, profiled) they still do not."""
    ids = [str(i) for i in range(8)]
    learned = _served([1])
    assert learned.choose(ids[:4], catch_up=[115] * 4, remaining=[127] * 4).ks == [0] * 4
    profiled = _served([1])
    for n, seconds in {2: 0.063, 3: 0.066, 4: 0.069, 5: 0.075, 6: 0.08, 7: 0.085, 8: 0.129}.items():
        profiled.costs.draft.record(n, seconds)
    assert all(profiled.choose(ids[:4], catch_up=[115] * 4, remaining=[127] * 4).ks)
    assert profiled.choose(ids, catch_up=[115] * 8, remaining=[127] * 8).ks == [0] * 8


def test_attention_is_timed_for_a_sequence_s_first_row_and_for_its_further_rows():
    """Attention is priced per cached key at two rates: a sequence's first row, and each further row of a
    verify (which reads keys the first brought in). Both come from the start-up profile."""
    long = tiny_model(max_position=2048)
    llm = LLM(target=long, draft=long, num_speculative_tokens=3, max_num_seqs=1)
    costs = llm.engine.policy.costs.target
    assert llm.profile_seconds > 0
    assert costs.per_row_key >= 0 and costs.per_extra_row_key is not None and costs.per_extra_row_key >= 0
    assert costs.attention(1000, 3000) == costs.per_row_key * 1000 + costs.per_extra_row_key * 3000
