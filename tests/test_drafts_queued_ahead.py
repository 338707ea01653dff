"""The next step's drafting queued behind a verify before the host reads it (engine/overlap.py `_queue_drafts`,
verify/on_device.py, DraftHeadProposer.queue_drafts): the device counts the drafts each sequence keeps, the head reads
the verify's rows at once and chains its rounds from where the count says, and the next step takes those drafts when the
host's own verification agrees. On a CPU the engine queues nothing by default; these tests turn the device path on at
fixed shapes and check that queued drafting gives the drafts, tokens and acceptance of drafting after the read (greedy;
every draft kept; imposed acceptance drawn a step at a time; requests arriving, finishing and waiting for a slot), that
block accounting holds over random engine operations, that the device's count equals the host's verification, and that
where the two disagree the drafts go unused and the tokens stay the same. Broken variants fail: the rounds started where
nothing was kept, the first round reading the target's picks in place of the kept drafts, the count past a confidence
stop."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import fixed_shapes_as_on_a_gpu, make_head, near_target_draft, priced_without_timing, tiny_model
from test_paged_kv import _holdings_are_consistent
from test_preemption import _options, _outputs_are_plain_decodings, _random_engine_operations

from specdecode import LLM, SamplingParams
from specdecode.bench.budgets import llm_holding
from specdecode.bench.imposed import MeasuredAcceptance
from specdecode.engine import overlap, queued_drafts
from specdecode.engine.policy import adaptive
from specdecode.executor import draft_chain
from specdecode.executor.runner import ModelRunner
from specdecode.proposers.base import DraftsOnDevice
from specdecode.proposers.draft_head import DraftHeadProposer
from specdecode.proposers.draft_model import DraftModelProposer
from specdecode.verify import on_device
from specdecode.verify.on_device import verified_on_device
from specdecode.verify.verifier import verify_argmax_rows

PROMPTS = [[5, 9, 14, 3, 22, 7], [40, 41, 42], list(range(10, 40))]
MAX_TOKENS = (60, 37, 44)
K = 4


@pytest.fixture(autouse=True)
def fixed_shapes(monkeypatch):
    fixed_shapes_as_on_a_gpu(monkeypatch)


# ---- the count on the device against the host's verification ------------------------------------------------------
def _random_verify(rng: random.Random, n: int, vocab: int = 6):
    """A verify's argmax over n sequences of random widths, drafts that often equal it, and their probabilities."""
    widths = [rng.randint(1, K + 1) for _ in range(n)]
    argmax = [rng.randrange(vocab) for _ in range(sum(widths))]
    drafts, probs, row = [], [], 0
    for w in widths:
        mine = [argmax[row + j] if rng.random() < 0.7 else rng.randrange(vocab) for j in range(w - 1)]
        drafts.append(mine + [0] * (K - len(mine)))
        probs.append([rng.choice((0.2, 0.9, 0.95)) for _ in range(K)])
        row += w
    return widths, argmax, drafts, probs


def _stood_by(drafts: list[int], probs: list[float], threshold: float) -> list[int]:
    for n, p in enumerate(probs):
        if p < threshold:
            return drafts[: n + 1]
    return drafts


def _counted_past_the_stop(probs, counts, threshold):
    return counts


@pytest.mark.parametrize("broken", [None, "counted past the stop"])
@pytest.mark.parametrize("threshold", [0.0, 0.5])
def test_the_device_counts_the_drafts_kept_as_the_host_verifies_them(threshold, broken, monkeypatch):
    if broken:
        monkeypatch.setattr(on_device, "_stood_by", _counted_past_the_stop)
    rng, agreed = random.Random(0), True
    for _ in range(60):
        widths, argmax, drafts, probs = _random_verify(rng, rng.randint(1, 5))
        verified = verified_on_device(
            torch.tensor(argmax), torch.tensor(drafts), torch.tensor(probs), widths, threshold
        )
        stood = [_stood_by(d[: w - 1], p[: w - 1], threshold) for d, p, w in zip(drafts, probs, widths)]
        results = verify_argmax_rows(stood, widths, argmax)
        agreed &= verified.accepted.tolist() == [r.num_accepted[0] for r in results]
        for i, r in enumerate(results):  # the tokens the next step's first round reads: the kept drafts, the bonus
            kept = r.num_accepted[0]
            assert verified.tokens[i, : kept + 1].tolist() == r.tokens[0]
            assert verified.rows[i, kept].item() == sum(widths[:i]) + kept  # its features: the row that chose it
    assert agreed is (broken is None or threshold == 0.0)


