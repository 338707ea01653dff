"""The draft-model proposer on its own: its cache catches up lazily, follows the target's commits and
rollbacks, frees its slot, and drafts the draft model's own greedy continuation."""

import dataclasses

import pytest
import torch
from conftest import DEVICE, tiny_model

from specdecode import SpecDecodeError
from specdecode.engine.sequence import Sequence
from specdecode.executor.runner import ModelRunner
from specdecode.proposers import DraftModelProposer, ProposerSetup, build_proposer
from specdecode.sampling import SamplingParams, argmax_probability, process_logits, sample_token


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


def test_a_sequence_never_drafted_for_counts_its_unseen_tokens_without_walking_the_prefixes_each_step(random_draft):
    """Under load the policy may leave a sequence undrafted for its whole run: what the draft would catch up on is
    then counted from one look at the draft's cached prefixes, as the sequence grows, not a walk of them each step."""
    proposer = DraftModelProposer(random_draft)
    proposer.reserve(num_slots=2, max_model_len=64, reuse_prefixes=True)
    first = _seq([5, 6, 7, 8] * 5)
    proposer.propose([first], [2], [None])
    proposer.release(first)  # its prompt's full blocks stay findable
    seq, walks = _seq([5, 6, 7, 8] * 5 + [9]), []
    cached = proposer.runner.cached_prefix
    proposer.runner.cached_prefix = lambda *a: walks.append(a) or cached(*a)
    found = seq.num_tokens - proposer.unseen_tokens(seq)
    for token in range(10, 30):
        seq.token_ids.append(token)
        assert proposer.unseen_tokens(seq) == seq.num_tokens - found
    assert len(walks) == 1
    proposer.release(seq)
    assert not proposer._found


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


def _drafted_alone(proposer, row: torch.Tensor, seq, drafted: list[int]):
    """One row's draft by the definition: over the target's vocabulary (-inf outside a restricted draft vocabulary),
    the request's processors seeing the drafts so far, then the argmax (greedy; its confidence the raw softmax's) or a
    draw from q (its confidence q's)."""
    vocab_ids = proposer.runner.vocab_ids
    full = row.float()
    if vocab_ids is not None:
        full = torch.full((proposer.runner.cfg.vocab_size,), float("-inf"), device=row.device)
        full = full.index_copy_(0, vocab_ids, row.float())
    eos = proposer.loaded.tokenizer.eos_token_ids
    processed = process_logits(full[None], seq.params, seq.prompt_ids, seq.output_ids + drafted, (), eos)
    token, q = sample_token(processed[0], seq.params, seq.generator)
    return token, float(argmax_probability(row)) if q is None else float(q[token]), q


def _round(restricted: bool, rows: int):
    """A proposer (its vocabulary restricted or not) and a round's logits, flat rows to peaked ones, some drafts among
    the last ids (a restricted vocabulary's map to other target ids)."""
    from specdecode.proposers.vocabulary import restrict_draft_vocab

    draft = tiny_model(seed=4)
    if restricted:
        restrict_draft_vocab(draft, 20)
    proposer = DraftModelProposer(draft, confidence_threshold=0.5)
    proposer.reserve(8, 64)
    width = len(proposer.runner.vocab_ids) if restricted else draft.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, width, generator=gen) * torch.logspace(-1, 1.5, rows)[:, None]
    logits[1:3, -3:] += 50.0
    return proposer, logits.to(DEVICE)


@pytest.mark.parametrize("restricted", [False, True])
def test_plain_greedy_drafts_of_a_round_come_back_as_each_rows_own(restricted):
    """A round's drafts for greedy sequences with nothing to apply to their logits come back in one copy to the host
    (_argmax_drafts): the tokens, in the target's ids (also from a restricted draft vocabulary), and the confidences
    the definition gives; a sampled sequence's row is left to be sampled."""
    proposer, logits = _round(restricted, 6)
    params = [SamplingParams(temperature=0)] * 5 + [SamplingParams(temperature=0.8)]
    seqs = [Sequence([1, 2, 3], p, None) for p in params]
    got = proposer._argmax_drafts(logits, list(range(6)), seqs)
    assert sorted(got) == [0, 1, 2, 3, 4]
    for row in range(5):
        token, confidence, q = _drafted_alone(proposer, logits[row], seqs[row], [])
        assert got[row][0] == token and got[row][2] is None
        assert got[row][1] == pytest.approx(confidence, rel=1e-6)
    assert len({d[0] for d in got.values()}) > 1 and min(d[1] for d in got.values()) < 0.5
    assert proposer._argmax_drafts(logits[:5], list(range(5)), seqs[:5]) == got  # every row plain greedy


