"""Logprobs under speculation equal plain decoding's for every emitted token (accepted draft, recovered,
bonus), and n outputs per prompt share one prefill, each with its own random stream."""

import pytest
import torch
from conftest import tiny_model

from specdecode import LLM, SamplingParams, SpecDecodeError
from specdecode.executor.runner import ModelRunner
from specdecode.sampling import process_logits, token_logprobs
from specdecode.verify import verifier

PROMPTS = ["hello world, hello world, hello", "abcabcabcabc"]
PROCESSED = dict(presence_penalty=0.5, logit_bias={3: 2.0})


def _llm(target, draft=None, k=3, **kw):
    kw.setdefault("speculation_policy", "fixed")
    return LLM(target=target, draft=draft, num_speculative_tokens=k, max_model_len=256, **kw)


def _flat(outputs) -> list[tuple[int, float, list]]:
    return [(lp.token_id, lp.logprob, lp.top) for o in outputs for lp in o.outputs[0].logprobs]


def _assert_close(spec, plain, tol=1e-4):
    assert [t for t, _, _ in spec] == [t for t, _, _ in plain]
    for (_, a, top_a), (_, b, top_b) in zip(spec, plain):
        assert abs(a - b) < tol
        assert [i for i, _ in top_a] == [i for i, _ in top_b]
        assert all(abs(x - y) < tol for (_, x), (_, y) in zip(top_a, top_b))


def test_greedy_logprobs_equal_plain(target, random_draft):
    params = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True, logprobs=3, **PROCESSED)
    plain = _flat(_llm(target, k=0).generate(PROMPTS, params))
    assert len(plain) == 50 and all(len(top) == 3 and lp <= 0 for _, lp, top in plain)
    assert all(top[0][0] == token for token, _, top in plain)  # greedy: the chosen token is the best
    for draft in (target, random_draft):
        _assert_close(_flat(_llm(target, draft, k=3).generate(PROMPTS, params)), plain)


def _exact_logprobs(target, prompt: list[int], output: list[int], params) -> list[float]:
    """Each token's logprob from a fresh forward over its prefix (no speculation, no batching)."""
    runner = ModelRunner(target.model, 1, 256)
    values = []
    for i, token in enumerate(output):
        slot = runner.allocate()
        logits = runner.forward([slot], [prompt + output[:i]], "last")
        runner.free(slot)
        processed = process_logits(logits, params, prompt, output[:i], (), target.tokenizer.eos_token_ids)
        values.append(token_logprobs(processed, [token], 0)[0].logprob)
    return values


def test_sampled_logprobs_are_the_targets_for_accepted_recovered_and_bonus_tokens(target):
    params = SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True, seed=3, logprobs=0, **PROCESSED)
    prompt = target.tokenizer.encode(PROMPTS[0])
    truncated = tiny_model(seed=0, layers=1)  # the target's first layer alone: right part of the time
    out = _llm(target, truncated, k=3).generate([prompt], params)[0]
    assert 0 < out.spec["num_accepted_tokens"] < out.spec["num_draft_tokens"]  # accepted and rejected drafts
    got = [lp.logprob for lp in out.outputs[0].logprobs]
    exact = _exact_logprobs(target, prompt, out.outputs[0].token_ids, params)
    assert max(abs(a - b) for a, b in zip(got, exact)) < 1e-4


def test_logprobs_of_the_wrong_row_are_caught(target, monkeypatch):
    """The broken variant reads each token's logprob one row late (the row after it was chosen)."""
    real = verifier.emitted_logprobs
    monkeypatch.setattr(
        verifier, "emitted_logprobs", lambda seq, processed, tokens: real(seq, torch.roll(processed, -1, 0), tokens)
    )
    params = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True, logprobs=0)
    plain = _flat(_llm(target, k=0).generate(PROMPTS, params))
    with pytest.raises(AssertionError):
        _assert_close(_flat(_llm(target, target, k=3).generate(PROMPTS, params)), plain)


def test_no_logprobs_unless_asked(target):
    out = _llm(target, target).generate(PROMPTS[0], SamplingParams(max_tokens=5))[0]
    assert out.outputs[0].logprobs is None


