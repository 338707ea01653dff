"""The KV cache in blocks: block accounting under random admits (sharing found prefixes or not), forwards,
commits, rollbacks, copies and finishes (references counted right, no block leaked, a block a slot writes
held by it alone; a version that forgets to return blocks fails, and one that writes into a shared block
fails the check of what each slot holds), memory that follows the tokens held, long prompts prefilled in
chunks with the bits of one call, spare blocks given back least recently released first, and a context that
defaults to the model's."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from conftest import tiny_model

from specdecode import LLM, SamplingParams
from specdecode.executor import runner as runner_module
from specdecode.executor.attention import attach_attention_kernel
from specdecode.executor.runner import ModelRunner
from specdecode.kv_cache import KVCache

STEPS = 1000
PREFIXES = [[(7 * i + 5 * j) % 60 for i in range(150)] for j in range(3)]  # prompts share these, so blocks match


def _holdings_are_consistent(runner: ModelRunner) -> None:
    """The pool's accounting: each block held as often as tables hold it, free or spare or held, never two of them;
    a slot holds what its written tokens need, or a forward queued on the device writes (`queued_end`)."""
    cache = runner._cache
    held = Counter(b for table in cache.tables for b in table)
    spare = list(cache.index._idle)
    assert all(cache.references(b) == held[b] for b in range(cache.num_blocks)), "a reference miscounted"
    assert set(held).isdisjoint(cache._free_blocks) and set(held).isdisjoint(spare), "a block both held and free"
    assert not set(spare) & set(cache._free_blocks), "a spare block also unused"
    assert len(held) + len(cache._free_blocks) + len(spare) == cache.num_blocks, "a block leaked"
    assert all(cache.index.is_registered(b) for b in spare) and not any(
        map(cache.index.is_registered, cache._free_blocks)
    )
    for slot, table in enumerate(cache.tables):
        needed = -(-max(runner._written[slot], runner.queued_end(slot)) // cache.block_size)
        assert len(table) == needed, f"slot {slot} holds {len(table)} blocks where it needs {needed}"
        assert torch.equal(cache.table[slot, : len(table)], torch.tensor(table, dtype=torch.int32))
        length = cache.lengths[slot]
        if length % cache.block_size:  # the block it writes next is its own, and nobody finds it
            mine = table[length // cache.block_size]
            assert cache.references(mine) == 1 and not cache.index.is_registered(mine), "a shared block is written"


def _entries_are_what_their_tokens_compute(runner: ModelRunner, slots: list[int]) -> None:
    """Each slot's committed keys and values equal a fresh computation of its tokens."""
    for slot in slots:
        n = runner.length(slot)
        if n == 0 or -1 in runner._tokens[slot][:n]:
            continue
        fresh = ModelRunner(runner.model, 1, runner.max_len)
        fresh.forward([0], [runner._tokens[slot][:n]], "last")
        for layer in range(runner.cfg.num_layers):
            for got, expected in (
                (runner._cache.keys(layer, slot, n), fresh._cache.keys(layer, 0, n)),
                (runner._cache.values(layer, slot, n), fresh._cache.values(layer, 0, n)),
            ):
                assert torch.allclose(got, expected, atol=1e-4), f"slot {slot} holds entries of other tokens"


