"""The draft-model proposer on its own: its cache catches up lazily, follows the target's commits and
rollbacks, frees its slot, and drafts the draft model's own greedy continuation."""

import pytest
import torch
from conftest import DEVICE, tiny_model

from specdecode import SpecDecodeError
from specdecode.engine.sequence import Sequence
from specdecode.executor.runner import ModelRunner
from specdecode.proposers import DraftModelProposer, ProposerSetup, build_proposer
from specdecode.sampling import SamplingParams


def _proposer(draft):
    p = DraftModelProposer(draft)
    p.reserve(num_slots=2, max_model_len=64)
    return p


def _seq(ids):
    return Sequence(list(ids), SamplingParams(temperature=0), None)


def _greedy_continuation(model, ids, k):
    runner = ModelRunner(model, 1, 64)
    slot, out = runner.allocate(), []
    inputs = list(ids)
    for _ in range(k):
        token = int(runner.forward([slot], [inputs], logits="last")[0].argmax())
        runner.commit(slot, runner.length(slot) + len(inputs))
        out.append(token)
        inputs = [token]
    return out


def test_drafts_are_the_draft_models_greedy_continuation(random_draft):
    proposer, seq = _proposer(random_draft), _seq([5, 6, 7, 8])
    drafts = proposer.propose([seq], [3], [None])
    assert drafts.tokens == [_greedy_continuation(random_draft.model, [5, 6, 7, 8], 3)]
    assert drafts.probs == [None]  # greedy drafting: one-hot q


def test_catches_up_lazily_and_rolls_back_to_what_the_target_kept(random_draft):
    proposer, seq = _proposer(random_draft), _seq([5, 6, 7, 8])
    assert proposer.unseen_tokens(seq) == 4  # never drafted for it: the whole prompt
    first = proposer.propose([seq], [3], [None]).tokens[0]
    # the draft has read the prompt and its first two drafts (the third is sampled, not fed back yet)
    assert proposer.unseen_tokens(seq) == 4 - 6
    seq.token_ids += [first[0], 60]  # the target kept one draft, then emitted its own token
    proposer.commit(seq, 5)
    assert proposer.unseen_tokens(seq) == 1  # only the target's own token is new to the draft
    again = proposer.propose([seq], [2], [None]).tokens[0]
    assert again == _greedy_continuation(random_draft.model, seq.token_ids, 2)


def test_the_forward_over_the_prompt_is_timed_as_the_drafts_prefill(random_draft):
    proposer, seq = _proposer(random_draft), _seq([5, 6, 7, 8])
    proposer.propose([seq], [3], [None])
    timer = proposer.timer
    assert (timer.draft_prefill_calls, timer.draft_calls) == (1, 2)  # the prompt, then two one-token rounds
    seq.token_ids += [1, 2, 3, 60]  # every draft kept, and the target's bonus token
    proposer.commit(seq, 7)
    proposer.propose([seq], [2], [None])  # reads the last draft and the bonus: a drafting step
    assert (timer.draft_prefill_calls, timer.draft_calls) == (1, 4)
    assert timer.draft_step_s == timer.draft_time / 4 and timer.draft_prefill_time > 0


def _first_draft_distribution(proposer, seq):
    seq.params, seq.generator = SamplingParams(temperature=1.0), torch.Generator(DEVICE).manual_seed(0)
    return proposer.propose([seq], [1], [None]).probs[0][0]


@pytest.mark.parametrize("rolls_back", [True, False])
def test_the_next_draft_sees_exactly_the_kept_text(random_draft, rolls_back):
    """The draft's next distribution equals a fresh draft's on the kept text, and a broken variant that
    skips the rollback (rejected drafts stay in its cache) is caught by the same comparison."""
    proposer, seq = _proposer(random_draft), _seq([5, 6, 7, 8])
    first = proposer.propose([seq], [3], [None]).tokens[0]
    seq.token_ids += [first[0], (first[1] + 1) % 60]  # the second draft was rejected
    if rolls_back:
        proposer.commit(seq, 5)
    seq.token_ids.append(61)  # the next step's pending token
    fresh = _first_draft_distribution(_proposer(random_draft), _seq(seq.token_ids))
    assert torch.allclose(_first_draft_distribution(proposer, seq), fresh) == rolls_back


