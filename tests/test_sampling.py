"""Temperature / top-k / top-p: the processed distribution that both target and draft use."""

import torch

from specdecode.sampling import SamplingParams, logits_to_probs

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])


def test_greedy_is_one_hot_argmax():
    probs = logits_to_probs(LOGITS, SamplingParams(temperature=0))
    assert probs.tolist() == [[1.0, 0, 0, 0, 0, 0]]


def test_temperature_scales_logits():
    probs = logits_to_probs(LOGITS, SamplingParams(temperature=0.5))
    torch.testing.assert_close(probs, (LOGITS / 0.5).softmax(-1))


def test_top_k_keeps_k_largest_renormalised():
    probs = logits_to_probs(LOGITS, SamplingParams(top_k=2))
    torch.testing.assert_close(probs[0, :2], LOGITS[0, :2].softmax(-1))
    assert probs[0, 2:].sum() == 0


def test_top_p_keeps_smallest_prefix_reaching_p():
    full = LOGITS.softmax(-1)[0]  # ~[0.56, 0.21, 0.13, 0.08, 0.03, 0.004]
    probs = logits_to_probs(LOGITS, SamplingParams(top_p=0.7))[0]
    assert (probs[:2] > 0).all() and probs[2:].sum() == 0  # 0.56 < 0.7 <= 0.56 + 0.21
    torch.testing.assert_close(probs[:2], full[:2] / full[:2].sum())


def test_top_p_one_and_top_k_off_leave_distribution_unchanged():
    torch.testing.assert_close(logits_to_probs(LOGITS, SamplingParams(top_p=1.0, top_k=-1)), LOGITS.softmax(-1))
