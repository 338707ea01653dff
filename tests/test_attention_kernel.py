"""The attention kernel (rope + KV write + attention of decode/verify batches in one call per layer):
the same numbers as the PyTorch path, and each token computed as if it were alone."""
import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.executor.attention import attach_attention_kernel
from specdecode.executor.kernels import load
from specdecode.executor.runner import ModelRunner
from specdecode.models.loader import LoadedModel

from conftest import ByteTokenizer, kernel_builds, tiny_model

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
    for layer in range(len(kernel_runner._cache.k)):  # rotated keys and values land where PyTorch puts them
        torch.testing.assert_close(kernel_runner._cache.k[layer], torch_runner._cache.k[layer], rtol=tolerance,
                                   atol=tolerance)
        torch.testing.assert_close(kernel_runner._cache.v[layer], torch_runner._cache.v[layer])


def _lowbit_with_kernel(hidden: int = 64):
    """A tiny model whose linear layers are the low-bit kernel (Q8_0 weights): each row of a call is
    computed alone by construction. (torch's float32 GEMM is not: on some CPUs, e.g. Ice Lake, it
    accumulates a row differently in a 1-row and a 4-row call, so a float model's logits differ in the
    last bit between verifying and decoding whatever the attention does.)"""
    from specdecode.executor.backends import build_quantized_model, quantize_weights
    from specdecode.executor.quant import lowbit_kernel

    from conftest import random_hf_weights, tiny_config

    if lowbit_kernel() is None:
        pytest.skip("the low-bit kernel needs a C compiler")
    cfg = tiny_config(hidden=hidden)
    model = build_quantized_model(cfg, quantize_weights(random_hf_weights(cfg, 0).items(), "w8a8"), "w8a8", "cpu")
    assert attach_attention_kernel(model) or model.layers[0].self_attn.rowwise_kernel is not None
    return model


def test_a_verified_token_is_computed_as_if_decoded_alone():
    model = _lowbit_with_kernel()
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
    model = _lowbit_with_kernel(hidden=256)
    whole = _last_logits(model, [LONG_PROMPT])
    assert torch.equal(_last_logits(model, [LONG_PROMPT[:KEPT_PREFIX], LONG_PROMPT[KEPT_PREFIX:]]), whole)
    assert torch.equal(_last_logits(model, [LONG_PROMPT[:-1], LONG_PROMPT[-1:]]), whole)


def test_a_masked_prefill_gives_other_bits_after_a_kept_prefix(monkeypatch):
    """The check above can fail: prefills by one masked call over the padded key range round differently
    from rows attended one by one, so the rest of a prompt after a kept prefix gets other bits."""
    model = _lowbit_with_kernel(hidden=256)
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
    draft = LoadedModel("tiny-kernel-draft", _with_kernel(seed=7, layers=1), ByteTokenizer(64),
                        tiny_model(seed=7, layers=1).config)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = [[5, 17, 33, 2, 9, 41], [60, 1, 1, 7], [12, 12, 12, 30, 31, 32, 33, 34]]
    plain = LLM(target=target, num_speculative_tokens=0, max_model_len=128, max_num_seqs=4)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    spec = LLM(target=target, draft=draft, num_speculative_tokens=4, max_model_len=128, max_num_seqs=4,
               speculation_policy="fixed")
    outs = spec.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert sum(o.spec["num_draft_tokens"] for o in outs) > 0


# (query heads, KV heads, dimension per head): the 0.5B's, the 1.5B's, a head narrower than two vectors, one
# query head per KV head over 6 vectors (AVX2 weighs 4 then 2), 8 per KV head (AVX2 weighs 6 then 2)
SHAPES = [(14, 2, 64), (12, 2, 128), (6, 1, 16), (3, 3, 48), (16, 2, 32)]


