"""The draft head proposer (drafts from the target's hidden states) and `distill`: greedy equality,
the sampled distribution, the pairing of features with tokens, KV rollback, refusal of a head made for
another target, and training that learns; each property beside a broken variant that fails it."""

import dataclasses
import json
import os
import time

import pytest
import torch
from conftest import make_head, random_hf_weights, tiny_model
from stats import PASS_P, chi2_pvalue, exact_joint, sampled_joint

from specdecode import LLM, SamplingParams, SpecDecodeError
from specdecode.distill.command import distill
from specdecode.distill.recipe import Recipe
from specdecode.executor.runner import ModelRunner
from specdecode.models.draft_head import HeadSpec, build_head, target_fingerprint
from specdecode.models.runtime import build_model
from specdecode.proposers import DraftBatch, register_proposer, unregister_proposer
from specdecode.proposers.draft_head import DraftHeadProposer, UnreadFeatures

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9], list(range(10, 40))]  # the last one prefills by the batched path


def _llm(target, head, k=3, **kw):
    kw.setdefault("speculation_policy", "fixed")
    return LLM(target=target, speculative_model=head, num_speculative_tokens=k, max_model_len=256, **kw)


def _ids(llm, prompts=PROMPTS, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def head(target, tmp_path_factory):
    return make_head(target, tmp_path_factory.mktemp("heads") / "tiny")


@pytest.fixture
def registered(request):
    """Register a proposer kind for one test only."""
    names = []

    def add(name, factory):
        register_proposer(name, factory)
        names.append(name)

    yield add
    for name in names:
        unregister_proposer(name)


def test_greedy_output_equals_plain_decoding(target, head):
    llm = _llm(target, head)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == _ids(
        LLM(target=target, num_speculative_tokens=0, max_model_len=256)
    )
    assert sum(o.spec["num_draft_tokens"] for o in outs) > 0
    # each prompt's features are read in one forward, timed as the head's prefill, not as a drafting step
    assert llm.timer.draft_prefill_calls >= 1 and llm.timer.draft_calls > llm.timer.draft_prefill_calls


def test_a_finished_sequence_holds_no_step_batch_of_hidden_states(target, head):
    """Its last feedback's hidden rows view the whole step's batch: a caller keeping the sequence (a server's
    request until its siblings end) would keep that batch alive."""
    engine = _llm(target, head).engine
    seqs = [engine.add_request(p, GREEDY) for p in PROMPTS]
    engine.step()
    assert all(s.feedback is not None for s in seqs)  # the check can fail
    while engine.has_unfinished():
        engine.step()
    assert all(s.finished and s.feedback is None for s in seqs)


class Recorder(DraftHeadProposer):
    """Records every (position, token, features) row the head reads from the target's features."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.rows: dict[str, dict[int, tuple[int, torch.Tensor]]] = {}
        self.tokens: dict[str, list[int]] = {}

    def read_ahead(self, seqs):
        for seq in seqs:  # all rows but the last (the first drafting round reads that one)
            self._record(seq, self.runner.length(self._slot(seq)), but_last=True)
        super().read_ahead(seqs)

    def _draft_forward(self, step, rows, seqs, slots, tokens):
        if step == 0:
            for i in rows:
                self._record(seqs[i], self.runner.length(slots[i]), but_last=False)
        return super()._draft_forward(step, rows, seqs, slots, tokens)

    def _record(self, seq, start: int, but_last: bool) -> None:
        read = self._features[seq.request_id].read()
        for j in range(len(read) - but_last):
            self.rows.setdefault(seq.request_id, {})[start + j] = (seq.token_ids[start + 1 + j], read[j])
        self.tokens[seq.request_id] = seq.token_ids


class ShiftedRecorder(Recorder):
    """Broken: pairs each feature row with the token one position later."""

    def _record(self, seq, start: int, but_last: bool) -> None:
        read = self._features[seq.request_id].read()
        self._features[seq.request_id] = UnreadFeatures(torch.cat([read[1:], read[-1:]]))
        super()._record(seq, start, but_last)


def _pairing_errors(target, recorder) -> int:
    """Rows whose features are not the target's own at that position (recomputed alone) or whose token is
    not the sequence's next one."""
    runner, errors = ModelRunner(target.model, 1, 256), 0
    for rid, rows in recorder.rows.items():
        ids = recorder.tokens[rid]
        slot = runner.allocate()
        _, hidden = runner.forward([slot], [ids], "all", hidden=True)
        runner.free(slot)
        for pos, (token, features) in rows.items():
            if token != ids[pos + 1] or not torch.allclose(features, hidden[pos], atol=1e-4, rtol=1e-4):
                errors += 1
    return errors


@pytest.mark.parametrize("kind, broken", [(Recorder, False), (ShiftedRecorder, True)])
def test_each_head_row_reads_the_targets_features_at_its_position_beside_the_next_token(
    target, head, registered, kind, broken
):
    registered("recording-head", lambda setup: kind.from_setup(setup))
    llm = _llm(target, "recording-head:" + head[len("head:") :])
    llm.generate(PROMPTS, GREEDY)
    recorder = llm.engine.proposer
    assert sum(len(r) for r in recorder.rows.values()) > sum(map(len, PROMPTS))
    errors = _pairing_errors(target, recorder)
    assert (errors > 0) if broken else (errors == 0)


@pytest.mark.parametrize("broken", [None, "never copied", "a chunk's rows reversed"])
def test_features_left_unread_for_many_steps_are_read_in_order_and_hold_only_their_own_rows(broken, monkeypatch):
    """A sequence the policy leaves undrafted (under load) gets a feature row every step, each a view of that step's
    whole batch: they are counted as they come and read in order, and once copied into a chunk of the sequence's own
    they no longer keep each step's batch alive. The broken variants: rows never copied (every step's batch kept),
    and a chunk's rows copied in reverse."""
    import gc
    import weakref

    chunk = UnreadFeatures.CHUNK
    if broken == "never copied":
        monkeypatch.setattr(UnreadFeatures, "CHUNK", 10**9)
    elif broken:
        monkeypatch.setattr(torch, "cat", lambda parts, *a: torch.concat(parts[::-1], *a))
    steps, batch = 3 * chunk + 5, 8
    unread, batches = UnreadFeatures(), []
    for step in range(steps):
        hidden = torch.full((batch, 4), float(step))  # a step's hidden states, one row per sequence
        batches.append(weakref.ref(hidden))
        unread.add(hidden[2:3])
        del hidden
    gc.collect()
    assert unread.rows == steps
    in_order = torch.equal(unread.read()[:, 0], torch.arange(steps, dtype=torch.float32))
    released = sum(ref() is None for ref in batches) == 3 * chunk  # the last 5 are still views
    assert (in_order and released) if broken is None else not (in_order and released)


def test_drafting_rolls_the_head_cache_back_to_the_targets_rows(target, head, registered):
    class NoRollback(DraftHeadProposer):
        def propose(self, seqs, ks, feedback=None):
            self._real_rows.clear()
            return super(DraftHeadProposer, self).propose(seqs, ks, feedback)  # skips the rollback

    llm = _llm(target, head)
    llm.generate(PROMPTS, GREEDY)
    proposer = llm.engine.proposer
    assert all(proposer.runner.length(s) == 0 for s in range(proposer.runner.num_slots))  # all released
    registered("no-rollback-head", lambda setup: NoRollback.from_setup(setup))
    with pytest.raises(RuntimeError, match="features from position"):
        _llm(target, "no-rollback-head:" + head[len("head:") :]).generate(PROMPTS, GREEDY)


class CacheSnapshots(DraftHeadProposer):
    """Records, as each drafting round begins, the head's cache rows and the tokens of the sequence."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.snapshots: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []

    def _draft_forward(self, step, rows, seqs, slots, tokens):
        if step == 0:
            cache = self.runner._cache
            for i in rows:
                n = self.runner.length(slots[i])
                self.snapshots.append(
                    (list(seqs[i].token_ids), cache.keys(0, slots[i], n), cache.values(0, slots[i], n))
                )
        return super()._draft_forward(step, rows, seqs, slots, tokens)


class IgnoresTheFirstToken(CacheSnapshots):
    """Broken: finds its rows by the tokens they read (token p + 1) alone, though row p read the target's
    features at p, which depend on every token up to p: the first token too."""

    def keep_prefix(self, seq, kept):
        inputs = seq.token_ids[1:]
        self._slots[seq.request_id] = seq.slot
        return self.runner.take(seq.slot, inputs, seq.tenant, min(kept, len(inputs)))


def _rows_unlike_a_fresh_heads(target, proposer) -> int:
    """Snapshot rows that differ from what a fresh head cache computes for the same tokens."""
    fresh_target, fresh_head, wrong = ModelRunner(target.model, 1, 256), ModelRunner(proposer.model, 1, 256), 0
    for ids, keys, values in proposer.snapshots:
        n = keys.shape[1]
        if n == 0:
            continue
        t, h = fresh_target.allocate(), fresh_head.allocate()
        _, hidden = fresh_target.forward([t], [ids[:n]], "all", hidden=True)
        fresh_head.forward([h], [ids[1 : n + 1]], "last", features=[hidden])
        fresh_keys, fresh_values = fresh_head._cache.keys(0, h, n), fresh_head._cache.values(0, h, n)
        for p in range(n):
            wrong += not (
                torch.allclose(keys[:, p], fresh_keys[:, p], atol=1e-3, rtol=1e-3)
                and torch.allclose(values[:, p], fresh_values[:, p], atol=1e-3, rtol=1e-3)
            )
        fresh_target.free(t)
        fresh_head.free(h)
    return wrong


@pytest.mark.parametrize("kind, broken", [(CacheSnapshots, False), (IgnoresTheFirstToken, True)])
def test_a_next_turn_keeps_the_head_rows_whose_tokens_it_shares(target, head, registered, kind, broken):
    """Prefix caching with a head: a prompt starts from the head's rows found for it, which the target's found
    prefix bounds (the head needs the target's features past its rows): a turn that continues the last starts
    where the head's rows of it end (all but the last step's positions, whose features it had not read yet); a
    prompt that changes token n keeps the head's rows below n - 1 (row p read token p + 1); one that changes
    only the first token finds its own rows, not those of the prompt it differs from. Outputs are plain
    decoding's either way."""
    registered("snapshot-head", lambda setup: kind.from_setup(setup))
    llm = _llm(target, "snapshot-head:" + head[len("head:") :], max_num_seqs=2)
    plain = LLM(target=target, num_speculative_tokens=0, max_model_len=256, max_num_seqs=2)
    a = list(range(10, 40))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    first = llm.generate([a], params)[0].outputs[0].token_ids
    assert first == plain.generate([a], params)[0].outputs[0].token_ids
    cached = []
    other_start = [a[0] + 1] + a[1:]
    for prompt in (a + first + [5, 6, 7], a[:20] + [50, 51, 52, 53], other_start, other_start + [9, 9, 9]):
        out, alone = llm.generate([prompt], params)[0], plain.generate([prompt], params)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        cached.append((out.metrics.num_cached_prompt_tokens, alone.metrics.num_cached_prompt_tokens))
    wrong = _rows_unlike_a_fresh_heads(target, llm.engine.proposer)
    if broken:
        assert wrong > 0
    else:
        assert len(a) + 15 - 4 <= cached[0][0] < cached[0][1] == len(a) + 15 and cached[1] == (19, 20)
        assert cached[2] == (0, 0) and cached[3] == (len(a) - 1, len(a)) and wrong == 0
    assert len(llm.engine.proposer.snapshots) > 3


def test_a_head_for_another_target_is_refused(head):
    other = tiny_model(seed=1)
    with pytest.raises(SpecDecodeError, match="trained for .* another model"):
        _llm(other, head)
    with pytest.raises(SpecDecodeError, match="not found; train one with `specdecode distill"):
        _llm(other, "head:/nonexistent/head")


def _bfloat16_copy(target):
    """The tiny target built in bfloat16, as the loader builds one (conftest's tiny_model uses seed 0)."""
    model = build_model(target.config, random_hf_weights(target.config, 0), torch.bfloat16, "cpu")
    return dataclasses.replace(target, model=model)


def test_the_target_fingerprint_is_the_same_in_float32_and_bfloat16(target):
    """`--dtype auto` gives a bfloat16 target on CPUs with native bf16 and a float32 one elsewhere: a head
    made for the file must load for both, and still not for another model."""
    as_bf16 = _bfloat16_copy(target).model
    assert as_bf16.norm.weight.dtype == torch.bfloat16
    assert target_fingerprint(as_bf16) == target_fingerprint(target.model)
    assert target_fingerprint(tiny_model(seed=1).model) != target_fingerprint(target.model)


def test_a_head_drafts_for_a_bfloat16_target(target, head):
    """The same head file on the target in bfloat16 (what `--dtype auto` loads on CPUs with native bf16):
    it loads, computes in the target's dtype, and greedy output equals that target's plain decoding."""
    bf16 = _bfloat16_copy(target)
    plain = LLM(target=bf16, num_speculative_tokens=0, max_model_len=256)
    llm = _llm(bf16, head)
    assert llm.engine.proposer.model.fc.weight.dtype == torch.bfloat16
    assert _ids(llm) == _ids(plain)
    assert sum(o.spec["num_draft_tokens"] for o in llm.generate(PROMPTS, GREEDY)) > 0


# ---- the distribution ---------------------------------------------------------------------------------
STAT_PARAMS = dict(
    temperature=1.0, max_tokens=3, repetition_penalty=1.3, presence_penalty=0.7, logit_bias={2: 1.0}, top_k=6
)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    target = tiny_model(seed=7, vocab=8, hidden=32)
    path = make_head(target, tmp_path_factory.mktemp("heads") / "small", intermediate=32)
    prompt, params = [1, 2, 3, 1], SamplingParams(n=16, **STAT_PARAMS)
    return target, path, prompt, params, exact_joint(target, prompt, params)


def test_sampling_with_the_head_follows_the_processed_target(small):
    target, path, prompt, params, joint = small
    counts, accepted = sampled_joint(target, None, prompt, params, samples=4000, speculative_model=path)
    assert 0.05 < accepted < 0.95  # an untrained head: both accepted drafts and rejections are exercised
    assert chi2_pvalue(counts, joint) > PASS_P


def test_sampling_with_the_head_under_a_grammar_follows_the_masked_target(small):
    """Drafting masks the head's distribution by the grammar too, and verification by the target's: the
    emitted outputs follow the grammar-masked, penalised target."""
    from specdecode.sampling import StructuredOutput

    target, path, _, _, _ = small
    params = SamplingParams(
        n=16,
        temperature=1.0,
        max_tokens=4,
        presence_penalty=0.5,
        structured_output=StructuredOutput(regex='[!"#]{1,2}[$%&]'),
    )
    joint = exact_joint(target, [1, 2, 3], params)
    counts, accepted = sampled_joint(target, None, [1, 2, 3], params, samples=6000, speculative_model=path)
    assert accepted > 0.05
    assert chi2_pvalue(counts, joint) > PASS_P


def test_a_head_that_misstates_its_probabilities_fails_the_distribution_test(small, registered):
    """Broken: the tokens are drawn from the head's q, but verification is told q is uniform. (Returning
    no q at all is not a broken variant: verifying a draft as one-hot is exact for any way of choosing
    it, and only lowers acceptance.)"""

    class UniformQ(DraftHeadProposer):
        def propose(self, seqs, ks, feedback=None):
            drafts = super().propose(seqs, ks, feedback)
            return DraftBatch(
                drafts.tokens, [None if q is None else torch.full_like(q, 1 / q.shape[-1]) for q in drafts.probs]
            )

    target, path, prompt, params, joint = small
    registered("uniform-q-head", lambda setup: UniformQ.from_setup(setup))
    counts, _ = sampled_joint(
        target, None, prompt, params, samples=4000, speculative_model="uniform-q-head:" + path[len("head:") :]
    )
    assert chi2_pvalue(counts, joint) < 1e-6


# ---- distill --------------------------------------------------------------------------------------------
# targets of the families beyond Qwen2's: Gemma 3's layers (a window narrower than the prompts, sandwich norms,
# GeGLU, q/k norms, a RoPE base per kind of layer) and a mixture of experts
FAMILY_TARGETS = {
    "gemma3": dict(
        arch="gemma3",
        qk_norm=True,
        activation="gelu_tanh",
        sandwich_norms=True,
        embedding_scale=8.0,
        sliding_window=8,
        sliding_layers=(0,),
        local_rope_theta=1e6,
    ),
    "mixtral": dict(arch="mixtral", num_experts=4, experts_per_token=2),
}


@pytest.mark.parametrize("family", list(FAMILY_TARGETS))
def test_distill_trains_a_head_for_other_families(family, tmp_path, monkeypatch):
    """(A tiny mixture of experts continues less predictably than the dense targets: a smaller margin.)"""
    _trains_a_head(tiny_model(seed=3, **FAMILY_TARGETS[family]), tmp_path, monkeypatch, torch.float32, margin=0.05)


@pytest.mark.parametrize("precision", [torch.float32, torch.bfloat16])
def test_distill_trains_a_head_that_drafts_what_the_target_says(target, tmp_path, monkeypatch, precision):
    """Trained on the target's own continuations of some prompts, the head's drafts are accepted far more
    often than an untrained head's on the continuation of a prompt it never saw; in both training
    precisions, whichever this CPU would choose (bf16 autocast where bf16 is native)."""
    _trains_a_head(target, tmp_path, monkeypatch, precision)


def _trains_a_head(target, tmp_path, monkeypatch, precision, margin: float = 0.15):
    from specdecode.distill import train

    monkeypatch.setattr(train, "resolve_dtype", lambda dtype, device: precision)
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    plain = LLM(target=target, num_speculative_tokens=0, max_model_len=256)
    outs = plain.generate(
        [[i, i + 1, (3 * i) % 60] for i in range(1, 49)], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    )
    text = tmp_path / "own.jsonl"
    text.write_text(
        "".join(
            json.dumps({"text": target.tokenizer.decode(o.prompt_token_ids + o.outputs[0].token_ids)}) + "\n"
            for o in outs
        )
    )
    out = tmp_path / "trained"
    recipe = Recipe(
        sources=[f"jsonl:{text}"],
        tokens=4000,
        chunk=48,
        draft_vocab_size=48,
        intermediate_size=64,
        steps=150,
        batch=8,
        lr=3e-3,
    )
    summary = distill(target, str(out), recipe, progress=False)
    assert summary["held_out_top1_per_round"][0] > 0.1  # chance: about 1 in 48
    unseen = [[50, 51, 27]]
    trained, untrained = (
        _llm(target, h, k=4).generate(unseen, GREEDY)[0].spec["acceptance_rate"]
        for h in (f"head:{out}", make_head(target, tmp_path / "untrained"))
    )
    assert trained > untrained + margin, (trained, untrained)


def test_distill_trains_on_from_a_given_head_and_refuses_one_for_another_target(target, tmp_path, monkeypatch):
    """`--init HEAD`: training starts from that head's weights and draft vocabulary (with a zero learning
    rate the result is the same head, whatever the recipe's own vocabulary size); a head made for another
    target is refused."""
    from specdecode.models.draft_head import read_head

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    text = tmp_path / "text.jsonl"
    text.write_text(
        "".join(json.dumps({"text": "".join(chr(40 + (i * j) % 50) for j in range(300))}) + "\n" for i in range(1, 9))
    )
    recipe = Recipe(
        sources=[f"jsonl:{text}"],
        tokens=2000,
        chunk=48,
        draft_vocab_size=32,
        intermediate_size=64,
        steps=3,
        batch=2,
        minutes=0,
    )
    first = tmp_path / "first"
    distill(target, str(first), recipe, progress=False)
    again = tmp_path / "again"
    distill(
        target, str(again), dataclasses.replace(recipe, init=str(first), lr=0.0, draft_vocab_size=48), progress=False
    )
    (_, before), (spec, after) = read_head(str(first)), read_head(str(again))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert spec.recipe["init"] == str(first) and spec.intermediate_size == 64
    other = tiny_model(seed=1)
    with pytest.raises(SpecDecodeError, match="another model"):
        distill(other, str(tmp_path / "other"), dataclasses.replace(recipe, init=str(first)), progress=False)


# ---- training-time test -----------------------------------------------------------------------------
def _drafting_rounds(head, features, ids, p, rounds):
    """What drafting computes: the head's cache filled from the target's features at positions 0..p, then
    `rounds` - 1 rounds each reading the previous round's estimate beside the next token (teacher-forced)."""
    runner = ModelRunner(head, 1, 64)
    slot = runner.allocate()
    logits, estimate = runner.forward([slot], [ids[1 : p + 2]], "last", hidden=True, features=[features[: p + 1]])
    out = [logits[-1]]
    for r in range(1, rounds):
        runner.commit(slot, p + r)
        logits, estimate = runner.forward([slot], [[ids[p + r + 1]]], "last", hidden=True, features=[estimate[-1:]])
        out.append(logits[-1])
    return out


@pytest.mark.parametrize("broken", [False, True])
def test_training_unrolls_the_rounds_as_drafting_computes_them(target, monkeypatch, broken):
    """Round r of the unrolled training forward at position p + r equals drafting's round r after the
    target's features up to p; a version that lets later rounds attend causally to every earlier
    round-0 row (keys drafting never has) fails."""
    import specdecode.models.draft_head as draft_head

    if broken:
        monkeypatch.setattr(
            draft_head,
            "_unrolled_mask",
            lambda step, width, device: torch.cat(
                [torch.ones(width, width, dtype=torch.bool, device=device).tril()]
                + [torch.eye(width, dtype=torch.bool, device=device)] * step,
                1,
            ),
        )
    torch.manual_seed(3)
    spec = HeadSpec(target.name, target_fingerprint(target.model), 48, target.config.vocab_size)
    head = build_head(spec, None, target.model, torch.arange(target.config.vocab_size))
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad and p.dim() == 2 and p.shape[0] != target.config.vocab_size:
                p.add_(torch.randn_like(p) * 0.2)  # far from the near-identity start, so rounds differ
    ids = list(range(3, 30))
    runner = ModelRunner(target.model, 1, 64)
    _, hidden = runner.forward([runner.allocate()], [ids], "all", hidden="all")
    with torch.no_grad():
        unrolled = head.unrolled(torch.tensor([ids[1:]], device=hidden.device), hidden[None, :-1].float(), 3)
    worst = 0.0
    for p in (0, 5, 17):
        for r, logits in enumerate(_drafting_rounds(head, hidden, ids, p, 3)):
            worst = max(worst, float((unrolled[r][0][p + r] - logits).abs().max()))
    assert (worst > 1e-3) if broken else (worst < 1e-4), worst


def test_the_head_keeps_its_cache_in_the_engines_kv_cache_dtype(target, head):
    from specdecode.executor.kernels import load

    lib = load("attention")
    if target.model.device.type != "cpu" or lib is None or not lib.attention_half_ok():
        pytest.skip("the float16 cache needs the CPU attention kernel with float16 support")
    for kv_cache_dtype, expected in (("float32", torch.float32), ("auto", torch.float16)):
        llm = _llm(target, head, kv_cache_dtype=kv_cache_dtype)
        assert llm.engine.proposer.runner._cache.k[0].dtype == expected


def _jsonl_text(tmp_path):
    """A distill source of 39 lines of 300 characters (`jsonl:FILE`)."""
    text = tmp_path / "text.jsonl"
    text.write_text(
        "".join(json.dumps({"text": "".join(chr(33 + (i * j) % 60) for j in range(300))}) + "\n" for i in range(1, 40))
    )
    return f"jsonl:{text}"


class _ForwardCounter:
    """Counts the recording's target forwards; with `limit` set, the forward after that many is
    interrupted (as a killed run would be)."""

    def __init__(self, monkeypatch, runner_class):
        self.calls, self.limit, forward = 0, None, runner_class.forward

        def counted(runner, *args, **kwargs):
            if self.calls == self.limit:
                raise KeyboardInterrupt
            self.calls += 1
            return forward(runner, *args, **kwargs)

        monkeypatch.setattr(runner_class, "forward", counted)


def test_an_interrupted_recording_resumes_where_its_last_shard_ends(target, tmp_path, monkeypatch):
    """Killed after 20 of 30 chunks, a rerun reads the two saved shards (16 chunks), records only the 14
    after them, and returns what one uninterrupted recording returns."""
    from specdecode.distill import data

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    source = _jsonl_text(tmp_path)
    forwards = _ForwardCounter(monkeypatch, data.ModelRunner)
    forwards.limit = 20
    with pytest.raises(KeyboardInterrupt):
        data.collect_features(target, [source], 32, 30 * 32, progress=False)
    forwards.calls, forwards.limit = 0, None
    resumed = data.collect_features(target, [source], 32, 30 * 32, progress=False)
    assert forwards.calls == 30 - 16
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "fresh"))
    whole = data.collect_features(target, [source], 32, 30 * 32, progress=False)
    assert len(whole) == 30 and all(
        torch.equal(getattr(resumed, f), getattr(whole, f)) for f in ("tokens", "hidden", "choice")
    )


