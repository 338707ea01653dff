"""Plain steps queued ahead (engine/overlap.py): each step's forward is queued before the tokens of the step before it
reach the host, reading them on the device. The tokens are those of steps run one after another, whatever stops a
sequence (max_tokens, EOS, a stop string), with requests arriving or waiting for a slot (steps still queued), sampled (a
draw from each sequence's stream, given back where a queued step is dropped) or asking for logprobs (read with each
token), preempted and resumed, and with their blocks found again by a later prompt; block accounting holds over random
engine operations. On a CPU the engine runs without them by default; these tests turn them on, through the eager forward
and the fixed-shape one taken through its capture path. Broken variants fail: the tokens read before the next forward is
queued, a stale queued step taken for a resumed sequence, token ids never settled, draws of a dropped step kept,
logprobs of another row."""

from __future__ import annotations

import pytest
from conftest import DEVICE, ByteTokenizer, make_head, tiny_model
from test_cuda_graphs import captured  # noqa: F401 (a fixture)
from test_paged_kv import _holdings_are_consistent
from test_preemption import _options, _outputs_are_plain_decodings, _random_engine_operations

from specdecode import LLM, SamplingParams
from specdecode.bench.budgets import llm_holding
from specdecode.engine import ahead, overlap
from specdecode.engine.policy import DraftDecision, Policy
from specdecode.executor import runner as runner_module
from specdecode.executor.runner import ModelRunner
from specdecode.models.loader import LoadedModel

PROMPTS = [[5, 9, 14, 3, 22, 7], [40, 41, 42], list(range(10, 40)), [7, 7, 8]]
MAX_TOKENS = [24, 7, 30, 1]


def _llm(target, overlap_steps: bool | None, **options) -> LLM:
    llm = LLM(target=target, num_speculative_tokens=0, max_model_len=256, progress=False, **options)
    if overlap_steps is not None:
        llm.engine.overlap = overlap_steps
    return llm


def _greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _count_queued(monkeypatch) -> list[int]:
    """Sequences in each forward queued ahead, as the test runs."""
    queued: list[int] = []
    forward = ModelRunner.forward_picked

    def counting(self, slots, picked, **kw):
        queued.append(len(slots))
        return forward(self, slots, picked, **kw)

    monkeypatch.setattr(ModelRunner, "forward_picked", counting)
    return queued


def _with_eos(model: LoadedModel, eos: int) -> LoadedModel:
    tokenizer = ByteTokenizer(model.config.vocab_size)
    tokenizer.eos_token_ids = frozenset({eos})
    return LoadedModel(model.name, model.model, tokenizer, model.config)


@pytest.mark.parametrize("forward", ["eager", "captured"])
def test_steps_queued_ahead_give_the_tokens_of_steps_one_after_another(forward, request, monkeypatch):
    if forward == "captured":
        request.getfixturevalue("captured")
        monkeypatch.setattr(runner_module, "fixed_shapes_by_default", lambda model: True)
        for kernels in ("fuse_elementwise", "gpu_attention"):  # not at issue here, and slow on a CPU
            if DEVICE == "cpu":
                monkeypatch.setattr(runner_module, kernels, lambda model: None)
    else:
        monkeypatch.setattr(runner_module, "fixed_shapes_by_default", lambda model: False)
    target = tiny_model(seed=0)
    assert _llm(target, None).engine.overlap == (forward == "captured")  # on by default where graphs replay
    params = [_greedy(m) for m in MAX_TOKENS]
    expected = [o.outputs[0].token_ids for o in _llm(target, False).generate(PROMPTS, params)]
    queued = _count_queued(monkeypatch)
    llm = _llm(target, True)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == expected
    assert (llm.engine.runner._fixed is not None) == (forward == "captured")
    assert len(queued) == max(MAX_TOKENS) - 3 and max(queued) == 3  # not for the 1-token request, nor the first step
    # EOS and a stop string end a sequence where the host sees them: the step queued behind them is dropped
    eos = expected[2][12]
    stop = target.tokenizer.decode(expected[0])[5:8]
    params = [_greedy(40, stop=[stop]), _greedy(40), SamplingParams(temperature=0, max_tokens=40), _greedy(40)]
    ends = [o.outputs[0] for o in _llm(_with_eos(target, eos), False).generate(PROMPTS, params)]
    got = [o.outputs[0] for o in _llm(_with_eos(target, eos), True).generate(PROMPTS, params)]
    assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in ends]
    assert got[2].finish_reason == "stop" and got[0].finish_reason == "stop"


