"""The w4a8 backend: GGUF Q4_K and Q6_K weights kept as stored, int8 activations per block of 32, this
package's kernels. A tiny model is built from random Q4_K and Q6_K blocks (v and the LM head in Q6_K, as
in Q4_K_M files) and compared with the same weights dequantized to float."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from specdecode import LLM, SamplingParams
from specdecode.executor import backends
from specdecode.executor.backends import build_quantized_model, quantize_weights
from specdecode.executor.quant import (ConcatLinear, W4A8Linear, W6A8Linear, pack_w4a8, pack_w6a8, split_q4_k,
                                      split_q6_k, w4a8_supported)
from specdecode.executor.runner import ModelRunner
from specdecode.models.gguf_loader import RawTensor
from specdecode.models.loader import LoadedModel
from specdecode.models.runtime import build_model

from conftest import ByteTokenizer, random_hf_weights, tiny_config

pytestmark = pytest.mark.skipif(not w4a8_supported(), reason="the w4a8 kernel needs a C compiler and AVX2/FMA")
Q4_K, Q6_K = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K


def random_q4_k(rows: int, columns: int, seed: int, zero_mean: bool = False) -> RawTensor:
    """Valid Q4_K blocks: random 4-bit values, small fp16 d and dmin, and random 6-bit scales and mins;
    or, zero_mean, every scale and min 32 with dmin = 7.5 d (weights spread around 0, as trained ones)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, columns // 256, 144), dtype=np.uint8)
    d = rng.uniform(0.0005, 0.0015, (rows, columns // 256))
    dmin = 7.5 * d if zero_mean else rng.uniform(0.0002, 0.001, (rows, columns // 256))
    blocks[..., :4] = np.stack([d, dmin], -1).astype(np.float16).view(np.uint8).reshape(rows, columns // 256, 4)
    if zero_mean:  # the 12 packed bytes that give scale = min = 32 to all eight sub-blocks
        blocks[..., 4:16] = np.array([160] * 8 + [0] * 4, dtype=np.uint8)
    return RawTensor(Q4_K, columns, torch.from_numpy(blocks.reshape(rows, -1)))


def random_q6_k(rows: int, columns: int, seed: int) -> RawTensor:
    """Valid Q6_K blocks: random 6-bit values (spread around 32, the zero), positive or negative 8-bit
    scales and a small fp16 d."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, columns // 256, 210), dtype=np.uint8)
    blocks[..., 192:208] = rng.integers(-40, 40, size=(rows, columns // 256, 16), dtype=np.int8).view(np.uint8)
    d = rng.uniform(0.0005, 0.0015, (rows, columns // 256)).astype(np.float16)
    blocks[..., 208:210] = d.view(np.uint8).reshape(rows, columns // 256, 2)
    return RawTensor(Q6_K, columns, torch.from_numpy(blocks.reshape(rows, -1)))


def as_float(raw: RawTensor) -> torch.Tensor:
    return torch.from_numpy(dequantize(raw.blocks.numpy(), raw.qtype).reshape(-1, raw.columns).copy())


def tiny_q4_k_model(seed: int = 0, layers: int = 2):
    """(w4a8 model, the same weights in float32). q, k, o and the MLP are Q4_K; v and the LM head Q6_K."""
    cfg = tiny_config(hidden=256, intermediate=512, layers=layers)
    named = dict(random_hf_weights(cfg, seed))
    for i, name in enumerate(list(named)):
        rows, columns = named[name].shape[0], named[name].shape[-1]
        if name.endswith(("v_proj.weight", "lm_head.weight")):
            named[name] = random_q6_k(rows, columns, seed * 1000 + i)
        elif name.endswith("_proj.weight"):
            named[name] = random_q4_k(rows, columns, seed * 1000 + i, zero_mean=True)
    floats = {k: as_float(v) if isinstance(v, RawTensor) else v for k, v in named.items()}
    model = build_quantized_model(cfg, quantize_weights(named.items(), backends.int8_weight_max()), "w4a8", "cpu")
    return model, build_model(cfg, floats, torch.float32, "cpu")


# per GGUF format the kernels take as stored: valid random blocks, and the layer built from them
FORMATS = {
    "q4_k": (random_q4_k, lambda raw: W4A8Linear(pack_w4a8(split_q4_k(raw.blocks)))),
    "q6_k": (random_q6_k, lambda raw: W6A8Linear(pack_w6a8(split_q6_k(raw.blocks)))),
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_repacking_keeps_every_value(fmt):
    blocks, layer_of = FORMATS[fmt]
    raw = blocks(32, 512, seed=1)
    assert torch.equal(layer_of(raw).dequantize(), as_float(raw))


@pytest.mark.parametrize("fmt", FORMATS)
def test_linear_is_close_to_the_float_product_and_row_invariant(fmt):
    blocks, layer_of = FORMATS[fmt]
    raw = blocks(48, 768, seed=2)
    layer = layer_of(raw)
    x = torch.randn(11, 768)  # more rows than one tile of the kernel
    exact = x @ as_float(raw).T
    y = layer(x)
    assert (y - exact).norm() / exact.norm() < 0.02
    assert torch.equal(y, torch.cat([layer(x[i:i + 1]) for i in range(11)]))


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_avx2_path_computes_what_the_native_path_does(fmt):
    """Both instruction-set paths, on any machine that runs both: the AVX2 kernel (maddubs) gives the
    native one's results bit for bit (integer sums are exact, the float steps are the same), so a
    result measured on one kind of machine holds on the other."""
    from specdecode.executor import kernels

    avx2 = kernels.load("lowbit", isa="avx2")
    assert avx2 is not None and avx2.w4a8_isa() == 256
    blocks, layer_of = FORMATS[fmt]
    layer = layer_of(blocks(48, 1024, seed=4))
    x = torch.randn(9, 1024)
    native = layer(x)
    layer.lib = avx2
    assert torch.equal(layer(x), native)
    assert torch.equal(layer(x[3:4]), native[3:4])


def test_model_with_mixed_formats_tracks_the_float_model():
    """q/k in Q4_K beside a Q6_K v under one bias (a ConcatLinear): the bias is added once."""
    model, reference = tiny_q4_k_model()
    assert isinstance(model.layers[0].self_attn.qkv_proj, ConcatLinear)
    assert isinstance(model.layers[0].self_attn.qkv_proj.parts[2], W6A8Linear)
    assert isinstance(model.layers[0].mlp.gate_up_proj, W4A8Linear) and isinstance(model.lm_head, W6A8Linear)
    ids = list(range(1, 48))
    got, expected = (ModelRunner(m, 1, 64).forward([0], [ids], "all") for m in (model, reference))
    # a doubled bias (each part's, then the concatenation's) measures 0.55 and 0.32 here
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.85
    assert (got - expected).norm() / expected.norm() < 0.15


def test_greedy_speculation_equals_plain_decoding_on_w4a8():
    model, _ = tiny_q4_k_model()
    draft, _ = tiny_q4_k_model(seed=5, layers=1)
    target = LoadedModel("tiny-w4a8", model, ByteTokenizer(64), model.cfg)
    drafter = LoadedModel("tiny-w4a8-draft", draft, ByteTokenizer(64), draft.cfg)
    prompts = [[5, 17, 33, 2, 9, 41], [60, 1, 1, 7], [12, 12, 12, 30, 31, 32, 33, 34]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(target=target, num_speculative_tokens=0, max_model_len=128, max_num_seqs=4)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    for proposer in (dict(draft=drafter), dict(draft=target)):
        spec = LLM(target=target, num_speculative_tokens=4, max_model_len=128, max_num_seqs=4, **proposer)
        assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == expected
    broken = LLM(target=target, draft=drafter, num_speculative_tokens=4, max_model_len=128, forced_accept=True,
                 speculation_policy="fixed")
    assert [o.outputs[0].token_ids for o in broken.generate(prompts, params)] != expected


def test_requantized_weights_with_seven_sub_blocks_per_scale():
    """w4a8-all (drafts): float weights to 4 bits; K = 896 (the 0.5B draft's width) puts 7 sub-blocks
    under each d. Close to the float product, rows independent, and the layer dequantizes to what it uses."""
    from specdecode.executor.quant import quantize_4bit

    torch.manual_seed(3)
    w, x = torch.randn(48, 896) * 0.05, torch.randn(6, 896)
    layer = W4A8Linear(pack_w4a8(quantize_4bit(w)))
    assert layer.sub_per_super == 7
    assert (layer.dequantize() - w).abs().max() <= 0.2 * w.abs().max()  # 16 levels per 32 weights
    y = layer(x)
    torch.testing.assert_close(y, x @ layer.dequantize().T, rtol=0.02, atol=0.02)
    assert (y - x @ w.T).norm() / (x @ w.T).norm() < 0.15
    assert torch.equal(y, torch.cat([layer(x[i:i + 1]) for i in range(6)]))


def test_a_draft_loaded_all_4bit_stays_a_lossless_proposer():
    """A requantized draft only changes acceptance: greedy output still equals plain decoding."""
    cfg = tiny_config(hidden=256, intermediate=512, layers=1)
    tensors = quantize_weights(random_hf_weights(cfg, 5).items(), backends.int8_weight_max(), all_4bit=True)
    draft_model = build_quantized_model(cfg, tensors, "w4a8-all", "cpu")
    assert isinstance(draft_model.layers[0].mlp.down_proj, W4A8Linear)
    model, _ = tiny_q4_k_model()
    target = LoadedModel("tiny-w4a8", model, ByteTokenizer(64), model.cfg)
    drafter = LoadedModel("tiny-draft", draft_model, ByteTokenizer(64), cfg)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = [[5, 17, 33, 2], [60, 1, 1, 7, 9]]
    plain = LLM(target=target, num_speculative_tokens=0, max_model_len=128).generate(prompts, params)
    spec = LLM(target=target, draft=drafter, num_speculative_tokens=3, max_model_len=128).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]


def test_a_vocabulary_subset_of_a_4bit_head_stays_4bit_and_exact():
    """A draft's restricted LM head keeps the selected rows as stored: each output equals the full head's
    column for that token, bit for bit; a count off the 16-row groups falls back to int8 rows."""
    from specdecode.executor.quant import W8A8Linear, quantize_4bit, unpack_w4a8

    torch.manual_seed(4)
    arrays = quantize_4bit(torch.randn(96, 256) * 0.05)
    head = W4A8Linear(pack_w4a8(arrays))
    unpacked = unpack_w4a8({name: getattr(head, name) for name in head.NAMES})
    assert all(torch.equal(unpacked[name], arrays[name]) for name in arrays)
    ids, x = torch.randperm(96)[:32].sort().values, torch.randn(3, 256)
    subset = head.select_rows(ids)
    assert isinstance(subset, W4A8Linear) and torch.equal(subset(x), head(x)[:, ids])
    assert isinstance(head.select_rows(ids[:20]), W8A8Linear)


def test_restricting_a_draft_vocabulary_keeps_whole_groups_and_the_special_tokens():
    from specdecode.proposers.draft_model import restrict_draft_vocab

    draft = LoadedModel("tiny", build_model(tiny_config(vocab=64), random_hf_weights(tiny_config(vocab=64), 1),
                                            torch.float32, "cpu"), ByteTokenizer(64), tiny_config(vocab=64))
    restrict_draft_vocab(draft, 20)
    ids = draft.model.vocab_ids.tolist()
    assert len(ids) == 32 and ids[:21] == list(range(21)) and 63 in ids  # 0..19, then whole groups; EOS kept