def test_imposed_counts_are_taken_as_given():
    widths, argmax = [3, 5, 1], list(range(9))
    drafts = torch.tensor([[7, 7, 0, 0], [7, 7, 7, 7], [0, 0, 0, 0]])
    verified = verified_on_device(torch.tensor(argmax), drafts, torch.ones(3, K), widths, kept=[2, 1, 0])
    assert verified.accepted.tolist() == [2, 1, 0]
    assert verified.tokens[:, :3].tolist() == [[7, 7, 2], [7, 4, 5], [8, 8, 8]]


# ---- the engine: queued drafting against drafting after the read -------------------------------------------------
def _engine(target, tmp_path, threshold: float = 0.0, drafter: str = "head", **options):
    options.update(num_speculative_tokens=K, max_model_len=256, progress=False, speculation_policy="fixed")
    if drafter == "head":
        options.update(speculative_model=make_head(target, tmp_path / "head"))
    else:
        options.update(draft=near_target_draft())
    return LLM(target=target, draft_confidence=threshold, **options).engine


def _run(engine, queued: bool, forced=False, arrive_at: int | None = None, confidence: list | None = None):
    """Outputs and each sequence's (steps, accepted drafts); where `arrive_at`, the third request arrives then; the
    drafter's probability of each draft read, into `confidence`."""
    engine.overlap, engine.overlap_drafting, engine.forced_accept = True, queued, forced
    if confidence is not None:
        read_from = DraftsOnDevice.read_from

        def reading(self, tokens, probs):  # each row's own drafts: its first counts[j]
            width = self.tokens.shape[1]
            confidence.extend(p for j, c in enumerate(self.counts) for p in probs[j * width : j * width + c])
            return read_from(self, tokens, probs)

        DraftsOnDevice.read_from = reading
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    seqs = [engine.add_request(p, q) for p, q in zip(PROMPTS[:2], params)]
    steps = 0
    while engine.has_unfinished() or len(seqs) < 3:
        if len(seqs) < 3 and steps == (arrive_at or 0):
            seqs.append(engine.add_request(PROMPTS[2], params[2]))
        engine.step()
        steps += 1
    if confidence is not None:
        DraftsOnDevice.read_from = read_from
    spec = [s.metrics.spec for s in seqs]
    return [s.output_ids for s in seqs], [(c.num_steps, c.num_accepted_tokens) for c in spec]


def _t(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def _started_where_nothing_was_kept(run):
    def broken(self, chain, slots, starts, logits, features, rounds, sampling=None, offsets=None):
        return run(self, chain, slots, starts, logits, features, rounds, sampling, None)

    return broken


def _verify_placed_where_nothing_was_kept(forward_after):
    def broken(self, slots, starts, picked, offsets, reach, **outputs):
        if outputs.get("logits") == "all":  # a verify's (a draft model's first round takes the last row's)
            offsets = torch.zeros_like(offsets)
        return forward_after(self, slots, starts, picked, offsets, reach, **outputs)

    return broken


def _picks_read_for_kept_drafts(verified):
    def broken(argmax, drafts, probs, widths, threshold=0.0, kept=None):
        out = verified(argmax, drafts, probs, widths, threshold, kept)
        out.tokens = argmax[out.rows]
        return out

    return broken


FORCED = {
    "greedy": lambda: False,
    "every draft kept": lambda: True,
    "imposed": lambda: MeasuredAcceptance([0.8, 0.6, 0.4, 0.2], seed=3),
}


@pytest.mark.parametrize(
    "drafter, forced, broken",
    [
        ("head", "greedy", None),
        ("head", "every draft kept", None),
        ("head", "imposed", None),
        ("head", "imposed", "started where nothing was kept"),
        ("head", "imposed", "the target's picks read for the kept drafts"),
        ("draft model", "greedy", None),
        ("draft model", "every draft kept", None),
        ("draft model", "imposed", None),
        ("draft model", "imposed", "started where nothing was kept"),
        ("draft model", "imposed", "the target's picks read for the kept drafts"),
        ("head", "imposed", "the next verify placed where nothing was kept"),
        ("draft model", "imposed", "the next verify placed where nothing was kept"),
    ],
)
def test_queued_drafting_drafts_what_drafting_after_the_read_does(drafter, forced, broken, tmp_path, monkeypatch):
    target, first, then = tiny_model(seed=0), [], []
    engine = _engine(target, tmp_path, drafter=drafter)
    after_the_read = _run(engine, queued=False, forced=FORCED[forced](), arrive_at=3, confidence=first)
    if broken == "started where nothing was kept":
        monkeypatch.setattr(draft_chain.DraftChain, "run", _started_where_nothing_was_kept(draft_chain.DraftChain.run))
    elif broken == "the next verify placed where nothing was kept":
        monkeypatch.setattr(
            ModelRunner, "forward_after", _verify_placed_where_nothing_was_kept(ModelRunner.forward_after)
        )
    elif broken:
        monkeypatch.setattr(queued_drafts, "verified_on_device", _picks_read_for_kept_drafts(verified_on_device))
    engine = _engine(target, tmp_path, drafter=drafter)
    queued = _run(engine, queued=True, forced=FORCED[forced](), arrive_at=3, confidence=then)
    assert engine.queued_drafts_taken >= 5 and engine.verifies_taken_ahead >= 5
    alike = queued == after_the_read and len(then) == len(first) and torch.allclose(_t(then), _t(first), atol=1e-5)
    assert alike is (broken is None)
    if forced == "greedy":  # lossless either way: the target's own tokens
        plain = LLM(target=target, num_speculative_tokens=0, progress=False)
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
        assert queued[0] == [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params)]


