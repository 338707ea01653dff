"""The engine on tiny random models: greedy speculative output equals plain greedy output token for
token (self-draft: everything accepted; random draft: almost nothing accepted; n-gram), stop
conditions inside an accepted chunk, batching, and the documented errors for bad input."""

import pytest
from conftest import fixed_k_llm, make_head, priced_without_timing, run_as_one_batch, tiny_model

from specdecode import LLM, SamplingParams, SpecDecodeError
from specdecode.models.loader import LoadedModel

PROMPTS = ["hello world, hello world, hello", "abcabcabcabc", "the quick brown fox"]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def _llm(target, draft=None, k=4, **kw):
    return fixed_k_llm(target, draft, k, **kw)  # these tests are about the mechanics of a given k


def _plain_ids(target, prompts=PROMPTS, params=GREEDY):
    return [o.outputs[0].token_ids for o in _llm(target, k=0).generate(prompts, params)]


@pytest.fixture(scope="module")
def plain(target):
    return _plain_ids(target)


def _spec_run(llm, prompts=PROMPTS, params=GREEDY):
    outs = [llm.generate(p, params)[0] for p in prompts]
    drafted = sum(o.spec["num_draft_tokens"] for o in outs)
    accepted = sum(o.spec["num_accepted_tokens"] for o in outs)
    return [o.outputs[0].token_ids for o in outs], accepted / max(drafted, 1)


def test_self_draft_accepts_everything_and_matches_plain(target, plain):
    ids, alpha = _spec_run(_llm(target, draft=target, k=4))
    assert ids == plain
    assert alpha > 0.95


def test_random_draft_rejects_almost_everything_and_matches_plain(target, random_draft, plain):
    ids, alpha = _spec_run(_llm(target, draft=random_draft, k=3))
    assert ids == plain
    assert alpha < 0.3


@pytest.mark.parametrize("k", [1, 2, 5])
def test_ngram_matches_plain(target, plain, k):
    ids, alpha = _spec_run(_llm(target, speculative_model="ngram", k=k))
    assert ids == plain
    assert alpha > 0  # the repetitive prompts give the lookup something to find


def test_broken_verifier_is_caught_by_the_equality_check(target, random_draft, plain):
    """forced_accept keeps every draft token: with a random draft the output must then differ."""
    ids, alpha = _spec_run(_llm(target, draft=random_draft, k=3, forced_accept=True))
    assert alpha == 1.0
    assert ids != plain


def test_batched_generate_equals_one_by_one(target, random_draft, plain):
    llm = _llm(target, draft=random_draft, k=3)
    batched = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert batched == plain


def test_metrics_are_consistent(target):
    out = _llm(target, draft=target, k=4).generate(PROMPTS[0], GREEDY)[0]
    m = out.spec
    assert m["num_output_tokens"] == len(out.outputs[0].token_ids) == 40
    assert 1 <= m["mean_accepted_length"] <= 5
    assert m["num_accepted_tokens"] <= m["num_draft_tokens"]
    assert len(m["acceptance_per_position"]) == 4
    assert out.metrics.ttft > 0 and out.metrics.tpot > 0


# ---- stop conditions inside an accepted chunk ------------------------------------------------------
def _with_eos(model: LoadedModel, eos: int) -> LoadedModel:
    tok = type(model.tokenizer)(model.config.vocab_size)
    tok.eos_token_ids = frozenset({eos})
    return LoadedModel(model.name, model.model, tok, model.config)


def test_eos_inside_accepted_chunk_stops_there(target, plain):
    ids = plain[0]
    cut = next(i for i in range(7, len(ids)) if ids[i] not in ids[:i])  # first occurrence of that token
    eos_target = _with_eos(target, ids[cut])
    out = _llm(eos_target, draft=target, k=4).generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=40))[0]
    assert out.outputs[0].token_ids == ids[: cut + 1]  # up to and including EOS, nothing after it
    assert out.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("included", [False, True])
def test_stop_string_inside_accepted_chunk(target, plain, included):
    """The text ends before the first stop string (after it, with vLLM's include_stop_str_in_output)."""
    text = target.tokenizer.decode(plain[0])
    stop = text[10:13]
    first = text.find(stop)
    params = SamplingParams(
        temperature=0, max_tokens=40, stop=[stop], ignore_eos=True, include_stop_str_in_output=included
    )
    out = _llm(target, draft=target, k=4).generate(PROMPTS[0], params)[0]
    assert out.outputs[0].text == text[: first + (len(stop) if included else 0)]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].text.count(stop) == included


