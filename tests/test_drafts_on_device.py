"""A speculative step that waits for the device once (engine/overlap.py, timing.py): the verify reads the drafts a
drafter's chained rounds left on the device, queued behind them, and the drafts come back with the target's argmax in
one copy (sampled sequences' drafts are read while the verify runs, then verified); the step's phases are timed by
marks read only after that copy. On a CPU the engine reads drafts first by default; these tests turn the device path
on at fixed shapes (the chained rounds' path) and check that it gives the tokens and the acceptance of a verify that
reads the drafts first, greedy and sampled, under a confidence stop (rows verified past it and ignored) and under
imposed acceptance, and that nothing waits before the step's read. Broken variants fail: rows
counted by the drafts kept rather than by those verified, the drafts not fed to the verify, drafts read before the
verify is queued, spans read as they end."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import DEVICE, fixed_shapes_as_on_a_gpu, make_head, near_target_draft, tiny_model

from specdecode import LLM, SamplingParams, timing
from specdecode.bench.imposed import MeasuredAcceptance
from specdecode.engine import overlap
from specdecode.executor import cuda_graphs
from specdecode.executor.runner import ModelRunner
from specdecode.proposers.base import DraftBatch, DraftsOnDevice

PROMPTS = [[5, 9, 14, 3, 22, 7], [40, 41, 42], list(range(10, 40))]
PARAMS = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (30, 17, 24)]
K = 4


@pytest.fixture(autouse=True)
def fixed_shapes(monkeypatch):
    fixed_shapes_as_on_a_gpu(monkeypatch)


def _drafting(drafter: str, target, tmp_path, **options) -> LLM:
    if drafter == "head":
        options.update(speculative_model=make_head(target, tmp_path / "head"), draft_confidence=0.4)
    else:
        options.update(draft=near_target_draft(), draft_confidence=0.0)  # a draft model chains without a stop
    options.update(num_speculative_tokens=K, max_model_len=256, progress=False, speculation_policy="fixed")
    return LLM(target=target, **options)


def _run(llm: LLM, on_device: bool, forced=None, params=PARAMS) -> tuple[list[list[int]], list[tuple[int, int, int]]]:
    """Outputs, and per sequence (steps, drafts, accepted)."""
    engine = llm.engine
    engine.overlap, engine.forced_accept = on_device, forced or False
    seqs = [engine.add_request(p, q) for p, q in zip(PROMPTS, params)]
    while engine.has_unfinished():
        engine.step()
    spec = [s.metrics.spec for s in seqs]
    outputs = [(s.output_ids, s.logprobs) if s.logprobs else s.output_ids for s in seqs]
    return outputs, [(c.num_steps, c.num_draft_tokens, c.num_accepted_tokens) for c in spec]


def _count_verifies(monkeypatch) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """The widths of each verify that read drafts on the device, and of the drafts read there, how many were drafted
    and how many stood by (cut after a draft under the confidence threshold)."""
    widths: list[list[int]] = []
    reads: list[tuple[int, int]] = []
    forward, after, read_from = ModelRunner.forward_picked, ModelRunner.forward_after, DraftsOnDevice.read_from

    def counting(self, slots, picked, widths_=None, **kw):
        if widths_ is not None and kw.get("first") is not None:  # a verify (a head's queued first round has none)
            widths.append(list(widths_))
        return forward(self, slots, picked, widths_, **kw)

    def counting_after(self, slots, starts, picked, offsets, reach, **kw):
        if kw.get("logits") == "all":  # a verify queued by the step before (a draft model's first round: "last")
            widths.append([picked.shape[1]] * len(slots))
        return after(self, slots, starts, picked, offsets, reach, **kw)

    def reading(self, tokens, probs):
        kept = read_from(self, tokens, probs)
        reads.append((sum(self.counts), sum(map(len, kept))))
        return kept

    monkeypatch.setattr(ModelRunner, "forward_picked", counting)
    monkeypatch.setattr(ModelRunner, "forward_after", counting_after)
    monkeypatch.setattr(DraftsOnDevice, "read_from", reading)
    return widths, reads


@pytest.mark.parametrize("drafter", ["draft model", "head"])
def test_a_verify_reading_drafts_on_the_device_gives_what_one_reading_them_first_does(drafter, tmp_path, monkeypatch):
    target = tiny_model(seed=0)
    plain = [o.outputs[0].token_ids for o in LLM(target=target, num_speculative_tokens=0).generate(PROMPTS, PARAMS)]
    first = _run(_drafting(drafter, target, tmp_path), on_device=False)
    verifies, reads = _count_verifies(monkeypatch)
    there = _run(_drafting(drafter, target, tmp_path), on_device=True)
    assert there == first and there[0] == plain
    assert len(verifies) >= 8 and max(max(w) for w in verifies) == K + 1 and len(reads) == len(verifies)
    assert sum(accepted for _, _, accepted in there[1]) > 0
    drafted, kept = (sum(n) for n in zip(*reads))
    assert drafted == sum(sum(w) - len(w) for w in verifies)  # every draft verified, those past a stop too
    assert (kept < drafted) is (drafter == "head")  # the head's confidence stop cut some


# Seeded sampled requests of different settings beside a greedy one asking for logprobs
SAMPLED = [
    SamplingParams(temperature=0.8, seed=1, max_tokens=30, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=17, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=1.2, top_k=8, top_p=0.9, seed=2, max_tokens=24, ignore_eos=True),
]


def _rows_of_kept_drafts(widths, drafts):
    return list(range(sum(len(t) + 1 for t in drafts)))


@pytest.mark.parametrize("drafter, broken", [("draft model", False), ("head", False), ("head", True)])
def test_sampled_steps_verify_drafts_read_on_the_device_as_drafts_read_first(drafter, broken, tmp_path, monkeypatch):
    """Sampled sequences' chained drafts (and those of a greedy one asking for logprobs) are read while the verify's
    forward, queued behind them, reads them on the device; each sequence's rows up to its drafts stood by are then
    verified (rejection sampling, logprobs): the outputs, logprobs and acceptance of a verify that reads the drafts
    first, the head's confidence stop cutting some. Broken: rows counted by the drafts kept, not by those verified."""
    target = tiny_model(seed=0)
    first = _run(_drafting(drafter, target, tmp_path), False, params=SAMPLED)
    verifies, reads = _count_verifies(monkeypatch)
    if broken:
        monkeypatch.setattr(overlap, "_stood_by_rows", _rows_of_kept_drafts)
    there = _run(_drafting(drafter, target, tmp_path), True, params=SAMPLED)
    assert (there == first) is not broken
    if broken:
        return
    assert len(verifies) >= 8 and len(reads) == len(verifies) and sum(a for _, _, a in there[1]) > 0
    drafted, kept = (sum(n) for n in zip(*reads))
    assert (kept < drafted) is (drafter == "head")  # the head's confidence stop cut some
    assert len({str(output) for output in there[0]}) == 3 and there[0][1][1]  # logprobs came back