# ---- n outputs ----------------------------------------------------------------------------------
def test_n_outputs_share_one_prefill(target, random_draft, monkeypatch):
    llm = _llm(target, random_draft, k=2)
    prompts_run = []
    real = llm.engine.runner.forward
    monkeypatch.setattr(
        llm.engine.runner,
        "forward",
        lambda slots, inputs, *a, **kw: prompts_run.append(len(inputs[0])) or real(slots, inputs, *a, **kw),
    )
    prompt = target.tokenizer.encode(PROMPTS[0])
    out = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, max_tokens=12, ignore_eos=True))[0]
    assert prompts_run.count(len(prompt)) == 1  # one prefill for four outputs
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert all(len(o.token_ids) == 12 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1


def test_greedy_n_outputs_are_all_plain_greedy(target, random_draft):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = _llm(target, k=0).generate(PROMPTS[0], params)[0].outputs[0].token_ids
    out = _llm(target, random_draft).generate(
        PROMPTS[0], SamplingParams(n=3, temperature=0, max_tokens=20, ignore_eos=True)
    )[0]
    assert [o.token_ids for o in out.outputs] == [plain] * 3


def test_seeded_n_is_reproducible_and_its_first_output_is_the_single_request(target, random_draft):
    def run(n):
        params = SamplingParams(n=n, temperature=1.0, max_tokens=15, seed=11, ignore_eos=True)
        return [o.token_ids for o in _llm(target, random_draft).generate(PROMPTS[1], params)[0].outputs]

    three = run(3)
    assert three == run(3)
    assert three[0] == run(1)[0]
    assert len(set(map(tuple, three))) == 3  # each output has a stream of its own


def test_siblings_draw_their_first_tokens_in_one_pass_as_one_by_one(target, random_draft, monkeypatch):
    """n outputs take their first tokens (and logprobs) from the prompt's last row in one verification without
    drafts, in one pass where verification takes one (a GPU's way): each sibling draws what it draws one by one
    (its own stream, processors, logprobs), and every sibling is in that one call."""
    from specdecode.engine import prefill

    params = SamplingParams(
        n=3, temperature=1.0, max_tokens=6, seed=5, logprobs=2, presence_penalty=0.5, ignore_eos=True
    )

    def run():
        outputs = _llm(target, random_draft).generate(PROMPTS[1], params)[0].outputs
        return [(o.token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in o.logprobs]) for o in outputs]

    one_by_one, calls = run(), []

    def in_one_pass(seqs, *args, **kwargs):
        calls.append(len(seqs))
        return verifier.verify_batch(seqs, *args, together=True, **kwargs)

    monkeypatch.setattr(prefill, "verify_batch", in_one_pass)
    assert run() == one_by_one
    assert calls == [3]
    assert len({tuple(tokens) for tokens, _ in one_by_one}) == 3  # each sibling its own stream


def test_requests_admitted_together_draw_their_first_tokens_in_one_pass_as_alone(target, random_draft, monkeypatch):
    """Two requests admitted in one step (one with n=2) draw their first tokens from their own prompts' last rows
    in one verification (a GPU's one wait), each what it draws alone. Rows handed to the wrong request (the
    deliberately broken variant: the first group's row for all) draw otherwise."""
    from specdecode.engine import prefill

    params = [
        SamplingParams(n=2, temperature=1.0, max_tokens=1, seed=5, logprobs=2),
        SamplingParams(temperature=0, max_tokens=1, logprobs=2),
    ]

    def run(prompts, params):
        return [[o.token_ids + [lp.logprob for lp in o.logprobs or []] for o in r.outputs]
                for r in _llm(target, random_draft).generate(prompts, params)]  # fmt: skip

    alone = [run([prompt], p)[0] for prompt, p in zip(PROMPTS, params)]
    calls = []

    def in_one_pass(seqs, drafts, q, rows, *args, **kwargs):
        calls.append(len(seqs))
        return verifier.verify_batch(seqs, drafts, q, rows, *args, together=True, **kwargs)

    monkeypatch.setattr(prefill, "verify_batch", in_one_pass)
    assert run(PROMPTS, params) == alone and calls == [3]
    monkeypatch.setattr(
        prefill, "verify_batch", lambda s, d, q, rows, *a: in_one_pass(s, d, q, rows[:1].expand_as(rows), *a)
    )
    assert run(PROMPTS, params) != alone


def test_n_above_the_slots_is_refused(target):
    with pytest.raises(SpecDecodeError, match="n=5 outputs need as many sequence slots"):
        _llm(target, max_num_seqs=4).generate("abc", SamplingParams(n=5))


def test_prompt_logprobs_are_the_targets_given_each_prefix(target):
    prompt = target.tokenizer.encode(PROMPTS[1])
    out = _llm(target, target).generate([prompt], SamplingParams(max_tokens=3, prompt_logprobs=2))[0]
    scored = out.prompt_logprobs
    assert scored[0] is None and [lp.token_id for lp in scored[1:]] == prompt[1:]
    runner = ModelRunner(target.model, 1, 256)
    for i in (1, 5, len(prompt) - 1):
        slot = runner.allocate()
        logits = runner.forward([slot], [prompt[:i]], "last")
        runner.free(slot)
        expected = token_logprobs(logits, [prompt[i]], 2)[0]
        assert abs(scored[i].logprob - expected.logprob) < 1e-4
        assert [t for t, _ in scored[i].top] == [t for t, _ in expected.top]
        assert scored[i].rank == 1 + int((logits[0] > logits[0, prompt[i]]).sum())  # vLLM's rank: 1 + those above