def test_a_recording_past_its_deadline_stops_at_a_shard_and_a_later_run_carries_on(target, tmp_path, monkeypatch):
    """With its deadline already past, a recording of 30 chunks ends after its first shard (8) and says it
    planned 30; a run without a deadline then records only the 22 after them, and returns what one
    uninterrupted recording returns."""
    from specdecode.distill import data

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    source = _jsonl_text(tmp_path)
    forwards = _ForwardCounter(monkeypatch, data.ModelRunner)
    cut = data.collect_features(target, [source], 32, 30 * 32, progress=False, deadline=time.time() - 1)
    assert (len(cut), cut.planned, forwards.calls) == (8, 30, 8)
    forwards.calls = 0
    carried_on = data.collect_features(target, [source], 32, 30 * 32, progress=False)
    assert (len(carried_on), carried_on.planned, forwards.calls) == (30, None, 22)
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "fresh"))
    whole = data.collect_features(target, [source], 32, 30 * 32, progress=False)
    assert all(torch.equal(getattr(carried_on, f), getattr(whole, f)) for f in ("tokens", "hidden", "choice"))
    assert all(torch.equal(getattr(cut, f), getattr(whole, f)[:8]) for f in ("tokens", "hidden", "choice"))


def test_a_recording_in_batches_of_chunks_equals_one_chunk_a_forward(target, tmp_path, monkeypatch):
    """Where the target records several chunks a forward (a GPU), 30 chunks take 8 forwards of at most 4
    (shards of 8) and give what one chunk a forward gives, row for row."""
    from specdecode.distill import data

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "one"))
    source = _jsonl_text(tmp_path)
    one = data.collect_features(target, [source], 32, 30 * 32, progress=False)
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "four"))
    monkeypatch.setattr(data, "RECORD_BATCH", {target.model.device.type: 4})
    forwards = _ForwardCounter(monkeypatch, data.ModelRunner)
    four = data.collect_features(target, [source], 32, 30 * 32, progress=False)
    assert forwards.calls == 8
    assert torch.equal(one.tokens, four.tokens) and torch.equal(one.choice, four.choice)
    torch.testing.assert_close(one.hidden, four.hidden, rtol=1e-2, atol=1e-2)  # bf16 rows


