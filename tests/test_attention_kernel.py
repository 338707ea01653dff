"""The attention kernel (rope + KV write + attention of decode/verify batches in one call per layer):
the same numbers as the PyTorch path, and each token computed as if it were alone."""

import ctypes
from importlib import resources

import pytest
import torch
from conftest import ByteTokenizer, kernel_builds, lowbit_tiny_model, tiny_model

from specdecode import LLM, SamplingParams
from specdecode.executor import kernels
from specdecode.executor.attention import attach_attention_kernel
from specdecode.executor.kernels import bind, build, compiler, load, machine_defines
from specdecode.executor.runner import ModelRunner
from specdecode.kv_cache import tiled_keys, untiled_keys
from specdecode.models.loader import LoadedModel

pytestmark = pytest.mark.skipif(load("attention") is None, reason="the attention kernel needs a C compiler")
PROMPT = list(range(1, 40))


def _with_kernel(seed=0, kv_cache_dtype="auto", **cfg):
    model = tiny_model(seed=seed, **cfg).model
    assert attach_attention_kernel(model, kv_cache_dtype)
    return model


def _verify(model, drafts):
    runner = ModelRunner(model, 2, 128)
    slot = runner.allocate()
    runner.forward([slot], [PROMPT], "last")
    runner.commit(slot, len(PROMPT))
    return runner.forward([slot], [drafts], "all"), runner


@pytest.mark.parametrize("kv_cache_dtype, tolerance", [("float32", 1e-5), ("float16", 1e-3)])
def test_the_kernel_computes_what_pytorch_does(kv_cache_dtype, tolerance):
    """Over either cache type. (Rotary embeddings that differ in the last float32 bit can round to
    neighbouring float16 values, hence the float16 cache's tolerance: one float16 step.)"""
    reference_model = tiny_model(seed=0).model
    reference_model.kv_cache_dtype = getattr(torch, kv_cache_dtype)
    reference, torch_runner = _verify(reference_model, [5, 6, 7])
    got, kernel_runner = _verify(_with_kernel(kv_cache_dtype=kv_cache_dtype), [5, 6, 7])
    assert kernel_runner._cache.k[0].dtype == getattr(torch, kv_cache_dtype)
    torch.testing.assert_close(got, reference, rtol=tolerance, atol=tolerance)
    n = len(PROMPT) + 3
    for layer in range(len(kernel_runner._cache.k)):  # rotated keys and values land where PyTorch puts them
        torch.testing.assert_close(
            kernel_runner._cache.keys(layer, 0, n),
            torch_runner._cache.keys(layer, 0, n),
            rtol=tolerance,
            atol=tolerance,
        )
        torch.testing.assert_close(kernel_runner._cache.values(layer, 0, n), torch_runner._cache.values(layer, 0, n))


def test_a_verified_token_is_computed_as_if_decoded_alone():
    model = lowbit_tiny_model()
    verified, _ = _verify(model, [5, 6, 7])
    runner = ModelRunner(model, 1, 128)
    slot = runner.allocate()
    runner.forward([slot], [PROMPT], "last")
    runner.commit(slot, len(PROMPT))
    alone = []
    for token in (5, 6, 7):
        alone.append(runner.forward([slot], [[token]], "all")[0])
        runner.commit(slot, runner.length(slot) + 1)
    assert torch.equal(verified, torch.stack(alone))


def _last_logits(model, pieces: list[list[int]]) -> torch.Tensor:
    """The last token's logits after feeding a prompt to a fresh runner in `pieces`, each one call."""
    runner = ModelRunner(model, 1, 256)
    slot = runner.allocate()
    for piece in pieces:
        logits = runner.forward([slot], [piece], "last")
        runner.commit(slot, runner.length(slot) + len(piece))
    return logits


LONG_PROMPT = [(7 * i + 3) % 60 + 1 for i in range(150)]  # wider than a verify call (MAX_VERIFY_WIDTH)
KEPT_PREFIX = 100  # also wider: what a finished request might leave behind for prefix caching


