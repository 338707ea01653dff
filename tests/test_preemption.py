"""Preemption: when the KV cache cannot hold the next step of every running sequence, the newest gives its blocks
back and is recomputed later from its tokens. Its output equals the one computed alone (greedy, with each kind
of proposer, and seeded sampling), no request is lost, and block accounting holds over 1,000 random engine
operations (admit, step, abort, preempt, finish) with no block leaked or held twice, with a draft model and with
a head (whose pool an admission that weighed only the target's ran out). A resume that forgets the output so far
fails the first test; a preemption that leaves a drafter's blocks held fails the second."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch
from conftest import DEVICE, ByteTokenizer, make_head, random_hf_weights, tiny_config
from test_paged_kv import _holdings_are_consistent

from specdecode import LLM, SamplingParams, SpecDecodeError
from specdecode.bench.budgets import llm_holding
from specdecode.engine.sequence import Sequence
from specdecode.models.loader import LoadedModel
from specdecode.models.runtime import build_model
from specdecode.proposers.draft_model import DraftModelProposer

PROMPTS = [[(5 * i + 3 * j) % 60 + 2 for i in range(20)] for j in range(3)]
TOKENS = 400  # past the admission's lookahead (256): two run at once in 12 blocks, then outgrow them
KINDS = ["plain", "draft", "head", "suffix"]


def _model(layers: int) -> LoadedModel:
    """The tiny model with a context of 1,024 tokens."""
    cfg = tiny_config(layers=layers, max_position=1024)
    weights = build_model(cfg, random_hf_weights(cfg, 0), torch.float32, DEVICE)
    return LoadedModel(f"tiny-1k-{layers}", weights, ByteTokenizer(cfg.vocab_size), cfg)


def _options(kind: str, tmp_path) -> dict:
    target = _model(layers=2)
    options = dict(target=target, num_speculative_tokens=3, speculation_policy="fixed", max_model_len=768)
    if kind == "plain":
        options["num_speculative_tokens"] = 0
    elif kind == "draft":
        options["draft"] = _model(layers=1)
    elif kind == "head":
        options["speculative_model"] = make_head(target, tmp_path / "head")
    else:
        options["speculative_model"] = "suffix"
    return options


def _run(llm: LLM, params: SamplingParams) -> tuple[list[Sequence], int]:
    seqs = [llm.engine.add_request(p, params) for p in PROMPTS]
    preempted = 0
    while llm.engine.has_unfinished():
        preempted += llm.engine.step().preempted
    return seqs, preempted


def _resumes_as_alone(options: dict, params: SamplingParams) -> None:
    """Three requests in 12 blocks: at least one is preempted, and every output is the one computed alone."""
    llm = llm_holding(12, **options)
    assert llm.engine.runner.num_blocks == 12
    seqs, preempted = _run(llm, params)
    assert preempted >= 1 and sum(s.metrics.num_preemptions for s in seqs) == preempted
    alone = LLM(**options)
    assert [s.output_ids for s in seqs] == [alone.generate([p], params)[0].outputs[0].token_ids for p in PROMPTS]
    for runner, _ in llm.engine.blocks.pools:
        assert runner.blocks_in_use() == 0


@pytest.mark.parametrize("kind", KINDS)
def test_a_preempted_sequence_resumes_with_the_output_computed_alone(kind, tmp_path):
    _resumes_as_alone(_options(kind, tmp_path), SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True))


def test_seeded_sampling_resumes_with_the_same_draws(tmp_path):
    """Rejection sampling with a draft model: the sequence's own random stream carries over its preemption."""
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=TOKENS, ignore_eos=True)
    _resumes_as_alone(_options("draft", tmp_path), params)


def test_a_resume_that_forgets_the_output_so_far_fails(tmp_path, monkeypatch):
    """The check above can fail: a preempted sequence recomputed from its prompt alone."""
    monkeypatch.setattr(Sequence, "resuming", property(lambda self: False))
    with pytest.raises((AssertionError, ValueError)):
        _resumes_as_alone(
            _options("plain", tmp_path), SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
        )


