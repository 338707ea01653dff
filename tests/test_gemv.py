"""The Triton kernel of captured forwards' linear layers at a few rows (executor/gemv.py), run in Triton's interpreter
on a CPU and compiled with SPECDECODE_TEST_DEVICE=cuda: against F.linear at every configuration, over rows, columns
and K that do not fill their tiles, with and without a bias, K split or not; a row's result the same whatever rows are
beside it; taken only inside fixed-shape forwards and at few rows; whole forwards against cuBLAS's; and the choice of
configuration by timing. Versions with a mistake in their source, or whose configuration follows the row count, fail.
"""

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, tiny_model, with_mistake
from test_cuda_graphs import captured  # noqa: F401 (a fixture)

pytest.importorskip("triton", reason="the GPU kernels' tests need Triton (the test extras install it)")

from triton.runtime.errors import OutOfResources  # noqa: E402

from specdecode.executor import cuda_graphs, gemv  # noqa: E402
from specdecode.executor.gemv import CONFIGS, Gemv, GemvConfig  # noqa: E402
from specdecode.models.layers import Linear  # noqa: E402

DTYPE = torch.float32 if DEVICE == "cpu" else torch.bfloat16
ATOL = 1e-4 if DEVICE == "cpu" else 5e-2  # float32 sums in another order than F.linear's; bfloat16 outputs
SPLIT = GemvConfig(16, 64, splits=3)  # K = 300 in three parts, the last one short


def _operands(seed: int, rows: int, n: int = 40, k: int = 300, bias: bool = True):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g) if bias else None
    return [None if t is None else t.to(DEVICE, DTYPE) for t in (x, w, b)]


@pytest.mark.parametrize("config", [*CONFIGS, SPLIT], ids=str)
@pytest.mark.parametrize("rows", [1, 5, 16, 20])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_the_kernel_computes_linear_layers(config, rows, bias):
    x, w, b = _operands(0, rows, bias=bias)  # 40 columns, K = 300: neither fills its blocks
    got = gemv.gemv(x, w, b, config)
    assert got.shape == (rows, 40) and got.dtype == DTYPE
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(got.float(), want, atol=ATOL, rtol=0)


def _normed(x, w, b, config, residual=True):
    """The kernel with its norm in: (y, the residual stream it wrote) for x + a residual made from x."""
    nw = torch.linspace(0.5, 1.5, x.shape[1], device=DEVICE, dtype=DTYPE)
    res = torch.roll(x, 1, 1) if residual else None
    out = torch.empty_like(x) if residual else None
    return gemv.gemv(x, w, b, config, (nw, 1e-6), res, out), out, nw, res


@pytest.mark.parametrize("config", [CONFIGS[0], SPLIT], ids=["one-part", "K-split"])
@pytest.mark.parametrize("rows", [1, 5, 20])
@pytest.mark.parametrize("residual", [True, False], ids=["residual", "first-layer"])
def test_the_kernel_takes_the_norm_before_it_in(config, rows, residual):
    x, w, b = _operands(3, rows)
    y, out, nw, res = _normed(x, w, b, config, residual)
    if residual:
        normed, stream = cuda_graphs._add_rms_norm(nw, 1e-6, x, res)
        assert torch.equal(out, stream)  # x + residual, rounded as the add rounds it
    else:
        normed = cuda_graphs._rms_norm(nw, 1e-6, x)
    torch.testing.assert_close(y.float(), F.linear(normed, w, b).float(), atol=ATOL, rtol=0)


@pytest.mark.parametrize("config", [CONFIGS[0], SPLIT], ids=["one-part", "K-split"])
@pytest.mark.parametrize("rows", [1, 5, 20])
def test_the_kernel_takes_swiglu_before_it_in(config, rows):
    x, w, b = _operands(4, rows, k=600)  # gate and up, 300 each
    y = gemv.gemv(x, w[:, :300].contiguous(), b, config, activated=True)
    torch.testing.assert_close(y.float(), F.linear(cuda_graphs._silu_mul(x), w[:, :300], b).float(), atol=ATOL, rtol=0)


