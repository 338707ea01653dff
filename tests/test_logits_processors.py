"""Logits processors (logit_bias, min_tokens, repetition/presence/frequency penalties, min_p) under
speculation: the formulas, greedy equality with plain decoding, and the statistical test that the
emitted text follows the processed target distribution, each failing on a deliberately broken variant."""

import math

import pytest
import torch
from conftest import fixed_k_llm, make_head, tiny_model
from stats import PASS_P, chi2_pvalue, exact_joint, sampled_joint

from specdecode import SamplingParams, SpecDecodeError
from specdecode.sampling import logits_to_probs, penalties, process_logits, processors
from specdecode.sampling.processors import History, process_rows
from specdecode.verify import verifier

PENALISED = dict(repetition_penalty=1.5, presence_penalty=0.8, frequency_penalty=1.2, logit_bias={5: 4.0, 9: -100.0})


def _llm(target, draft=None, k=3, **kw):
    return fixed_k_llm(target, draft, k, **{"draft_confidence": None, **kw})  # the default confidence stop


# ---- the formulas -----------------------------------------------------------------------------------
def test_penalties_follow_their_definitions_per_row():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0]]).repeat(3, 1)
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    out = process_logits(logits, params, prompt_ids=[4], output_ids=[0, 0], drafts=[1, 3])
    # row 0 sees output [0, 0]; row 1 adds draft 1; row 2 adds drafts 1 and 3
    expected = torch.tensor(
        [
            [2.0 / 2 - 0.5 - 0.5, -1.0, 0.5, 3.0, 0.0 * 2],
            [2.0 / 2 - 0.5 - 0.5, -1.0 * 2 - 0.5 - 0.25, 0.5, 3.0, 0.0],
            [2.0 / 2 - 0.5 - 0.5, -1.0 * 2 - 0.5 - 0.25, 0.5, 3.0 / 2 - 0.5 - 0.25, 0.0],
        ]
    )
    torch.testing.assert_close(out, expected)


def test_bias_and_min_tokens():
    logits = torch.zeros(3, 6)
    params = SamplingParams(logit_bias={"2": 1.5}, min_tokens=3, max_tokens=8)
    out = process_logits(logits, params, [1], output_ids=[0], drafts=[2, 2], eos_ids={5})
    assert out[:, 2].tolist() == [1.5] * 3
    # output has 1 token: rows 0 and 1 are tokens 2 and 3 of the output, row 2 is the fourth
    assert out[:, 5].tolist() == [-math.inf, -math.inf, 0.0]


def _bad_words(ids: list[list[int]], **kw) -> SamplingParams:
    """Params whose bad words tokenize to `ids` (a tokenizer would set them from the words)."""
    params = SamplingParams(**kw)
    params.bad_words_ids = ids
    return params


# Requests of different processors side by side (one with none), each with its own prompt, output and drafts
BATCH = [
    History(SamplingParams(allowed_token_ids=[1, 3, 6, 9], logit_bias={3: 1.0}), [2], [0], [3, 6], 3),
    History(_bad_words([[2], [3, 4], [4, 4, 6]], repetition_penalty=1.2), [1], [5, 4], [4, 3, 4], 4),
    History(SamplingParams(logit_bias={2: 1.5, 7: -3.0}), [1], [0, 4], [3], 2),
    History(SamplingParams(min_tokens=4, max_tokens=9), [2], [1], [5, 6, 2], 4),
    History(SamplingParams(repetition_penalty=1.4, frequency_penalty=0.3), [3, 7], [0, 0, 6], [6, 1], 3),
    History(SamplingParams(temperature=0.7), [4], [2], [], 1),
    History(SamplingParams(presence_penalty=0.5, repetition_penalty=0.8, logit_bias={0: 2.0}), [6], [7, 7], [7], 2),
    # tokens past the rows' vocabulary (a draft's may be smaller) are nowhere in them
    History(SamplingParams(repetition_penalty=1.3, frequency_penalty=0.2), [2, 11], [9, 3, 3], [8, 3, 1], 4),
]


