"""The Triton kernels of captured forwards' attention (executor/paged_attention.py), run in Triton's interpreter on a
CPU (tests/conftest.py turns it on) and compiled with SPECDECODE_TEST_DEVICE=cuda: against PyTorch's path through
the batch (RoPE, cache write, gathered blocks, masked SDPA) on scattered blocks, windows and padding rows; the same
output for a row whatever else is in its call; whole forwards against the eager ones; and the choice of attention
for a GPU's runners. Versions with a mistake in their source fail. And every launch compiles for Hopper (sm_90),
down to machine code, where no GPU is at hand."""

import dataclasses
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import DEVICE, cloned_cache, tiny_config, tiny_model, with_mistake

pytest.importorskip("triton", reason="the GPU kernels' tests need Triton (the test extras install it)")

from triton.runtime.errors import OutOfResources  # noqa: E402

from specdecode.executor import gemv, paged_attention  # noqa: E402
from specdecode.executor import runner as runner_module  # noqa: E402
from specdecode.executor.cuda_graphs import Bucket, StaticBatch  # noqa: E402
from specdecode.executor.paged_attention import PagedAttention  # noqa: E402
from specdecode.executor.runner import ModelRunner  # noqa: E402
from specdecode.kv_cache import KVCache  # noqa: E402
from specdecode.models.layers import apply_rope  # noqa: E402

# float32 on a CPU: the kernels sum over keys in another order than SDPA's
ATOL = 2e-5 if DEVICE == "cpu" else 2e-2
DTYPE = torch.float32 if DEVICE == "cpu" else torch.bfloat16