def _rows_alone_and_beside(compute, config) -> list[bool]:
    """Whether each of row 0's results (alone, then beside 4 and beside 15 other rows) is the first's, bit for bit; on
    a GPU every row's too, at each place in its tile (Triton's interpreter multiplies on the CPU, whose BLAS rounds the
    rows of a tile's edge otherwise)."""
    x, w, b = _operands(1, 16)
    alone = [compute(x[i : i + 1], w, b, config) for i in range(16)]
    same = []
    for rows in (5, 16):
        beside = compute(torch.cat([x[:1], torch.randn_like(x[1:rows])]), w, b, config)
        same.append(torch.equal(beside[0], alone[0][0]))
    if DEVICE == "cuda":
        together = compute(x, w, b, config)
        same += [torch.equal(together[i], alone[i][0]) for i in range(16)]
    return same


PROLOGUES = {
    "plain": gemv.gemv,
    "normed": lambda x, w, b, config: _normed(x, w, b, config)[0],
    "activated": lambda x, w, b, config: gemv.gemv(torch.cat([x, x.flip(1)], 1), w, b, config, activated=True),
}


@pytest.mark.parametrize("prologue", PROLOGUES)
@pytest.mark.parametrize("config", [CONFIGS[0], SPLIT], ids=["one-part", "K-split"])
def test_a_row_is_computed_the_same_whatever_rows_are_beside_it(config, prologue):
    assert all(_rows_alone_and_beside(PROLOGUES[prologue], config))


def test_a_configuration_that_follows_the_row_count_is_caught():
    def by_rows(x, w, b, config):  # a wider block of K for calls of more rows: sums grouped otherwise
        return gemv.gemv(x, w, b, config if x.shape[0] == 1 else GemvConfig(config.block_n, 2 * config.block_k))

    assert not all(_rows_alone_and_beside(by_rows, GemvConfig(16, 32)))


@pytest.mark.parametrize("config", [CONFIGS[0], SPLIT], ids=["one-part", "K-split"])
def test_the_kernel_holds_its_rounded_outputs_in_float32_where_asked(config):
    """The LM head's call: float32 logits without a cast kernel of their own, holding what rounding to the model's type
    gives (float16 here: the interpreter's bfloat16 products are wrong)."""
    assert all(_float32_outputs_rounded(gemv, config))


@pytest.mark.parametrize(
    "old,new",
    [
        ("acc.to(x.dtype.element_ty).to(y.dtype.element_ty)", "acc.to(y.dtype.element_ty)"),
        ("total.to(x.dtype.element_ty).to(y.dtype.element_ty)", "total.to(y.dtype.element_ty)"),
    ],
    ids=["one part unrounded", "splits' sums unrounded"],
)
def test_float32_outputs_left_unrounded_are_caught(old, new, tmp_path, monkeypatch):
    broken = with_mistake(gemv, old, new, tmp_path, monkeypatch)
    assert not all(ok for config in (CONFIGS[0], SPLIT) for ok in _float32_outputs_rounded(broken, config))


def _float32_outputs_rounded(module, config) -> list[bool]:
    """Whether the kernel's float32 output equals its float16 output widened, plain and with the norm taken in."""
    x, w, b = (t.to(torch.float16) for t in _operands(4, 5))
    nw = torch.linspace(0.5, 1.5, x.shape[1], device=DEVICE, dtype=torch.float16)
    agree = []
    for norm in (None, (nw, 1e-6)):
        wide = module.gemv(x, w, b, config, norm, out_dtype=torch.float32)
        agree.append(wide.dtype == torch.float32 and torch.equal(wide, module.gemv(x, w, b, config, norm).float()))
    return agree


MISTAKES = {  # what the source says, and what the broken version says instead
    "the next weight row": ("w + cols[:, None] * K", "w + (cols[:, None] + 1) * K"),
    "a split's part taken from K's start": ("at = s * PART + k0 + ks", "at = k0 + ks"),
    "the splits merged without the last": ("for s in range(1, SPLITS):", "for s in range(1, SPLITS - 1):"),
    "the bias left out": ("acc += tl.load(bias + cols", "acc -= 0 * tl.load(bias + cols"),
    "the last block of K dropped": ("inside = at < K", "inside = at < K - 64"),
    "the norm over half of K": ("rstd = tl.rsqrt(squares / K + eps)", "rstd = tl.rsqrt(squares / (K // 2) + eps)"),
    "the residual stream never written": ("s, j == 0, M", "s, j < 0, M"),
    "the norm's weight left out": ("* scale[None, :]).to(", "* 1.0).to("),
    "SiLU of up": ("gate * tl.sigmoid(gate) * up", "gate * tl.sigmoid(up) * up"),
}


