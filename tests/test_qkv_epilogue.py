"""The QKV projection with RoPE and the cache write in its kernel (executor/qkv_epilogue.py), run in Triton's
interpreter on a CPU and compiled with SPECDECODE_TEST_DEVICE=cuda: against the separate kernels (the projection, then
paged_attention's rotation and cache write) at configurations of one part of K and of several, over head sizes and
groupings, with and without a bias and a residual stream, and padding rows; whole forwards with it against forwards
without; taken only where its start-up check passes, and never past q/k norms. Versions with a mistake in their
source fail."""

import functools
import logging

import pytest
import torch
from conftest import DEVICE, cloned_cache, tiny_model, with_mistake

pytest.importorskip("triton", reason="the GPU kernels' tests need Triton (the test extras install it)")

from test_paged_attention import _case, _forwards  # noqa: E402
from triton.runtime.errors import OutOfResources  # noqa: E402

from specdecode.executor import gemv, paged_attention, qkv_epilogue  # noqa: E402
from specdecode.executor.gemv import CONFIGS, Gemv, GemvConfig  # noqa: E402
from specdecode.executor.paged_attention import PagedAttention, rope_store, rotate_and_store  # noqa: E402
from specdecode.models.layers import Linear  # noqa: E402

DTYPE = torch.float32 if DEVICE == "cpu" else torch.bfloat16
ATOL = 1e-5 if DEVICE == "cpu" else 2e-2  # float32: sums in another grouping of columns than the separate kernel's
SPLIT = GemvConfig(16, 64, splits=3)  # K = 150 in three parts, the last one short
SHAPES = {  # heads, KV heads, head size
    "6-per-kv-head": (12, 2, 32),
    "no-grouping": (2, 2, 16),
    "head-size-48": (4, 2, 48),  # a program's pairs cross from one head into the next
}


def _projection(seed: int, shape, rows: int, bias: bool, residual: bool):
    """A case of test_paged_attention's (two sequences and a padding one, `rows` new rows each) and a QKV projection
    of K = 150 for it: the kernels' operands (x, weight, bias, norm, residual, residual_out)."""
    heads, kv_heads, dim = shape
    case = _case(seed, heads, kv_heads, dim, starts=[70, 5], rows=rows)
    g = torch.Generator().manual_seed(seed)
    n, k, count = (heads + 2 * kv_heads) * dim, 150, case[1].positions.numel()
    x, stream = torch.randn(count, k, generator=g), torch.randn(count, k, generator=g)
    w, b = torch.randn(n, k, generator=g) / k**0.5, torch.randn(n, generator=g)
    norm = (torch.rand(k, generator=g) + 0.5).to(DEVICE, DTYPE), 1e-6
    x, stream, w, b = (t.to(DEVICE, DTYPE) for t in (x, stream, w, b))
    operands = (x, w, b if bias else None, norm, stream if residual else None)
    return case, operands


def _both(module, config, shape, rows=4, bias=True, residual=True, seed=1):
    """(the fused kernel's queries, residual stream and cache), then the separate kernels'."""
    (cache, batch, _, rope, _), (x, w, b, norm, stream) = _projection(seed, shape, rows, bias, residual)
    heads, kv_heads, dim = shape
    theirs = cloned_cache(cache)
    outs = [torch.empty_like(x) if residual else None for _ in range(2)]
    store = rope_store(batch, cache, 0, rope, heads, kv_heads)
    fused = module.projected(x, w, b, config, norm, stream, outs[0], store=store)
    qkv = gemv.gemv(x, w, b, config, norm, stream, outs[1])
    q, k, v = (t.unflatten(-1, (-1, dim)).unflatten(0, (-1, rows)) for t in qkv.split(_sizes(shape), -1))
    separate = rotate_and_store(q, k, v, rope_store(batch, theirs, 0, rope, heads, kv_heads))
    mine = (fused[:, : heads * dim], outs[0], *cache.k, *cache.v)
    return mine, (separate.flatten(1), outs[1], *theirs.k, *theirs.v)