def test_a_stop_token_inside_an_accepted_chunk_stops_there_ignore_eos_or_not(target, plain):
    """vLLM's stop_token_ids: the first of them ends the text as EOS does (kept, nothing after it)."""
    ids = plain[0]
    cut = next(i for i in range(7, len(ids)) if ids[i] not in ids[:i])
    for ignore_eos in (False, True):
        params = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[ids[cut]], ignore_eos=ignore_eos)
        out = _llm(target, draft=target, k=4).generate(PROMPTS[0], params)[0].outputs[0]
        assert (out.token_ids, out.finish_reason) == (ids[: cut + 1], "stop")


def test_min_tokens_holds_back_the_stop_tokens_too(target, plain):
    """As vLLM's: before min_tokens no stop token may come (the first output token, here), EOS ignored or not."""
    first = plain[0][0]
    for ignore_eos in (False, True):
        params = SamplingParams(
            temperature=0, max_tokens=12, min_tokens=6, stop_token_ids=[first], ignore_eos=ignore_eos
        )
        out = _llm(target, draft=target, k=4).generate(PROMPTS[0], params)[0].outputs[0]
        assert first not in out.token_ids[:6] and len(out.token_ids) >= 6


def test_truncate_prompt_tokens_keeps_the_prompts_end(target):
    """vLLM's truncate_prompt_tokens: the last N tokens are the prompt; -1 keeps what fits beside max_tokens."""
    llm, ids = _llm(target, draft=target, k=4), target.tokenizer.encode(PROMPTS[0] * 20)
    assert len(ids) > 256
    kept = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8, truncate_prompt_tokens=5))[0]
    assert (
        kept.outputs[0].token_ids
        == llm.generate([ids[-5:]], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].token_ids
    )
    assert kept.prompt_token_ids == ids[-5:]
    fitted = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8, truncate_prompt_tokens=-1))[0]
    assert fitted.prompt_token_ids == ids[-(256 - 8) :] and len(fitted.outputs[0].token_ids) == 8
    with pytest.raises(SpecDecodeError, match="the prompt has"):
        llm.generate([ids], SamplingParams(temperature=0, max_tokens=8))


@pytest.mark.parametrize("max_tokens", [1, 2, 7])
def test_max_tokens_is_exact(target, max_tokens):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    out = _llm(target, draft=target, k=4).generate(PROMPTS[0], params)[0]
    assert len(out.outputs[0].token_ids) == max_tokens
    assert out.outputs[0].finish_reason == "length"


def test_sampling_with_seed_is_reproducible(target, random_draft):
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=20, seed=11)
    llm = _llm(target, draft=random_draft, k=3)
    a, b = llm.generate(PROMPTS[0], params)[0], llm.generate(PROMPTS[0], params)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


# ---- bad input ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(SpecDecodeError, match=message):
        SamplingParams(**kwargs)


def test_empty_and_too_long_prompts(target):
    llm = _llm(target, k=0)
    with pytest.raises(SpecDecodeError, match="empty"):
        llm.generate([[]], GREEDY)
    with pytest.raises(SpecDecodeError, match="context"):
        llm.generate("x" * 300, GREEDY)


def test_a_call_with_one_prompt_refused_leaves_none_of_its_others_to_run_in_the_next(target):
    llm = _llm(target, k=0)
    with pytest.raises(SpecDecodeError, match="context"):
        llm.generate(["ab", "cd", "x" * 300], GREEDY)
    assert not llm.engine.has_unfinished()  # the first two were aborted, not left waiting
    outputs = llm.generate(["ef"], GREEDY)
    decoded = len(outputs[0].outputs[0].token_ids) - 1  # the first token comes from the prefill
    assert len(outputs) == 1 and llm.engine.totals.num_emitted_tokens == decoded  # nothing else ran


def test_negative_k_and_vocabulary_mismatch(target):
    with pytest.raises(SpecDecodeError, match="k"):
        _llm(target, k=-1)
    other = tiny_model(seed=1, vocab=80)
    with pytest.raises(SpecDecodeError, match="vocabularies"):
        _llm(target, draft=other)


