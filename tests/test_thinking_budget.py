"""thinking_token_budget (vLLM's): a reasoning model's thinking is closed with </think> at the row where it has taken
its budget, the same row in plain decoding and in every verify and draft row; greedy speculation equals plain
decoding and sampling follows the processed target, each failing on a broken variant that reads the output without
the drafts."""

import pytest
import torch
from conftest import fixed_k_llm as _llm
from conftest import tiny_model
from stats import PASS_P, chi2_pvalue, exact_joint, sampled_joint

from specdecode import SamplingParams, SpecDecodeError
from specdecode.sampling import process_logits, processors
from specdecode.sampling.processors import History

OPENER, CLOSER = 60, 61  # <think> and </think> as the test tokenizer's tokens


def _params(tokenizer, **kw) -> SamplingParams:
    params = SamplingParams(**kw)
    params.update_from_tokenizer(tokenizer)
    return params


class Tags:
    think_ids = (OPENER, CLOSER)


def _only(row: torch.Tensor) -> list[int]:
    return torch.isfinite(row).nonzero().flatten().tolist()


def test_the_row_that_runs_the_budget_out_may_take_only_the_closing_tag():
    params = _params(Tags(), thinking_token_budget=2)
    opened = process_logits(torch.zeros(3, 64), params, [1], output_ids=[5], drafts=[6, 7], thinking_from_prompt=True)
    # the prompt opened it: output positions 0 and 1 think, position 2 (row 1: output [5] + draft 6) closes it
    assert [_only(row) for row in opened] == [list(range(64)), [CLOSER], list(range(64))]
    reply = process_logits(torch.zeros(3, 64), params, [1], output_ids=[OPENER], drafts=[6, 7])
    # the reply's first token opened it: positions 1 and 2 think, position 3 (row 2) closes it
    assert [_only(row) for row in reply] == [list(range(64)), list(range(64)), [CLOSER]]
    closed = process_logits(torch.zeros(3, 64), params, [1], output_ids=[OPENER], drafts=[CLOSER, 7])
    no_thinking = process_logits(torch.zeros(3, 64), params, [1], output_ids=[5], drafts=[6, 7])
    assert torch.isfinite(closed).all() and torch.isfinite(no_thinking).all()


def test_a_budget_needs_the_tags_as_tokens_and_no_other_limit_on_the_vocabulary(target):
    with pytest.raises(SpecDecodeError, match="tokens of their own"):
        _llm(target).generate(["hi"], SamplingParams(thinking_token_budget=4))
    with pytest.raises(SpecDecodeError, match="allowed_token_ids or bad_words"):
        SamplingParams(thinking_token_budget=4, allowed_token_ids=[1, 2])
    with pytest.raises(SpecDecodeError, match="thinking_token_budget"):
        SamplingParams(thinking_token_budget=-1)


@pytest.fixture
def tagged(target, monkeypatch):
    monkeypatch.setattr(target.tokenizer, "think_ids", (OPENER, CLOSER), raising=False)
    return target


# left inside the thinking (by its last token, or an earlier one), left after it
PROMPTS = [[5, 6, 7, 8, 9, OPENER], [1, 2, 3, 1, 2, 3, OPENER, 4], [40, OPENER, 41, CLOSER, 42]]
GREEDY = dict(temperature=0, max_tokens=24, ignore_eos=True)


def _outputs(llm, **kw) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(**GREEDY, **kw))]


@pytest.mark.parametrize("budget", [0, 1, 3, 6])
@pytest.mark.parametrize("proposer", ["self", "random", "ngram", "narrow draft"])
def test_greedy_speculation_with_a_budget_equals_plain_decoding(tagged, random_draft, budget, proposer):
    plain = _outputs(_llm(tagged, k=0), thinking_token_budget=budget)
    free = _outputs(_llm(tagged, k=0))
    for ids, unbounded in zip(plain[:2], free):  # the first two prompts leave the reply thinking
        assert ids[budget] == CLOSER and ids[:budget] == unbounded[:budget] and unbounded[budget] != CLOSER
    assert plain[2] == free[2]
    draft = {"self": tagged, "random": random_draft, "narrow draft": random_draft}.get(proposer)
    narrow = dict(draft_vocab_size=8) if proposer == "narrow draft" else {}  # a draft that cannot write </think>
    llm = _llm(tagged, draft, k=3, speculative_model="ngram" if proposer == "ngram" else None, **narrow)
    assert _outputs(llm, thinking_token_budget=budget) == plain