@pytest.mark.parametrize("drafter", ["head", "draft model"])
def test_drafting_queued_on_a_count_the_host_does_not_confirm_goes_unused(drafter, tmp_path, monkeypatch, caplog):
    """The device's count off by one where it can be: the host's verification disagrees, drops the queued drafting
    and the next step drafts after the read; the tokens and acceptance are those of drafting after the read."""
    target = tiny_model(seed=0)
    forced = FORCED["imposed"]
    after_the_read = _run(_engine(target, tmp_path, drafter=drafter), queued=False, forced=forced())

    def miscounted(argmax, drafts, probs, widths, threshold=0.0, kept=None):
        out = verified_on_device(argmax, drafts, probs, widths, threshold, kept)
        out.accepted = torch.where(out.accepted > 0, out.accepted - 1, out.accepted + 1)
        return out

    monkeypatch.setattr(queued_drafts, "verified_on_device", miscounted)
    engine = _engine(target, tmp_path, drafter=drafter)
    assert _run(engine, queued=True, forced=forced()) == after_the_read
    assert engine.queued_drafts_taken == 0 and "queued drafting dropped" in caplog.text


def test_queued_drafting_under_a_confidence_stop_gives_the_target_own_tokens(tmp_path):
    """Greedy with the head's confidence stop: drafts past it are verified and ignored, on the device as on the host."""
    target = tiny_model(seed=0)
    engine = _engine(target, tmp_path, threshold=0.4)
    queued = _run(engine, queued=True)
    after_the_read = _run(_engine(target, tmp_path, threshold=0.4), queued=False)
    assert queued == after_the_read and engine.queued_drafts_taken >= 10


