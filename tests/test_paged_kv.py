"""The KV cache in blocks: block accounting under random admits, aborts, rollbacks, commits and finishes (no
block leaked or held twice; a version that forgets to return them fails), memory that follows the tokens
held, long prompts prefilled in chunks with the bits of one call, kept contexts giving their blocks back, and
a context that defaults to the model's."""
from __future__ import annotations

import random

import pytest
import torch
from conftest import tiny_model

from specdecode import LLM, SamplingParams
from specdecode.executor import runner as runner_module
from specdecode.executor.attention import attach_attention_kernel
from specdecode.executor.runner import ModelRunner
from specdecode.kv_cache import KVCache

STEPS = 1000


def _holdings_are_consistent(runner: ModelRunner) -> None:
    cache = runner._cache
    held = [b for table in cache.tables for b in table]
    assert len(held) == len(set(held)), "a block held twice"
    assert set(held).isdisjoint(cache._free_blocks), "a block both held and free"
    assert len(held) + len(cache._free_blocks) == cache.num_blocks, "a block leaked"
    for slot, table in enumerate(cache.tables):  # a slot holds what its written tokens need, no more
        assert len(table) == -(-runner._written[slot] // cache.block_size) or slot in runner._kept
        assert torch.equal(cache.table[slot, :len(table)], torch.tensor(table, dtype=torch.int32))


def _random_operations(runner: ModelRunner, seed: int) -> None:
    """STEPS random admits (with a kept prefix or not), forwards of 1-40 tokens, commits, rollbacks, copies and
    frees, the accounting checked after each."""
    rng = random.Random(seed)
    live: list[int] = []
    for _ in range(STEPS):
        op = rng.choice(["admit", "forward", "forward", "commit", "rollback", "copy", "free"])
        if op == "admit" and runner.num_free:
            tokens = [rng.randrange(60) for _ in range(rng.randrange(1, 80))]
            live.append(runner.allocate(tokens if rng.random() < 0.5 else None, rng.choice(["a", "b"])))
        elif op == "forward" and live:
            slot = rng.choice(live)
            n = min(rng.randrange(1, 40), runner.max_len - runner.length(slot))
            if n > 0 and runner._cache.num_free_blocks + len(runner._kept) * 4 > 3:
                try:
                    runner.forward([slot], [[rng.randrange(60) for _ in range(n)]], "last")
                except Exception as e:  # the pool can run out: the engine's admission prevents that, not this
                    assert "out of blocks" in str(e)
        elif op == "commit" and live:
            slot = rng.choice(live)
            runner.commit(slot, rng.randint(runner.length(slot), runner._written[slot]))
        elif op == "rollback" and live:
            slot = rng.choice(live)
            runner.rollback(slot, rng.randint(0, runner.length(slot)))
        elif op == "copy" and live and runner.num_free:
            dest = runner.allocate()
            try:
                runner.copy_slot(rng.choice(live), dest)
                live.append(dest)
            except Exception as e:
                assert "out of blocks" in str(e)
                runner.free(dest)
        elif op == "free" and live:
            runner.free(live.pop(rng.randrange(len(live))))
        _holdings_are_consistent(runner)


@pytest.mark.parametrize("reuse_prefixes", [False, True])
def test_block_accounting_survives_a_thousand_random_operations(reuse_prefixes):
    runner = ModelRunner(tiny_model(seed=0).model, 6, 256, reuse_prefixes=reuse_prefixes, num_blocks=12)
    _random_operations(runner, seed=int(reuse_prefixes))


def test_a_cache_that_forgets_to_return_blocks_fails_the_accounting(monkeypatch):
    """The check above can fail: a truncate that keeps its blocks' places in the table but never frees them."""
    original = KVCache.truncate

    def leaky(self, slot, length):
        before = list(self.tables[slot])
        original(self, slot, length)
        for block in before[len(self.tables[slot]):]:
            self._free_blocks.remove(block)  # taken back from the pool: lost

    monkeypatch.setattr(KVCache, "truncate", leaky)
    runner = ModelRunner(tiny_model(seed=0).model, 6, 256, num_blocks=12)
    with pytest.raises(AssertionError, match="leaked"):
        _random_operations(runner, seed=0)


def test_memory_follows_the_tokens_held():
    """A 200-token sequence in a cache whose context is 32k tokens holds four blocks of 64, and gives them back."""
    model = tiny_model(seed=0).model
    runner = ModelRunner(model, 4, 32768)
    assert runner.num_blocks == 4 * 32768 // runner.block_size
    slot = runner.allocate()
    runner.forward([slot], [list(range(1, 61)) * 3 + list(range(20))], "last")
    runner.commit(slot, 200)
    assert runner.blocks_in_use() == 4
    runner.rollback(slot, 100)
    assert runner.blocks_in_use() == 2
    runner.free(slot)
    assert runner.blocks_in_use() == 0 and runner._cache.num_free_blocks == runner.num_blocks


def test_kept_contexts_give_their_blocks_back_oldest_first():
    runner = ModelRunner(tiny_model(seed=0).model, 3, 256, reuse_prefixes=True, num_blocks=4)
    first, second = runner.allocate(), runner.allocate()
    for slot, tokens in ((first, list(range(1, 60)) * 2), (second, list(range(2, 61)))):
        runner.forward([slot], [tokens], "last")
        runner.commit(slot, len(tokens))
        runner.free(slot)  # kept: the first two blocks, the second one
    assert runner._cache.num_free_blocks == 1 and runner.cached_prefix(list(range(2, 61)) + [5]) == 59
    third = runner.allocate()
    runner.forward([third], [list(range(3, 50)) * 2], "last")  # 94 tokens: two blocks, the oldest kept ones
    assert runner.cached_prefix(list(range(1, 60)) * 2 + [5]) == 0  # the first context gave its blocks
    assert runner.cached_prefix(list(range(2, 61)) + [5]) == 59  # the second kept its own


def _with_kernel():
    model = tiny_model(seed=0, hidden=64).model
    assert attach_attention_kernel(model)
    return model


def test_a_long_prompt_prefilled_in_chunks_gives_the_bits_of_one_call(monkeypatch):
    model = _with_kernel()
    prompt = [(7 * i + 3) % 60 + 1 for i in range(300)]

    def logits_and_keys(chunk: int):
        monkeypatch.setattr(runner_module, "PREFILL_CHUNK", chunk)
        runner = ModelRunner(model, 1, 512)
        slot = runner.allocate()
        logits, hidden = runner.forward([slot], [prompt], "all", hidden="all")
        return logits, hidden, runner._cache.keys(1, slot, 300)

    whole = logits_and_keys(4096)
    for got, expected in zip(logits_and_keys(96), whole):  # three full chunks and a part
        assert torch.equal(got, expected)


def test_the_context_defaults_to_the_models():
    target = tiny_model(seed=0)
    llm = LLM(target=target, num_speculative_tokens=0)
    assert llm.engine.max_model_len == target.config.max_position
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4