def test_a_prompt_gives_the_same_bits_whole_after_a_kept_prefix_and_token_by_token():
    """With the kernel a prefill attends row by row too, so a prompt continued from a kept prefix (prefix
    caching) computes exactly what a whole prefill does, and so does decoding its last token alone: greedy
    output does not depend on which earlier request left a prefix behind."""
    model = lowbit_tiny_model(hidden=256)
    whole = _last_logits(model, [LONG_PROMPT])
    assert torch.equal(_last_logits(model, [LONG_PROMPT[:KEPT_PREFIX], LONG_PROMPT[KEPT_PREFIX:]]), whole)
    assert torch.equal(_last_logits(model, [LONG_PROMPT[:-1], LONG_PROMPT[-1:]]), whole)


def test_a_masked_prefill_gives_other_bits_after_a_kept_prefix(monkeypatch):
    """The check above can fail: prefills by one masked call over the padded key range round differently
    from rows attended one by one, so the rest of a prompt after a kept prefix gets other bits."""
    model = lowbit_tiny_model(hidden=256)
    monkeypatch.setattr(ModelRunner, "_rowwise_width", lambda self: 64)
    after_prefix = _last_logits(model, [LONG_PROMPT[:KEPT_PREFIX], LONG_PROMPT[KEPT_PREFIX:]])
    assert not torch.equal(after_prefix, _last_logits(model, [LONG_PROMPT]))


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "float16"])
@pytest.mark.parametrize("isa", kernel_builds())
def test_every_build_gives_the_scalar_reference_bits(isa, kv_cache_dtype):
    model = _with_kernel(kv_cache_dtype=kv_cache_dtype)
    kernel = model.layers[0].self_attn.rowwise_kernel
    kernel.lib = load("attention", "scalar")
    reference, _ = _verify(model, [5, 6, 7, 8])
    kernel.lib = load("attention", isa)
    assert torch.equal(_verify(model, [5, 6, 7, 8])[0], reference)


def test_greedy_speculation_equals_plain_decoding_with_the_kernel():
    target = LoadedModel("tiny-kernel", _with_kernel(), ByteTokenizer(64), tiny_model().config)
    draft = LoadedModel(
        "tiny-kernel-draft", _with_kernel(seed=7, layers=1), ByteTokenizer(64), tiny_model(seed=7, layers=1).config
    )
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = [[5, 17, 33, 2, 9, 41], [60, 1, 1, 7], [12, 12, 12, 30, 31, 32, 33, 34]]
    plain = LLM(target=target, num_speculative_tokens=0, max_model_len=128, max_num_seqs=4)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    spec = LLM(
        target=target,
        draft=draft,
        num_speculative_tokens=4,
        max_model_len=128,
        max_num_seqs=4,
        speculation_policy="fixed",
    )
    outs = spec.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert sum(o.spec["num_draft_tokens"] for o in outs) > 0


# (query heads, KV heads, dimension per head): the 0.5B's, the 1.5B's, a head narrower than two vectors, one
# query head per KV head over 6 vectors (AVX2 weighs 4 then 2), 8 per KV head (AVX2 weighs 6 then 2)
SHAPES = [(14, 2, 64), (12, 2, 128), (6, 1, 16), (3, 3, 48), (16, 2, 32)]


def _call(
    lib,
    qkv,
    H,
    Hkv,
    D,
    slots,
    positions,
    cos,
    sin,
    k,
    v,
    out,
    window=0,
    scale=None,
    norms=None,
    eps=1e-6,
    tables=None,
    softcap=0.0,
    sinks=None,
) -> int:
    """One call of the kernel over the cache k, v [blocks, Hkv, B, D] read through tables [S, MB] (default: one
    block a slot, slot s's block s); norms: (q weights, k weights) or None; softcap: of the scores (0: none); sinks:
    [H] logits in each head's softmax (gpt-oss's) or None. The keys
    go to the kernel in tiles as the cache stores them, and the ones it writes come back into k."""
    attend = lib.rowwise_attention_f16 if k.dtype == torch.float16 else lib.rowwise_attention
    q_norm, k_norm = (0, 0) if norms is None else (norms[0].data_ptr(), norms[1].data_ptr())
    if tables is None:
        tables = torch.arange(k.shape[0], dtype=torch.int32)[:, None]
    tiles = tiled_keys(k)
    code = attend(
        qkv.data_ptr(),
        len(slots),
        H,
        Hkv,
        D,
        slots.data_ptr(),
        positions.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        q_norm,
        k_norm,
        eps,
        D**-0.5 if scale is None else scale,
        window,
        softcap,
        0 if sinks is None else sinks.data_ptr(),
        tiles.data_ptr(),
        v.data_ptr(),
        tables.data_ptr(),
        tables.shape[0],
        tables.shape[1],
        k.shape[2],
        k.shape[0],
        out.data_ptr(),
        torch.get_num_threads(),
    )
    k.copy_(untiled_keys(tiles))
    return code


