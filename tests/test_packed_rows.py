"""A GPU's packed eager calls attended by the paged kernels (executor/paged_rows.py), run in Triton's interpreter on a
CPU (tests/conftest.py turns it on) and compiled with SPECDECODE_TEST_DEVICE=cuda: whole eager forwards against
PyTorch's row-by-row path, a token's bits the same in any call and as a captured forward's decode row, the width a
runner packs with them, and an engine's greedy outputs with them. Versions with a mistake in their source fail."""

import pytest
import torch
from conftest import DEVICE, cloned_cache, tiny_model, with_mistake

pytest.importorskip("triton", reason="the GPU kernels' tests need Triton (the test extras install it)")

from specdecode import LLM, SamplingParams  # noqa: E402
from specdecode.config import MAX_VERIFY_WIDTH  # noqa: E402
from specdecode.executor import paged_rows  # noqa: E402
from specdecode.executor import runner as runner_module  # noqa: E402
from specdecode.executor.cuda_graphs import Bucket, StaticBatch  # noqa: E402
from specdecode.executor.paged_attention import PagedAttention  # noqa: E402
from specdecode.executor.paged_rows import PackedRowAttention  # noqa: E402
from specdecode.executor.runner import ModelRunner  # noqa: E402
from specdecode.models.runtime import ForwardBatch  # noqa: E402

ATOL = 2e-5 if DEVICE == "cpu" else 2e-2  # float32 on a CPU: the kernels sum keys in another order than SDPA

FEATURES = {
    "qwen2": {},
    "window+local-rope+qk-norm+softcap": {
        "arch": "llama", "sliding_window": 6, "sliding_layers": (1,), "local_rope_theta": 500.0, "qk_norm": True,
        "attention_softcap": 0.5,
    },
}  # fmt: skip


def _attach(model, kernel) -> None:
    for layer in model.layers:
        layer.self_attn.rowwise_kernel = kernel


def _forwards(model, kernel, widths=((70, 12), (1, 6), (5, 1), (3, 4), (1, 2))):
    """Eager forwards of two sequences: a prompt wider than a packed call and one beside it, then prompts, decodes
    and verifies, a rejected draft now and then; every row's logits."""
    runner = ModelRunner(model, 3, 600, fixed_shapes=False)
    _attach(model, kernel)  # after the runner, which on a GPU attaches the kernels itself
    slots = [runner.allocate(), runner.allocate()]
    g = torch.Generator().manual_seed(0)
    outs = []
    for step in widths:
        inputs = [torch.randint(0, 60, (n,), generator=g).tolist() for n in step]
        outs.append(runner.forward(slots, inputs, "all"))
        for slot, new in zip(slots, inputs):
            runner.commit(slot, runner.length(slot) + len(new) - (len(new) > 2))
    return outs


@pytest.mark.parametrize("features", FEATURES, ids=list(FEATURES))
def test_packed_eager_forwards_with_the_kernels_compute_pytorchs_row_by_row_attention(features):
    model = tiny_model(seed=3, max_position=1024, **FEATURES[features]).model
    attention = PagedAttention()
    for got, want in zip(_forwards(model, PackedRowAttention(attention)), _forwards(model, None)):
        torch.testing.assert_close(got, want, atol=10 * ATOL, rtol=0)


def _attention_case(seed: int = 0):
    """A tiny model's first attention layer, a cache whose two sequences hold 300 and 7 tokens, and a packed call of
    new tokens: a verify of 4 rows of the first, one decode row of the second, and its q, k, v and RoPE tables."""
    model = tiny_model(seed=seed, max_position=1024).model
    attn = model.layers[0].self_attn
    runner = ModelRunner(model, 2, 512, fixed_shapes=True)  # a scratch block, as a captured forward's cache has
    cache = runner._cache
    starts, num_new = [300, 7], [4, 1]
    for slot, (start, n) in enumerate(zip(starts, num_new)):
        cache.reserve(slot, start + n)
    g = torch.Generator().manual_seed(seed)
    for part in cache.k + cache.v:
        part.copy_(torch.randn(part.shape, generator=g))
    batch = ForwardBatch.build([0, 1], starts, num_new, 512, DEVICE, "all")
    width = attn.qkv_proj.weight.shape[0]
    qkv = torch.randn(1, sum(num_new), width, generator=g).to(DEVICE)
    rope = model.rope_tables(batch.positions, qkv.dtype)[attn.rope]
    return attn, cache, batch, qkv, rope