def _by_definition(logits: torch.Tensor, histories, eos_ids) -> torch.Tensor:
    """Row by row, from the formulas: only the allowed tokens kept; bias; EOS banned while the output is short; a bad
    word's last token banned where the text before the row ends with the rest of it; then the penalties over the
    output and the drafts before the row."""
    out, row = logits.clone(), 0
    for h in histories:
        p = h.params
        for j in range(h.rows):
            x = out[row]
            before = list(h.output_ids) + list(h.drafts[:j])
            if p.allowed_token_ids:
                x[[t for t in range(len(x)) if t not in p.allowed_token_ids]] = -math.inf
            for i, v in (p.logit_bias or {}).items():
                x[i] += v
            if p.min_tokens and len(h.output_ids) + j < p.min_tokens:
                x[list(eos_ids)] = -math.inf
            for word in p.bad_words_ids:
                if len(before) >= len(word) - 1 and before[len(before) - len(word) + 1 :] == word[:-1]:
                    x[word[-1]] = -math.inf
            if p.has_penalties:
                for t in range(len(x)):
                    n = before.count(t)
                    if n or t in h.prompt_ids:
                        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
                    x[t] -= p.frequency_penalty * n + p.presence_penalty * (n > 0)
            row += 1
    return out


def _batch_logits() -> torch.Tensor:
    return torch.randn(sum(h.rows for h in BATCH), 8, generator=torch.Generator().manual_seed(3)) * 2


def test_requests_processed_together_get_their_own_rows_processed_by_definition():
    logits = _batch_logits()
    together = process_rows(logits.clone(), BATCH, eos_ids={5})
    torch.testing.assert_close(together, _by_definition(logits, BATCH, {5}))
    alone, row = [], 0
    for h in BATCH:  # one request alone takes the same operations: the same bits
        alone.append(process_logits(logits[row : row + h.rows], h.params, h.prompt_ids, h.output_ids, h.drafts, {5}))
        row += h.rows
    assert torch.equal(together, torch.cat(alone))


def test_many_requests_with_long_histories_get_their_rows_penalised_by_definition():
    rng = torch.Generator().manual_seed(5)

    def tokens(n):
        return torch.randint(0, 40, (n,), generator=rng).tolist()

    histories = []
    for i in range(12):
        rep, freq, pres = (1 + 0.1 * (i % 4), 0.3 * (i % 3), 0.2 * (i % 2))
        params = SamplingParams(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres)
        drafts = tokens(i % 5)
        histories.append(History(params, tokens(3 * i), tokens(2 * i), drafts, len(drafts) + 1))
    logits = torch.randn(sum(h.rows for h in histories), 40, generator=rng) * 3
    torch.testing.assert_close(process_rows(logits.clone(), histories), _by_definition(logits, histories, ()))


def test_penalties_read_a_prompt_as_its_distinct_tokens_and_write_rows_of_any_strides_in_place():
    """The engine passes each prompt's distinct tokens (made once per sequence): the same result as the prompt itself.
    Penalties write in place, so logits whose rows are not contiguous (a view) are changed where they lie."""
    import numpy as np

    from specdecode.sampling.penalties import penalise

    logits = _batch_logits()
    distinct = [History(h.params, np.unique(np.asarray(h.prompt_ids)), h.output_ids, h.drafts, h.rows) for h in BATCH]
    assert torch.equal(process_rows(logits.clone(), distinct, {5}), process_rows(logits.clone(), BATCH, {5}))
    penalised = [h for h in BATCH if h.params.has_penalties]
    firsts = [sum(h.rows for h in BATCH[:i]) for i, h in enumerate(BATCH) if h.params.has_penalties]
    view = logits.T.contiguous().T  # the same values, column-major
    expected = logits.clone()
    penalise(expected, penalised, firsts)
    penalise(view, penalised, firsts)
    assert not view.is_contiguous() and torch.equal(view, expected)


