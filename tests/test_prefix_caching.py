"""Prefix caching: computed blocks are found again by their tokens, and a prompt of the same tenant that starts
with them computes only the rest; running sequences share a common prefix's blocks; the answer is the one
computed whole, one tenant never starts from another's blocks, and what is found follows every commit and
rollback."""

import pytest
import torch
from conftest import DEVICE, ByteTokenizer, random_hf_weights, tiny_config

from specdecode import LLM, SamplingParams, prefix_index
from specdecode.engine.engine import Engine
from specdecode.errors import SpecDecodeError
from specdecode.executor.runner import ModelRunner
from specdecode.kv_cache import KVCache
from specdecode.models.loader import LoadedModel
from specdecode.models.runtime import build_model
from specdecode.proposers.draft_model import DraftModelProposer

A = list(range(5, 25))


def full_logits(model, tokens: list[int]) -> torch.Tensor:
    runner = ModelRunner(model, 1, 256)
    return runner.forward([runner.allocate()], [tokens], "all")


def kept(runner: ModelRunner, tokens: list[int], scope: str = "t") -> int:
    """Run tokens in a fresh slot, commit them, free the slot; its index."""
    slot = runner.allocate(tokens, scope)
    runner.forward([slot], [tokens[runner.length(slot) :]], "last")
    runner.commit(slot, len(tokens))
    runner.free(slot)
    return slot


def test_a_finished_sequence_gives_its_prefix_to_the_next_prompt_of_its_scope(target):
    runner = ModelRunner(target.model, 3, 64, reuse_prefixes=True)
    kept(runner, A)
    longer = A + [30, 31, 32]
    again = runner.allocate(longer, "t")
    assert runner.length(again) == len(A)
    logits = runner.forward([again], [longer[len(A) :]], "all")
    torch.testing.assert_close(logits, full_logits(target.model, longer)[len(A) :], rtol=0, atol=1e-5)
    runner.commit(again, len(longer))
    runner.free(again)
    same = runner.allocate(A, "t")  # the whole prompt is cached: its last token is computed again, for its logits
    assert runner.length(same) == len(A) - 1
    runner.free(same)
    other = runner.allocate(longer, "u")  # another tenant: nothing found
    assert runner.length(other) == 0
    assert runner.cached_prefix(longer, "t") == len(longer) - 1  # both turns stay findable


def test_the_found_tokens_follow_rollbacks_and_timing_slots(target):
    runner = ModelRunner(target.model, 2, 64, reuse_prefixes=True)
    slot = runner.allocate(A, "t")
    runner.forward([slot], [A + [40, 41]], "all")  # a draft of two tokens after A...
    runner.commit(slot, len(A) + 2)
    runner.rollback(slot, len(A))  # ...rejected, and another token in its place
    runner.forward([slot], [[50]], "last")
    runner.commit(slot, len(A) + 1)
    runner.free(slot)
    assert runner.cached_prefix(A + [40, 41, 1], "t") == len(A)
    assert runner.cached_prefix(A + [50, 1], "t") == len(A) + 1
    timing = runner.allocate()
    runner.assume_cached(timing, 30)  # positions that hold no known token
    runner.free(timing)
    assert runner.cached_prefix([-1] * 10 + [1], "t") == 0
    runner.forget_prefixes()
    assert runner.cached_prefix(A + [50, 1], "t") == 0
    plain = ModelRunner(target.model, 2, 64)  # reuse off: nothing is found
    kept(plain, A)
    assert plain.cached_prefix(A + [1], "t") == 0 and plain.length(plain.allocate(A + [1], "t")) == 0