def test_queued_drafting_keeps_the_head_rows_a_later_request_finds_again(tmp_path, monkeypatch):
    """With prefix caching: the rows queued drafting settles and commits are found again by a request repeating a
    finished one's text, as many as after the read, and it then drafts as after the read. Broken (by hand): the rows
    settled with the ids one position early are found again nowhere."""
    target, runs, found = tiny_model(seed=0), [], []
    keep_prefix = DraftHeadProposer.keep_prefix

    def finding(self, seq, kept):
        found.append(keep_prefix(self, seq, kept))
        return found[-1]

    monkeypatch.setattr(DraftHeadProposer, "keep_prefix", finding)
    for queued in (False, True):
        head = make_head(target, tmp_path / "head")
        options = dict(num_speculative_tokens=K, max_model_len=256, progress=False, speculation_policy="fixed")
        engine = LLM(target=target, speculative_model=head, draft_confidence=0.0, prefix_caching=True, **options).engine
        first = _run(engine, queued, forced=FORCED["imposed"]())
        again = []
        engine.forced_accept = MeasuredAcceptance([0.8, 0.6, 0.4, 0.2], seed=4)
        for prompt, out in zip(PROMPTS, first[0]):  # each prompt followed by the start of its own output
            seq = engine.add_request(prompt + out[:20], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
            while engine.has_unfinished():
                engine.step()
            again.append(seq.output_ids)
        runs.append((first, again, engine.queued_drafts_taken, sum(found)))
        found.clear()
    assert runs[0][:2] == runs[1][:2] and runs[1][2] >= 10
    assert runs[1][3] == runs[0][3] >= 48  # the head's rows found again: each repeated text's full blocks


def _choosing(engine, ks_of_step):
    """The engine's policy choosing, at its n-th decoding step, ks_of_step(n, its choice's length) drafts."""
    choose, steps = engine.policy.choose, []

    def chosen(*args, **kwargs):
        decision = choose(*args, **kwargs)
        decision.ks = ks_of_step(len(steps), len(decision.ks))
        steps.append(list(decision.ks))
        return decision

    engine.policy.choose = chosen
    return steps


@pytest.mark.parametrize("drafter", ["head", "draft model"])
def test_a_step_drafting_fewer_than_were_queued_takes_the_first_of_them(drafter, tmp_path):
    """The policy's k changing from step to step (some sequences drafting nothing): a step takes the first of the
    drafts queued for it, as many as the policy chose or were queued, and a run drafting after the read given those
    very counts drafts the same, as the imposed acceptance keeps them. Broken (by hand): a step taking every draft
    queued drafts more than the policy chose."""
    target, rng, executed = tiny_model(seed=0), random.Random(0), []
    engine = _engine(target, tmp_path, drafter=drafter)
    chosen = _choosing(engine, lambda step, n: [rng.choice((0, 1, 2, K, K)) for _ in range(n)])
    record = engine.step

    def step():
        out = record()
        executed.append(list(out.draft_lengths))
        return out

    engine.step = step
    queued = _run(engine, queued=True, forced=FORCED["imposed"]())
    assert engine.queued_drafts_taken >= 5
    decoding = [ks for ks in executed if ks]  # the steps that decoded (not a prompt's alone)
    pairs = [(mine, wanted) for ks, want in zip(decoding, chosen) for mine, wanted in zip(ks, want)]
    assert all(mine <= wanted for mine, wanted in pairs) and any(mine < wanted for mine, wanted in pairs)
    engine = _engine(target, tmp_path, drafter=drafter)
    _choosing(engine, lambda step, n: decoding[step])
    assert _run(engine, queued=False, forced=FORCED["imposed"]()) == queued  # the kept drafts are in the tokens


@pytest.mark.parametrize("broken", [None, "queued before a re-measure"])
def test_no_drafting_is_queued_for_a_step_the_adaptive_policy_keeps_plain(broken, tmp_path, monkeypatch):
    """The adaptive policy re-measures plain decoding every few speculative steps: drafting queued for such a step
    would go unused, so none is (broken: the policy saying nothing of it)."""
    if broken:
        monkeypatch.setattr(adaptive.AdaptivePolicy, "plain_next", lambda self: False)
    target = tiny_model(seed=0)
    head = make_head(target, tmp_path / "head")
    options = dict(num_speculative_tokens=K, max_model_len=256, progress=False, draft_confidence=0.0)
    engine = LLM(target=target, speculative_model=head, speculation_policy="adaptive", **options).engine
    engine.policy.refresh_plain_every, engine.policy.clear_margin = 4, float("inf")  # every 4 speculative steps
    priced_without_timing(engine.policy, monkeypatch, 1)
    dropped = []
    monkeypatch.setattr(engine.proposer, "drop_queued", lambda queued, seqs: dropped.append(len(seqs)))
    engine.overlap, engine.forced_accept = True, True
    seq = engine.add_request(PROMPTS[2], SamplingParams(temperature=0, max_tokens=120, ignore_eos=True))
    plain_steps = 0
    while engine.has_unfinished():
        out = engine.step()
        plain_steps += bool(out.draft_lengths) and not any(out.draft_lengths)
    assert seq.metrics.spec.num_spec_steps >= 8 and plain_steps >= 2 and engine.queued_drafts_taken >= 4
    assert (dropped == []) is (broken is None)


@pytest.mark.parametrize("broken", [None, "nothing queued while a request waits"])
def test_drafting_is_queued_while_requests_wait_for_a_slot(broken, tmp_path, monkeypatch):
    """Two slots, three requests: while both slots are taken and the third waits (a busy server), drafting and the
    next verify are queued as with nothing waiting; the tokens are the target's own. Broken: nothing queued while a
    request waits."""
    if broken:
        monkeypatch.setattr(overlap.QueuingAhead, "_may_admit_next", lambda self, leaving=0: bool(self.waiting))
    target = tiny_model(seed=0)
    engine = _engine(target, tmp_path, max_num_seqs=2)
    engine.overlap = True
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    seqs = [engine.add_request(p, q) for p, q in zip(PROMPTS, params)]
    queued_while_waiting = 0
    while engine.has_unfinished():
        waited = bool(engine.waiting)
        engine.step()
        queued_while_waiting += waited and engine._drafts_ahead is not None and engine._drafts_ahead.verify is not None
    plain = LLM(target=target, num_speculative_tokens=0, progress=False)
    assert [s.output_ids for s in seqs] == [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params)]
    assert (queued_while_waiting >= 10) is (broken is None)