@pytest.mark.parametrize("mistake", MISTAKES, ids=list(MISTAKES))
def test_kernels_with_a_mistake_fail(mistake, tmp_path, monkeypatch):
    broken = with_mistake(gemv, *MISTAKES[mistake], tmp_path, monkeypatch)
    assert all(_computes_its_three_ways(gemv))  # the test can pass
    assert not all(_computes_its_three_ways(broken))


def _computes_its_three_ways(module) -> list[bool]:
    """Whether the kernel (of `module`) computes a linear layer, one with the norm before it and one with SwiGLU before
    it, at one part of K and at three."""
    x, w, b = _operands(2, 3)
    nw, res = torch.rand(300, device=DEVICE, dtype=DTYPE) + 0.5, torch.randn_like(x)
    normed, stream = cuda_graphs._add_rms_norm(nw, 1e-6, x, res)
    gate_up = torch.cat([x, res], 1)
    agree = []
    for c in (CONFIGS[0], SPLIT):
        out = torch.empty_like(x)
        ways = [
            (module.gemv(x, w, b, c), F.linear(x, w, b)),
            (module.gemv(x, w, b, c, (nw, 1e-6), res, out), F.linear(normed, w, b)),
            (out, stream),
            (module.gemv(gate_up, w, b, c, activated=True), F.linear(cuda_graphs._silu_mul(gate_up), w, b)),
        ]
        agree += [torch.allclose(got.float(), want.float(), atol=ATOL, rtol=0) for got, want in ways]
    return agree


def _linear_with_kernel(monkeypatch) -> tuple[Linear, list[int]]:
    layer = Linear(300, 40, bias=True).to(DEVICE, DTYPE)
    layer.kernel = Gemv(CONFIGS[0])
    calls = []
    compute = gemv.gemv

    def counted(x, *args):
        calls.append(x.shape[0])
        return compute(x, *args)

    monkeypatch.setattr(gemv, "gemv", counted)
    return layer, calls


def test_the_kernel_serves_fixed_shape_forwards_of_few_rows(monkeypatch):
    layer, calls = _linear_with_kernel(monkeypatch)
    x = torch.randn(2, 8, 300, device=DEVICE, dtype=DTYPE)  # 16 rows
    with torch.inference_mode():
        eager = layer(x)
        assert calls == []  # outside fixed shapes: cuBLAS (here the CPU's own)
        with cuda_graphs._fixed_shapes():
            fixed = layer(x)
            assert calls == [16] and fixed.shape == (2, 8, 40)
            layer(torch.randn(17, 300, device=DEVICE, dtype=DTYPE))
            assert calls == [16]  # 17 rows: cuBLAS
    torch.testing.assert_close(fixed, eager, atol=ATOL, rtol=0)


def _fixed_forwards(model):
    from test_paged_attention import _forwards

    return _forwards(model, None)


def _qwen2():
    return tiny_model(seed=3).model


def _gemma_like():
    return tiny_model(seed=3, sandwich_norms=True, activation="gelu_tanh").model


def _draft_head():
    from test_cuda_graphs import _head_for

    return _head_for(tiny_model(seed=3))


# What each runs by the kernel (calls a forward) and folds in: the norms before QKV, gate/up and the LM head, SwiGLU
# before down. Sandwich norms stay apart, and GeGLU; a head's fc reads two norms side by side, its own.
MODELS = {
    "qwen2": (_qwen2, {"plain": 2, "normed": 5, "activated": 2}),
    "gemma-like (sandwich norms, GeGLU)": (_gemma_like, {"plain": 6, "normed": 3, "activated": 0}),
    "draft head": (_draft_head, {"plain": 2, "normed": 3, "activated": 1}),
}