def test_prompt_near_context_end_stops_with_length(target, random_draft):
    llm = _llm(target, draft=random_draft, k=4)
    out = llm.generate("y" * 250, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length"
    assert 250 + len(out.outputs[0].token_ids) == 256


def test_a_step_says_what_it_did(target):
    """The server's metrics read each step's output: a prefill-only step reports the admitted sequence and no
    decoding counts (none of the previous step's, which would be counted twice); a speculative step reports its
    drafts and the sequences it decoded; a finishing step names the finished sequence."""
    llm = _llm(target, draft=target, k=3)
    engine = llm.engine
    first = engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    out = engine.step()  # nothing decoded before: the prefill alone, its first token out at once
    assert out.updated == [first] and out.batch_size == 0 and out.counters.num_steps == 0
    out = engine.step()  # the first speculative step
    assert out.updated == [first] and out.batch_size == 1 and out.draft_lengths[0] > 0
    assert out.counters.num_draft_tokens == out.draft_lengths[0] and out.counters.num_steps == 1
    assert out.counters.num_emitted_tokens == out.counters.num_accepted_tokens + 1
    finished = []
    while engine.has_unfinished():
        finished += engine.step().finished
    assert finished == [first]
    second = engine.add_request([4, 5], SamplingParams(temperature=0, max_tokens=1))
    out = engine.step()  # prefill emits the only token: no decoding step
    assert out.updated == [second] and out.finished == [second]
    assert out.counters.num_draft_tokens == 0 and out.counters.num_steps == 0 and out.batch_size == 0


def test_each_step_gives_each_sequence_its_new_tokens_and_logprobs(target):
    """Read step by step, what each step gave each sequence adds up to its output: tokens, logprobs (the n
    samples each their own), and the finish reason in the step that finished it, none before."""
    llm = _llm(target, draft=target, k=3)
    engine = llm.engine
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=9, ignore_eos=True, logprobs=1, n=2)
    seqs = engine.add_group([1, 2, 3], params) + engine.add_group([4, 5], SamplingParams(temperature=0, max_tokens=5))
    given = {id(s): ([], [], []) for s in seqs}
    while engine.has_unfinished():
        for update in engine.step().outputs:
            tokens, logprobs, reasons = given[id(update.seq)]
            assert update.token_ids
            tokens += update.token_ids
            logprobs += update.logprobs or []
            reasons.append(update.finish_reason)
    for seq in seqs:
        tokens, logprobs, reasons = given[id(seq)]
        assert tokens == seq.output_ids and reasons[-1] == seq.finish_reason and not any(reasons[:-1])
        assert logprobs == (seq.logprobs or [])
    assert len(given[id(seqs[0])][1]) == 9 and given[id(seqs[0])][0] != given[id(seqs[1])][0]


@pytest.mark.parametrize("broken", [False, True])
def test_requests_arriving_during_a_prefill_decode_with_it_from_the_first_step(target, broken):
    """A step that admits while nothing decodes ends after the prefill, so three requests that arrive while the
    first prompt is prefilled are admitted next and decoded together with it in the very first decoding step,
    instead of the first one decoding alone (and, with the adaptive policy, perhaps starting a draft catch-up that
    a batch of four no longer wants). Broken: the first step decodes at once."""
    engine = _llm(target, draft=target, k=3, speculation_policy="adaptive").engine
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    if broken:
        engine._decoding = lambda: True
    engine.add_request([1, 2, 3], params)
    first = engine.step()
    for prompt in ([4, 5, 6], [7, 8], [9, 10, 11, 12]):
        engine.add_request(prompt, params)
    second = engine.step()
    assert (first.batch_size, second.batch_size) == ((1, 4) if broken else (0, 4))


def test_adaptive_with_prompt_lookup_matches_plain_batched(target, random_draft, monkeypatch):
    """Adaptive policy, a useless draft model and prompt lookup beside it, three requests in one batch:
    lookup drafts (one-hot q, no draft forward) are verified like any other, per sequence and step, and
    the packed ragged verify keeps the output equal to plain decoding token for token."""
    plain_ids = _plain_ids(target)
    llm = _llm(target, draft=random_draft, k=4, speculation_policy="adaptive", prompt_lookup="ngram")
    priced_without_timing(llm.engine.policy, monkeypatch, len(PROMPTS))
    outputs, step_ks, lookup_drafts = run_as_one_batch(
        llm.engine, [target.tokenizer.encode(p) for p in PROMPTS], GREEDY
    )
    assert outputs == plain_ids
    assert lookup_drafts > 0
    assert any(len(set(ks)) > 1 for ks in step_ks)  # ragged within a step
    assert llm.engine.policy.estimator.lookup_acceptance.counts  # lookup outcomes were learned


def test_adaptive_without_rollback_breaks_equality(target, random_draft, monkeypatch):
    """The check above can fail: if the KV pointer kept rejected drafts (no rollback), later tokens
    attend to them and the output drifts from plain decoding."""
    plain_ids = _plain_ids(target)
    llm = _llm(target, draft=random_draft, k=4, speculation_policy="adaptive", prompt_lookup="ngram")
    priced_without_timing(llm.engine.policy, monkeypatch, len(PROMPTS))
    runner = llm.engine.runner
    original_commit = runner.commit

    def commit_keeping_rejected_drafts(slot, length, hold=0):
        original_commit(slot, runner._written[slot])  # as if every verified draft had been accepted

    runner.commit = commit_keeping_rejected_drafts
    ids = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert llm.engine.policy.estimator.lookup_acceptance.counts  # lookup drafts were verified
    assert ids != plain_ids