def test_the_default_recipe_is_the_devices_and_given_options_override_it():
    from specdecode.distill.recipe import GPU_RECIPE, recipe_for

    assert recipe_for("cpu", tokens=None) == Recipe()
    on_gpu = recipe_for("cuda", steps=None, lr=2e-3)
    assert (on_gpu.tokens, on_gpu.batch, on_gpu.sources, on_gpu.lr) == (
        GPU_RECIPE["tokens"],
        GPU_RECIPE["batch"],
        GPU_RECIPE["sources"],
        2e-3,
    )
    assert on_gpu.steps == GPU_RECIPE["steps"] and on_gpu.chunk == Recipe().chunk


def test_python_sources_read_about_the_budget_in_a_fixed_order():
    from specdecode.bench.datasets import python_sources

    small, larger = python_sources(200_000), python_sources(600_000)
    assert 200_000 <= sum(map(len, small)) < 200_000 + 200_000  # stops at the first file past the budget
    assert larger[: len(small)] == small  # a larger budget reads more of the same order
    assert all(len(text.encode()) >= 1_000 for text in larger)  # too short for a chunk: left out


def test_another_python_sample_reads_other_files_and_the_first_sample_stays():
    """`python:N` orders the files by another hash: a budget reads mostly other files; `python` and
    `python:0` read the same files as ever; a malformed name says what to write."""
    from specdecode.bench.datasets import python_sample, python_sources
    from specdecode.distill.data import source_texts

    first, again, other = python_sources(300_000), python_sources(300_000, sample=0), python_sources(300_000, sample=1)
    assert first == again and len(set(first) & set(other)) < len(first) / 2
    assert source_texts("python:1", 300_000 // 5) == other and python_sample("python") == 0
    for bad in ("python:", "python:x", "pythons"):
        with pytest.raises(SpecDecodeError, match="python:N"):
            python_sample(bad)


def test_training_shortens_its_schedule_to_end_by_its_deadline():
    """A run whose remaining steps would end past its deadline takes as many as the measured pace allows
    (never fewer than it has taken); one with time to spare takes all of its steps."""
    from specdecode.distill.train import Run, fit

    run = Run(100, 1, 0.1, 1, 0, "test", deadline=1020.5)
    run.shorten(10, 1.0, 1000.0)
    assert run.steps == 30
    run.shorten(10, 1.0, 2000.0)
    assert run.steps == 10
    model = torch.nn.Linear(2, 1)

    def batch_loss(pick):
        return model(torch.ones(len(pick), 2)).square().mean(), {}

    past = Run(100, 2, 0.1, 1, 0, "test", deadline=time.time() - 1)
    log = fit(model, batch_loss, 4, past, progress=False)
    assert len(log) == past.steps == 4  # the pace is known after 3 steps past the first
    unhurried = Run(6, 2, 0.1, 1, 0, "test", deadline=time.time() + 3600)
    assert len(fit(model, batch_loss, 4, unhurried, progress=False)) == 6


def test_a_distill_run_past_its_budget_trains_on_what_it_recorded(target, tmp_path, monkeypatch):
    """With no time at all, distill records one shard, trains the steps the measured pace allows, and still
    writes a head that loads; the summary says how much text and how many steps it used."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    recipe = Recipe(
        sources=[_jsonl_text(tmp_path)],
        tokens=30 * 32,
        chunk=32,
        draft_vocab_size=48,
        intermediate_size=32,
        steps=300,
        batch=2,
        minutes=1e-6,
    )
    summary = distill(target, str(tmp_path / "hurried"), recipe, progress=False)
    assert summary["train_tokens"] == 7 * 32  # 8 chunks recorded, one held out
    assert summary["steps"] == 4
    _llm(target, f"head:{tmp_path / 'hurried'}").generate([[1, 2, 3]], GREEDY)


def test_completions_are_the_targets_greedy_continuations_laid_end_to_end_and_kept(target, tmp_path, monkeypatch):
    """`completions:jsonl:FILE`: each prompt followed by what the engine decodes for it greedily, shortest
    prompts first, cut into chunks; a second recording reads the kept completions instead of generating."""
    from specdecode.distill import completions, data

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(completions.BATCH, "cpu", 3)  # several batches of mixed lengths
    prompts = ["".join(chr(33 + (7 * i + 3 * j) % 60) for j in range(15 - i)) for i in range(10)]
    file = tmp_path / "prompts.jsonl"
    file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    params = SamplingParams(temperature=0, max_tokens=12)
    engine = LLM(target=target, num_speculative_tokens=0, max_num_seqs=8, max_model_len=64)
    outputs = [
        target.tokenizer.encode(p) + o.outputs[0].token_ids for p, o in zip(prompts, engine.generate(prompts, params))
    ]
    expected = [
        t for p, ids in sorted(zip(prompts, outputs), key=lambda po: len(target.tokenizer.encode(po[0]))) for t in ids
    ]
    assert len(expected) > 4 * 16

    def recorded():
        return data.collect_features(target, [f"completions:jsonl:{file}"], 16, 10_000, False, (10, 12))

    first = recorded()
    assert first.tokens.flatten().tolist() == expected[: len(first) * 16] and len(first) == len(expected) // 16
    monkeypatch.setattr(completions, "_generate_stream", lambda *a: pytest.fail("generated again"))
    os.remove(data._cache_path(target, [f"completions:jsonl:{file}"], 16, 10_000, [10, 12]))  # features only
    assert torch.equal(recorded().tokens, first.tokens)


def test_padded_greedy_completions_equal_the_engines_and_end_at_eos(target, monkeypatch):
    """Decoded together in padded calls, prompts of different lengths continue as each does alone in the
    engine, and a completion ends with its EOS while the others go on."""
    from specdecode.distill.completions import greedy_completions

    prompts = [list(range(3, 3 + n)) for n in (2, 9, 5, 17)]
    engine = LLM(target=target, num_speculative_tokens=0, max_num_seqs=1, max_model_len=64)
    alone = [o.outputs[0].token_ids for o in engine.generate(prompts, SamplingParams(temperature=0, max_tokens=10))]
    assert greedy_completions(target, prompts, 10) == alone
    eos = alone[2][3]  # the third prompt's fourth token, made an EOS: that completion stops there
    monkeypatch.setattr(target.tokenizer, "eos_token_ids", frozenset({eos}))
    cut = greedy_completions(target, prompts, 10)
    assert cut[2] == alone[2][: alone[2].index(eos) + 1]
    assert all(c == a[: a.index(eos) + 1] if eos in a else c == a for c, a in zip(cut, alone))


@pytest.mark.parametrize("generate", ["_padded_batches", "_engine_stream"])
def test_completions_start_no_prompt_past_their_deadline(target, monkeypatch, generate):
    """Both ways of decoding completions (padded batches on a GPU, the engine's packed steps on a CPU)
    finish the prompts they started and start none after the deadline; without one they complete all."""
    from tqdm import tqdm

    from specdecode.distill import completions
    from specdecode.engine.engine import Engine

    monkeypatch.setitem(completions.BATCH, "cpu", 2)
    now = [0.0]  # a clock that each padded batch and each engine step moves on by one second
    monkeypatch.setattr(completions.time, "time", lambda: now[0])
    decode, step = completions.greedy_completions, Engine.step
    monkeypatch.setattr(completions, "greedy_completions", lambda *a: now.__setitem__(0, now[0] + 1) or decode(*a))
    monkeypatch.setattr(Engine, "step", lambda self, *a: now.__setitem__(0, now[0] + 1) or step(self, *a))
    ids = [[3 + i, 4 + i, 5] for i in range(5)]
    run = getattr(completions, generate)
    cut = run(target, ids, 6, 0.5, tqdm(disable=True))
    assert len(cut) == 2 and all(cut)  # the first two, started at 0 s, finished
    assert len(run(target, ids, 6, None, tqdm(disable=True))) == 5


def test_stdlib_completion_prompts_end_after_a_docstring():
    from specdecode.distill.completions import stdlib_function_prompts

    prompts = stdlib_function_prompts(20)
    assert len(prompts) == 20 and len(set(prompts)) == 20
    for p in prompts:
        assert p.lstrip().startswith("def ") and p.rstrip().endswith(('"""', "'''")), p


def test_a_head_holds_no_copy_of_its_targets_weights():
    """The head copies its target's rotary tables; once the target's tensors are views into one arena of all its
    weights (huge pages), a deep copy of such a view would bring the whole arena along."""
    target = tiny_model(seed=3)
    weights = torch.zeros(1 << 22)  # 16 MB: the arena the target's tensors view
    at = 0
    for name, t in list(target.model.rotary.named_buffers()):
        view = weights[at : at + t.numel()].view(t.shape)
        view.copy_(t)
        target.model.rotary._buffers[name] = view
        at += t.numel()
    spec = HeadSpec(target.name, target_fingerprint(target.model), 48, target.config.vocab_size)
    head = build_head(spec, None, target.model, torch.arange(target.config.vocab_size))
    for name, t in head.rotary.named_buffers():
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), name
        assert torch.equal(t, target.model.rotary.get_buffer(name))


def test_a_head_moves_to_huge_pages_only_what_it_owns():
    """What the head shares with its target (the final norm) views the target's arena of weights; the head's own
    move must leave it there, and take everything else it holds."""
    target = tiny_model(seed=3)
    spec = HeadSpec(target.name, target_fingerprint(target.model), 48, target.config.vocab_size)
    head = build_head(spec, None, target.model, torch.arange(target.config.vocab_size))
    own = head.own_modules()
    storages = lambda module: {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())}  # noqa: E731
    assert not storages(own) & storages(target.model)
    assert storages(head) - storages(target.model) == storages(own)
