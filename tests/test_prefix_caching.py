"""Prefix caching: a freed slot keeps its context, and a prompt of the same tenant that starts with it
computes only the rest; the answer is the one computed whole, one tenant never starts from another's
context, and the kept tokens follow every commit and rollback."""
import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.executor import runner as runner_module
from specdecode.executor.runner import ModelRunner

A = list(range(5, 25))


def full_logits(model, tokens: list[int]) -> torch.Tensor:
    runner = ModelRunner(model, 1, 64)
    return runner.forward([runner.allocate()], [tokens], "all")


def kept(runner: ModelRunner, tokens: list[int], scope: str = "t") -> int:
    """Run tokens in a fresh slot, commit them, free the slot; its index."""
    slot = runner.allocate(tokens, scope)
    runner.forward([slot], [tokens[runner.length(slot):]], "last")
    runner.commit(slot, len(tokens))
    runner.free(slot)
    return slot


def test_a_freed_slot_gives_its_prefix_to_the_next_prompt_of_its_scope(target):
    runner = ModelRunner(target.model, 3, 64, reuse_prefixes=True)
    slot = kept(runner, A)
    longer = A + [30, 31, 32]
    again = runner.allocate(longer, "t")
    assert again == slot and runner.length(again) == len(A)
    logits = runner.forward([again], [longer[len(A):]], "all")
    torch.testing.assert_close(logits, full_logits(target.model, longer)[len(A):], rtol=0, atol=1e-5)
    runner.commit(again, len(longer))
    runner.free(again)
    same = runner.allocate(A, "t")  # the whole prompt is cached: its last token is computed again, for its logits
    assert same == slot and runner.length(same) == len(A) - 1
    runner.free(same)
    other = runner.allocate(longer, "u")  # another tenant: nothing reused, and the kept slot is spared
    assert runner.length(other) == 0 and other != slot
    assert runner.cached_prefix(longer, "t") == len(A) - 1


def test_the_kept_tokens_follow_rollbacks_and_timing_slots(target):
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
    plain = ModelRunner(target.model, 2, 64)  # reuse off: nothing is kept
    kept(plain, A)
    assert plain.cached_prefix(A + [1], "t") == 0 and plain.length(plain.allocate(A + [1], "t")) == 0


def second_turn(target, draft, monkeypatch=None, **options) -> tuple[list, list, int, int]:
    """A chat's second turn after its first on one engine: (tokens, logprobs, prompt tokens the target
    found cached, prompt tokens the draft found cached)."""
    llm = LLM(target=target, draft=draft, num_speculative_tokens=3, max_model_len=256, max_num_seqs=2,
              speculation_policy="fixed", **options)
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
    return (out.outputs[0].token_ids, [t.logprob for t in out.outputs[0].logprobs],
            out.metrics.num_cached_prompt_tokens, draft_found[0] if draft_found else 0)


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
    true_prefix = runner_module.common_prefix
    monkeypatch.setattr(runner_module, "common_prefix", lambda a, b, limit: min(true_prefix(a, b, limit) + 1, limit))
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
        a = torch.randint(0, 3, (int(torch.randint(0, 40, (), generator=rng)),), generator=rng).tolist()
        b = a[:int(torch.randint(0, len(a) + 1, (), generator=rng))] + torch.randint(0, 3, (5,), generator=rng).tolist()
        limit = int(torch.randint(0, 50, (), generator=rng))
        first_difference = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert runner_module.common_prefix(a, b, limit) == min(first_difference, limit)