def _misaligned(drafts, widths, argmax, forced=False):
    return _verify_rows(drafts, [len(t) + 1 for t in drafts], argmax, forced)


_verify_rows = overlap.verify_argmax_rows


def _drafts_not_fed(fill):
    def fill_without_drafts(self, slots, starts, inputs, scratch_row, features=None, picked=None, picked_at=0, *rest):
        if picked is not None and picked_at:  # a verify's: every draft read as token 0
            picked = torch.zeros_like(picked)
        return fill(self, slots, starts, inputs, scratch_row, features, picked, picked_at, *rest)

    return fill_without_drafts


@pytest.mark.parametrize("broken", [None, "rows counted by the drafts kept", "drafts not fed"])
def test_imposed_acceptance_reads_drafts_on_the_device_alike(broken, tmp_path, monkeypatch):
    """Steps that keep as many drafts as a measured pair did (bench/imposed.py), the head's confidence stop cutting
    some: each emits the kept drafts and the target's token after them, whichever way the drafts reach the verify. A
    verify that counts a sequence's rows by its drafts kept (not by those it verified), or reads no drafts, differs."""
    target = tiny_model(seed=0)
    llm = _drafting("head", target, tmp_path)
    first = _run(llm, False, MeasuredAcceptance([0.9, 0.8, 0.6, 0.5], seed=4))
    if broken == "rows counted by the drafts kept":
        monkeypatch.setattr(overlap, "verify_argmax_rows", _misaligned)
    elif broken == "drafts not fed":
        monkeypatch.setattr(cuda_graphs.StaticBatch, "fill", _drafts_not_fed(cuda_graphs.StaticBatch.fill))
    there = _run(_drafting("head", target, tmp_path), True, MeasuredAcceptance([0.9, 0.8, 0.6, 0.5], seed=4))
    assert (there == first) is (broken is None)