def test_running_sequences_share_the_full_blocks_of_a_common_prefix(target):
    """A second prompt with a committed sequence's first 150 tokens holds its two full blocks by reference (one
    copy in memory) and continues from a copy of nothing else; each computes what a whole prefill does, and
    a rollback into a shared block leaves the other's entries alone."""
    runner = ModelRunner(target.model, 3, 256, reuse_prefixes=True)
    common = [(5 * i + i // 12) % 60 + 2 for i in range(150)]
    first = runner.allocate(common + [7], "t")
    runner.forward([first], [common + [7]], "last")
    runner.commit(first, 151)
    second = runner.allocate(common + [8, 9], "t")
    assert runner.length(second) == 128 and runner.blocks_in_use() == 3 + 2 - 2
    logits = runner.forward([second], [(common + [8, 9])[128:]], "all")
    torch.testing.assert_close(logits, full_logits(target.model, common + [8, 9])[128:], rtol=0, atol=1e-5)
    runner.commit(second, 152)
    runner.rollback(second, 100)  # into the second shared block: a copy of it is the second's own now
    runner.forward([second], [[60] * 10], "last")
    runner.commit(second, 110)
    keys = runner._cache.keys(0, first, 151)
    fresh = ModelRunner(target.model, 1, 256)
    fresh.forward([0], [common + [7]], "last")
    torch.testing.assert_close(keys, fresh._cache.keys(0, 0, 151), rtol=0, atol=1e-5)


def second_turn(target, draft, monkeypatch=None, **options) -> tuple[list, list, int, int]:
    """A chat's second turn after its first on one engine: (tokens, logprobs, prompt tokens the target
    found cached, prompt tokens the draft found cached)."""
    llm = LLM(
        target=target,
        draft=draft,
        num_speculative_tokens=3,
        max_model_len=256,
        max_num_seqs=2,
        speculation_policy="fixed",
        **options,
    )
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    first = llm.generate([A], params)[0].outputs[0].token_ids
    draft_found = []
    allocate = llm.engine.proposer.runner.allocate

    def spy(tokens=None, scope=""):
        slot = allocate(tokens, scope)
        draft_found.append(llm.engine.proposer.runner.length(slot))
        return slot

    if monkeypatch is not None:
        monkeypatch.setattr(llm.engine.proposer.runner, "allocate", spy)
    out = llm.generate([A + first + [7, 8, 9]], params)[0]
    return (
        out.outputs[0].token_ids,
        [t.logprob for t in out.outputs[0].logprobs],
        out.metrics.num_cached_prompt_tokens,
        draft_found[0] if draft_found else 0,
    )


def test_a_second_turn_starts_from_the_first_and_answers_as_computed_whole(target, random_draft, monkeypatch):
    tokens, logprobs, target_found, draft_found = second_turn(target, random_draft, monkeypatch)
    # the first turn's prompt and every output token but the last (never fed back) were kept
    assert target_found == len(A) + 11 and draft_found >= len(A)
    whole = second_turn(target, random_draft, prefix_caching=False)
    assert whole[2] == 0 and tokens == whole[0]
    assert max(abs(a - b) for a, b in zip(logprobs, whole[1])) < 1e-4


def test_a_prefix_claimed_one_token_too_long_is_caught(target, random_draft, monkeypatch):
    """The check above sees a cache that reuses one position more than the prompts share."""
    whole = second_turn(target, random_draft, prefix_caching=False)
    true_prefix = prefix_index.common_prefix
    monkeypatch.setattr(prefix_index, "common_prefix", lambda a, b: min(true_prefix(a, b) + 1, len(b)))
    tokens, logprobs, _, _ = second_turn(target, random_draft)
    assert tokens != whole[0] or max(abs(a - b) for a, b in zip(logprobs, whole[1])) >= 1e-4


@pytest.mark.parametrize("same_tenant", [True, False])
def test_tenants_never_start_from_each_others_context(target, same_tenant):
    llm = LLM(target=target, num_speculative_tokens=0, max_model_len=256, max_num_seqs=2)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.engine.add_group(A, params, tenant="alice")
    while llm.engine.has_unfinished():
        llm.engine.step()
    seq = llm.engine.add_group(A + [3, 4], params, tenant="alice" if same_tenant else "bob")[0]
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert seq.metrics.num_cached_prompt_tokens == (len(A) if same_tenant else 0)


def test_common_prefix_equals_the_first_difference():
    rng = torch.Generator().manual_seed(0)
    for _ in range(2000):
        a = tuple(torch.randint(0, 3, (int(torch.randint(0, 40, (), generator=rng)),), generator=rng).tolist())
        tail = tuple(torch.randint(0, 3, (5,), generator=rng).tolist())
        b = a[: int(torch.randint(0, len(a) + 1, (), generator=rng))] + tail
        first_difference = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert prefix_index.common_prefix(a, b) == first_difference


@pytest.fixture(scope="module")
def long_target():
    """The tiny model with a 4k-token context, for prompts of a 2k-token prefix."""
    cfg = tiny_config(max_position=4096)
    return LoadedModel(
        "tiny-4k",
        build_model(cfg, random_hf_weights(cfg, 0), torch.float32, DEVICE),
        ByteTokenizer(cfg.vocab_size),
        cfg,
    )


PREFIX = [(7 * i + i // 9) % 60 + 2 for i in range(2048)]  # 32 blocks


def _run_together(llm, prompts: list[list[int]], tenants: list[str], n: int = 1):
    """Queue every prompt, then step until all finish; (their sequences, the most KV blocks held at once,
    prompt tokens computed in all)."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, n=n)
    seqs = [s for prompt, tenant in zip(prompts, tenants) for s in llm.engine.add_group(prompt, params, tenant=tenant)]
    most = 0
    while llm.engine.has_unfinished():
        llm.engine.step()
        most = max(most, llm.engine.runner.blocks_in_use())
    computed = sum(len(s.prompt_ids) - s.metrics.num_cached_prompt_tokens for s in seqs if s.index == 0)
    return seqs, most, computed


@pytest.mark.parametrize("variant", ["shared", "copied", "off"])
def test_four_requests_with_a_common_2k_prefix_compute_and_store_it_once(long_target, variant, monkeypatch):
    """Four requests whose prompts start with the same 2,048 tokens: the prefix is computed once and held once
    (32 blocks, beside each request's own last block), and the outputs are those computed alone. A cache that
    copies found blocks instead of sharing them fails the count of blocks, one without prefix caching that of
    tokens computed."""
    if variant == "copied":
        monkeypatch.setattr(KVCache, "share", lambda self, slot, blocks: [self.append_copy(slot, b) for b in blocks])
    llm = LLM(
        target=long_target,
        num_speculative_tokens=0,
        max_model_len=4096,
        max_num_seqs=4,
        prefix_caching=variant != "off",
    )
    prompts = [PREFIX + [i + 2] * 10 for i in range(4)]
    seqs, most, computed = _run_together(llm, prompts, ["t"] * 4)
    alone = [
        LLM(target=long_target, num_speculative_tokens=0, max_model_len=4096, prefix_caching=False)
        .generate([p], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
        .outputs[0]
        .token_ids
        for p in prompts[:2]
    ]
    assert [s.output_ids for s in seqs[:2]] == alone
    assert (computed == 2048 + 4 * 10) == (variant != "off")
    assert (most == 32 + 4) == (variant == "shared")


def test_n_samples_share_their_prompts_blocks(long_target):
    llm = LLM(target=long_target, num_speculative_tokens=0, max_model_len=4096, max_num_seqs=4)
    seqs, most, computed = _run_together(llm, [PREFIX + [5]], ["t"], n=4)
    assert len(seqs) == 4 and most == 32 + 4 and computed == 2049


@pytest.mark.parametrize("scoped", [True, False])
def test_two_tenants_running_together_never_share_a_block(long_target, scoped, monkeypatch):
    """Two API keys with the same prompt each compute it; an index that forgot the scope fails."""
    if not scoped:
        monkeypatch.setattr(prefix_index.PrefixIndex, "root", staticmethod(lambda scope: "everyone"))
    llm = LLM(target=long_target, num_speculative_tokens=0, max_model_len=4096, max_num_seqs=4)
    seqs, _, computed = _run_together(llm, [PREFIX + [5], PREFIX + [5]], ["alice", "bob"])
    assert (computed == 2 * 2049) == scoped


def _most_running(engine: Engine) -> int:
    """Step until every request finishes; the most sequences running at once."""
    most = 0
    while engine.has_unfinished():
        engine.step()
        most = max(most, len(engine.running))
    return most


@pytest.mark.parametrize("variant", ["counted once", "counted whole", "in use ignored"])
def test_admission_counts_a_shared_prefix_once_and_never_runs_out(long_target, variant, monkeypatch):
    """A pool of 36 blocks: four requests with a common 2,048-token prefix (33 blocks each, 32 of them shared) run
    together, and a fifth with a prompt of its own waits until they finish, all answering as computed alone.
    Counting each sequence whole runs them one at a time; forgetting the blocks in use admits the fifth beside the
    four, and the pool runs out."""
    if variant == "counted whole":  # every sequence charged its longest length, as if it shared nothing
        monkeypatch.setattr(ModelRunner, "blocks_in_use", lambda self: 0)
        monkeypatch.setattr(ModelRunner, "blocks_held", lambda self, slot: 0)
    if variant == "in use ignored":
        monkeypatch.setattr(ModelRunner, "blocks_in_use", lambda self: 0)
    engine = Engine(ModelRunner(long_target.model, 5, 4096, reuse_prefixes=True, num_blocks=36), long_target.tokenizer)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [PREFIX + [i + 2] * 10 for i in range(4)] + [PREFIX[::-1] + [3] * 10]
    seqs = [engine.add_request(p, params) for p in prompts]
    if variant == "in use ignored":
        with pytest.raises(SpecDecodeError, match="out of blocks"):
            _most_running(engine)
        return
    assert _most_running(engine) == (4 if variant == "counted once" else 1)
    alone = LLM(target=long_target, num_speculative_tokens=0, max_model_len=4096, prefix_caching=False)
    for seq, prompt in zip(seqs[3:], prompts[3:]):
        assert seq.output_ids == alone.generate([prompt], params)[0].outputs[0].token_ids


@pytest.mark.parametrize("drafter_counted", [True, False])
def test_admission_counts_the_drafters_pool_too(long_target, drafter_counted, monkeypatch):
    """The draft model's pool holds each sequence whole (its prefixes not reused here), so the four requests that
    share the target's blocks run one at a time; admission that weighed the target's pool alone runs the
    draft model out of blocks."""
    if not drafter_counted:
        monkeypatch.setattr(DraftModelProposer, "kv_pool", lambda self: None)
    proposer = DraftModelProposer(long_target)
    proposer.reserve(4, 4096, reuse_prefixes=False, num_blocks=36)
    runner = ModelRunner(long_target.model, 4, 4096, reuse_prefixes=True, num_blocks=36)
    engine = Engine(runner, long_target.tokenizer, [proposer], num_speculative_tokens=2)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    seqs = [engine.add_request(PREFIX + [i + 2] * 10, params) for i in range(4)]
    if not drafter_counted:
        with pytest.raises(SpecDecodeError, match="out of blocks"):
            _most_running(engine)
        return
    assert _most_running(engine) == 1 and all(len(s.output_ids) == 6 for s in seqs)