def test_each_step_queues_the_next_forward_before_reading_its_tokens(monkeypatch):
    """The point of it: the host's wait for a step's tokens comes after the next forward is queued. A variant that
    reads them first (what a step did before) fails."""
    events: list[str] = []
    forward, copied = ModelRunner.forward_picked, ahead.copied_to_host

    def queue(self, slots, picked, **kw):
        events.append("queue")
        return forward(self, slots, picked, **kw)

    def copy(picked):
        read = copied(picked)

        def reading():
            events.append("read")
            return read()

        return reading

    monkeypatch.setattr(ModelRunner, "forward_picked", queue)
    monkeypatch.setattr(ahead, "copied_to_host", copy)
    _llm(tiny_model(seed=0), True).generate([PROMPTS[0]], _greedy(12))
    # 11 decoding steps: the first plain one in a row queues nothing, nor does the step of the last token
    assert events == ["read"] + ["queue", "read"] * 9 + ["read"]

    def read_first(picked):
        values = copied(picked)()
        events.append("read")
        return lambda: values

    events.clear()
    monkeypatch.setattr(ahead, "copied_to_host", read_first)
    _llm(tiny_model(seed=0), True).generate([PROMPTS[0]], _greedy(12))
    assert events != ["read"] + ["queue", "read"] * 9 + ["read"]


def test_plain_steps_let_go_of_timed_spans_the_device_has_passed():
    """On a GPU a timed call's span is two events in the device's queue, added up once passed: a server whose policy
    only takes plain steps still lets them go, rather than holding one for every prompt its drafter read."""
    from specdecode.timing import Mark, Span

    class Passed:  # an event the device has reached, 2 ms after the one before
        def query(self):
            return True

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return 2.0

    llm = _llm(tiny_model(seed=0), True)
    timer = llm.engine.timer
    timer.record("draft_prefill", Span(Mark(0.0, Passed()), Mark(1.0, Passed())))
    assert timer._queued
    llm.generate([PROMPTS[0]], _greedy(4))
    assert not timer._queued and timer._seconds["draft_prefill"] == pytest.approx(0.002)


def test_requests_arriving_mid_run_decode_as_they_would_alone(monkeypatch):
    """Arrivals while steps are queued ahead, greedy, sampled with a seed and asking for logprobs: each output is the
    one computed alone, and every sequence decodes from the step after its
    admission (a queued step covers the sequences it was queued for; the others sit one step out, not more)."""
    target = tiny_model(seed=0)
    arrivals = [
        (0, PROMPTS[0], _greedy(30)),
        (3, PROMPTS[1], _greedy(20)),
        (4, PROMPTS[2], SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True)),
        (9, PROMPTS[3], _greedy(15, logprobs=2)),
        (20, PROMPTS[2], _greedy(9)),
    ]
    alone = [_llm(target, False).generate([p], params)[0].outputs[0].token_ids for _, p, params in arrivals]
    queued = _count_queued(monkeypatch)
    engine, seqs, step, waited = _llm(target, True).engine, [], 0, []
    while step < 100 and (engine.has_unfinished() or len(seqs) < len(arrivals)):
        seqs += [engine.add_request(p, params) for at, p, params in arrivals if at == step]
        before = {id(s): s.num_output_tokens for s in engine.running}
        engine.step()
        waited += [s for s in engine.running if before.get(id(s)) == s.num_output_tokens and not s.finished]
        step += 1
    assert [s.output_ids for s in seqs] == alone
    assert queued and all(waited.count(s) <= 1 for s in seqs)


@pytest.mark.parametrize("broken", [False, True])
def test_no_plain_step_is_queued_for_a_step_that_probes_drafting(broken, random_draft, monkeypatch):
    """A useless draft under the adaptive policy: it probes drafting on one sequence now and then, and a plain step
    queued for the step that probes would go unused (its forward computed for nothing), so none is; the tokens are
    plain decoding's. Broken: the policy saying nothing of its next probe."""
    from conftest import priced_without_timing

    from specdecode.engine.policy import adaptive

    if broken:
        monkeypatch.setattr(adaptive.AdaptivePolicy, "probes_next", lambda self, contexts: False)
    target = tiny_model(seed=0)
    params = [_greedy(120), _greedy(90)]
    plain = [o.outputs[0].token_ids for o in _llm(target, False).generate(PROMPTS[:2], params)]
    llm = LLM(target=target, draft=random_draft, num_speculative_tokens=4, speculation_policy="adaptive",
              max_model_len=256, progress=False)  # fmt: skip
    engine = llm.engine
    engine.overlap = True
    priced_without_timing(engine.policy, monkeypatch, 2)
    probes, wasted, choose = [], [], engine.policy.choose

    def choosing(*args, **kwargs):
        decision = choose(*args, **kwargs)
        if decision.probe:
            probes.append(decision.ks)
            wasted.append(engine._ahead is not None)  # a plain step queued for this one, now dropped
        return decision

    monkeypatch.setattr(engine.policy, "choose", choosing)
    seqs = [engine.add_request(p, q) for p, q in zip(PROMPTS, params)]
    while engine.has_unfinished():
        engine.step()
    assert [s.output_ids for s in seqs] == plain
    assert len(probes) >= 2 and all(sorted(ks)[-2:] in ([4], [0, 4]) for ks in probes)
    assert any(wasted) is broken