# Sequences that process their logits or sample, seeded (a greedy one with penalties, sampled ones of three settings)
PROCESSED = [
    SamplingParams(temperature=0, repetition_penalty=1.3, logit_bias={2: 3.0}),
    SamplingParams(temperature=0.8, seed=11, frequency_penalty=0.5),
    SamplingParams(temperature=1.1, top_k=4, seed=12, presence_penalty=0.4),
    SamplingParams(temperature=0.7, top_p=0.8, seed=13),
    SamplingParams(temperature=0),  # plain greedy: _argmax_drafts' row
]


def _processed_round(restricted: bool):
    """A round of PROCESSED sequences, each with its output and drafts so far: the proposer's drafts, and each row's
    drafted alone by the definition."""
    proposer, logits = _round(restricted, len(PROCESSED))

    def fresh():
        streams = [None if p.seed is None else torch.Generator(DEVICE).manual_seed(p.seed) for p in PROCESSED]
        seqs = [Sequence([1, 2, 3, 4], p, g) for p, g in zip(PROCESSED, streams)]
        for n, seq in enumerate(seqs):
            seq.token_ids.extend([2, 5, n])
        return seqs

    drafted = [[2], [30, 30], [7, 2], [1], []]
    # each row's uniform: the first its stream draws (the greedy rows' go unused)
    uniforms = torch.cat([torch.rand(1, generator=s.generator, dtype=torch.float64, device=DEVICE) if s.generator
                          else torch.zeros(1, dtype=torch.float64, device=DEVICE) for s in fresh()])  # fmt: skip
    got = proposer._processed_drafts(logits, list(range(len(PROCESSED))), fresh(), drafted, uniforms)
    alone = {row: _drafted_alone(proposer, logits[row], seq, drafted[row]) for row, seq in enumerate(fresh()[:-1])}
    return got, alone


def _same(got, alone) -> bool:
    return sorted(got) == sorted(alone) and all(
        got[r][0] == alone[r][0]
        and got[r][1] == pytest.approx(alone[r][1], rel=1e-6)
        and ((got[r][2] is None and alone[r][2] is None) or torch.equal(got[r][2], alone[r][2]))
        for r in alone
    )


@pytest.mark.parametrize("restricted", [False, True])
def test_rows_that_process_or_sample_draft_in_one_pass_what_each_drafts_alone(restricted):
    """A round's rows of sequences that process their logits or sample, drafted together (one pass, one copy): each
    row's token, confidence and q those it gets drafted alone, its seeded stream drawing what it draws alone."""
    got, alone = _processed_round(restricted)
    assert _same(got, alone)
    assert {got[r][2] is None for r in got} == {True, False}  # greedy and sampled rows among them


BROKEN_ROUND = {
    # each seeded row drawing from the next sequence's stream
    "streams mixed up": ("sample_at", lambda real: lambda q, uniforms: real(q, uniforms.roll(1))),
    # every row's distribution under the first sampled row's settings
    "one setting for all": ("probs_of_rows", lambda real: lambda rows, params: real(rows, [params[0]] * len(params))),
    # the processors not seeing the drafts so far (each output is 3 tokens)
    "drafts so far unseen": (
        "process_rows",
        lambda real: (
            lambda rows, hs, eos: real(rows, [dataclasses.replace(h, output_ids=h.output_ids[:3]) for h in hs], eos)
        ),
    ),
}


@pytest.mark.parametrize("broken", list(BROKEN_ROUND))
def test_a_pass_that_mixes_up_rows_is_caught(monkeypatch, broken):
    from specdecode.proposers import draft_model

    name, wrap = BROKEN_ROUND[broken]
    monkeypatch.setattr(draft_model, name, wrap(getattr(draft_model, name)))
    assert not _same(*_processed_round(False))
