"""A draft model that stops drafting after a token it is unsure of: where it stops, that greedy output
still equals plain decoding, and that sampled output still follows the target exactly (chi-square
against the exact joint), with the tempting variant that drops the unsure token instead failing it."""

import pytest
import torch
from conftest import run_as_one_batch, tiny_model
from stats import PASS_P, chi2_pvalue, exact_joint, sampled_joint

from specdecode import LLM, SamplingParams, SpecDecodeError
from specdecode.engine.sequence import Sequence
from specdecode.executor.runner import ModelRunner
from specdecode.proposers import DraftModelProposer

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [40, 41, 42], [9, 9, 9, 9, 9], [60, 3, 33]]


def _greedy_with_confidence(model, ids: list[int], k: int) -> list[tuple[int, float]]:
    """The draft model's greedy continuation, each token with the probability the model gave it."""
    runner = ModelRunner(model, 1, 64)
    slot, out, inputs = runner.allocate(), [], list(ids)
    for _ in range(k):
        probs = runner.forward([slot], [inputs], logits="last")[0].float().softmax(-1)
        runner.commit(slot, runner.length(slot) + len(inputs))
        token = int(probs.argmax())
        out.append((token, float(probs[token])))
        inputs = [token]
    return out


def test_drafting_stops_right_after_the_first_unsure_token(random_draft):
    ids, k = [5, 6, 7, 8], 6
    continuation = _greedy_with_confidence(random_draft.model, ids, k)
    confidences = sorted(c for _, c in continuation)
    threshold = (confidences[2] + confidences[3]) / 2  # some drafts fall below it, some do not
    proposer = DraftModelProposer(random_draft, confidence_threshold=threshold)
    proposer.reserve(num_slots=1, max_model_len=64)
    drafts = proposer.propose([Sequence(ids, SamplingParams(temperature=0), None)], [k], [None]).tokens[0]
    first_unsure = next(i for i, (_, c) in enumerate(continuation) if c < threshold)
    assert drafts == [t for t, _ in continuation[: first_unsure + 1]]


@pytest.mark.parametrize("threshold", [-0.1, 1.0])
def test_threshold_outside_zero_to_one_is_refused(target, random_draft, threshold):
    with pytest.raises(SpecDecodeError, match="confidence threshold must be in"):
        LLM(target=target, draft=random_draft, draft_confidence=threshold)


def test_greedy_output_equals_plain_when_rows_stop_at_different_steps(target):
    """A draft close to the target (its own weights, perturbed): confident on some rows and not others,
    so a batch's sequences stop drafting after different numbers of tokens."""
    draft, noise = tiny_model(seed=0), torch.Generator().manual_seed(1)  # not the global stream: other tests move it
    with torch.no_grad():
        for p in draft.model.parameters():
            p.add_(torch.randn(p.shape, generator=noise) * 0.05)
    plain, _, _ = run_as_one_batch(
        LLM(target=target, num_speculative_tokens=0, max_model_len=256).engine, PROMPTS, GREEDY
    )
    llm = LLM(
        target=target,
        draft=draft,
        num_speculative_tokens=6,
        max_model_len=256,
        speculation_policy="fixed",
        draft_confidence=0.5,
    )
    spec, step_ks, _ = run_as_one_batch(llm.engine, PROMPTS, GREEDY)
    assert spec == plain
    drafted = {k for ks in step_ks for k in ks}
    assert 6 in drafted and drafted & {1, 2, 3, 4, 5}  # some rows drafted all 6, others stopped early


# ---- sampling: still the target's distribution ------------------------------------------------------
SMALL_VOCAB = 8
PARAMS = SamplingParams(n=16, temperature=1.0, max_tokens=4)  # id 7 is EOS
THRESHOLD = 0.25  # the small draft's proposals fall on both sides of it


@pytest.fixture(scope="module")
def small_pair():
    return tiny_model(seed=7, vocab=SMALL_VOCAB, hidden=32), tiny_model(seed=8, vocab=SMALL_VOCAB, hidden=32, layers=1)


@pytest.fixture(scope="module")
def joint(small_pair):
    return exact_joint(small_pair[0], [1, 2, 3, 1], PARAMS)


def _drop_unsure_last_draft(propose):
    """The tempting variant: stop *before* an unsure token (drop it) rather than after it. Which tokens
    get proposed then depends on the sampled token beyond what q says, and verification stops being exact."""

    def wrapped(self, seqs, ks, feedback=None):
        batch = propose(self, seqs, ks, feedback)
        for i, (tokens, q) in enumerate(zip(batch.tokens, batch.probs)):
            if tokens and q is not None and float(q[-1][tokens[-1]]) < self.confidence_threshold:
                batch.tokens[i], batch.probs[i] = tokens[:-1], (q[:-1] if len(tokens) > 1 else None)
        return batch

    return wrapped


def test_sampled_output_follows_the_target_with_early_stops(small_pair, joint):
    counts, accepted, drafts_per_step = sampled_joint(
        *small_pair, [1, 2, 3, 1], PARAMS, samples=8000, k=3, draft_confidence=THRESHOLD, with_drafts_per_step=True
    )
    assert 0.1 < accepted < 0.95  # both accepted drafts and rejections are exercised
    assert 1.05 < drafts_per_step < 1.9  # up to 2 fit before max_tokens: the draft stopped early in some steps
    assert chi2_pvalue(counts, joint) > PASS_P


def test_dropping_the_unsure_token_fails_the_distribution_test(small_pair, joint, monkeypatch):
    monkeypatch.setattr(DraftModelProposer, "propose", _drop_unsure_last_draft(DraftModelProposer.propose))
    counts, _ = sampled_joint(*small_pair, [1, 2, 3, 1], PARAMS, samples=8000, k=3, draft_confidence=THRESHOLD)
    assert chi2_pvalue(counts, joint) < 1e-6


@pytest.mark.parametrize(
    "device, eager, asked, expected",
    [("cpu", False, None, 0.8), ("cuda", False, None, 0.0), ("cuda", True, None, 0.8), ("cuda", False, 0.5, 0.5)],
)
def test_the_default_threshold_is_none_where_drafting_rounds_chain_on_the_device(device, eager, asked, expected):
    """0.8 by default; none on CUDA with graphs, where a drafter's rounds chain on the device (every round and
    verify row runs anyway: a stop would only drop accepted drafts), and none asked for there either."""
    from specdecode.config import EngineConfig

    assert EngineConfig(draft_confidence=asked, enforce_eager=eager).draft_confidence_on(device) == expected


def test_a_proposer_built_from_the_default_config_stops_at_the_default_threshold(target, random_draft):
    from specdecode.proposers import ProposerSetup, build_proposer

    assert build_proposer("draft_model", ProposerSetup(target, loaded=random_draft)).confidence_threshold == 0.8


def test_an_engine_on_a_cpu_stops_at_the_default_threshold(target, random_draft):
    llm = LLM(target=target, draft=random_draft, num_speculative_tokens=3, max_model_len=64, progress=False)
    assert llm.config.draft_confidence == 0.8 == llm.engine.proposer.confidence_threshold