def _sitting_out(engine, requests: list[tuple[list[int], SamplingParams]]) -> tuple[list, list, int]:
    """Runs the requests, all added at once: the outputs, each sequence skipped by a decoding step (as often as it
    was: one admitted while others decode gets its prompt's token and the step's), and the steps queued ahead while a
    request waited."""
    seqs = [engine.add_request(p, params) for p, params in requests]
    skipped, queued_while_waiting = [], 0
    while engine.has_unfinished():
        before, waited = {id(s): s.num_output_tokens for s in engine.running}, bool(engine.waiting)
        engine.step()
        gained = [(s, s.num_output_tokens - before.get(id(s), 0)) for s in engine.running if not s.finished]
        skipped += [s for s, tokens in gained if tokens < (2 if before and id(s) not in before else 1)]
        queued_while_waiting += waited and engine._ahead is not None
    return [s.output_ids for s in seqs], skipped, queued_while_waiting


@pytest.mark.parametrize("broken", [None, "nothing queued while a request waits", "queued whoever waits"])
def test_a_full_engine_queues_ahead_while_requests_wait_for_a_slot(broken, monkeypatch):
    """Two slots, four requests: while every slot is taken and requests wait (a busy server), steps are still queued
    ahead; none is queued after a step in which a sequence stops at its length, so the request admitted into its
    slot decodes from the next step. One stopped by EOS frees its slot unforeseen: the request admitted into it sits
    one step out. Each output is the request's alone. Broken variants fail: nothing queued while a request waits (no
    overlap in a busy server), steps queued whoever waits (a request admitted at a foreseen stop sits a step out)."""
    if broken == "nothing queued while a request waits":
        monkeypatch.setattr(overlap.QueuingAhead, "_may_admit_next", lambda self, leaving=0: bool(self.waiting))
    elif broken:
        monkeypatch.setattr(overlap.QueuingAhead, "_may_admit_next", lambda self, leaving=0: False)
    target = tiny_model(seed=0)
    stopping = SamplingParams(temperature=0, max_tokens=40)
    eos = _llm(target, False).generate([PROMPTS[2]], stopping)[0].outputs[0].token_ids[6]
    target = _with_eos(target, eos)
    requests = [(PROMPTS[0], _greedy(8)), (PROMPTS[1], _greedy(30)), (PROMPTS[2], stopping), (PROMPTS[3], _greedy(10))]
    alone = [_llm(target, False).generate([p], params)[0].outputs[0].token_ids for p, params in requests]
    assert len(alone[2]) < 10  # stopped by EOS, before request 1's end
    outputs, skipped, queued = _sitting_out(_llm(target, True, max_num_seqs=2).engine, requests)
    assert outputs == alone
    assert (queued >= 5) is (broken != "nothing queued while a request waits")
    assert (len(skipped) <= 1) is (broken != "queued whoever waits")


def _preempted_with_a_step_queued(params: list[SamplingParams]):
    """An engine running two requests, the second preempted while a step is queued for it; the outputs alone."""
    target = tiny_model(seed=0)
    alone = [_llm(target, False).generate([p], q)[0].outputs[0].token_ids for p, q in zip(PROMPTS, params)]
    engine = _llm(target, True).engine
    seqs = [engine.add_request(p, q) for p, q in zip(PROMPTS, params)]
    for _ in range(6):
        engine.step()
    assert engine._ahead is not None and seqs[1] in engine._ahead.seqs
    engine._preempt(seqs[1])
    return engine, seqs, alone


