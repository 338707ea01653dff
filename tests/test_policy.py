"""Speculation policies: fixed, vLLM's disable-by-batch-size, and the adaptive goodput policy."""
import pytest

from specdecode import LLM, SamplingParams, SpecDecodeError
from specdecode.engine.policy import SpeculationPolicy, expected_tokens


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1
    assert expected_tokens(1.0, 4) == 5
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_fixed_and_disable_by_batch_size():
    assert SpeculationPolicy("fixed", 3).choose(["a"] * 10) == 3
    p = SpeculationPolicy("disable_by_batch_size", 3, max_batch_for_speculation=4)
    assert p.choose(["a"] * 4) == 3
    assert p.choose(["a"] * 5) == 0
    with pytest.raises(SpecDecodeError):
        SpeculationPolicy("disable_by_batch_size", 3)
    with pytest.raises(SpecDecodeError, match="unknown speculation policy"):
        SpeculationPolicy("sometimes", 3)


def _measured(alpha: float, c: float, k_max: int = 4, batch: int = 1, verify_growth: float = 0.0):
    p = SpeculationPolicy("adaptive", k_max)
    p.acceptance["r"] = alpha
    for tokens in range(batch, batch * (k_max + 1) + 1):
        p.costs.observe("target", tokens, 1.0 + verify_growth * (tokens - batch))
    p.costs.observe("draft", batch, c)
    return p


def test_adaptive_explores_then_decides():
    p = SpeculationPolicy("adaptive", 4)
    assert p.choose(["r"]) == 0  # nothing measured: plain first
    p.costs.observe("target", 1, 1.0)
    assert p.choose(["r"]) == 4  # plain measured: try speculating once


@pytest.mark.parametrize("alpha, c, expected", [
    (0.9, 0.1, 4),  # good draft, cheap: draft the most
    (0.2, 0.5, 0),  # poor draft, costly: do not speculate
    (0.0, 0.05, 0),  # nothing is ever accepted
])
def test_adaptive_picks_goodput_maximising_k(alpha, c, expected):
    assert _measured(alpha, c).choose(["r"]) == expected


def test_adaptive_stops_when_verification_gets_expensive():
    """Under load a wide verify call stops being free (compute-bound): speculation must switch off."""
    assert _measured(0.8, 0.1, batch=16, verify_growth=0.2).choose(["r"] * 16) == 0
    assert _measured(0.8, 0.1, batch=16, verify_growth=0.0).choose(["r"] * 16) > 0


def test_adaptive_engine_stays_lossless_and_turns_off_for_a_useless_draft(target, random_draft):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(target=target, num_speculative_tokens=0, max_model_len=256).generate("hello world", params)
    llm = LLM(target=target, draft=random_draft, num_speculative_tokens=4, speculation_policy="adaptive",
              max_model_len=256)
    out = llm.generate("hello world", params)
    assert out[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    decisions = llm.engine.policy.decisions
    assert decisions[0] > sum(n for k, n in decisions.items() if k > 0)  # mostly plain decoding
    assert out[0].spec["num_draft_forwards"] < 40  # k = 0 steps ran no draft forward