def test_a_commit_keeps_the_blocks_a_verify_queued_ahead_writes(target):
    """The step's commit drops what its verify rejected but keeps the blocks where the next verify, queued on the
    device, writes (`queued_end`): given back, another sequence could take them before that verify has written
    there. Taken (its rows written again) or dropped, the next commit gives them back."""
    runner = ModelRunner(target.model, 2, 1024, fixed_shapes=True)
    slot, size = runner.allocate(), runner.block_size
    runner.assume_cached(slot, size + 1)
    picked, offsets = torch.zeros(1, 3, dtype=torch.long), torch.tensor([2])
    runner.forward_after([slot], [size + 1], picked, offsets, reach=2 * size - 4, logits="all")
    assert runner.queued_end(slot) == 3 * size and runner.blocks_held(slot) == 3
    for settle in (lambda: runner.wrote_again(slot, size + 1, [5], size + 4), lambda: runner.drop_queued(slot)):
        runner.commit(slot, size + 1)
        assert runner.length(slot) == size + 1 and runner.blocks_held(slot) == 3
        settle()
        assert runner.queued_end(slot) == 0
        runner.commit(slot, size + 1)
        assert runner.blocks_held(slot) == 2
        runner.forward_after([slot], [size + 1], picked, offsets, reach=2 * size - 4, logits="all")


@pytest.mark.parametrize("drafter", ["head", "draft model"])
def test_a_long_prompt_arriving_while_drafting_is_queued_leaves_the_tokens_alike(drafter, tmp_path):
    """A long prompt arriving while drafting and a verify are queued is admitted and prefilled a chunk a step
    (chunked prefill): nothing is queued while it waits or prefills, queuing resumes after, and the tokens are those
    of drafting and verifying after the read."""
    target, runs = tiny_model(seed=0), []
    for queued in (False, True):
        engine = _engine(target, tmp_path, drafter=drafter)
        engine.prefill_chunk = 8
        engine.overlap, engine.overlap_drafting, engine.forced_accept = True, queued, FORCED["imposed"]()
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        first, steps, rode = engine.add_request(PROMPTS[0], params), 0, 0
        while engine.has_unfinished():
            if steps == 4:
                late = engine.add_request([(7 * i) % 60 + 2 for i in range(48)], params)
            rode += bool(engine.prefilling) and steps > 4
            engine.step()
            steps += 1
        runs.append(([first.output_ids, late.output_ids], rode, engine.verifies_taken_ahead))
    assert runs[1][0] == runs[0][0] and runs[1][1] >= 3 and runs[1][2] >= 5


BROKEN_QUEUES = {
    "queued rows never rolled back": lambda: (DraftModelProposer, "drop_queued", lambda self, queued, seqs: None),
    "the next verify's blocks given back": lambda: (
        ModelRunner,
        "commit",
        lambda self, slot, length, commit=ModelRunner.commit: self.drop_queued(slot) or commit(self, slot, length),
    ),
}


@pytest.mark.parametrize(
    "drafter, broken",
    [
        ("head", None),
        ("draft", None),
        ("draft", "queued rows never rolled back"),
        ("head", "the next verify's blocks given back"),
    ],
)
def test_block_accounting_holds_over_random_operations_with_drafting_queued(drafter, broken, tmp_path, monkeypatch):
    """Requests added, stepped, aborted and preempted at random while drafting and verifies are queued ahead (with
    requests waiting for slots): every pool's accounting holds after each operation, every request ends with the
    target's own greedy tokens, and no pool holds a block after. Broken: a draft model's queued rows never rolled
    back where they go unused; a commit giving back the blocks the next verify, queued on the device, writes."""
    if broken:
        monkeypatch.setattr(*BROKEN_QUEUES[broken]())
    llm = llm_holding(40, **_options(drafter, tmp_path), max_num_seqs=4, draft_confidence=0.0)  # a draft model chains
    engine = llm.engine
    engine.overlap = True
    try:
        seqs, _ = _random_engine_operations(llm, seed=5, steps=250)
        _outputs_are_plain_decodings(llm, seqs)
    except (AssertionError, IndexError, ValueError):
        assert broken
        return
    assert not broken
    assert engine.queued_drafts_taken > 100 and engine.verifies_taken_ahead > 100 and all(s.finished for s in seqs)
    for runner, _ in engine.blocks.pools:
        _holdings_are_consistent(runner)
        assert runner.blocks_in_use() == 0