def _attend_long_context(isa, dtype: torch.dtype, shape=SHAPES[0], n: int = 300, **options):
    """The kernel alone (the build `isa`, or a library): one token at position n - 1 after n - 1 random cached
    keys, and two verified drafts after it."""
    (H, Hkv, D), L = shape, 512
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(3, (H + 2 * Hkv) * D, generator=gen)
    k = (torch.randn(1, Hkv, L, D, generator=gen) * 3).to(dtype)
    v = torch.randn(1, Hkv, L, D, generator=gen).to(dtype)
    angles = torch.rand(3, D // 2, generator=gen).repeat(1, 2) * 6
    cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
    slots, positions = torch.zeros(3, dtype=torch.int64), torch.arange(n - 1, n + 2, dtype=torch.int64)
    out = torch.empty(3, H * D)
    lib = load("attention", isa) if isinstance(isa, str) else isa
    sinks = _sinks(H) if options.pop("sinks", False) else None
    assert _call(lib, qkv, H, Hkv, D, slots, positions, cos, sin, k, v, out, sinks=sinks, **options) == 0
    return out, qkv, k, v, cos, sin, positions


def _sinks(heads: int) -> torch.Tensor:
    """gpt-oss's sinks: each head's own, from well below these scores to well above them."""
    return torch.linspace(-4.0, 6.0, heads)


def _rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def _rms_norm(x, weight, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


# a sliding window that ends inside a block of keys, and one inside a block of values, with a query scale and
# q/k norms (Gemma 3's layers), and none of them (Llama's); scores soft-capped (Gemma 2's layers: a cap these
# scores, about 3 at most, bend far from their own)
WINDOWED = [
    dict(),
    dict(window=37, scale=0.11),
    dict(window=130, norms=True),
    dict(window=37, softcap=1.5),
    dict(window=37, sinks=True),
]
WINDOWED_IDS = ["full", "window-37", "window-130-qk-norm", "window-37-softcap", "window-37-sinks"]
BITS_CASES = dict(argnames="options", argvalues=WINDOWED[:2] + WINDOWED[3:], ids=WINDOWED_IDS[:2] + WINDOWED_IDS[3:])


def _softcapped(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    return scores if not cap else torch.tanh(scores / cap) * cap


@pytest.mark.parametrize("options", WINDOWED, ids=WINDOWED_IDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_long_context_attention_matches_float64(dtype, shape, options):
    """Hundreds of keys (full and partial blocks of keys and values), either cache type: the scalar path
    against float64 attention over what the cache holds (the drafts' own k/v written by the call), over the
    last `window` keys only where a window is set."""
    H, Hkv, D = shape
    norms = (1 + torch.rand(D), 1 + torch.rand(D)) if options.get("norms") else None
    out, qkv, k, v, cos, sin, positions = _attend_long_context("scalar", dtype, shape, **{**options, "norms": norms})
    for t in range(3):
        q = qkv[t, : H * D].view(H, D).double()
        q = _rope(q if norms is None else _rms_norm(q, norms[0].double()), cos[t].double(), sin[t].double())
        n = int(positions[t]) + 1
        seen = slice(max(0, n - options.get("window", n)), n)
        keys = k[0, :, seen].double().repeat_interleave(H // Hkv, 0)
        values = v[0, :, seen].double().repeat_interleave(H // Hkv, 0)
        scores = q[:, None, :] @ keys.transpose(1, 2) * options.get("scale", D**-0.5)
        scores = _softcapped(scores, options.get("softcap"))
        if options.get("sinks"):
            scores = torch.cat([scores, _sinks(H).double().view(H, 1, 1)], -1)
        weights = torch.softmax(scores, -1)[..., : seen.stop - seen.start]
        torch.testing.assert_close(out[t].double(), (weights @ values).reshape(H * D), rtol=1e-4, atol=1e-5)
    if norms is not None:  # the drafts' keys went into the cache normalised, then rotated
        raw = qkv[2, H * D : (H + Hkv) * D].view(Hkv, D).double()
        expected = _rope(_rms_norm(raw, norms[1].double()), cos[2].double(), sin[2].double())
        torch.testing.assert_close(k[0, :, int(positions[2])].double(), expected, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(**BITS_CASES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("isa", kernel_builds())
def test_long_context_attention_gives_the_scalar_bits_on_every_build(isa, dtype, shape, options):
    assert torch.equal(
        _attend_long_context(isa, dtype, shape, **options)[0],
        _attend_long_context("scalar", dtype, shape, **options)[0],
    )


def _the_other_prefetching_build():
    """This machine's own build, asking for the cache ahead into the other level than it does here (L2 on Intel's
    AVX-512 cores, L1 elsewhere), so that every machine runs both."""
    into_l2 = "-DSPECDECODE_PREFETCH_L2" in machine_defines("attention", "native")
    switch = b"#undef SPECDECODE_PREFETCH_L2\n" if into_l2 else b"#define SPECDECODE_PREFETCH_L2 1\n"
    source = switch + resources.files(kernels).joinpath("attention.c").read_bytes()
    return bind(ctypes.CDLL(build("attention", "native", compiler(), source)), "attention")


@pytest.mark.parametrize(**BITS_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_either_way_of_prefetching_gives_the_scalar_bits(dtype, options):
    other = _the_other_prefetching_build()
    for shape in SHAPES[:2]:
        assert torch.equal(
            _attend_long_context(other, dtype, shape, **options)[0],
            _attend_long_context("scalar", dtype, shape, **options)[0],
        )


@pytest.mark.parametrize(
    "vendor, flags, isa, into_l2",
    [
        ("GenuineIntel", {"avx2", "avx512f"}, "native", True),
        ("GenuineIntel", {"avx2", "avx512f"}, "avx512", True),
        ("GenuineIntel", {"avx2", "avx512f"}, "avx2", False),
        ("GenuineIntel", {"avx2"}, "native", False),
        ("AuthenticAMD", {"avx2", "avx512f"}, "native", False),
        ("AuthenticAMD", {"avx2", "avx512f"}, "avx512", False),
    ],
)
def test_the_cache_is_asked_for_into_l2_only_on_intels_avx512_cores(monkeypatch, vendor, flags, isa, into_l2):
    monkeypatch.setattr(kernels, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset(flags))
    assert ("-DSPECDECODE_PREFETCH_L2" in machine_defines("attention", isa)) == into_l2
    assert machine_defines("norm", isa) == []


def test_a_window_the_kernel_ignored_would_fail_the_reference():
    """The float64 check above sees a window: the whole context's attention is far from the windowed one."""
    windowed = _attend_long_context("scalar", torch.float32, window=37)[0]
    assert not torch.allclose(windowed, _attend_long_context("scalar", torch.float32)[0], rtol=1e-3, atol=1e-3)


def test_sinks_the_kernel_ignored_would_fail_the_reference():
    sunk = _attend_long_context("scalar", torch.float32, window=37, sinks=True)[0]
    assert not torch.allclose(sunk, _attend_long_context("scalar", torch.float32, window=37)[0], rtol=1e-3, atol=1e-3)


def test_a_soft_cap_the_kernel_ignored_would_fail_the_reference():
    capped = _attend_long_context("scalar", torch.float32, window=37, softcap=1.5)[0]
    assert not torch.allclose(capped, _attend_long_context("scalar", torch.float32, window=37)[0], rtol=1e-3, atol=1e-3)


def test_a_call_outside_the_cache_or_of_a_shape_it_does_not_take_is_refused_with_a_code():
    (H, Hkv, D), lib = SHAPES[0], load("attention", "scalar")
    qkv, out = torch.randn(1, (H + 2 * Hkv) * D), torch.empty(1, H * D)
    k = v = torch.zeros(1, Hkv, 32, D)
    cos = sin = torch.ones(1, D)

    def call(slot, position, **kw):
        return _call(lib, qkv, H, Hkv, D, torch.tensor([slot]), torch.tensor([position]), cos, sin, k, v, out, **kw)

    assert call(0, 31) == 0
    assert call(0, 32) == call(1, 0) == -3  # past the cache's length, a slot it does not have
    assert call(0, 0, window=-1) == -1
    assert call(0, 0, tables=torch.tensor([[7]], dtype=torch.int32)) == -3  # a block the cache does not have


def _attend_batch(isa: str, dtype: torch.dtype, slots: list[int], positions: list[int], seed: int = 2, **options):
    """One call of the kernel on the 0.5B's shapes over a cache of random keys and values in two slots:
    the outputs and the cache after the call (which the call extends with the batch's own keys)."""
    H, Hkv, D, L, N = 14, 2, 64, 512, len(slots)
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(N, (H + 2 * Hkv) * D, generator=gen)
    k = (torch.randn(2, Hkv, L, D, generator=gen) * 3).to(dtype)
    v = torch.randn(2, Hkv, L, D, generator=gen).to(dtype)
    angles = torch.rand(N, D // 2, generator=gen).repeat(1, 2) * 6
    cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
    slots_t, positions_t = torch.tensor(slots, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64)
    lib = load("attention", isa)
    out = torch.empty(N, H * D)
    assert _call(lib, qkv, H, Hkv, D, slots_t, positions_t, cos, sin, k, v, out, **options) == 0
    alone = torch.empty(N, H * D)
    for t in range(N):  # each token again in a call of its own, over the cache the batch call left
        assert (
            _call(
                lib,
                qkv[t : t + 1],
                H,
                Hkv,
                D,
                slots_t[t : t + 1],
                positions_t[t : t + 1],
                cos[t : t + 1],
                sin[t : t + 1],
                k,
                v,
                alone[t : t + 1],
                **options,
            )
            == 0
        )
    return out, alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("isa", kernel_builds())
def test_a_sequences_verified_tokens_attend_together_as_if_each_were_alone(isa, dtype):
    """A batch as verification makes it: one sequence's 11 tokens (more than attend together in one run,
    with key and value blocks that end inside the run), another's 3 at a position of its own, and a
    decoded token beside them: every token's output is the bits of a call of its own."""
    slots = [0] * 11 + [1] * 3 + [1]
    positions = list(range(290, 301)) + [40, 41, 42] + [200]
    out, alone = _attend_batch(isa, dtype, slots, positions)
    assert torch.equal(out, alone)


@pytest.mark.parametrize("window, first", [(5, 290), (37, 290), (300, 423)])
@pytest.mark.parametrize("isa", kernel_builds())
def test_verified_tokens_in_a_sliding_window_attend_together_as_if_each_were_alone(isa, window, first):
    """The same under a window narrower than a run of tokens (5: each token's first key differs from the
    run's), one whose start falls inside a block of keys (37), and one wider than a chunk of keys whose first
    keys straddle a multiple of 32 within a run of 8 (300 from 423: the run's first token sees keys from 124, its
    last from 131), with q/k norms and another scale: a token's chunks start where they would alone."""
    slots = [0] * 11 + [1] * 3 + [1]
    positions = list(range(first, first + 11)) + [40, 41, 42] + [200]
    norms = (1 + torch.rand(64), 1 + torch.rand(64))
    out, alone = _attend_batch(isa, torch.float16, slots, positions, window=window, scale=0.07, norms=norms)
    assert torch.equal(out, alone)


def _softmax_exponentials(isa: str, scores: torch.Tensor, softcap: float = 0.0) -> tuple[torch.Tensor, float]:
    p = scores.clone()
    total = load("attention", isa).attention_softmax_unnormalised(p.data_ptr(), p.numel(), softcap)
    return p, total


def _scores_over_exp_range(n: int = 20_003) -> torch.Tensor:
    """Scores whose differences from the maximum span exp's whole range and past its clamp at -87, in
    full 16-lane blocks and a ragged tail."""
    gen = torch.Generator().manual_seed(1)
    return torch.cat([torch.rand(n - 3, generator=gen) * -120, torch.tensor([0.0, -87.0, -200.0])])


@pytest.mark.parametrize("isa", kernel_builds())
def test_softmax_exponentials_give_the_scalar_bits_on_every_build(isa):
    """The polynomial exp lane by lane (the SIMD paths) against the scalar path, bit for bit."""
    scores = _scores_over_exp_range()
    got, total = _softmax_exponentials(isa, scores)
    reference, reference_total = _softmax_exponentials("scalar", scores)
    assert torch.equal(got, reference) and total == reference_total


def _scores_over_tanh_range(n: int = 20_003) -> torch.Tensor:
    """Scores of either sign from far inside the cap (where tanh is its argument) to far past it (where it is 1),
    and the edges: zeros of both signs, the largest float."""
    gen = torch.Generator().manual_seed(2)
    spread = torch.randn(n - 4, generator=gen) * torch.logspace(-6, 3, n - 4)
    return torch.cat([spread, torch.tensor([0.0, -0.0, 3.4e38, -3.4e38])])


@pytest.mark.parametrize("isa", kernel_builds())
def test_soft_capped_exponentials_give_the_scalar_bits_on_every_build(isa):
    scores = _scores_over_tanh_range()
    got, total = _softmax_exponentials(isa, scores, softcap=30.0)
    reference, reference_total = _softmax_exponentials("scalar", scores, softcap=30.0)
    assert torch.equal(got, reference) and total == reference_total


def test_soft_capped_scores_are_cap_times_tanh_to_within_a_few_ulp_of_the_cap():
    """The exponentials of capped scores against float64's: the cap's tanh is (1 - e) / (1 + e), whose error near
    zero is a few ulp of 1 (not of the score), times the cap."""
    cap, scores = 30.0, _scores_over_tanh_range()
    got, total = _softmax_exponentials("scalar", scores, softcap=cap)
    capped = _softcapped(scores.double(), cap)
    exact = torch.exp(capped - capped.max())
    torch.testing.assert_close(got.double(), exact, rtol=4 * cap * 2**-24, atol=0)
    assert total == pytest.approx(float(exact.sum()), rel=1e-5)
    uncapped, _ = _softmax_exponentials("scalar", scores)
    assert not torch.allclose(uncapped.double(), exact, rtol=1e-3, atol=1e-6)


def test_softmax_exponentials_are_exp_to_within_a_few_ulp():
    scores = _scores_over_exp_range()
    got, total = _softmax_exponentials("scalar", scores)
    shifted = scores.double() - scores.max().double()
    exact = torch.exp(shifted.clamp(min=-87.0))  # below -87 the kernel gives exp(-87), not a denormal
    torch.testing.assert_close(got.double(), exact, rtol=3e-7, atol=0)
    assert total == pytest.approx(float(exact.sum()), rel=1e-5)


def _into_blocks(cache: torch.Tensor, block: int, order: torch.Tensor) -> torch.Tensor:
    """A cache [S, Hkv, L, D] cut into blocks of `block` positions, stored in the pool at `order`'s places."""
    S, Hkv, L, D = cache.shape
    blocks = cache.view(S, Hkv, L // block, block, D).transpose(1, 2).reshape(-1, Hkv, block, D)
    pool = torch.empty_like(blocks)
    pool[order] = blocks
    return pool


@pytest.mark.parametrize("block", [32, 64, 256])
@pytest.mark.parametrize("isa", kernel_builds())
def test_a_cache_in_scattered_blocks_gives_the_contiguous_caches_bits(isa, block):
    """Keys and values read through block tables (blocks in a shuffled order in the pool) under a window that
    ends inside a block: the same outputs, and the same entries written, as one contiguous stretch a slot."""
    H, Hkv, D, L, N = 14, 2, 64, 512, 15
    slots = torch.tensor([0] * 11 + [1] * 4, dtype=torch.int64)
    positions = torch.tensor(list(range(290, 301)) + [40, 41, 42, 200], dtype=torch.int64)
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(N, (H + 2 * Hkv) * D, generator=gen)
    k, v = (torch.randn(2, Hkv, L, D, generator=gen).half() for _ in range(2))
    angles = torch.rand(N, D // 2, generator=gen).repeat(1, 2) * 6
    cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
    lib, options = load("attention", isa), dict(window=37, scale=0.07)
    expected = torch.empty(N, H * D)
    order = torch.randperm(2 * L // block, generator=gen)
    k_blocks, v_blocks = _into_blocks(k, block, order), _into_blocks(v, block, order)
    assert _call(lib, qkv, H, Hkv, D, slots, positions, cos, sin, k, v, expected, **options) == 0
    got = torch.empty(N, H * D)
    tables = order.view(2, L // block).to(torch.int32)
    assert (
        _call(lib, qkv, H, Hkv, D, slots, positions, cos, sin, k_blocks, v_blocks, got, tables=tables, **options) == 0
    )
    assert torch.equal(got, expected)
    assert torch.equal(k_blocks, _into_blocks(k, block, order)) and torch.equal(v_blocks, _into_blocks(v, block, order))