@pytest.mark.parametrize("prologues", [True, False], ids=["prologues taken in", "norms and SwiGLU apart"])
@pytest.mark.parametrize("name", MODELS, ids=list(MODELS))
def test_whole_forwards_with_the_kernel_compute_cublass(name, prologues, monkeypatch):
    monkeypatch.setattr(gemv, "TAKES_PROLOGUES", prologues)
    build, fused_calls = MODELS[name]
    if not prologues:  # every call the kernel's alone
        fused_calls = {"plain": sum(fused_calls.values()), "normed": 0, "activated": 0}
    model = build().to(DTYPE)
    want = _fixed_forwards(model)
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    kinds, wide = [], []
    compute = gemv.gemv

    def counted(x, weight, bias, config, norm=None, residual=None, residual_out=None, activated=False, out_dtype=None):
        kinds.append("normed" if norm is not None else "activated" if activated else "plain")
        wide.append(out_dtype)
        return compute(x, weight, bias, config, norm, residual, residual_out, activated, out_dtype)

    monkeypatch.setattr(gemv, "gemv", counted)
    for i, layer in enumerate(layers):
        layer.kernel = Gemv((CONFIGS[0], SPLIT)[i % 2])
    try:
        got = _fixed_forwards(model)
    finally:
        for layer in layers:
            layer.kernel = None
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=10 * ATOL, rtol=0)
    calls = {kind: kinds.count(kind) / 4 for kind in ("plain", "normed", "activated")}  # 4 of the 5 forwards fixed
    assert calls == fused_calls
    assert wide.count(torch.float32) == 4  # the LM head's call of each: float32 logits, no cast of their own


def _timings(monkeypatch, fastest: GemvConfig, kernel_seconds: float, cublas_seconds: float = 1.0):
    """Timings made up: `fastest` takes kernel_seconds a call, every other configuration twice cuBLAS's."""

    def seconds(copies, rows, config):
        if config is None:
            return cublas_seconds
        return kernel_seconds if config == fastest else 2 * cublas_seconds

    monkeypatch.setattr(gemv, "seconds_a_call", seconds)
    gemv._timed_shape.cache_clear()


def _kernels(model) -> set:
    return {None if m.kernel is None else m.kernel.config for m in model.modules() if isinstance(m, Linear)}


def test_each_layer_shape_takes_the_fastest_configuration_where_it_beats_cublas(monkeypatch):
    model = tiny_model(seed=1).model
    _timings(monkeypatch, CONFIGS[2], kernel_seconds=0.5)
    timed = gemv.attach_gemv(model)
    assert _kernels(model) == {CONFIGS[2]}
    assert len(timed) == len({gemv.layer_shape(m) for m in model.modules() if isinstance(m, Linear)})
    assert all(t.chosen == CONFIGS[2] and t.cublas == [1.0, 1.0] for t in timed.values())
    _timings(monkeypatch, CONFIGS[2], kernel_seconds=0.99)  # within the timing's noise: cuBLAS kept
    gemv.attach_gemv(model)
    assert _kernels(model) == {None}
    monkeypatch.setenv(gemv.CHOICE, "triton")  # the fastest configuration, whatever cuBLAS does
    gemv.attach_gemv(model)
    assert _kernels(model) == {CONFIGS[2]}
    monkeypatch.setenv(gemv.CHOICE, "cublas")
    assert gemv.attach_gemv(model) == {} and _kernels(model) == {None}
    monkeypatch.setenv(gemv.CHOICE, "cutlass")
    with pytest.raises(ValueError, match="'auto', 'cublas' or 'triton'"):
        gemv.attach_gemv(model)
    gemv._timed_shape.cache_clear()


def _does_not_fit(*args, **kwargs):
    """What Triton raises where a launch needs more shared memory than the device's programs may have."""
    raise OutOfResources(196608, 101376, "shared memory")


def test_configurations_that_do_not_fit_the_device_are_passed_over(monkeypatch):
    """A device with less shared memory than a configuration needs (a float32 model's BLOCK_K 512 on an sm_89 card)
    refuses its launches: start-up takes the fastest configuration that runs, or cuBLAS where none does."""
    model = tiny_model(seed=1).model
    _timings(monkeypatch, CONFIGS[2], kernel_seconds=0.1)
    timed_fastest = gemv.seconds_a_call

    def seconds(copies, rows, config):
        if config == CONFIGS[2]:
            _does_not_fit()
        return 0.5 if config == CONFIGS[4] else timed_fastest(copies, rows, config)

    monkeypatch.setattr(gemv, "seconds_a_call", seconds)
    timed = gemv.attach_gemv(model)
    assert _kernels(model) == {CONFIGS[4]}
    assert all(t.configs[CONFIGS[2]] == [math.inf, math.inf] for t in timed.values())
    monkeypatch.setattr(gemv, "seconds_a_call", lambda copies, rows, config: 1.0 if config is None else _does_not_fit())
    monkeypatch.setenv(gemv.CHOICE, "triton")  # even where asked for, a kernel that cannot run is not taken
    gemv._timed_shape.cache_clear()
    gemv.attach_gemv(model)
    assert _kernels(model) == {None}
    gemv._timed_shape.cache_clear()


