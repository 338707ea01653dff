"""The block kernel (kernels/lowbit.c): every GGUF format it takes is kept as stored (dequantized exactly
as `gguf` does), its products track the float product, each output row is independent of the rows
computed with it, and every instruction-set build gives the portable scalar build's bits; the build
itself shows the compiler's errors, and without a compiler the backends fall back to float."""

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from conftest import ByteTokenizer, kernel_builds, random_hf_weights, tiny_config
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from specdecode import LLM, SamplingParams, SpecDecodeError
from specdecode.executor import backends, kernels
from specdecode.executor.backends import build_quantized_model, quantize_weights
from specdecode.executor.formats import FORMATS, pack, quantize_4bit, quantize_q8_0, split, unpack
from specdecode.executor.quant import BlockEmbedding, BlockLinear, ConcatLinear
from specdecode.executor.runner import ModelRunner
from specdecode.models.gguf_loader import RawTensor
from specdecode.models.loader import LoadedModel
from specdecode.models.runtime import build_model

pytestmark = pytest.mark.skipif(
    kernels.load("lowbit") is None, reason=f"no low-bit kernel: {kernels.build_problem('lowbit')}"
)
K_BLOCK_BYTES = {"Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def gguf_blocks(fmt: str, rows: int, columns: int, seed: int) -> RawTensor:
    """Valid blocks of a format: gguf's own quantizer where it has one, else random values with small fp16
    scales (weights spread around 0, as trained ones)."""
    rng = np.random.default_rng(seed)
    if fmt not in K_BLOCK_BYTES:
        blocks = quantize((rng.standard_normal((rows, columns)) * 0.05).astype(np.float32), T[fmt])
        return RawTensor(T[fmt], columns, torch.from_numpy(np.ascontiguousarray(blocks).reshape(rows, -1)))
    nb = columns // 256
    b = rng.integers(0, 256, size=(rows, nb, K_BLOCK_BYTES[fmt]), dtype=np.uint8)
    d = rng.uniform(0.0005, 0.0015, (rows, nb))
    if fmt == "Q6_K":
        b[..., 192:208] = rng.integers(-40, 40, size=(rows, nb, 16), dtype=np.int8).view(np.uint8)
        b[..., 208:210] = d.astype(np.float16).view(np.uint8).reshape(rows, nb, 2)
    elif fmt == "Q3_K":  # random bits, packed 6-bit scales and all; d last
        b[..., 108:110] = d.astype(np.float16).view(np.uint8).reshape(rows, nb, 2)
    else:  # every 6-bit scale and min 32, dmin = 7.5 d (q = 7.5 is the zero)
        b[..., :4] = np.stack([d, 7.5 * d], -1).astype(np.float16).view(np.uint8).reshape(rows, nb, 4)
        b[..., 4:16] = np.array([160] * 8 + [0] * 4, dtype=np.uint8)
    return RawTensor(T[fmt], columns, torch.from_numpy(b.reshape(rows, -1)))


def as_float(raw: RawTensor) -> torch.Tensor:
    return torch.from_numpy(dequantize(raw.blocks.numpy(), raw.qtype).reshape(-1, raw.columns).copy())


def layer_of(raw: RawTensor) -> BlockLinear:
    return BlockLinear(split(raw.qtype, raw.blocks))


# rows off the 16-row groups (padded inside) and widths of one K super-block or a few legacy blocks
SHAPES = {fmt: (40, 256 if fmt in K_BLOCK_BYTES else 96) for fmt in FORMATS}


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_is_kept_as_stored(fmt):
    raw = gguf_blocks(fmt, *SHAPES[fmt], seed=1)
    arrays = split(raw.qtype, raw.blocks)
    layer = BlockLinear(arrays)
    assert torch.equal(layer.dequantize(), as_float(raw))  # gguf's products, bit for bit
    back = layer.arrays()
    assert torch.equal(back.q, arrays.q) and torch.equal(back.d, arrays.d)
    for name in ("sc", "mn", "dmin"):
        assert (getattr(back, name) is None) == (getattr(arrays, name) is None)
        assert getattr(back, name) is None or torch.equal(getattr(back, name), getattr(arrays, name))
    ids = torch.tensor([39, 0, 17])
    assert torch.equal(BlockEmbedding(layer, torch.float32)(ids[None])[0], as_float(raw)[ids])


@pytest.mark.parametrize("fmt", FORMATS)
def test_product_tracks_the_float_product_and_rows_are_independent(fmt):
    rows, columns = 48, 512 if fmt in K_BLOCK_BYTES else 160
    raw = gguf_blocks(fmt, rows, columns, seed=2)
    layer = layer_of(raw)
    x = torch.randn(11, columns)  # more rows than one tile of the kernel
    x[0] *= 50  # one row with a much larger range must not change the others
    exact = x @ as_float(raw).T
    y = layer(x)
    assert (y - exact).norm() / exact.norm() < 0.02
    assert torch.equal(y, torch.cat([layer(x[i : i + 1]) for i in range(11)]))


def ties(columns: int, seed: int = 0) -> torch.Tensor:
    """A row whose int8 blocks have scale exactly 1 (amax 127) and every other value halfway between two
    integers: rounding to nearest must break each tie to even, as the reference does."""
    gen = torch.Generator().manual_seed(seed)
    row = torch.randint(-100, 100, (columns,), generator=gen).float() + 0.5
    row[::32] = 127.0
    return row


@pytest.mark.parametrize("isa", kernel_builds(amx_tiles=True))
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_build_gives_the_scalar_reference_bits(fmt, isa):
    """Integer sums are exact and the float steps are the same operations in the same order, so each SIMD
    path equals the portable scalar path bit for bit: a result measured on one kind of CPU holds on all."""
    columns = 1024 if fmt in K_BLOCK_BYTES else 1120  # blocks of 32: 32, or 35 (an odd one after pairs)
    raw = gguf_blocks(fmt, 64, columns, seed=4)
    x = torch.randn(150, columns)  # tiles of every size; blocks of 64 rows, 64 and a tail of 22
    x[5] = ties(columns)
    layer = layer_of(raw)
    layer.lib = kernels.load("lowbit", "scalar")
    reference = layer(x)
    layer.lib = kernels.load("lowbit", isa)
    assert torch.equal(layer(x), reference)
    assert torch.equal(layer(x[:70]), reference[:70])  # a tail of 6 rows computed in the block before it
    assert torch.equal(layer(x[3:4]), reference[3:4])


def int8_residual(x: torch.Tensor) -> torch.Tensor:
    """What x's int8 blocks of 32 miss (the kernel's rounding: scale amax / 127, nearest, ties to even)."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return (blocks - torch.round(blocks * (1 / scale)) * scale).reshape(x.shape)


@pytest.mark.parametrize("isa", kernel_builds(amx_tiles=True))
@pytest.mark.parametrize("fmt", FORMATS)
def test_two_pass_activations_add_the_residual_product_on_every_build(fmt, isa):
    """w4a16: x's int8 product plus its residual's, in that order, bit for bit on every build, with each
    output row independent of the rows beside it; the product then tracks the float one far closer."""
    rows, columns = 48, 512 if fmt in K_BLOCK_BYTES else 160
    raw = gguf_blocks(fmt, rows, columns, seed=5)
    layer = layer_of(raw)
    layer.lib = kernels.load("lowbit", isa)
    x = torch.randn(24, columns)  # 48 quantized rows: AMX tiles where the CPU has AMX
    x[0] *= 50
    x[4] = ties(columns)  # the residual of a tie is +-0.5 only if it is broken as torch.round breaks it
    one_pass, residual_pass = layer(x), layer(int8_residual(x))
    layer.passes = 2
    y = layer(x)
    assert torch.equal(y, one_pass + residual_pass)
    assert torch.equal(y, torch.cat([layer(x[i : i + 1]) for i in range(24)]))
    exact = x.double() @ as_float(raw).double().T
    assert (y - exact).norm() < (one_pass - exact).norm() / 30


def test_eight_bit_weights_and_activations_do_not_saturate():
    """The largest products, 127 x 127 summed in pairs, stay exact on every build (u8 x s8 pair sums
    saturate int16 at 32767 without VNNI when the signs are not moved onto x)."""
    w = torch.full((16, 64), 0.5)
    w[:, 1::2] = -0.5
    x = torch.ones(2, 64)
    x[:, 1::2] = -1.0
    layer = BlockLinear(quantize_q8_0(w))
    for isa in ("native", "scalar"):
        layer.lib = kernels.load("lowbit", isa)
        torch.testing.assert_close(layer(x), torch.full((2, 16), 32.0), rtol=1e-6, atol=0)


def test_the_kernel_checks_its_preconditions():
    layer = BlockLinear(quantize_q8_0(torch.randn(16, 64)))
    with pytest.raises(SpecDecodeError, match="64 input features"):
        layer(torch.randn(2, 48))
    with pytest.raises(SpecDecodeError, match="outside the table"):
        layer.dequantize(torch.tensor([16]))
    lib = layer.lib
    x, y = torch.randn(1, 48), torch.empty(1, 16)
    assert lib.lowbit_linear(4, x.data_ptr(), 1, 48, 16, 1, *layer.buffer_addresses, y.data_ptr(), 1, 1) == -2
    assert lib.lowbit_linear(9, x.data_ptr(), 1, 64, 16, 1, *layer.buffer_addresses, y.data_ptr(), 1, 1) == -1
    assert lib.lowbit_linear(4, x.data_ptr(), 1, 64, 16, 1, 0, 0, 0, 0, 0, 0, y.data_ptr(), 1, 1) == -4
    layer.passes = 3
    with pytest.raises(SpecDecodeError, match="passes other than 1 or 2"):
        layer(torch.randn(1, 64))


def test_a_failing_build_shows_the_compiler_output(tmp_path, monkeypatch):
    compiler = tmp_path / "broken-cc"
    compiler.write_text("#!/bin/sh\necho 'lowbit.c:1: error: this compiler is broken on purpose' >&2\nexit 1\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    kernels._load.cache_clear()
    try:
        assert kernels.load("lowbit") is None
        assert "broken on purpose" in kernels.build_problem("lowbit")
        with pytest.raises(SpecDecodeError, match="broken on purpose"):
            backends.resolve_quantization("w4a8", "cpu")
        assert os.listdir(tmp_path / "cache" / "kernels") == []  # no partial library or temporary source left
    finally:
        monkeypatch.undo()
        kernels._load.cache_clear()


def test_without_a_compiler_the_backends_fall_back_to_float(monkeypatch):
    monkeypatch.setattr(kernels, "compiler", lambda: None)
    kernels._load.cache_clear()
    try:
        with pytest.warns(UserWarning, match="no C compiler"):
            assert backends.resolve_quantization("auto", "cpu") == "none"
        with pytest.raises(SpecDecodeError, match="no C compiler.*\n.*--quantization none"):
            backends.resolve_quantization("w4a8", "cpu")
    finally:
        monkeypatch.undo()
        kernels._load.cache_clear()
    assert backends.resolve_quantization("auto", "cpu", draft=True) == "w4a8-all"


def test_a_build_lands_in_the_cache_by_rename(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    path = kernels.build("norm", "scalar", kernels.compiler())
    assert os.path.dirname(path) == str(tmp_path / "kernels")
    assert os.listdir(tmp_path / "kernels") == [os.path.basename(path)]


# ---- whole models --------------------------------------------------------------------------------------------
def tiny_gguf_model(seed: int = 0, layers: int = 2, quantization: str = "w4a8"):
    """(low-bit model, the same weights in float32): q, k, o and the MLP in Q4_K; v and the LM head in Q6_K
    (as in Q4_K_M files); the embedding in Q8_0 and the up projection in Q5_0, as in the 0.5B's file."""
    cfg = tiny_config(hidden=256, intermediate=512, layers=layers)
    named = dict(random_hf_weights(cfg, seed))
    for i, name in enumerate(list(named)):
        rows, columns = named[name].shape[0], named[name].shape[-1]
        fmt = (
            "Q6_K"
            if name.endswith(("v_proj.weight", "lm_head.weight"))
            else "Q5_0"
            if "up_proj" in name
            else "Q8_0"
            if "embed" in name
            else "Q4_K"
            if name.endswith("_proj.weight")
            else None
        )
        if fmt:
            named[name] = gguf_blocks(fmt, rows, columns, seed * 1000 + i)
    floats = {k: as_float(v) if isinstance(v, RawTensor) else v for k, v in named.items()}
    model = build_quantized_model(cfg, quantize_weights(named.items(), "w4a8"), quantization, "cpu")
    return model, build_model(cfg, floats, torch.float32, "cpu")


def test_a_model_with_mixed_formats_tracks_the_float_model():
    """q/k in Q4_K beside a Q6_K v under one bias (a ConcatLinear): the bias is added once."""
    model, reference = tiny_gguf_model()
    assert isinstance(model.layers[0].self_attn.qkv_proj, ConcatLinear)
    assert model.layers[0].self_attn.qkv_proj.parts[2].format.name == "Q6_K"
    assert isinstance(model.layers[0].mlp.gate_up_proj, ConcatLinear) and model.lm_head.format.name == "Q6_K"
    ids = list(range(1, 48))
    got, expected = (ModelRunner(m, 1, 64).forward([0], [ids], "all") for m in (model, reference))
    # a doubled bias (each part's, then the concatenation's) measures 0.55 and 0.32 here
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.85
    assert (got - expected).norm() / expected.norm() < 0.15
    two_pass, _ = tiny_gguf_model(quantization="w4a16")  # every layer, the tied or separate LM head too
    assert all(m.passes == 2 for m in two_pass.modules() if isinstance(m, BlockLinear))
    closer = ModelRunner(two_pass, 1, 64).forward([0], [ids], "all")
    assert (closer - expected).norm() < (got - expected).norm() / 30


@pytest.mark.parametrize("quantization", ["w4a8", "w4a16"])
def test_greedy_speculation_equals_plain_decoding_on_gguf_formats(quantization):
    model, _ = tiny_gguf_model(quantization=quantization)
    draft, _ = tiny_gguf_model(seed=5, layers=1)
    target = LoadedModel("tiny-w4a8", model, ByteTokenizer(64), model.cfg)
    drafter = LoadedModel("tiny-w4a8-draft", draft, ByteTokenizer(64), draft.cfg)
    prompts = [[5, 17, 33, 2, 9, 41], [60, 1, 1, 7], [12, 12, 12, 30, 31, 32, 33, 34]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(target=target, num_speculative_tokens=0, max_model_len=128, max_num_seqs=4)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    for proposer in (dict(draft=drafter), dict(draft=target)):  # a fixed k: every step verifies drafts
        spec = LLM(
            target=target,
            num_speculative_tokens=4,
            max_model_len=128,
            max_num_seqs=4,
            speculation_policy="fixed",
            **proposer,
        )
        outs = spec.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert sum(o.spec["num_draft_tokens"] for o in outs) > 0
    broken = LLM(
        target=target,
        draft=drafter,
        num_speculative_tokens=4,
        max_model_len=128,
        forced_accept=True,
        speculation_policy="fixed",
    )
    assert [o.outputs[0].token_ids for o in broken.generate(prompts, params)] != expected


def test_requantized_weights_with_seven_sub_blocks_per_scale():
    """w4a8-all (drafts): float weights to 4 bits; K = 896 (the 0.5B draft's width) puts 7 sub-blocks
    under each d. Close to the float product, rows independent, and the layer dequantizes to what it uses."""
    torch.manual_seed(3)
    w, x = torch.randn(48, 896) * 0.05, torch.randn(6, 896)
    layer = BlockLinear(quantize_4bit(w))
    assert layer.S == 7
    assert (layer.dequantize() - w).abs().max() <= 0.2 * w.abs().max()  # 16 levels per 32 weights
    y = layer(x)
    torch.testing.assert_close(y, x @ layer.dequantize().T, rtol=0.02, atol=0.02)
    assert (y - x @ w.T).norm() / (x @ w.T).norm() < 0.15
    assert torch.equal(y, torch.cat([layer(x[i : i + 1]) for i in range(6)]))


def test_a_draft_loaded_all_4bit_stays_a_lossless_proposer():
    """A requantized draft only changes acceptance: greedy output still equals plain decoding."""
    cfg = tiny_config(hidden=256, intermediate=512, layers=1)
    draft_model = build_quantized_model(
        cfg, quantize_weights(random_hf_weights(cfg, 5).items(), "w4a8-all"), "w4a8-all", "cpu"
    )
    assert draft_model.layers[0].mlp.down_proj.format.name == "Q4_K"
    model, _ = tiny_gguf_model()
    target = LoadedModel("tiny-w4a8", model, ByteTokenizer(64), model.cfg)
    drafter = LoadedModel("tiny-draft", draft_model, ByteTokenizer(64), cfg)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = [[5, 17, 33, 2], [60, 1, 1, 7, 9]]
    plain = LLM(target=target, num_speculative_tokens=0, max_model_len=128).generate(prompts, params)
    spec = LLM(target=target, draft=drafter, num_speculative_tokens=3, max_model_len=128).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]


@pytest.mark.parametrize("count", [32, 20])
def test_a_vocabulary_subset_of_a_head_stays_in_its_format_and_exact(count):
    """A draft's restricted LM head keeps the selected rows as stored: each output equals the full head's
    column for that token, bit for bit, also for a count off the 16-row groups."""
    torch.manual_seed(4)
    head = BlockLinear(quantize_4bit(torch.randn(96, 256) * 0.05))
    assert torch.equal(unpack(head.format, head.S, pack(head.arrays())).q, head.arrays().q)
    ids, x = torch.randperm(96)[:count].sort().values, torch.randn(3, 256)
    subset = head.select_rows(ids)
    assert subset.format == head.format and subset.out_features == count
    assert torch.equal(subset(x), head(x)[:, ids])


def test_restricting_a_draft_vocabulary_keeps_whole_groups_and_the_special_tokens():
    from specdecode.proposers.vocabulary import restrict_draft_vocab

    draft = LoadedModel(
        "tiny",
        build_model(tiny_config(vocab=64), random_hf_weights(tiny_config(vocab=64), 1), torch.float32, "cpu"),
        ByteTokenizer(64),
        tiny_config(vocab=64),
    )
    restrict_draft_vocab(draft, 20)
    ids = draft.model.vocab_ids.tolist()
    assert len(ids) == 32 and ids[:21] == list(range(21)) and 63 in ids  # 0..19, then whole groups; EOS kept


def test_processes_that_need_one_library_at_once_compile_it_once(tmp_path, monkeypatch):
    """Two builds of one library at a time (the test workers, a server's replicas): one runs the compiler, the
    other waits for its library. The compiler here is slow on purpose, so both builds overlap."""
    calls = tmp_path / "calls"
    compiler = tmp_path / "slow-cc"
    compiler.write_text(f'#!/bin/sh\necho called >> {calls}\nsleep 1\nexec {kernels.compiler()} "$@"\n')
    compiler.chmod(0o755)
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    with ThreadPoolExecutor(2) as pool:
        paths = list(pool.map(lambda _: kernels.build("norm", "scalar", str(compiler)), range(2)))
    assert paths[0] == paths[1] and calls.read_text().count("called") == 1
    assert os.listdir(tmp_path / "cache" / "kernels") == [os.path.basename(paths[0])]  # no lock file left