BROKEN_BATCH = {
    # each request's tokens counted as the next request's
    "tokens of another request": (penalties, "_keys", lambda told: lambda tokens, r, vocab: told(tokens, r + 1, vocab)),
    # the drafts up to and including the row's own token counted
    "a row's own draft counted": (penalties, "_drafts_before", lambda told: lambda h, row: told(h, row + 1)),
    # a bad word matched against the output alone, as if no draft came before the row
    "bad words without the drafts": (
        processors,
        "_bad_word_ends",
        lambda told: lambda h: told(History(h.params, h.prompt_ids, h.output_ids, (), h.rows)),
    ),
    # the allowed tokens of the request before kept in a row
    "allowed ids of another request": (
        processors,
        "_keep_allowed",
        lambda told: lambda logits, hs, starts: told(logits, hs, [s + 1 for s in starts]),
    ),
    # EOS banned one row too long
    "min_tokens one row late": (
        processors,
        "_short_rows",
        lambda told: lambda h: range(min(told(h).stop + 1, h.rows)),
    ),
}


@pytest.mark.parametrize("broken", list(BROKEN_BATCH))
def test_a_batch_that_mixes_up_requests_is_caught(monkeypatch, broken):
    module, name, wrap = BROKEN_BATCH[broken]
    monkeypatch.setattr(module, name, wrap(getattr(module, name)))
    logits = _batch_logits()
    assert not torch.allclose(process_rows(logits.clone(), BATCH, eos_ids={5}), _by_definition(logits, BATCH, {5}))


def test_min_p_keeps_tokens_within_a_factor_of_the_best():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = logits_to_probs(logits, SamplingParams(min_p=0.2))  # floor: 0.1
    torch.testing.assert_close(probs, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(presence_penalty=3), "presence_penalty must be a finite number from -2 to 2"),
        (dict(repetition_penalty=0), "repetition_penalty must be in (0, 10]"),
        (dict(min_p=1.5), "min_p must be a finite number from 0 to 1"),
        (dict(logit_bias={"x": 1}), "logit_bias keys must be token ids"),
        (dict(logit_bias={3: 200}), "logit_bias[3] must be a finite number from -100 to 100"),
        (dict(min_tokens=20, max_tokens=10), "min_tokens must be an integer from 0 to 10"),
        (dict(logprobs=21), "logprobs must be an integer from 0 to 20"),
        (dict(n=0), "n must be an integer from 1 to 16"),
    ],
)
def test_bad_processor_params(kwargs, message):
    with pytest.raises(SpecDecodeError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        SamplingParams(**kwargs)


def test_logit_bias_outside_the_vocabulary_is_refused(target):
    with pytest.raises(SpecDecodeError, match="token id 5000 in logit_bias is not in this model's vocabulary"):
        _llm(target, k=0).generate("abc", SamplingParams(logit_bias={5000: 1.0}))


# ---- greedy equality ----------------------------------------------------------------------------------
PROMPTS = ["hello world, hello world, hello", "abcabcabcabc"]
GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, **PENALISED)