def _logged(monkeypatch, log: list[str]) -> None:
    """Log each verify launched with drafts still on the device (and each queued for the next step), each read of
    drafts to the host, and each wait for a timing mark (on a GPU its events; on a CPU a stand-in for them, which
    records the host's time)."""
    forward, after, settle = ModelRunner.forward_picked, ModelRunner.forward_after, DraftBatch.settle

    def verify(self, slots, picked, widths=None, **kw):
        log.append("verify" if widths else "plain")
        return forward(self, slots, picked, widths, **kw)

    def verify_ahead(self, slots, starts, picked, offsets, reach, **kw):
        if kw.get("logits") == "all":  # the next step's verify (a draft model's first round: "last")
            log.append("next verify")
        return after(self, slots, starts, picked, offsets, reach, **kw)

    def read(self, tokens, probs):
        log.append("read")
        return settle(self, tokens, probs)

    class Event:
        def __init__(self, enable_timing=False):
            self.at = None

        def record(self):
            self.at = time.perf_counter()

        def query(self):
            return True

        def synchronize(self):
            log.append("wait")

        def elapsed_time(self, end):
            return (end.at - self.at) * 1000

    monkeypatch.setattr(ModelRunner, "forward_picked", verify)
    monkeypatch.setattr(ModelRunner, "forward_after", verify_ahead)
    monkeypatch.setattr(DraftBatch, "settle", read)
    if DEVICE == "cuda":  # the real events, their waits logged
        synchronize = torch.cuda.Event.synchronize

        def waiting(self):
            log.append("wait")
            return synchronize(self)

        monkeypatch.setattr(torch.cuda.Event, "synchronize", waiting)
        return
    monkeypatch.setattr(timing, "_device_queue", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", Event)


def _read_spans_at_once(record):
    def record_resolved(self, which, seconds, calls=1):
        if isinstance(seconds, timing.Span):
            seconds.seconds  # noqa: B018 (the read is the point)
        return record(self, which, seconds, calls)

    return record_resolved


@pytest.mark.parametrize("broken", [None, "drafts read first", "spans read as they end"])
def test_a_speculative_step_waits_for_the_device_once_after_its_verify_is_queued(broken, tmp_path, monkeypatch):
    """Within a step, the verify is queued before the drafts are read, and no timing mark is waited for before that
    read (after it, every mark has passed). Broken variants: the engine reading drafts first, a timer reading each
    span as it ends (as timing did by synchronising)."""
    llm = _drafting("head", tiny_model(seed=0), tmp_path)
    log: list[str] = []
    _logged(monkeypatch, log)
    if broken == "drafts read first":
        monkeypatch.setattr(overlap.QueuingAhead, "_verifies_on_device", lambda self, seqs, drafts: False)
    elif broken == "spans read as they end":
        monkeypatch.setattr(timing.StepTimer, "record", _read_spans_at_once(timing.StepTimer.record))
    assert _verified_before_read(llm, log) is (broken is None)


def test_a_sampled_step_reads_its_drafts_after_its_verify_is_queued(tmp_path, monkeypatch):
    """As above for a seeded sampled request: its verify is queued before its drafts are read."""
    llm = _drafting("head", tiny_model(seed=0), tmp_path)
    log: list[str] = []
    _logged(monkeypatch, log)
    assert _verified_before_read(llm, log, SAMPLED[0])


def _verified_before_read(llm: LLM, log: list[str], params: SamplingParams = PARAMS[0]) -> bool:
    """Whether, over a request's steps that drafted with chained rounds (5 or more), each queued its verify before
    reading the drafts (or the step before queued it) and waited for no timing mark before that read (`log`: as
    _logged keeps it)."""
    engine = llm.engine
    engine.overlap = True
    engine.add_request(PROMPTS[0], params)
    steps = []
    while engine.has_unfinished():
        log.clear()
        if any(engine.step().draft_lengths):
            steps.append(list(log))
    chained = [  # steps that drafted k > 1 (the rounds chained): what each did before its read, and the step before
        (step[: step.index("read")], before) for before, step in zip([[], *steps], steps) if "read" in step
    ]
    queued = all("verify" in mine or "next verify" in before for mine, before in chained)
    return len(chained) >= 5 and queued and all("wait" not in mine for mine, _ in chained)