def _sizes(shape) -> tuple:
    heads, kv_heads, dim = shape
    return heads * dim, kv_heads * dim, kv_heads * dim


@pytest.mark.parametrize("config", [CONFIGS[0], GemvConfig(32, 64), GemvConfig(64, 64), SPLIT], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
@pytest.mark.parametrize("rows", [1, 5], ids=["decode", "verify"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_the_projection_rotates_and_writes_the_cache_as_the_separate_kernels_do(config, shape, rows, bias):
    mine, theirs = _both(qkv_epilogue, config, SHAPES[shape], rows, bias)
    for got, want in zip(mine, theirs):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_the_first_layers_projection_normalises_its_input_alone():
    mine, theirs = _both(qkv_epilogue, CONFIGS[0], SHAPES["6-per-kv-head"], residual=False)
    assert mine[1] is None and theirs[1] is None
    for got, want in zip(mine[:1] + mine[2:], theirs[:1] + theirs[2:]):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_a_call_that_is_not_a_qkv_projection_of_a_few_rows_is_refused():
    (cache, batch, _, rope, _), (x, w, b, norm, _) = _projection(0, (2, 2, 16), 4, True, False)
    store = rope_store(batch, cache, 0, rope, 2, 2)
    with pytest.raises(ValueError, match="not a QKV projection"):
        qkv_epilogue.projected(x, w[:-16], b[:-16], CONFIGS[0], norm, store=store)
    with pytest.raises(ValueError, match="at most 16 rows"):
        qkv_epilogue.projected(torch.cat([x, x, x]), w, b, CONFIGS[0], norm, store=store)


MISTAKES = {  # what the source says, and what the broken version says instead
    "the rotation's signs swapped": ("tl.where(d < D // 2, -1.0, 1.0)", "tl.where(d < D // 2, 1.0, -1.0)"),
    "a pair's second column the next one": ("second = first + D // 2", "second = first + 1"),
    "values rotated too": ("values.to(v_cache.dtype.element_ty)", "rotated.to(v_cache.dtype.element_ty)"),
    "queries stored unrotated": ("rotated.to(y.dtype.element_ty)", "values.to(y.dtype.element_ty)"),
    "keys at the next position": ("key_offset(base, at[:, None],", "key_offset(base, at[:, None] + 1,"),
    "the bias left out": ("acc += tl.load(bias + cols", "acc -= 0 * tl.load(bias + cols"),
    "a split left out of the merge": ("for s in range(1, SPLITS):", "for s in range(1, SPLITS - 1):"),
    "the merge's partner in the next head": ("cols + D // 2, cols - D // 2)", "cols + D // 2, cols + D // 2)"),
}


@pytest.mark.parametrize("mistake", MISTAKES, ids=list(MISTAKES))
def test_kernels_with_a_mistake_fail(mistake, tmp_path, monkeypatch):
    broken = with_mistake(qkv_epilogue, *MISTAKES[mistake], tmp_path, monkeypatch)
    assert _the_kernels_agree()  # the test can pass
    assert not all(_agrees(broken))


@functools.cache
def _the_kernels_agree() -> bool:
    return all(_agrees(qkv_epilogue))


def _agrees(module) -> list[bool]:
    agree = []
    for config in (CONFIGS[0], SPLIT):
        mine, theirs = _both(module, config, SHAPES["6-per-kv-head"], rows=3)
        agree += [torch.allclose(got, want, atol=ATOL, rtol=0) for got, want in zip(mine, theirs)]
    return agree


def _with_kernels(model, configs=(CONFIGS[0], SPLIT)):
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    for i, layer in enumerate(layers):
        layer.kernel = Gemv(configs[i % len(configs)])
    return layers


def _counted(monkeypatch) -> list[str]:
    """The names of the epilogue's and the separate rotation's launches, as they run."""
    names = []
    for module, name in (
        (qkv_epilogue, "_projected"),
        (qkv_epilogue, "_merged"),
        (paged_attention, "_rotate_and_store"),
    ):
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name, _Counted(kernel, name, names))
    return names


class _Counted:
    def __init__(self, kernel, name, names):
        self.kernel, self.name, self.names = kernel, name, names

    def __getitem__(self, grid):
        self.names.append(self.name)
        return self.kernel[grid]


def _draft_head():
    from test_cuda_graphs import _head_for

    return _head_for(tiny_model(seed=3))


@pytest.mark.parametrize(
    "build,configs,layers,prologues",
    [
        (lambda: tiny_model(seed=3).model, (CONFIGS[0],), 2, False),
        (lambda: tiny_model(seed=3).model, (CONFIGS[0],), 2, True),
        (lambda: tiny_model(seed=3).model, (SPLIT,), 2, False),
        (_draft_head, (CONFIGS[0],), 1, False),
    ],
    ids=["qwen2 one-part", "qwen2 one-part, the norm taken in too", "qwen2 K-split", "draft head"],
)
def test_whole_forwards_with_the_epilogue_compute_those_without(build, configs, layers, prologues, monkeypatch):
    """The epilogue after the kernel's norm prologue, or after the norm computed apart (gemv.TAKES_PROLOGUES)."""
    monkeypatch.setattr(gemv, "TAKES_PROLOGUES", prologues)
    model = build().to(DTYPE)
    _with_kernels(model, configs)
    names = _counted(monkeypatch)
    want = _forwards(model, PagedAttention())
    assert names == ["_rotate_and_store"] * 5 * layers  # 5 forwards, the kernels' epilogues not checked yet
    assert paged_attention.attach_epilogues(model) == layers  # every layer's QKV kernel passes the check
    names.clear()
    got = _forwards(model, PagedAttention())
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=10 * ATOL, rtol=0)
    # the first forward's 27 rows are past the kernel's 16, the 4 others' rows within them
    epilogue = "_projected" if configs[0].splits == 1 else "_merged"
    assert names == ["_rotate_and_store"] * layers + [epilogue] * 4 * layers
    names.clear()
    _forwards(model, PagedAttention(in_projection=False))  # an attention may keep them apart (cuda_check's A/B)
    assert names == ["_rotate_and_store"] * 5 * layers


def test_layers_with_qk_norms_keep_rope_apart():
    model = tiny_model(seed=3, qk_norm=True).model.to(DTYPE)
    layers = _with_kernels(model)
    assert paged_attention.attach_epilogues(model) == 0
    assert not any(layer.kernel.rope_epilogue for layer in layers)


def test_an_epilogue_that_disagrees_on_this_device_is_not_taken(monkeypatch, caplog):
    model = tiny_model(seed=3).model.to(DTYPE)
    _with_kernels(model)
    case = paged_attention.epilogue_case

    def wrong(*args):
        mine, theirs = case(*args)
        return (mine[0] + 1, *mine[1:]), theirs

    monkeypatch.setattr(paged_attention, "epilogue_case", wrong)
    paged_attention._agrees.cache_clear()
    with caplog.at_level(logging.WARNING):
        assert paged_attention.attach_epilogues(model) == 0
    assert "keep RoPE and the cache write apart" in caplog.text
    paged_attention._agrees.cache_clear()


def test_an_epilogue_the_device_cannot_hold_is_not_taken(monkeypatch):
    model = tiny_model(seed=3).model.to(DTYPE)
    _with_kernels(model)
    paged_attention._agrees.cache_clear()
    assert paged_attention.attach_epilogues(model) == 2  # the test can fail

    def refused(*args, **kwargs):
        raise OutOfResources(196608, 101376, "shared memory")

    monkeypatch.setattr(qkv_epilogue, "_projected", type("Refused", (), {"__getitem__": lambda self, grid: refused})())
    paged_attention._agrees.cache_clear()
    assert paged_attention.attach_epilogues(model) == 0
    paged_attention._agrees.cache_clear()