def _closer_drafted_before_the_budget(target) -> tuple[list[int], int, int]:
    """A prompt, a closing tag and a budget such that plain decoding writes the tag itself one token before the budget
    ends, inside one verify window of a self-drafting k = 3 (windows from output positions 1, 5, 9, ...)."""
    prompt = [5, 6, 7, 8, 9, OPENER]
    free = _outputs(_llm(target, k=0))[0]
    p = next(p for p in range(1, 20) if p % 4 and free[p] not in free[:p] and free[p + 1] != free[p])
    return prompt, free[p], p + 1


def test_reading_the_output_without_the_drafts_breaks_greedy_equality(target, monkeypatch):
    prompt, closer, budget = _closer_drafted_before_the_budget(target)
    monkeypatch.setattr(target.tokenizer, "think_ids", (OPENER, closer), raising=False)
    params = SamplingParams(**GREEDY, thinking_token_budget=budget)
    plain = _llm(target, k=0).generate([prompt], params)[0].outputs[0].token_ids
    assert _llm(target, target, k=3).generate([prompt], params)[0].outputs[0].token_ids == plain
    told = processors._thinking_run_out
    monkeypatch.setattr(
        processors,
        "_thinking_run_out",
        lambda h: told(History(h.params, h.prompt_ids, h.output_ids, (), h.rows, h.thinking_from_prompt)),
    )
    assert _llm(target, k=0).generate([prompt], params)[0].outputs[0].token_ids == plain  # plain reads no drafts
    assert _llm(target, target, k=3).generate([prompt], params)[0].outputs[0].token_ids != plain


SMALL_VOCAB = 8  # id 7 is EOS
PROCESSED = dict(
    temperature=2.0, max_tokens=3, repetition_penalty=1.3, presence_penalty=0.7, frequency_penalty=0.9, top_k=6
)


@pytest.fixture(scope="module")
def small_pair():
    return tiny_model(seed=7, vocab=SMALL_VOCAB, hidden=32), tiny_model(seed=8, vocab=SMALL_VOCAB, hidden=32, layers=1)


@pytest.fixture
def budget_stats(small_pair, monkeypatch):
    """The likeliest first token outside the prompt as <think>, the likeliest after it as </think>: a budget of 1 then
    closes the thinking at the third token wherever the second did not."""
    target, draft = small_pair
    prompt = [1, 2, 3, 1]
    free = exact_joint(target, prompt, SamplingParams(temperature=1.0, max_tokens=2))
    # the reply opens it (exact_joint reads no prompt): a token the prompt does not hold
    candidates = [t for t in range(SMALL_VOCAB - 1) if t not in prompt]
    opener = max(candidates, key=lambda t: sum(p for out, p in free.items() if out[0] == t))
    closer = max(range(SMALL_VOCAB - 1), key=lambda t: free.get((opener, t), 0.0))
    for model in (target, draft):
        monkeypatch.setattr(model.tokenizer, "think_ids", (opener, closer), raising=False)
    # with the other processors, whose changes to the two models' logits make drafts miss often enough
    params = SamplingParams(n=16, thinking_token_budget=1, **PROCESSED)
    params.update_from_tokenizer(target.tokenizer)
    joint = exact_joint(target, prompt, params)
    bounded = [out for out in joint if out[0] == opener and out[1] not in (closer, SMALL_VOCAB - 1)]
    assert bounded and all(out[2] == closer for out in bounded)
    return prompt, params, joint


def test_sampling_with_a_budget_follows_the_processed_target(small_pair, budget_stats):
    prompt, params, joint = budget_stats
    counts, accepted = sampled_joint(*small_pair, prompt, params, samples=8000)
    assert 0.1 < accepted < 0.98  # rejections: hundreds among 8,000 samples
    assert chi2_pvalue(counts, joint) > PASS_P


def test_a_budget_read_without_the_drafts_fails_the_distribution_test(small_pair, budget_stats, monkeypatch):
    told = processors._thinking_run_out
    monkeypatch.setattr(
        processors,
        "_thinking_run_out",
        lambda h: told(History(h.params, h.prompt_ids, h.output_ids, (), h.rows, h.thinking_from_prompt)),
    )
    prompt, params, joint = budget_stats
    counts, _ = sampled_joint(*small_pair, prompt, params, samples=8000)
    assert chi2_pvalue(counts, joint) < 1e-6