def _ids(llm, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


@pytest.fixture(scope="module")
def plain_penalised(target):
    return _ids(_llm(target, k=0))


def test_processors_change_the_output(target, plain_penalised):
    unprocessed = _ids(_llm(target, k=0), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    assert unprocessed != plain_penalised
    assert all(9 not in ids for ids in plain_penalised)  # logit_bias -100 bans a token


@pytest.mark.parametrize("proposer", ["self", "random", "ngram"])
def test_greedy_with_processors_equals_plain(target, random_draft, plain_penalised, proposer):
    draft = {"self": target, "random": random_draft}.get(proposer)
    llm = _llm(target, draft, k=3, speculative_model="ngram" if proposer == "ngram" else None)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == plain_penalised
    drafted = sum(o.spec["num_draft_tokens"] for o in outs)
    accepted = sum(o.spec["num_accepted_tokens"] for o in outs)
    assert drafted > 0
    if proposer == "self":  # the draft applies the same processors, so a self-draft is always right
        assert accepted == drafted


def test_penalties_without_the_drafts_break_greedy_equality(target, plain_penalised, monkeypatch):
    """The broken variant: the verify window's rows all see the text before the drafts."""
    real = verifier.processed_logits
    monkeypatch.setattr(verifier, "processed_logits", lambda seq, logits, drafts, eos: real(seq, logits, [], eos))
    assert _ids(_llm(target, target, k=3)) != plain_penalised


# ---- the distribution ---------------------------------------------------------------------------------
SMALL_VOCAB = 8  # id 7 is EOS
STAT_PARAMS = dict(
    temperature=1.0,
    max_tokens=3,
    min_tokens=2,
    repetition_penalty=1.3,
    presence_penalty=0.7,
    frequency_penalty=0.9,
    logit_bias={2: 1.0},
    min_p=0.02,
    top_k=6,
)


@pytest.fixture(scope="module")
def small_pair():
    return tiny_model(seed=7, vocab=SMALL_VOCAB, hidden=32), tiny_model(seed=8, vocab=SMALL_VOCAB, hidden=32, layers=1)


@pytest.fixture(scope="module")
def stat_setup(small_pair):
    target, _ = small_pair
    prompt = [1, 2, 3, 1]
    params = SamplingParams(n=16, **STAT_PARAMS)
    return prompt, params, exact_joint(target, prompt, params)


def test_sampling_with_processors_follows_the_processed_target(small_pair, stat_setup):
    prompt, params, joint = stat_setup
    counts, accepted = sampled_joint(*small_pair, prompt, params, samples=8000)
    assert 0.1 < accepted < 0.95  # both accepted drafts and rejections are exercised
    assert chi2_pvalue(counts, joint) > PASS_P


def test_penalties_without_the_drafts_fail_the_distribution_test(small_pair, stat_setup, monkeypatch):
    real = verifier.processed_logits
    monkeypatch.setattr(verifier, "processed_logits", lambda seq, logits, drafts, eos: real(seq, logits, [], eos))
    prompt, params, joint = stat_setup
    counts, _ = sampled_joint(*small_pair, prompt, params, samples=8000)
    assert chi2_pvalue(counts, joint) < 1e-6


def test_min_tokens_holds_back_eos(small_pair):
    target, draft = small_pair
    eos_first = SamplingParams(temperature=0, max_tokens=6, logit_bias={7: 100.0})
    assert _llm(target, draft, k=2).generate([[1, 2]], eos_first)[0].outputs[0].token_ids == [7]
    out = (
        _llm(target, draft, k=2)
        .generate([[1, 2]], SamplingParams(temperature=0, max_tokens=6, min_tokens=4, logit_bias={7: 100.0}))[0]
        .outputs[0]
    )
    assert len(out.token_ids) == 5 and out.token_ids[-1] == 7 and 7 not in out.token_ids[:4]
    assert out.finish_reason == "stop"


def test_the_exact_joint_sums_to_one_and_respects_min_tokens(stat_setup):
    _, _, joint = stat_setup
    assert math.isclose(sum(joint.values()), 1.0, rel_tol=1e-5)
    assert {len(t) for t in joint} == {3}
    assert all(7 not in t[:2] for t in joint)  # min_tokens=2: no EOS in the first two tokens
    assert any(t[-1] == 7 for t in joint)  # the third may end the text


# ---- allowed_token_ids and bad_words ------------------------------------------------------------------
ALLOWED = list(range(20, 50))  # none of them in the 16 ids a draft_vocab_size=8 draft keeps


@pytest.fixture(scope="module")
def limited(target):
    """Greedy params that allow ALLOWED only and ban, as bad words, a two-token word and a token that decoding with
    ALLOWED alone generates (so the ban bites), with plain decoding's outputs under them."""
    kw = dict(temperature=0, max_tokens=30, ignore_eos=True, allowed_token_ids=ALLOWED)
    free = _ids(_llm(target, k=0), SamplingParams(**kw))
    first = free[0]
    pair = next(first[i : i + 2] for i in range(2, len(first) - 1) if first[i] != first[i + 1])
    single = next(t for t in first if t not in pair)
    params = SamplingParams(**kw, bad_words=[target.tokenizer.decode(pair), target.tokenizer.decode([single])])
    return params, free, pair, single, _ids(_llm(target, k=0), params)


def test_allowed_ids_and_bad_words_hold_in_plain_decoding(target, limited):
    params, free, pair, single, plain = limited
    unlimited = _ids(_llm(target, k=0), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    assert free != unlimited and plain != free  # each limit changes the output
    for ids in plain + free:
        assert set(ids) <= set(ALLOWED)
    for ids in plain:
        assert single not in ids and all([a, b] != pair for a, b in zip(ids, ids[1:]))


@pytest.mark.parametrize("proposer", ["self", "random", "ngram", "narrow draft"])
def test_greedy_with_allowed_ids_and_bad_words_equals_plain(target, random_draft, limited, proposer):
    """ "narrow draft": a draft whose LM head covers none of the allowed ids drafts from a uniform q, never fails."""
    params, *_, plain = limited
    draft = {"self": target, "random": random_draft, "narrow draft": random_draft}.get(proposer)
    narrow = dict(draft_vocab_size=8) if proposer == "narrow draft" else {}
    llm = _llm(target, draft, k=3, speculative_model="ngram" if proposer == "ngram" else None, **narrow)
    outs = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert sum(o.spec["num_draft_tokens"] for o in outs) > 0


def test_sampling_from_a_narrow_draft_keeps_to_the_allowed_ids(target, random_draft):
    params = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, allowed_token_ids=ALLOWED, seed=3)
    outs = _llm(target, random_draft, k=3, draft_vocab_size=8).generate(PROMPTS, params)
    assert all(set(o.outputs[0].token_ids) <= set(ALLOWED) for o in outs)


def test_bad_words_matched_without_the_drafts_break_greedy_equality(target, limited, monkeypatch):
    """The broken variant: a verify row's bad words matched against the output alone, not the drafts before it."""
    params, *_, plain = limited
    told = processors._bad_word_ends
    monkeypatch.setattr(
        processors, "_bad_word_ends", lambda h: told(History(h.params, h.prompt_ids, h.output_ids, (), h.rows))
    )
    assert _ids(_llm(target, target, k=3), params) != plain


LIMITED_STATS = dict(temperature=1.0, max_tokens=3, allowed_token_ids=[1, 2, 3, 4, 5, 7], bad_words=["!", '"#'])


@pytest.fixture(scope="module")
def limited_stats(small_pair):
    target, _ = small_pair
    params = SamplingParams(n=16, **LIMITED_STATS)
    params.update_from_tokenizer(target.tokenizer)
    assert params.bad_words_ids == [[1], [2, 3]]
    return [1, 2, 3, 1], params, exact_joint(target, [1, 2, 3, 1], params)


def test_sampling_with_allowed_ids_and_bad_words_follows_the_processed_target(small_pair, limited_stats):
    prompt, params, joint = limited_stats
    assert all(0 not in t and 6 not in t and 1 not in t and "2, 3" not in str(t) for t in joint)
    counts, accepted = sampled_joint(*small_pair, prompt, params, samples=8000)
    assert 0.1 < accepted < 0.95
    assert chi2_pvalue(counts, joint) > PASS_P


def test_bad_words_without_the_drafts_fail_the_distribution_test(small_pair, limited_stats, monkeypatch):
    told = processors._bad_word_ends
    monkeypatch.setattr(
        processors, "_bad_word_ends", lambda h: told(History(h.params, h.prompt_ids, h.output_ids, (), h.rows))
    )
    prompt, params, joint = limited_stats
    counts, _ = sampled_joint(*small_pair, prompt, params, samples=8000)
    assert chi2_pvalue(counts, joint) < 1e-6


# ---- a request's own processors (SamplingParams.logits_processors) --------------------------------------------------
def no_repeats(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    """The last token may not come again at once, and the token the output's length names is favoured."""
    if output_ids:
        logits[output_ids[-1]] = float("-inf")
    logits[len(output_ids) % 6 + 1] += 1.5
    return logits


def test_a_requests_own_processors_see_the_tokens_before_each_row():
    """Row j is given the output and drafts[:j] (a three-argument processor the prompt first); processors run in order,
    before the others (here a bias); a processor that returns something else than the row is refused by name."""
    seen = []

    def record(prompt_ids, output_ids, logits):
        seen.append((list(prompt_ids), list(output_ids)))
        return logits * 2

    params = SamplingParams(logits_processors=[record, no_repeats], logit_bias={4: 1.0})
    out = process_logits(torch.ones(3, 8), params, [9], [5, 6], drafts=[2, 3], prompt=[9, 9, 7])
    assert seen == [([9, 9, 7], [5, 6]), ([9, 9, 7], [5, 6, 2]), ([9, 9, 7], [5, 6, 2, 3])]
    expected = torch.full((3, 8), 2.0)
    for j, (last, favoured) in enumerate([(6, 3), (2, 4), (3, 5)]):
        expected[j, favoured] += 1.5
        expected[j, last] = float("-inf")
    expected[:, 4] += 1.0
    torch.testing.assert_close(out, expected)
    with pytest.raises(SpecDecodeError, match="'<lambda>' returned list"):
        process_logits(torch.ones(1, 8), SamplingParams(logits_processors=[lambda ids, x: x.tolist()]), [1], [2])
    with pytest.raises(SpecDecodeError, match="takes 1 arguments"):
        SamplingParams(logits_processors=[lambda x: x])


@pytest.fixture(scope="module")
def own_processed(target):
    """Greedy params with no_repeats, and plain decoding's outputs under them (which the processor changes)."""
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logits_processors=[no_repeats])
    plain = _ids(_llm(target, k=0), params)
    assert plain != _ids(_llm(target, k=0), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    assert all(a != b for ids in plain for a, b in zip(ids, ids[1:]))
    return params, plain


@pytest.mark.parametrize("proposer", ["self", "random", "ngram", "head"])
def test_greedy_with_a_requests_own_processors_equals_plain(target, random_draft, own_processed, proposer, tmp_path):
    params, plain = own_processed
    draft = {"self": target, "random": random_draft}.get(proposer)
    named = make_head(target, tmp_path / "head") if proposer == "head" else "ngram" if proposer == "ngram" else None
    llm = _llm(target, draft, k=3, speculative_model=named)
    outs = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert sum(o.spec["num_draft_tokens"] for o in outs) > 0
    assert proposer != "self" or sum(o.spec["num_accepted_tokens"] for o in outs) > 0


def _own_processors_without_the_drafts(monkeypatch):
    """The broken variant: each verify row given the output alone, not the drafts before it."""
    told = processors.custom_processed
    monkeypatch.setattr(
        processors,
        "custom_processed",
        lambda rows, h: told(rows, History(h.params, h.prompt_ids, h.output_ids, (), h.rows, prompt=h.prompt)),
    )


def test_own_processors_without_the_drafts_break_greedy_equality(target, own_processed, monkeypatch):
    params, plain = own_processed
    _own_processors_without_the_drafts(monkeypatch)
    assert _ids(_llm(target, target, k=3), params) != plain


@pytest.fixture(scope="module")
def own_stats(small_pair):
    target, _ = small_pair
    params = SamplingParams(n=16, temperature=1.0, max_tokens=3, logits_processors=[no_repeats])
    return [1, 2, 3, 1], params, exact_joint(target, [1, 2, 3, 1], params)


def test_sampling_with_own_processors_follows_the_processed_target(small_pair, own_stats):
    prompt, params, joint = own_stats
    assert all(a != b for t in joint for a, b in zip(t, t[1:]))
    counts, accepted = sampled_joint(*small_pair, prompt, params, samples=8000)
    assert 0.1 < accepted < 0.95
    assert chi2_pvalue(counts, joint) > PASS_P


def test_own_processors_without_the_drafts_fail_the_distribution_test(small_pair, own_stats, monkeypatch):
    _own_processors_without_the_drafts(monkeypatch)
    prompt, params, joint = own_stats
    counts, _ = sampled_joint(*small_pair, prompt, params, samples=8000)
    assert chi2_pvalue(counts, joint) < 1e-6