def _random_engine_operations(llm: LLM, seed: int, steps: int = 1000) -> tuple[list[Sequence], int]:
    """`steps` random operations: requests added (prompts that share prefixes or not, n of 1-2), steps, aborts
    and preemptions of random sequences, the accounting of every pool checked after each; then every request
    runs to its end. Returns the sequences and how many preemptions the steps made (not counting those asked for)."""
    rng, engine, seqs, made = random.Random(seed), llm.engine, [], 0
    prefixes = [[(7 * i + 5 * j) % 60 + 2 for i in range(150)] for j in range(3)]
    for _ in range(steps):
        op = rng.choices(["add", "step", "abort", "preempt"], weights=[6, 28, 1, 1])[0]
        unfinished = [s for s in seqs if not s.finished]
        if op == "add" and len(engine.waiting) < 6:
            prompt = rng.choice(prefixes)[: rng.randrange(1, 150)] + [rng.randrange(2, 60)]
            params = SamplingParams(
                temperature=0, max_tokens=rng.randrange(1, 400), ignore_eos=True, n=rng.choice([1, 2])
            )
            try:
                seqs += engine.add_group(prompt, params, tenant=rng.choice(["a", "b"]))
            except SpecDecodeError as e:  # n x its longest length is more than the pool
                assert "lower max_tokens or n" in str(e)
        elif op == "step" and engine.has_unfinished():
            made += engine.step().preempted
        elif op == "abort" and unfinished:
            engine.abort(rng.choice(unfinished))
        elif op == "preempt" and engine._active():
            engine._preempt(rng.choice(engine._active()))
        for runner, _ in engine.blocks.pools:
            _holdings_are_consistent(runner)
        placed = [*engine.waiting, *engine.running, *(p.seq for p in engine.prefilling)]
        assert sorted(map(id, placed)) == sorted(id(s) for s in seqs if not s.finished), "a request lost or doubled"
    while engine.has_unfinished():
        made += engine.step().preempted
    return seqs, made


def _outputs_are_plain_decodings(llm: LLM, seqs: list[Sequence]) -> None:
    """Each sequence's output is its prompt's greedy decoding by the target alone (an aborted one's, a prefix of it):
    what was preempted, resumed, queued ahead or dropped changed no token. The plain decodings in one batched call."""
    wanted = {(tuple(s.prompt_ids), s.params.max_tokens) for s in seqs}
    plain = LLM(target=llm.target, num_speculative_tokens=0, max_model_len=llm.config.max_model_len, progress=False)
    prompts = sorted(wanted)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in prompts]
    outs = plain.generate([list(p) for p, _ in prompts], params)
    decoded = {prompt: out.outputs[0].token_ids for prompt, out in zip(prompts, outs)}
    for seq in seqs:
        alone = decoded[(tuple(seq.prompt_ids), seq.params.max_tokens)]
        assert seq.output_ids == alone[: len(seq.output_ids)], f"{seq.request_id} decoded otherwise"
        assert seq.finish_reason == "abort" or len(seq.output_ids) == len(alone)


@pytest.mark.parametrize("kind, leaky", [("draft", False), ("head", False), ("draft", True)])
def test_block_accounting_survives_a_thousand_random_engine_operations(kind, leaky, monkeypatch, tmp_path):
    """Every request ends with its max_tokens (or aborted), its tokens the target's own greedy ones, and every pool
    ends with no block held; a preemption that leaves the draft model's slot and blocks held fails."""
    if leaky:  # the draft model forgets the sequence's slot without giving it back
        monkeypatch.setattr(DraftModelProposer, "suspend", lambda self, seq: self._slots.pop(seq.request_id, None))
    llm = llm_holding(16, **{**_options(kind, tmp_path), "max_model_len": 768, "max_num_seqs": 8})
    llm.engine.blocks.lookahead = 16  # admitted on trust soon: the pool runs short often
    with pytest.raises((AssertionError, SpecDecodeError)) if leaky else contextlib.nullcontext():
        seqs, made = _random_engine_operations(llm, seed=3)
        held = [runner.blocks_in_use() for runner, _ in llm.engine.blocks.pools]
        assert held == [0, 0], f"blocks still held after every request ended: {held}"
        assert all(s.finish_reason == "abort" or len(s.output_ids) == s.params.max_tokens for s in seqs)
        assert made > 0, "the pool never ran short: nothing was tested"
        _outputs_are_plain_decodings(llm, seqs)


def test_an_aborted_preempted_sequence_leaves_no_estimates_or_indexes_behind():
    """A request preempted, then aborted while it waits (a client gone under memory pressure): the adaptive policy's
    estimates and the lookup's n-gram index of it go, as at any finish; a server would otherwise keep them for good."""
    llm = LLM(target=_model(layers=1), speculative_model="ngram", num_speculative_tokens=3, max_model_len=256)
    engine = llm.engine
    seq = engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(4):
        engine.step()
    estimator, lookup = engine.policy.estimator, engine.lookup
    assert seq.request_id in estimator.acceptance and seq.request_id in lookup._indexes  # the test can fail
    engine._preempt(seq)
    engine.abort(seq)
    assert seq.request_id not in estimator.acceptance and seq.request_id not in lookup._indexes