def _case(seed: int, heads, kv_heads, dim, starts: list[int], rows: int, block_size: int = 64, keys: int = 256):
    """A cache of scattered blocks with random entries, a bucket of len(starts) sequences and a padding one, `rows`
    new rows each after `starts` cached tokens, over `keys` key positions, and their q, k, v and RoPE tables."""
    cfg = dataclasses.replace(tiny_config(hidden=heads * dim), num_heads=heads, num_kv_heads=kv_heads)
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(cfg, 4, 512, DTYPE, DEVICE, block_size=block_size, scratch=True)
    for slot in (3, 1, 0):  # blocks taken out of order: a sequence's blocks are not contiguous
        cache.reserve(slot, 40)
    slots = [0, 1, 3][: len(starts)]
    for slot, start in zip(slots, starts):
        cache.reserve(slot, start + rows)
    for part in cache.k + cache.v:
        part.copy_(torch.randn(part.shape, generator=g))
    bucket = Bucket(len(starts) + 1, rows, keys)
    batch = StaticBatch(bucket, DEVICE)
    batch.fill(slots, starts, [[1] * rows for _ in starts], cache.scratch_row)
    shape = (bucket.seqs, rows)
    q, k, v = (torch.randn(*shape, h, dim, generator=g).to(DEVICE, DTYPE) for h in (heads, kv_heads, kv_heads))
    angles = torch.randn(*shape, dim // 2, generator=g)
    angles = torch.cat([angles, angles], -1)[:, None]
    rope = (angles.cos().to(DEVICE, DTYPE), angles.sin().to(DEVICE, DTYPE))
    return cache, batch, (q, k, v), rope, [(slot, start + rows) for slot, start in zip(slots, starts)]


def _pytorch(batch, cache, q, k, v, rope, window, scale, softcap=None):
    """The same step through the batch as the fixed-shape forward runs it without the kernels."""
    q, k = (apply_rope(t.transpose(1, 2), *rope) for t in (q, k))
    batch.forget()
    batch.store(cache, 0, k, v.transpose(1, 2))
    keys, values = batch.load(cache, 0)
    out = batch.attend(q, keys, values, window, scale, softcap)
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


def _both(attention, case, window=None, scale=0.3, softcap=None, their_softcap="same"):
    cache, batch, (q, k, v), rope, slots = case
    theirs = cloned_cache(cache)
    got = attention(batch, cache, 0, q, k, v, rope, window, scale, softcap)
    want = _pytorch(batch, theirs, q, k, v, rope, window, scale, softcap if their_softcap == "same" else their_softcap)
    return got, want, cache, theirs, slots


SOFTCAP = 0.5  # below the cases' scores
SHAPES = {  # heads, KV heads, head dim
    "6-per-kv-head": (12, 2, 32),
    "no-grouping": (2, 2, 16),
    "head-dim-48": (4, 2, 48),  # not a power of two: masked lanes
}


@pytest.mark.parametrize("split_keys", [512, 64], ids=["one-program-a-row", "split-and-merged"])
@pytest.mark.parametrize("heads_per_program", [1, None], ids=["a-head-a-program", "a-group-a-program"])
@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
@pytest.mark.parametrize("rows,window", [(1, None), (4, None), (3, 7)], ids=["decode", "verify", "verify-window"])
def test_the_kernels_compute_pytorchs_attention_and_cache_writes(split_keys, heads_per_program, shape, rows, window):
    case = _case(1, *SHAPES[shape], starts=[70, 5], rows=rows)
    got, want, cache, theirs, slots = _both(PagedAttention(heads_per_program, split_keys=split_keys), case, window)
    real = got[: len(slots)]  # the padding sequence's rows are dropped by the caller
    torch.testing.assert_close(real, want[: len(slots)], atol=ATOL, rtol=0)
    for slot, n in slots:  # the new rows' rotated keys and values where PyTorch's path puts them
        torch.testing.assert_close(cache.keys(0, slot, n), theirs.keys(0, slot, n), atol=ATOL, rtol=0)
        torch.testing.assert_close(cache.values(0, slot, n), theirs.values(0, slot, n), atol=0, rtol=0)


@pytest.mark.parametrize("split_keys", [512, 64], ids=["one-program-a-row", "split-and-merged"])
def test_soft_capped_scores_are_pytorchs(split_keys):
    """Gemma 2's soft cap on the scores, at a cap these scores reach; a kernel that ignored it would not agree."""
    case = _case(6, *SHAPES["6-per-kv-head"], starts=[70, 5], rows=3)
    got, want, *_ = _both(PagedAttention(split_keys=split_keys), case, 7, softcap=SOFTCAP)
    torch.testing.assert_close(got[:2], want[:2], atol=ATOL, rtol=0)
    case = _case(6, *SHAPES["6-per-kv-head"], starts=[70, 5], rows=3)
    uncapped, want, *_ = _both(PagedAttention(split_keys=split_keys), case, 7, their_softcap=SOFTCAP)
    assert not torch.allclose(uncapped[:2], want[:2], atol=ATOL, rtol=0)


def test_blocks_of_32_tokens():
    case = _case(2, 4, 2, 16, starts=[40, 100], rows=2, block_size=32)
    got, want, *_ = _both(PagedAttention(), case, None)
    torch.testing.assert_close(got[:2], want[:2], atol=ATOL, rtol=0)


@pytest.mark.parametrize("span", [128, 256])
@pytest.mark.parametrize("block_size", [32, 64])
@pytest.mark.parametrize("rows,window", [(1, None), (3, 7)], ids=["decode", "verify-window"])
def test_spans_of_keys_from_several_blocks(span, block_size, rows, window):
    """A program taking more keys at a time than a KV block holds reads each key from its own block (the blocks are
    scattered), in a bucket of 512 key positions split in two and merged."""
    case = _case(5, 4, 2, 16, starts=[300, 70, 5], rows=rows, block_size=block_size, keys=512)
    got, want, *_ = _both(PagedAttention(span=span, split_keys=256), case, window)
    torch.testing.assert_close(got[:3], want[:3], atol=ATOL, rtol=0)


def test_a_span_that_cannot_tile_its_split_is_refused():
    with pytest.raises(ValueError, match="dividing split_keys"):
        PagedAttention(span=128, split_keys=64)
    with pytest.raises(ValueError, match="power of two"):
        PagedAttention(span=96)


@pytest.mark.parametrize("start", [40, 70], ids=["keys-in-one-split", "keys-in-two"])
@pytest.mark.parametrize("span", [64, 128])
def test_a_row_gets_the_same_output_whatever_else_its_call_holds(start, span):
    """Decoded alone in the smallest bucket, or beside another sequence in a bucket of more key positions (more
    splits, merged by the second kernel): the same bits, its keys being the same."""
    attention = PagedAttention(span=span, split_keys=span)
    alone = _case(3, 4, 2, 16, starts=[start], rows=1, keys=128)
    beside = _case(3, 4, 2, 16, starts=[start, 9], rows=1, keys=512)
    for mine, theirs in zip((*alone[2], *alone[3]), (*beside[2], *beside[3])):
        theirs[0] = mine[0]  # the same new row (the caches' entries are the same already)
    first = attention(alone[1], alone[0], 0, *alone[2], alone[3], None, 0.3)[0]
    second = attention(beside[1], beside[0], 0, *beside[2], beside[3], None, 0.3)[0]
    assert torch.equal(first, second)


def test_splits_of_64_keys_widen_only_where_a_call_would_hold_too_many_sums():
    """A row's bits are the same in every call short of MAX_PARTIALS partial sums (splits of 64 keys at any length for
    a batch-1 decode or verify); the largest buckets hold no more than 512-key splits did."""
    attention = PagedAttention()
    assert [attention.split_of(keys, 1) for keys in (64, 256, 8192, 1 << 20)] == [64, 64, 64, 64]
    assert [attention.split_of(keys, 5) for keys in (256, 32768)] == [64, 64]
    assert attention.split_of(16384, 1024) == 512  # 16 sequences of 64 rows
    largest = [(1024, 16384), (512, 32768), (64, 4096), (16, 1 << 18)]  # rows x keys within cuda_graphs' bounds
    held = [rows * keys // attention.split_of(keys, rows) for rows, keys in largest]
    assert max(held) <= paged_attention.MAX_PARTIALS == max(rows * keys // 512 for rows, keys in largest)


def _forwards(model, attention):
    runner = ModelRunner(model, 3, 600, fixed_shapes=True)
    runner._fixed.attention = attention
    slots = [runner.allocate(), runner.allocate()]
    g = torch.Generator().manual_seed(0)
    outs = []
    for widths in ((20, 7), (1, 1), (4, 1), (3, 6), (1, 2)):  # a prefill, decodes, verifies
        inputs = [torch.randint(0, 60, (n,), generator=g).tolist() for n in widths]
        outs.append(runner.forward(slots, inputs, "all"))
        for slot, new in zip(slots, inputs):
            runner.commit(slot, runner.length(slot) + len(new) - (len(new) > 2))  # a rejected draft now and then
    return outs


@pytest.mark.parametrize(
    "features",
    [
        {},
        {"sliding_window": 5, "qk_norm": True},
        {"attention_scale": 0.2},
        {"attention_softcap": SOFTCAP},
        {"query_temperature": 0.5, "query_temperature_floor": 16},  # Ministral 3's: its prompt crosses the floor
    ],
    ids=["qwen2", "window+qk-norm", "scale", "softcap", "query-temperature"],
)
def test_whole_forwards_with_the_kernels_compute_pytorchs(features):
    model = tiny_model(seed=3, **features).model
    for got, want in zip(_forwards(model, PagedAttention()), _forwards(model, None)):
        torch.testing.assert_close(got, want, atol=10 * ATOL, rtol=0)


MISTAKES = {  # what the source says, and what the broken version says instead
    "a row sees only the keys before its own": ("key[None, :] <= position", "key[None, :] < position"),
    "the window one key wider": ("position[:, None] - reach)", "position[:, None] - reach - 1)"),
    "keys stored unrotated": ("TILE, D), rotated.to(", "TILE, D), tl.load(x + d).to("),
    "old sums not rescaled": ("acc = acc * rescale[:, None] +", "acc = acc +"),
    "splits merged unweighted": ("total += tl.load(part_total + s * count + i) * weight", "total += 1.0"),
    "the value of the next position": ("value_offset(base, at, d, BS, D)", "value_offset(base, at + 1, d, BS, D)"),
    "a span's keys all from its first key's block": ("tl.minimum(key, KEYS", "tl.minimum(key - n + n * 0, KEYS"),
}


@pytest.mark.parametrize("mistake", MISTAKES, ids=list(MISTAKES))
def test_kernels_with_a_mistake_fail(mistake, tmp_path, monkeypatch):
    broken = with_mistake(paged_attention, *MISTAKES[mistake], tmp_path, monkeypatch)
    # 64: four splits merged; a span of 128: two blocks a span
    cases = [(64, split_keys, window) for split_keys in (512, 64) for window in (None, 7)] + [(128, 256, None)]
    assert not all(_agrees(broken.PagedAttention(span=span, split_keys=keys), window) for span, keys, window in cases)


def _agrees(attention, window) -> bool:
    got, want, cache, theirs, _ = _both(attention, _case(4, 4, 2, 16, starts=[70, 5], rows=3), window)
    same_cache = all(torch.allclose(a, b, atol=ATOL) for a, b in zip(cache.k + cache.v, theirs.k + theirs.v))
    return same_cache and torch.allclose(got[:2], want[:2], atol=ATOL, rtol=0)


def test_a_gpu_takes_the_kernels_unless_told_or_they_fail(monkeypatch, caplog):
    model = tiny_model(seed=1).model
    runner_module._checked_kernels.cache_clear()
    assert isinstance(runner_module.gpu_attention(model), PagedAttention)  # they pass their check here
    monkeypatch.setenv(runner_module.ATTENTION_CHOICE, "sdpa")
    assert runner_module.gpu_attention(model) is None
    monkeypatch.setenv(runner_module.ATTENTION_CHOICE, "flash")
    with pytest.raises(ValueError, match="'triton' or 'sdpa'"):
        runner_module.gpu_attention(model)
    monkeypatch.delenv(runner_module.ATTENTION_CHOICE)

    def wrong(attention, device, dtype, head_dim):
        got, want = paged_attention._small_case(attention, device, dtype, head_dim)
        return got + 1, want

    monkeypatch.setattr(paged_attention, "_small_case", wrong)
    runner_module._checked_kernels.cache_clear()
    with caplog.at_level(logging.WARNING):
        assert runner_module.gpu_attention(model) is None  # disagreeing kernels are not used
    assert "stays PyTorch's" in caplog.text
    runner_module._checked_kernels.cache_clear()


def test_kernels_the_device_cannot_hold_at_a_models_head_size_leave_its_attention_to_pytorch(monkeypatch, caplog):
    """A program's shared memory grows with the head size (Gemma 3's 256 in float32 needs 152 KB, an sm_89 card has
    99 KB): the start-up check runs at each model's head size, and where the device refuses the launch, that model's
    forwards keep PyTorch's attention and start-up goes on."""
    small, large = tiny_model(seed=1).model, tiny_model(seed=1, hidden=128).model
    attend = PagedAttention.__call__

    def refusing_large_heads(self, batch, cache, layer, q, *args):
        if q.shape[-1] > small.cfg.dim_per_head:
            raise OutOfResources(151872, 101376, "shared memory")
        return attend(self, batch, cache, layer, q, *args)

    monkeypatch.setattr(PagedAttention, "__call__", refusing_large_heads)
    runner_module._checked_kernels.cache_clear()
    assert isinstance(runner_module.gpu_attention(small), PagedAttention)
    with caplog.at_level(logging.WARNING):
        assert runner_module.gpu_attention(large) is None
    assert "stays PyTorch's" in caplog.text and "shared memory" in caplog.text
    runner_module._checked_kernels.cache_clear()


def test_every_launch_compiles_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    tool = Path(__file__).resolve().parents[1] / "tools" / "gpu_kernels_compile.py"
    proc = subprocess.run([sys.executable, str(tool)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "every launch compiled for sm_90 (bfloat16)" in proc.stdout
    assert "0 launches need more than sm_90's" in proc.stdout  # none that start-up would have to pass over
    assert proc.stdout.count("_attend ") == 6  # each representative forward's attention, splits merged once
    # the linear layers' kernel at each configuration, with RoPE and the cache write taken in (a split configuration's
    # parts by the plain kernel, merged by the epilogue's), and at two with the norm or SwiGLU taken in, float32 logits
    splits = sum(c.splits > 1 for c in gemv.CONFIGS)
    assert proc.stdout.count("_gemv ") == len(gemv.CONFIGS) + splits + 6
    assert proc.stdout.count("_sum_splits ") == splits + 3
    assert proc.stdout.count("_projected ") == len(gemv.CONFIGS) - splits and proc.stdout.count("_merged ") == splits
    # a mixture of experts' calls (decode, verify, 64 sequences, a prompt chunk; GeGLU's verify): router, gate/up, down
    assert proc.stdout.count("_experts_matmul ") == 2 * 5 and proc.stdout.count("_sum_experts ") == 5
    assert proc.stdout.count("_routed ") == 5
    assert proc.stdout.count("_count_pairs ") == proc.stdout.count("_place_pairs ") == 5
