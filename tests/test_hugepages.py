"""Weights and KV caches on huge pages: the same numbers from one arena, views and shared tensors kept,
and memory the kernel really backs with 2 MB pages."""

import pytest
import torch
from conftest import random_hf_weights, tiny_config
from torch import nn

from specdecode.executor.backends import build_quantized_model, quantize_weights
from specdecode.executor.hugepages import ENV, HUGE_PAGE, huge_pages_available, move_to_huge_pages
from specdecode.executor.runner import ModelRunner
from specdecode.kv_cache import KVCache
from specdecode.models.runtime import build_model

needs_thp = pytest.mark.skipif(not huge_pages_available(), reason="this kernel gives no transparent huge pages")


@pytest.fixture(autouse=True)
def huge_pages_on(monkeypatch):
    """Whatever the environment says (SPECDECODE_HUGE_PAGES=0 to measure without): these tests are of them."""
    monkeypatch.setenv(ENV, "1")


def _huge_kb(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address` (from /proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    return 0


def _model(quantization: str):
    """A model of 2 layers whose tensors add up to more than one huge page."""
    cfg = tiny_config(vocab=8192, hidden=128)
    weights = random_hf_weights(cfg, 0)
    if quantization == "none":
        return build_model(cfg, weights, torch.float32, "cpu")
    return build_quantized_model(cfg, quantize_weights(weights.items(), quantization), quantization, "cpu")


def _logits(model) -> torch.Tensor:
    runner = ModelRunner(model, 1, 64)
    slot = runner.allocate()
    with torch.inference_mode():
        return runner.forward([slot], [list(range(1, 30))], "all")


@needs_thp
@pytest.mark.parametrize("quantization", ["none", "w8a8"])
def test_moved_weights_give_the_same_logits_from_one_arena_on_huge_pages(quantization):
    model = _model(quantization)
    before = _logits(model)
    old_memory = [t.data for t in [*model.parameters(), *model.buffers()]]
    moved = move_to_huge_pages(model)
    for t in old_memory:  # what is left at the old addresses is wrong: only the arena may be read
        t.zero_()
    assert moved >= HUGE_PAGE
    tensors = [*model.parameters(), *model.buffers()]
    start = min(t.data_ptr() for t in tensors)
    assert start % HUGE_PAGE == 0
    assert all(start <= t.data_ptr() < start + moved for t in tensors)
    assert _huge_kb(start) >= HUGE_PAGE // 1024
    assert torch.equal(_logits(model), before)  # the low-bit layers read their new addresses


@needs_thp
def test_views_and_shared_tensors_stay_views_and_shared():
    module = nn.Module()
    base = torch.arange(1 << 20, dtype=torch.float32)  # 4 MB
    module.register_buffer("base", base)
    module.register_buffer("window", base[1000:2000])
    module.weight = nn.Parameter(torch.randn(300, 7).t())  # not contiguous
    expected = {name: t.clone() for name, t in [*module.named_buffers(), *module.named_parameters()]}
    weight_strides = module.weight.stride()
    assert move_to_huge_pages(module) > 0
    assert module.window.untyped_storage().data_ptr() == module.base.untyped_storage().data_ptr()
    assert module.window.data_ptr() == module.base.data_ptr() + 1000 * 4
    assert isinstance(module.weight, nn.Parameter) and module.weight.stride() == weight_strides
    for name, t in [*module.named_buffers(), *module.named_parameters()]:
        assert torch.equal(t, expected[name]), name


def test_nothing_moves_when_small_pages_are_asked_for(monkeypatch):
    monkeypatch.setenv(ENV, "0")
    model = _model("none")
    where = [t.data_ptr() for t in model.parameters()]
    assert move_to_huge_pages(model) == 0
    assert [t.data_ptr() for t in model.parameters()] == where


@needs_thp
def test_the_kv_cache_is_one_allocation_on_huge_pages_its_blocks_zeroed_when_taken():
    cfg = tiny_config(layers=4, hidden=128)
    cache = KVCache(cfg, 4, 2048, torch.float16, "cpu")  # 2 x 4 layers x 4 slots x 2 heads x 2048 x 64 x 2 B
    storage = cache.k[0].untyped_storage()
    assert all(t.untyped_storage().data_ptr() == storage.data_ptr() for t in cache.k + cache.v)
    slot = cache.allocate()
    cache.reserve(slot, 2048)
    assert all(not t[block].any() for t in cache.k + cache.v for block in cache.tables[slot])
    assert cache.k[0].data_ptr() % HUGE_PAGE == 0 and _huge_kb(cache.k[0].data_ptr()) > 0