def test_a_token_gets_the_same_bits_alone_and_as_a_captured_forwards_decode_row():
    attn, cache, batch, qkv, rope = _attention_case()
    kernel = PackedRowAttention(PagedAttention())
    together = kernel(qkv, rope, batch, cache, attn)  # writes every new token's key and value
    positions, slots = batch.positions[0].tolist(), batch.slots[0].tolist()
    for i, (position, slot) in enumerate(zip(positions, slots)):
        alone = ForwardBatch.build([slot], [position], [1], 512, DEVICE, "all")
        tables = tuple(t[:, :, i : i + 1] for t in rope)
        assert torch.equal(kernel(qkv[:, i : i + 1], tables, alone, cloned_cache(cache), attn)[0], together[i])
        decode = StaticBatch(Bucket(2, 1, 512), DEVICE)  # beside a padding sequence
        decode.fill([slot], [position], [[0]], cache.scratch_row)
        q, k, v = (t[:, i : i + 1] for t in attn.split_heads(qkv))
        pad = [torch.cat([t, torch.zeros_like(t)]) for t in (q, k, v)]
        rows = [torch.cat([t, t]) for t in tables]
        captured = PagedAttention()(decode, cloned_cache(cache), attn.layer, *pad, rows, attn.window, attn.scale)
        assert torch.equal(captured[0, 0], together[i])


MISTAKES = {  # what the source says, and what the broken version says instead
    "keys up to the next power of two of half the furthest": (
        "triton.next_power_of_2(batch.kv_len)", "triton.next_power_of_2(batch.kv_len // 2)"
    ),
    "every layer rotated by the first table it met": (
        "cos, sin, _ = rows.rope[id(rope[0])]", "cos, sin, _ = next(iter(rows.rope.values()))"
    ),
    "each token at the position after its own": (
        "positions, slots = batch.positions.reshape(-1),", "positions, slots = batch.positions.reshape(-1) + 1,"
    ),
    "every token in the first token's slot": (
        "batch.slots.reshape(-1)\n", "batch.slots.reshape(-1)[:1].repeat(batch.slots.numel())\n"
    ),
}  # fmt: skip


@pytest.mark.parametrize("mistake", MISTAKES, ids=list(MISTAKES))
def test_kernels_with_a_mistake_fail(mistake, tmp_path, monkeypatch):
    broken = with_mistake(paged_rows, *MISTAKES[mistake], tmp_path, monkeypatch)
    model = tiny_model(seed=3, max_position=1024, **FEATURES["window+local-rope+qk-norm+softcap"]).model
    widths = ((300, 6), (2, 1))  # keys past the least a call rounds to
    got = _forwards(model, broken.PackedRowAttention(PagedAttention()), widths)
    want = _forwards(model, None, widths)
    assert not all(torch.allclose(a, b, atol=10 * ATOL, rtol=0) for a, b in zip(got, want))


def test_a_gpus_runners_attend_packed_eager_calls_with_the_kernels_up_to_the_verify_width(monkeypatch):
    model = tiny_model(seed=1).model
    runner_module._checked_kernels.cache_clear()
    assert isinstance(runner_module.gpu_attention(model), PagedAttention)  # they pass their check here
    kernels = {layer.self_attn.rowwise_kernel for layer in model.layers}
    assert len(kernels) == 1 and isinstance(kernels.pop(), PackedRowAttention)
    runner = ModelRunner(model, 2, 256, fixed_shapes=False)
    assert runner._rowwise_width() == MAX_VERIFY_WIDTH and not runner.packs_any_width
    other = tiny_model(seed=1).model
    monkeypatch.setenv(runner_module.ATTENTION_CHOICE, "sdpa")
    assert runner_module.gpu_attention(other) is None
    assert all(layer.self_attn.rowwise_kernel is None for layer in other.layers)
    runner_module._checked_kernels.cache_clear()


def test_greedy_speculation_with_the_kernels_reproduces_plain_decoding(monkeypatch):
    """A mixture of experts' engine on a GPU whose experts keep PyTorch's path (every forward eager) attends every
    step's packed rows with the kernels: drafts verified by them (a draft of the target's weights, attended by
    PyTorch's row-by-row path: accepted where the kernels agree) give plain decoding's tokens, and those of PyTorch's
    path."""
    monkeypatch.setenv(runner_module.EXPERTS_CHOICE, "pytorch")
    moe = dict(arch="mixtral", num_experts=4, experts_per_token=2)
    target, draft = tiny_model(seed=0, **moe), tiny_model(seed=0, **moe)
    prompts = [[5, 6, 7, 8, 9, 10], [20, 21, 22]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def generated(kernel, k):
        llm = LLM(target=target, draft=draft, num_speculative_tokens=k, max_model_len=64, progress=False,
                  speculation_policy="fixed")  # fmt: skip
        _attach(target.model, kernel)
        outputs = llm.generate(prompts, params)
        return [out.outputs[0].token_ids for out in outputs], sum(out.spec["num_accepted_tokens"] for out in outputs)

    kernel = PackedRowAttention(PagedAttention())
    (speculated, accepted), (plain, _) = generated(kernel, 3), generated(kernel, 0)
    assert speculated == plain == generated(None, 0)[0]
    assert accepted > 10
