"""Acceptance imposed on a benchmark run (bench/imposed.py): each step keeps drafts as often, per position, as the
measured run it was given kept them; through the engine, the run's own acceptance per position is that one, and its
emitted tokens are the kept drafts and the target's token after them. A variant that draws each position on its own
(not the first i + 1 kept together) keeps later positions too often and fails."""

import json

import pytest
import torch
from conftest import tiny_model

from specdecode import LLM, SamplingParams
from specdecode.bench import imposed
from specdecode.bench.imposed import MeasuredAcceptance
from specdecode.engine.sequence import Sequence
from specdecode.verify.verifier import verify_drafts


def _kept_more_than(acceptance, k: int, steps: int) -> list[float]:
    kept = [acceptance(k) for _ in range(steps)]
    return [sum(1 for n in kept if n > i) / steps for i in range(k)]


def test_steps_keep_drafts_as_often_as_the_measured_run():
    acceptance = MeasuredAcceptance([0.8, 0.55, 0.6, 0.3], seed=1)  # a rise is a measuring artefact: capped
    assert acceptance.survival == [0.8, 0.55, 0.55, 0.3]
    got = _kept_more_than(acceptance, 4, 20000)
    assert got == pytest.approx(acceptance.survival, abs=0.015)
    assert _kept_more_than(acceptance, 2, 5000) == pytest.approx([0.8, 0.55], abs=0.03)  # fewer drafts: a prefix
    with pytest.raises(ValueError, match="fractions"):
        MeasuredAcceptance([1.2])


def test_positions_drawn_apart_keep_later_ones_too_often(monkeypatch):
    """The check above can fail: a draw per position (independent) keeps 2+ drafts 0.8 x 0.55 of the time."""

    class Apart(MeasuredAcceptance):
        def __call__(self, drafts):
            n = 0
            while n < drafts and self._random.random() < self.survival[n]:
                n += 1
            return n

    got = _kept_more_than(Apart([0.8, 0.55], seed=1), 2, 20000)
    assert got[1] != pytest.approx(0.55, abs=0.015)


def test_a_step_emits_the_kept_drafts_and_the_targets_token_after_them():
    seq = Sequence([1, 2, 3], SamplingParams(temperature=0), torch.Generator().manual_seed(0))
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    drafts = [7, 8, 9]
    for kept in range(4):
        result, _ = verify_drafts(seq, drafts, None, logits, [], forced_accept=lambda n, kept=kept: kept)
        assert result.num_accepted == [kept]
        assert result.tokens == [drafts[:kept] + [int(logits[kept].argmax())]]


def test_the_engine_keeps_drafts_as_imposed(tmp_path):
    path = tmp_path / "latency.json"
    path.write_text(json.dumps({"results": [{"k": 0}, {"k": 3, "acceptance_per_position": [0.7, 0.4, 0.2]}]}))
    target = tiny_model(seed=0)
    llm = LLM(
        target=target, draft=tiny_model(seed=123, layers=1), num_speculative_tokens=3, speculation_policy="fixed",
        draft_confidence=0.0, max_model_len=512, progress=False,
    )  # fmt: skip
    llm.engine.forced_accept = imposed.MeasuredAcceptance.from_latency(str(path), 3, seed=2)
    out = llm.generate([[5, 9, 14]] * 4, SamplingParams(temperature=0, max_tokens=120, ignore_eos=True))
    spec = llm.engine.totals
    rates = [a / d for a, d in zip(spec.accepted_per_position, spec.drafted_per_position)]
    assert rates == pytest.approx([0.7, 0.4, 0.2], abs=0.08) and spec.num_spec_steps > 120
    assert all(o.metrics.forced_accept for o in out)  # reported as a forced run, not the models' acceptance
    with pytest.raises(ValueError, match="k = 4"):
        MeasuredAcceptance.from_latency(str(path), 4)