def test_a_kernel_whose_prologues_do_not_fit_is_taken_without_them(monkeypatch):
    model = tiny_model(seed=1).model
    _timings(monkeypatch, CONFIGS[0], kernel_seconds=0.1)
    compute = gemv.gemv

    def without_room_for_prologues(x, weight, bias, config, norm=None, *args, activated=False, **kwargs):
        if norm is not None or activated:
            _does_not_fit()
        return compute(x, weight, bias, config, norm, *args, activated=activated, **kwargs)

    monkeypatch.setattr(gemv, "gemv", without_room_for_prologues)
    gemv.attach_gemv(model)
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert _kernels(model) == {CONFIGS[0]} and not any(m.kernel.prologues for m in layers)
    gemv._timed_shape.cache_clear()


def test_a_kernel_that_disagrees_with_cublas_is_not_taken(monkeypatch, caplog):
    model = tiny_model(seed=1).model
    _timings(monkeypatch, CONFIGS[0], kernel_seconds=0.1)
    compute = gemv.gemv
    monkeypatch.setattr(gemv, "gemv", lambda *args: compute(*args) * 1.01)
    with caplog.at_level(logging.WARNING):
        gemv.attach_gemv(model)
    assert _kernels(model) == {None} and "disagrees" in caplog.text
    gemv._timed_shape.cache_clear()


@pytest.mark.parametrize("mistake", ["the norm over half of K", "the residual stream never written", "SiLU of up"])
def test_a_kernel_whose_prologues_disagree_is_taken_without_them(mistake, monkeypatch, caplog, tmp_path):
    """Start-up checks the norm and SwiGLU the kernel takes in as it checks the layer: where they disagree with the
    separate steps, the layers take the kernel alone and the model runs the norm and SwiGLU apart."""
    monkeypatch.setattr(gemv, "TAKES_PROLOGUES", True)
    model = tiny_model(seed=1).model
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    _timings(monkeypatch, CONFIGS[0], kernel_seconds=0.1)
    gemv.attach_gemv(model)
    assert all(m.kernel.prologues for m in layers)  # the test can pass
    monkeypatch.setattr(gemv, "gemv", with_mistake(gemv, *MISTAKES[mistake], tmp_path, monkeypatch).gemv)
    gemv._timed_shape.cache_clear()
    with caplog.at_level(logging.WARNING):
        gemv.attach_gemv(model)
    assert _kernels(model) == {CONFIGS[0]} and not any(m.kernel.prologues for m in layers)
    assert "without the norm or SwiGLU" in caplog.text
    x = torch.randn(2, layers[0].in_features, device=DEVICE, dtype=DTYPE)
    with cuda_graphs._fixed_shapes():  # where the kernel takes calls, the norm is computed apart, SwiGLU declined
        assert torch.equal(
            layers[0].kernel.normed(layers[0], model.norm, x, None)[0], layers[0].kernel(layers[0], model.norm(x))
        )
        assert layers[0].kernel.activated(layers[0], torch.cat([x, x], -1), "silu") is None
    gemv._timed_shape.cache_clear()


def test_start_up_says_what_captured_forwards_run(monkeypatch, request):
    from specdecode import LLM
    from specdecode.executor import runner as runner_module

    target = tiny_model(seed=2)
    assert "captured forwards" not in LLM(target=target, max_model_len=64, progress=False).startup_summary()
    request.getfixturevalue("captured")
    monkeypatch.setattr(runner_module, "fixed_shapes_by_default", lambda model: True)
    layers = [m for m in target.model.modules() if isinstance(m, Linear)]
    layers[0].kernel, layers[1].kernel = Gemv(CONFIGS[0]), Gemv(CONFIGS[0], prologues=False)
    layers[0].kernel.rope_epilogue = True  # the first layer's QKV projection, as paged_attention.attach_epilogues sets
    try:
        summary = LLM(target=target, max_model_len=64, progress=False).startup_summary()
    finally:
        for layer in layers[:2]:
            layer.kernel = None
    assert f"2 of {len(layers)} linear layers by the Triton kernel" in summary
    assert "1 of them without the norm or SwiGLU before them" in summary
    assert "RoPE and the cache write in the kernel of 1 of 2 QKV projections" in summary
    assert "attention by PyTorch's SDPA" in summary  # the paged kernels are a GPU's, after their check