@pytest.mark.parametrize("broken", [False, True])
def test_a_sequence_preempted_with_a_step_queued_for_it_resumes_as_alone(broken, monkeypatch):
    """Preempted while a step is queued for it, a sequence is recomputed into a slot: the queued step is not its own
    any more (its row sits the first step out). A variant that takes the queued row by the sequence alone, not
    where it stands, fails."""
    if broken:
        monkeypatch.setattr(ahead, "standing", lambda seq, emitted=0: id(seq))
    engine, seqs, alone = _preempted_with_a_step_queued([_greedy(30), _greedy(30)])
    if broken:
        with pytest.raises(ValueError, match="cannot commit"):
            while engine.has_unfinished():
                engine.step()
        return
    while engine.has_unfinished():
        engine.step()
    assert [s.output_ids for s in seqs] == alone and seqs[1].metrics.num_preemptions == 1


def test_block_accounting_holds_over_random_operations_with_steps_queued_ahead(tmp_path, monkeypatch):
    options = _options("plain", tmp_path)
    llm = llm_holding(40, **options)
    llm.engine.overlap = True
    queued = _count_queued(monkeypatch)
    seqs, _ = _random_engine_operations(llm, seed=3, steps=300)
    assert len(queued) > 50 and all(s.finished for s in seqs)
    _outputs_are_plain_decodings(llm, seqs)
    _holdings_are_consistent(llm.engine.runner)
    assert llm.engine.runner.blocks_in_use() == 0


@pytest.mark.parametrize("broken", [False, True])
def test_blocks_written_ahead_are_found_again_by_their_tokens(broken, monkeypatch):
    """A finished request's blocks, written by steps queued ahead, are found by a prompt that continues it: the
    runner knew their tokens by the time they were committed. Never settled, they are not found."""
    if broken:
        monkeypatch.setattr(ModelRunner, "settle", lambda self, slot, position, token: None)
    target = tiny_model(seed=0)

    def cached(overlap_steps: bool) -> int:
        llm = _llm(target, overlap_steps, prefix_caching=True)
        first = llm.generate([PROMPTS[2]], _greedy(70))[0].outputs[0].token_ids
        follow = llm.generate([PROMPTS[2] + first + [3]], _greedy(2))[0]
        return follow.metrics.num_cached_prompt_tokens

    found = cached(True)
    assert (found == cached(False)) is not broken
    assert found >= (0 if broken else 96)


class _Scripted(Policy):
    """Drafts k on the steps `drafts(step)` says, plain decoding on the others: runs of plain steps (queued ahead
    from the second on) between drafting ones, which do not take the step queued for them."""

    def __init__(self, k: int, drafts):
        super().__init__(k)
        self.drafts, self.step = drafts, 0

    def decide(self, request_ids, *args, **kwargs) -> DraftDecision:
        self.step += 1
        return DraftDecision.main_proposer([self.k_max if self.drafts(self.step) else 0] * len(request_ids))


@pytest.mark.parametrize("drafter", ["draft model", "head"])
def test_plain_steps_between_drafting_ones_queue_ahead_and_feed_the_drafter_alike(drafter, tmp_path, monkeypatch):
    """A drafter's engine whose policy drafts now and then: its plain steps are queued ahead (with the hidden states a
    head reads), a step queued where the next one drafts is dropped, and the drafter drafts what it drafts with
    every step run one after another (it was fed the same tokens and features); the output is plain decoding's."""
    target = tiny_model(seed=0)
    options = dict(draft=tiny_model(seed=123, layers=1)) if drafter == "draft model" else {}
    if drafter == "head":
        options["speculative_model"] = make_head(target, tmp_path / "head")
    params = [_greedy(40), _greedy(33)]
    plain = [o.outputs[0].token_ids for o in _llm(target, False).generate(PROMPTS[:2], params)]
    queued = _count_queued(monkeypatch)

    def run(overlap_steps: bool):
        llm = LLM(target=target, num_speculative_tokens=3, max_model_len=256, progress=False, **options)
        engine = llm.engine
        engine.overlap, engine.policy = overlap_steps, _Scripted(3, lambda step: step % 5 == 0)
        drafted, dropped, propose = [], 0, engine.proposer.propose

        def recording(seqs, ks, feedback):
            batch = propose(seqs, ks, feedback)
            drafted.append(batch.tokens)
            return batch

        engine.proposer.propose = recording
        seqs = [engine.add_request(p, q) for p, q in zip(PROMPTS, params)]
        while engine.has_unfinished():
            queued_before = engine._ahead is not None
            dropped += any(engine.step().draft_lengths) and queued_before
        return [s.output_ids for s in seqs], drafted, dropped

    (outputs, drafted, dropped), (outputs_alone, drafted_alone, _) = run(True), run(False)
    assert outputs == outputs_alone == plain
    assert drafted == drafted_alone and len(drafted) >= 6
    assert len(queued) >= 2 * len(drafted) and dropped >= len(drafted) - 2  # each plain run's last queued, dropped