def _random_operations(runner: ModelRunner, seed: int, check_entries_every: int = 0) -> None:
    """STEPS random admits (prompts that start with a shared prefix or not), forwards of 1-40 tokens, commits,
    rollbacks, copies and frees, the accounting checked after each (and the entries every so often)."""
    rng = random.Random(seed)
    live: list[int] = []
    for step in range(STEPS):
        op = rng.choice(["admit", "forward", "forward", "commit", "commit", "rollback", "copy", "free"])
        if op == "admit" and runner.num_free:
            tokens = rng.choice(PREFIXES)[: rng.randrange(1, 150)] + [
                rng.randrange(60) for _ in range(rng.randrange(3))
            ]
            slot = runner.allocate(tokens if rng.random() < 0.7 else None, rng.choice(["a", "b"]))
            live.append(slot)
            if rng.random() < 0.7:  # its prompt prefilled past what was found
                try:
                    runner.forward([slot], [tokens[runner.length(slot) :]], "last")
                    runner.commit(slot, len(tokens))
                except Exception as e:
                    assert "out of blocks" in str(e)
        elif op == "forward" and live:
            slot = rng.choice(live)
            n = min(rng.randrange(1, 40), runner.max_len - runner.length(slot))
            known = runner._tokens[slot][: runner.length(slot)]
            following = [p for p in PREFIXES if p[: len(known)] == known]  # keep following a prefix, mostly
            tokens = rng.choice(following)[len(known) : len(known) + n] if following and rng.random() < 0.9 else []
            tokens = tokens or [rng.randrange(60) for _ in range(n)]
            if n > 0:
                try:
                    runner.forward([slot], [tokens], "last")
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
        if check_entries_every and step % check_entries_every == 0:
            _entries_are_what_their_tokens_compute(runner, live)


@pytest.mark.parametrize("reuse_prefixes", [False, True])
def test_block_accounting_survives_a_thousand_random_operations(reuse_prefixes):
    runner = ModelRunner(tiny_model(seed=0).model, 6, 256, reuse_prefixes=reuse_prefixes, num_blocks=12)
    _random_operations(runner, seed=int(reuse_prefixes))


def test_slots_sharing_blocks_hold_what_their_own_tokens_compute():
    runner = ModelRunner(tiny_model(seed=0).model, 6, 256, reuse_prefixes=True, num_blocks=24)
    _random_operations(runner, seed=2, check_entries_every=10)
    assert runner._cache.index._children, "no block was ever found again: the test shared nothing"


def test_a_cache_that_writes_into_a_shared_block_fails_the_checks(monkeypatch):
    """The two checks above can fail: a truncation that leaves the slot writing into a block others hold."""
    monkeypatch.setattr(KVCache, "_own", lambda self, slot, i: None)
    runner = ModelRunner(tiny_model(seed=0).model, 6, 256, reuse_prefixes=True, num_blocks=24)
    with pytest.raises(AssertionError, match="shared block is written|entries of other tokens"):
        _random_operations(runner, seed=2, check_entries_every=10)


def test_a_cache_that_forgets_to_return_blocks_fails_the_accounting(monkeypatch):
    """The check above can fail: a truncate that keeps its blocks' places in the table but never frees them."""
    original = KVCache.truncate

    def leaky(self, slot, length, forget=False, hold=0):
        before = list(self.tables[slot])
        original(self, slot, length, forget, hold)
        for block in before[len(self.tables[slot]) :]:
            if block in self._free_blocks:
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


def test_spare_blocks_go_back_least_recently_released_first():
    runner = ModelRunner(tiny_model(seed=0).model, 3, 256, reuse_prefixes=True, num_blocks=4)
    first, second = runner.allocate(), runner.allocate()
    older, newer = list(range(1, 60)) * 2, list(range(2, 61))
    for slot, tokens in ((first, older), (second, newer)):
        runner.forward([slot], [tokens], "last")
        runner.commit(slot, len(tokens))
        runner.free(slot)  # spare: the first two blocks, then the second one
    assert runner._cache.num_free_blocks == 4 and runner.blocks_in_use() == 0
    assert runner.cached_prefix(older + [5]) == len(older) and runner.cached_prefix(newer + [5]) == len(newer)
    third = runner.allocate()
    runner.forward([third], [list(range(3, 50)) * 2], "last")  # 94 tokens: the unused block and the oldest spare
    assert runner.cached_prefix(older + [5]) == 64  # its last block went first, its first is still found
    assert runner.cached_prefix(newer + [5]) == len(newer)  # the second kept its own


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