def test_release_frees_the_slot(random_draft):
    proposer = _proposer(random_draft)
    seqs = [_seq([1, 2, 3]), _seq([4, 5, 6])]
    proposer.propose(seqs, [1, 1], [None, None])
    assert proposer.runner.num_free == 0
    with pytest.raises(SpecDecodeError, match="slots are in use"):
        proposer.propose([_seq([7, 8])], [1], [None])
    proposer.release(seqs[0])
    proposer.propose([_seq([7, 8])], [1], [None])


def test_the_registry_builds_it_and_refuses_another_vocabulary(target, random_draft):
    built = build_proposer("draft_model", ProposerSetup(target, loaded=random_draft))
    assert isinstance(built, DraftModelProposer) and built.model is random_draft.model
    other = tiny_model(seed=1, vocab=32)
    with pytest.raises(SpecDecodeError, match="different vocabularies"):
        build_proposer("draft_model", ProposerSetup(target, loaded=other))
    with pytest.raises(SpecDecodeError, match="unknown proposer"):
        build_proposer("no-such-kind", ProposerSetup(target))


def test_sampled_drafts_carry_their_distribution(random_draft):
    proposer = _proposer(random_draft)
    seq = Sequence([1, 2, 3], SamplingParams(temperature=0.8, seed=1), torch.Generator(DEVICE).manual_seed(1))
    drafts = proposer.propose([seq], [3], [None])
    q = drafts.probs[0].cpu()
    assert q.shape == (3, random_draft.config.vocab_size)
    assert torch.allclose(q.sum(-1), torch.ones(3)) and all(q[i, t] > 0 for i, t in enumerate(drafts.tokens[0]))


@pytest.mark.parametrize("restricted", [False, True])
def test_plain_greedy_drafts_of_a_round_come_back_as_each_rows_own(restricted):
    """A round's drafts for greedy sequences with nothing to apply to their logits come back in one copy to the host
    (_argmax_drafts): the tokens, in the target's ids (also from a restricted draft vocabulary), and the confidences
    that sampling each row and weighing its draft give; a sampled sequence's row is left to be sampled."""
    from specdecode.proposers.draft_model import restrict_draft_vocab

    draft = tiny_model(seed=4)
    if restricted:
        restrict_draft_vocab(draft, 20)
    proposer = DraftModelProposer(draft, confidence_threshold=0.5)
    proposer.reserve(4, 64)
    width = len(proposer.runner.vocab_ids) if restricted else draft.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    scales = torch.tensor([0.1, 1.0, 3.0, 10.0, 30.0, 1.0])[:, None]  # flat rows to peaked ones
    logits = torch.randn(6, width, generator=gen) * scales
    logits[1:3, -3:] += 50.0  # drafts among the last ids: a restricted vocabulary's map to other target ids
    logits = logits.to(DEVICE)
    params = [SamplingParams(temperature=0)] * 5 + [SamplingParams(temperature=0.8)]
    seqs = [Sequence([1, 2, 3], p, None) for p in params]
    got = proposer._argmax_drafts(logits, list(range(6)), seqs)
    assert sorted(got) == [0, 1, 2, 3, 4]
    for row in range(5):
        token, q = proposer._sample(logits[row], seqs[row], [])
        assert q is None and got[row][0] == token
        assert got[row][1] == pytest.approx(proposer._confidence(logits[row], token, q), rel=1e-6)
    assert len({token for token, _ in got.values()}) > 1 and min(c for _, c in got.values()) < 0.5
    assert proposer._argmax_drafts(logits[:5], list(range(5)), seqs[:5]) == got  # every row plain greedy