def _attend_long_context(isa: str, dtype: torch.dtype, shape=SHAPES[0], n: int = 300):
    """The kernel alone: one token at position n - 1 after n - 1 random cached keys, and two verified
    drafts after it."""
    (H, Hkv, D), L = shape, 512
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(3, (H + 2 * Hkv) * D, generator=gen)
    k = (torch.randn(1, Hkv, L, D, generator=gen) * 3).to(dtype)
    v = torch.randn(1, Hkv, L, D, generator=gen).to(dtype)
    angles = torch.rand(3, D // 2, generator=gen).repeat(1, 2) * 6
    cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
    slots, positions = torch.zeros(3, dtype=torch.int64), torch.arange(n - 1, n + 2, dtype=torch.int64)
    out = torch.empty(3, H * D)
    lib = load("attention", isa)
    attend = lib.rowwise_attention_f16 if dtype == torch.float16 else lib.rowwise_attention
    attend(qkv.data_ptr(), 3, H, Hkv, D, slots.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
           k.data_ptr(), v.data_ptr(), L, out.data_ptr(), torch.get_num_threads())
    return out, qkv, k, v, cos, sin, positions


def _rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_long_context_attention_matches_float64(dtype, shape):
    """Hundreds of keys (full and partial blocks of keys and values), either cache type: the scalar path
    against float64 attention over what the cache holds (the drafts' own k/v written by the call)."""
    out, qkv, k, v, cos, sin, positions = _attend_long_context("scalar", dtype, shape)
    H, Hkv, D = shape
    for t in range(3):
        q = _rope(qkv[t, :H * D].view(H, D).double(), cos[t].double(), sin[t].double())
        n = int(positions[t]) + 1
        keys = k[0, :, :n].double().repeat_interleave(H // Hkv, 0)
        values = v[0, :, :n].double().repeat_interleave(H // Hkv, 0)
        weights = torch.softmax(q[:, None, :] @ keys.transpose(1, 2) / D ** 0.5, -1)
        torch.testing.assert_close(out[t].double(), (weights @ values).reshape(H * D), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("isa", kernel_builds())
def test_long_context_attention_gives_the_scalar_bits_on_every_build(isa, dtype, shape):
    assert torch.equal(_attend_long_context(isa, dtype, shape)[0], _attend_long_context("scalar", dtype, shape)[0])


def _attend_batch(isa: str, dtype: torch.dtype, slots: list[int], positions: list[int], seed: int = 2):
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
    attend = lib.rowwise_attention_f16 if dtype == torch.float16 else lib.rowwise_attention
    out = torch.empty(N, H * D)
    attend(qkv.data_ptr(), N, H, Hkv, D, slots_t.data_ptr(), positions_t.data_ptr(), cos.data_ptr(), sin.data_ptr(),
           k.data_ptr(), v.data_ptr(), L, out.data_ptr(), torch.get_num_threads())
    alone = torch.empty(N, H * D)
    for t in range(N):  # each token again in a call of its own, over the cache the batch call left
        attend(qkv[t].data_ptr(), 1, H, Hkv, D, slots_t[t:].data_ptr(), positions_t[t:].data_ptr(),
               cos[t].data_ptr(), sin[t].data_ptr(), k.data_ptr(), v.data_ptr(), L, alone[t].data_ptr(),
               torch.get_num_threads())
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


def _softmax_exponentials(isa: str, scores: torch.Tensor) -> tuple[torch.Tensor, float]:
    p = scores.clone()
    total = load("attention", isa).attention_softmax_unnormalised(p.data_ptr(), p.numel())
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


def test_softmax_exponentials_are_exp_to_within_a_few_ulp():
    scores = _scores_over_exp_range()
    got, total = _softmax_exponentials("scalar", scores)
    shifted = scores.double() - scores.max().double()
    exact = torch.exp(shifted.clamp(min=-87.0))  # below -87 the kernel gives exp(-87), not a denormal
    torch.testing.assert_close(got.double(), exact, rtol=3e-7, atol=0)
    assert total == pytest.approx(float(exact.sum()), rel=1e-5)