def test_generate_takes_one_sampling_params_per_prompt_as_vllm_does(target):
    from specdecode import LLM, SamplingParams, SpecDecodeError

    llm = LLM(target=target, num_speculative_tokens=0, max_model_len=128)
    prompts = [[5, 6, 7], [8, 9]]
    each = [
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
    ]
    outs = llm.generate(prompts, each)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 7]
    assert outs[1].outputs[0].token_ids == llm.generate([prompts[1]], each[1])[0].outputs[0].token_ids
    with pytest.raises(SpecDecodeError, match="one per prompt; got 1 for 2 prompts"):
        llm.generate(prompts, each[:1])


@pytest.fixture(scope="module")
def tiny_head(target, tmp_path_factory):
    return make_head(target, tmp_path_factory.mktemp("heads") / "tiny")


@pytest.mark.parametrize("drafter", ["head", "draft model"])
def test_the_drafter_reads_a_prompt_before_its_first_token(target, random_draft, tiny_head, drafter):
    """When the first token is out, the drafter has read all of the prompt but its last position (the first
    drafting round reads from there): the prompt's one-off cost falls in the time to the first token, not
    between the first token and the second. Its drafts are those of a drafter that reads the prompt in its
    first round, and so is the output (a drafter that does not read ahead: the broken variant, which fails the
    first assertion)."""
    prompt = list(range(3, 43))
    options = dict(speculative_model=tiny_head) if drafter == "head" else dict(draft=random_draft)
    ahead, lazily = (_first_token_and_run(_llm(target, k=3, **options), prompt, read_ahead) for read_ahead in (1, 0))
    assert ahead[0] == [1 if drafter == "head" else 2]
    assert lazily[0][0] > len(prompt) - 1
    assert ahead[1:] == lazily[1:] and ahead[3] > 0


def _first_token_and_run(llm, prompt, read_ahead: bool):
    """(what the drafter had not read when the first token was out, then over a whole run: the output, the
    acceptance per position, the draft tokens)."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    if not read_ahead:
        llm.engine.policy.expects_drafting = lambda batch: False
    engine = llm.engine
    seq = engine.add_request(prompt, params)
    engine.step()  # the prefill alone: the first token is out
    unseen = [engine.proposer.unseen_tokens(seq)]
    out = llm.generate(prompt, params)[0]
    return unseen, out.outputs[0].token_ids, out.spec["acceptance_per_position"], out.spec["num_draft_tokens"]


def test_an_unknown_option_is_refused_with_the_valid_ones_named(target):
    with pytest.raises(TypeError, match=r"'max_num_seq': did you mean 'max_num_seqs'.*options are: model, "):
        LLM(target=target, max_num_seq=4)
    with pytest.raises(TypeError, match=r"unknown option\(s\) 'shade' for LLM; the options are: .*prefix_caching"):
        LLM(target=target, shade="blue")  # no option's name is close to it


@pytest.mark.parametrize("drafting", [True, False])
def test_a_step_that_captured_a_graph_is_untimed_for_the_policy(target, random_draft, drafting):
    """On a GPU a bucket's graph is captured the first time a step meets it (0.15-1.5 s on an H100): that step's time
    is one-off work, so the policy learns no cost from it (not a verify's, nor a draft round's, nor a catch-up's, whose
    first sample the policy takes as it is). Drafting: a verify step with a draft's rounds; else a plain step queued
    ahead, as on a GPU."""
    llm = LLM(
        target=target,
        draft=random_draft if drafting else None,
        num_speculative_tokens=3 if drafting else 0,
        max_model_len=256,
        speculation_policy="fixed",
    )
    engine, captured, observed = llm.engine, [0], []
    engine.overlap = not drafting
    engine.runner.graphs_captured = lambda: captured[0]  # what a capture in the step would show
    decide, observe = engine._decide_drafts, engine.policy.observe_step

    def deciding(seqs):
        captured[0] += len(observed) in (2, 5)  # the third and sixth steps capture a graph
        return decide(seqs)

    def observing(ks, target_seconds, draft_seconds, *args, **kwargs):
        observed.append((kwargs.get("untimed", False), draft_seconds))
        return observe(ks, target_seconds, draft_seconds, *args, **kwargs)

    engine._decide_drafts, engine.policy.observe_step = deciding, observing
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=24, ignore_eos=True))
    assert len(observed) >= 8 and [i for i, (untimed, _) in enumerate(observed) if untimed] == [2, 5]
    assert all(seconds is None for untimed, seconds in observed if untimed)  # nor a draft round's cost learned
    assert all((seconds is None) != drafting for untimed, seconds in observed[:8] if not untimed)