def _sampled(max_tokens: int, seed: int, **settings) -> SamplingParams:
    settings = {"temperature": 0.8, "top_p": 0.9, **settings}
    return SamplingParams(seed=seed, max_tokens=max_tokens, ignore_eos=True, **settings)


def test_sampled_steps_queue_ahead_and_draw_what_steps_one_after_another_draw(monkeypatch):
    """Seeded sampled sequences of two settings beside greedy ones: each queued step draws its token on the device
    from the sequence's own stream, the draw its verification would make, so the outputs are those of steps run one
    after another."""
    target = tiny_model(seed=0)
    params = [_sampled(30, 1), _greedy(20), _sampled(25, 2, temperature=1.2, top_k=5), _sampled(12, 3)]
    expected = [o.outputs[0].token_ids for o in _llm(target, False).generate(PROMPTS, params)]
    queued = _count_queued(monkeypatch)
    assert [o.outputs[0].token_ids for o in _llm(target, True).generate(PROMPTS, params)] == expected
    assert len(queued) >= 20 and max(queued) == 4


picks_of = ahead.picks_of  # the real one, which the broken variant below wraps once it is patched in


def _logprobs_a_row_late(seqs, logits):
    tokens, table = picks_of(seqs, logits)
    return tokens, None if table is None else table.roll(1, 0)


@pytest.mark.parametrize("broken", [False, True])
def test_steps_queued_for_sequences_asking_for_logprobs_give_the_logprobs_of_steps_one_after_another(
    broken, monkeypatch
):
    """Greedy and seeded sampled sequences asking for logprobs (different numbers of alternatives) beside one that
    does not: their steps queue ahead, each token's logprobs read with it, and tokens and logprobs are those of steps
    one after another. Broken: each row given the table of the row before."""
    target = tiny_model(seed=0)
    params = [_greedy(20, logprobs=2), _sampled(25, 4, logprobs=0), _greedy(12), _sampled(18, 5, logprobs=3)]

    def run(overlap_steps: bool):
        outputs = _llm(target, overlap_steps).generate(PROMPTS, params)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]

    expected = run(False)
    queued = _count_queued(monkeypatch)
    if broken:
        monkeypatch.setattr(ahead, "picks_of", _logprobs_a_row_late)
    assert (run(True) == expected) is not broken
    assert len(queued) >= 15 and max(queued) == 4
    assert [len(lp[0].top) for _, lp in expected if lp] == [2, 0, 3]


@pytest.mark.parametrize("broken", [False, True])
def test_a_sampled_sequence_preempted_with_a_step_queued_for_it_draws_as_alone(broken, monkeypatch):
    """The queued step's draw for a preempted sequence goes back to its stream (the sequence resumes in another slot
    and draws that token again): its output is the one decoded alone. Kept instead, the stream runs one draw ahead."""
    if broken:
        monkeypatch.setattr(ahead.StepAhead, "undraw", lambda self, seqs=None: None)
    engine, seqs, alone = _preempted_with_a_step_queued([_sampled(30, 7), _sampled(30, 8)])
    while engine.has_unfinished():
        engine.step()
    assert ([s.output_ids for s in seqs] == alone) is not broken


@pytest.mark.parametrize("broken", [False, True])
def test_steps_queued_for_sampled_sequences_and_dropped_for_drafting_give_their_draws_back(broken, monkeypatch):
    """A drafter's engine whose policy drafts now and then: each drafting step drops the plain step queued before it,
    and its draws go back to the sampled sequences' streams, so the outputs are those of an engine that never
    queued. Kept instead, they differ."""
    if broken:
        monkeypatch.setattr(ahead.StepAhead, "undraw", lambda self, seqs=None: None)
    target, draft = tiny_model(seed=0), tiny_model(seed=123, layers=1)
    params = [_sampled(40, 11), _sampled(33, 12)]

    def run(overlap_steps: bool) -> list[list[int]]:
        llm = LLM(target=target, draft=draft, num_speculative_tokens=3, max_model_len=256, progress=False)
        engine = llm.engine
        engine.overlap, engine.policy = overlap_steps, _Scripted(3, lambda step: step % 5 == 0)
        seqs = [engine.add_request(p, q) for p, q in zip(PROMPTS, params)]
        while engine.has_unfinished():
            engine.step()
        return [s.output_ids for s in seqs]

    assert (run(True) == run(False)) is not broken
