"""LoRA adapters (models/lora.py) against transformers' model with the adapter's updates merged into its weights: a
PEFT adapter on the checkpoint folder and on llama.cpp's GGUF conversion of it, and llama.cpp's conversion of the
adapter (its q/k rows interleaved as the base's are: a reader that does not undo it fails); on low-bit weights kept as
stored; adapters that add up and scale; greedy speculation with an adapter equal to plain decoding with it; and
adapters that cannot be applied refused with the reason."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import fixed_k_llm, kernel_builds, make_head
from families import convert, convert_lora, make_checkpoint, make_lora, merged_reference, reference_model
from test_families import _expected, _logits, _prompt

from specdecode import LLM, SamplingParams
from specdecode.config import EngineConfig
from specdecode.errors import SpecDecodeError
from specdecode.models.loader import load_model
from specdecode.models.lora import Adapter, AdapterRoute, AdapterSet, LowRankAdded

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")
# llama.cpp interleaves Llama's q/k rows; Phi-4-mini fuses q/k/v and gate/up and turns RoPE on part of a head;
# Qwen2 has q/k/v biases
FAMILIES = ["llama3", "phi4_mini", "qwen2_yarn"]
TOLERANCE = dict(atol=1e-2, rtol=1e-4)  # logits the adapter moves by tens


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """family -> (checkpoint folder, its GGUF, the PEFT adapter, its GGUF, the adapter's updates), made once."""
    cache = {}

    def get(family: str):
        if family not in cache:
            root = tmp_path_factory.mktemp(f"lora-{family}")
            folder = make_checkpoint(family, root / "checkpoint")
            updates = make_lora(reference_model(folder), root / "adapter", TARGETS)
            adapter_gguf = convert_lora(root / "adapter", folder, root / "adapter.gguf")
            cache[family] = folder, convert(folder, root / "model.gguf"), root / "adapter", adapter_gguf, updates
        return cache[family]

    return get


def _loaded(model, *adapters: Adapter, quantization: str = "none", served: dict[str, Adapter] | None = None, **options):
    options |= dict(dtype="float32", kv_cache_dtype="float32") if quantization == "none" else {}
    options |= dict(quantization=quantization, lora=adapters, served_lora=served)
    return load_model(str(model), progress=False, **options)


@pytest.mark.parametrize("route", ["peft on the folder", "peft on the gguf", "gguf on the gguf"])
@pytest.mark.parametrize("family", FAMILIES)
def test_an_adapted_model_computes_what_transformers_computes_with_the_adapter_merged(made, family, route):
    folder, gguf, adapter, adapter_gguf, updates = made(family)
    model, path = {"peft on the folder": (folder, adapter), "peft on the gguf": (gguf, adapter)}.get(
        route, (gguf, adapter_gguf)
    )
    loaded = _loaded(model, Adapter(str(path)))
    assert loaded.model.backend.endswith("+ LoRA (8 layers)")
    ids = _prompt(loaded.config.vocab_size)
    want = _expected(merged_reference(folder, updates), ids)
    torch.testing.assert_close(_logits(loaded.model, ids), want, **TOLERANCE)
    assert (want - _expected(reference_model(folder), ids)).abs().max() > 10  # the adapter matters


def test_a_reader_that_leaves_llama_cpp_s_interleaved_rows_computes_otherwise(made, monkeypatch):
    """The broken variant: the GGUF adapter's q/k rows of B taken as stored."""
    folder, gguf, _, adapter_gguf, updates = made("llama3")
    monkeypatch.setattr("specdecode.models.gguf_loader.runtime_rows", lambda cfg, name, w: torch.from_numpy(w.copy()))
    loaded = _loaded(gguf, Adapter(str(adapter_gguf)))
    ids = _prompt(loaded.config.vocab_size)
    want = _expected(merged_reference(folder, updates), ids)
    assert not torch.allclose(_logits(loaded.model, ids), want, **TOLERANCE)


@pytest.mark.parametrize("quantization", ["w8a8", "w8a16"])
def test_low_bit_weights_stay_as_stored_and_the_adapter_is_added_beside_them(made, quantization):
    """Against the merged float model the adapted low-bit model errs as the plain low-bit model errs against the
    plain one (the adapter at a tenth: the logits move by tens, the error stays the quantization's)."""
    folder, gguf, _, adapter_gguf, updates = made("llama3")
    plain, adapted = (
        _loaded(gguf, quantization=quantization),
        _loaded(gguf, Adapter(str(adapter_gguf), 0.1), quantization=quantization),
    )
    layer = adapted.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, LowRankAdded)
    assert type(layer.self_attn.qkv_proj.base) is type(plain.model.layers[0].self_attn.qkv_proj)
    ids = _prompt(plain.config.vocab_size)
    want, base = _expected(merged_reference(folder, updates, 0.1), ids), _expected(reference_model(folder), ids)
    plain_error = (_logits(plain.model, ids) - base).abs().max()
    assert (_logits(adapted.model, ids) - want).abs().max() < 2 * plain_error
    assert (want - base).abs().max() > 10 * plain_error


def test_adapters_add_up_each_at_its_scale(made, tmp_path):
    folder, _, adapter, _, updates = made("qwen2_yarn")
    second = make_lora(reference_model(folder), tmp_path / "second", ("o_proj", "down_proj"), rank=2, seed=1)
    loaded = _loaded(folder, Adapter.parse(str(adapter)), Adapter.parse(f"{tmp_path / 'second'}:0.5"))
    ids = _prompt(loaded.config.vocab_size)
    both = {name: updates.get(name, 0) + 0.5 * second.get(name, 0) for name in {*updates, *second}}
    torch.testing.assert_close(_logits(loaded.model, ids), _expected(merged_reference(folder, both), ids), **TOLERANCE)
    unchanged = _loaded(folder, Adapter(str(adapter), 0.0))
    torch.testing.assert_close(_logits(unchanged.model, ids), _expected(reference_model(folder), ids), **TOLERANCE)


@pytest.mark.parametrize("proposer", ["ngram", "suffix", "head"])
def test_greedy_speculation_with_an_adapter_equals_plain_decoding_with_it(made, proposer, tmp_path):
    _, gguf, _, adapter_gguf, _ = made("qwen2_yarn")
    target = _loaded(gguf, Adapter(str(adapter_gguf), 0.1), quantization="w8a8")
    drafter = make_head(target, tmp_path / "head", intermediate=64) if proposer == "head" else proposer
    vocab = target.config.vocab_size
    prompts = [_prompt(vocab, 24, seed=2) * 2, _prompt(vocab, 9, seed=3)]  # the first repeats itself: lookups hit
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    plain = LLM(target=target, num_speculative_tokens=0, max_model_len=256).generate(prompts, params)
    spec = fixed_k_llm(target, speculative_model=drafter).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert sum(o.spec["num_draft_tokens"] for o in spec) > 0


def _peft(folder, tmp_path, **settings):
    """The family's adapter with its settings changed."""
    out = tmp_path / "changed"
    out.mkdir()
    (out / "adapter_model.safetensors").write_bytes((folder / "adapter_model.safetensors").read_bytes())
    (out / "adapter_config.json").write_text(
        json.dumps(json.loads((folder / "adapter_config.json").read_text()) | settings)
    )
    return out


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"use_dora": True}, "uses DoRA, which is not supported"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "all"}, "bias 'all'"),
        ({"peft_type": "IA3"}, "is a IA3 adapter; only LoRA is read"),
    ],
)
def test_peft_settings_that_change_what_the_adapter_computes_are_refused(made, tmp_path, settings, message):
    folder, _, adapter, _, _ = made("qwen2_yarn")
    with pytest.raises(SpecDecodeError, match=message):
        _loaded(folder, Adapter(str(_peft(adapter, tmp_path, **settings))))


def test_adapters_that_cannot_apply_are_refused_with_the_reason(made, tmp_path):
    folder, gguf, adapter, _, _ = made("qwen2_yarn")
    reference = reference_model(folder)
    make_lora(reference, tmp_path / "head", ("lm_head",))
    with pytest.raises(SpecDecodeError, match="adapts lm_head, which this runtime does not compute as a linear layer"):
        _loaded(folder, Adapter(str(tmp_path / "head")))
    other = make_checkpoint("qwen2_yarn", tmp_path / "wider", hidden_size=96)
    make_lora(reference_model(other), tmp_path / "other", ("o_proj",))
    with pytest.raises(SpecDecodeError, match="takes 64 inputs to 64 outputs: an adapter of another model"):
        _loaded(folder, Adapter(str(tmp_path / "other")))
    with pytest.raises(SpecDecodeError, match="is not a LoRA adapter"):
        _loaded(folder, Adapter(str(gguf)))
    with pytest.raises(SpecDecodeError, match="give a PEFT adapter's folder"):
        _loaded(folder, Adapter(str(tmp_path / "missing")))
    with pytest.raises(SpecDecodeError, match="lora is a list of adapter paths"):
        LLM(target=_loaded(folder), lora=[""])


def test_an_adapter_of_experts_is_refused(tmp_path):
    """Mixtral's experts as transformers 4 named them (PEFT's keys for them)."""
    from safetensors.torch import load_file, save_file

    folder = make_checkpoint("mixtral", tmp_path / "mixtral")
    make_lora(reference_model(folder), tmp_path / "experts", ("q_proj",))
    weights = tmp_path / "experts" / "adapter_model.safetensors"
    expert = "base_model.model.model.layers.1.block_sparse_moe.experts.0.w1"
    matrices = {f"{expert}.lora_A.weight": torch.zeros(4, 64), f"{expert}.lora_B.weight": torch.zeros(128, 4)}
    save_file(load_file(str(weights)) | matrices, str(weights))
    with pytest.raises(SpecDecodeError, match=r"adapts model\.layers\.1\.mlp\.experts\.0\.gate_proj"):
        _loaded(folder, Adapter(str(tmp_path / "experts")))


def test_an_adapter_of_deepseeks_latent_attention_is_refused(tmp_path):
    """DeepSeek-V2-Lite's directly projected queries (q_proj, under the name the runtime's projections share): refused
    with the reason, not added to the expanded projection the runtime computes in their place."""
    folder = make_checkpoint("deepseek_v2", tmp_path / "deepseek")
    make_lora(reference_model(folder), tmp_path / "queries", ("q_proj",))
    with pytest.raises(SpecDecodeError, match="latent attention are not built"):
        _loaded(folder, Adapter(str(tmp_path / "queries")))


def test_adapter_specs_are_paths_with_an_optional_scale():
    assert Adapter.parse("a/b") == Adapter("a/b") and Adapter.parse("a/b:0.5") == Adapter("a/b", 0.5)
    assert Adapter.parse("C:/adapters/x") == Adapter("C:/adapters/x")


def test_the_commands_take_adapters_one_flag_each():
    from specdecode.cli import build_parser
    from specdecode.server.serve_cmd import llm_options

    assert llm_options(build_parser().parse_args(["serve", "--lora", "a", "--lora", "b.gguf:0.5"]))["lora"] == (
        "a",
        "b.gguf:0.5",
    )
    assert llm_options(build_parser().parse_args(["serve"]))["lora"] == ()
    assert llm_options(build_parser().parse_args(["serve", "--lora-dtype", "bfloat16"]))["lora_dtype"] == "bfloat16"
    with pytest.raises(SpecDecodeError, match="unknown lora_dtype 'int8'"):
        EngineConfig(lora_dtype="int8")
    assert build_parser().parse_args(["generate", "--lora", "a", "hi"]).lora == ["a"]


def _one_set(base, lora_a, blocks) -> LowRankAdded:
    return LowRankAdded(base, [AdapterSet(lora_a, blocks, torch.ones(lora_a.shape[0]))], AdapterRoute([]))


def _adapted_zeros(rows: int):
    """A layer of zero weights whose adapter has the 1.5B's shapes for q (rank 16), and an input of `rows` rows."""
    g = torch.Generator().manual_seed(0)
    zeros = torch.nn.Linear(1536, 1792, bias=False)
    torch.nn.init.zeros_(zeros.weight)
    blocks = [(slice(0, 1792), slice(0, 16), torch.randn(1792, 16, generator=g))]
    layer = _one_set(zeros, torch.randn(16, 1536, generator=g), blocks)
    return layer, torch.randn(1, rows, 1536, generator=g)


@pytest.mark.parametrize("rows", [2, 4, 5, 9])
def test_a_token_s_update_is_the_same_alone_and_among_others(rows):
    """The logits of a token decoded alone and verified beside drafts are the same bit for bit: its adapted layers'
    outputs are too."""
    layer, x = _adapted_zeros(rows)
    assert torch.equal(layer(x[:, :1]), layer(x)[:, :1])


def test_a_gemm_of_the_update_rounds_a_row_otherwise_among_others(monkeypatch):
    """The broken variant: the update by GEMMs of all rows at once (on CPUs whose GEMM rounds so; Zen 4 does)."""
    import specdecode.models.lora as lora

    monkeypatch.setattr(lora, "row_by_row_linear", torch.nn.functional.linear)
    layer, x = _adapted_zeros(9)
    lora_a = layer.sets[0].lora_a
    if torch.equal(torch.nn.functional.linear(x[:, :1], lora_a), torch.nn.functional.linear(x, lora_a)[:, :1]):
        pytest.skip("this CPU's GEMM rounds a row the same among others")
    assert not torch.equal(layer(x[:, :1]), layer(x)[:, :1])


# ---- the LoRA kernel (kernels/lora.c) and the one-call decoder that calls it ----------------------------------


def _qkv_like(g, kept: torch.dtype = torch.float32) -> LowRankAdded:
    """The 1.5B's q/k/v shapes with q and v adapted (k not: its rows stay as the base computes them), ranks 16 and 8
    at scales 0.37 and 2, the matrices kept in `kept`."""
    zeros = torch.nn.Linear(1536, 2048, bias=False)
    torch.nn.init.zeros_(zeros.weight)
    blocks = [
        (slice(0, 1536), slice(0, 16), torch.randn(1536, 16, generator=g).to(kept)),
        (slice(1792, 2048), slice(16, 24), torch.randn(256, 8, generator=g).to(kept)),
    ]
    scales = torch.tensor([0.37] * 16 + [2.0] * 8)
    adapter_set = AdapterSet((torch.randn(24, 1536, generator=g) / 40).to(kept), blocks, scales)
    return LowRankAdded(zeros, [adapter_set], AdapterRoute([]))


def _widened(layer: LowRankAdded) -> LowRankAdded:
    """The layer with its adapter's matrices as float32 copies of their values."""
    kept = layer.sets[0]
    blocks = [(rows, ranks, getattr(kept, f"lora_b{i}").t().float()) for i, (rows, ranks) in enumerate(kept.spans)]
    return LowRankAdded(layer.base, [AdapterSet(kept.lora_a.float(), blocks, kept.scales)], AdapterRoute([]))


def _with_kernel(layer: LowRankAdded, isa: str = "native") -> LowRankAdded:
    from specdecode.executor.kernels import load
    from specdecode.executor.lora_kernel import LoRAKernel

    layer.kernel = LoRAKernel(load("lora", isa))
    return layer


@pytest.mark.parametrize("rows", [1, 3, 8, 20])
def test_the_kernel_computes_the_update_pytorch_does_each_row_as_if_alone(rows):
    g = torch.Generator().manual_seed(1)
    layer, x = _qkv_like(g), torch.randn(1, rows, 1536, generator=g)
    expected = layer(x)  # PyTorch's path: no kernel
    got = _with_kernel(layer)(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[..., 1536:1792], torch.zeros(1, rows, 256))  # k: not adapted
    assert all(torch.equal(layer(x[:, r : r + 1])[0, 0], got[0, r]) for r in range(rows))


@pytest.mark.parametrize("isa", kernel_builds())
def test_every_build_of_the_kernel_gives_the_scalar_reference_bits(isa):
    g = torch.Generator().manual_seed(2)
    layer, x = _qkv_like(g), torch.randn(1, 11, 1536, generator=g)
    assert torch.equal(_with_kernel(layer, isa)(x), _with_kernel(layer, "scalar")(x))


@pytest.mark.parametrize("isa", kernel_builds())
@pytest.mark.parametrize("kept", [torch.float16, torch.bfloat16])
def test_an_adapter_kept_in_16_bits_computes_the_bits_of_its_values_in_float32(kept, isa):
    g = torch.Generator().manual_seed(3)
    layer, x = _qkv_like(g, kept), torch.randn(1, 11, 1536, generator=g)
    got = _with_kernel(layer, isa)(x)
    assert torch.equal(got, _with_kernel(_widened(layer), isa)(x))
    layer.kernel = None  # PyTorch's path widens them too
    torch.testing.assert_close(got, layer(x), rtol=1e-5, atol=1e-5)


def test_a_kernel_that_reads_one_16_bit_format_as_the_other_computes_otherwise(monkeypatch):
    """The broken variant: float16 matrices read as bfloat16."""
    from specdecode.executor import lora_kernel

    monkeypatch.setitem(lora_kernel.FORMATS, torch.float16, lora_kernel.FORMATS[torch.bfloat16])
    g = torch.Generator().manual_seed(3)
    layer, x = _qkv_like(g, torch.float16), torch.randn(1, 11, 1536, generator=g)
    assert not torch.allclose(_with_kernel(layer)(x), _with_kernel(_widened(layer))(x), atol=1e-2)


def _decoder_and_module_logits(loaded) -> tuple[torch.Tensor, torch.Tensor]:
    ids = _prompt(loaded.config.vocab_size)
    one_call = _logits(loaded.model, ids)
    kernel, loaded.model.layers_kernel = loaded.model.layers_kernel, None
    by_module = _logits(loaded.model, ids)
    loaded.model.layers_kernel = kernel
    return one_call, by_module


def test_the_one_call_decoder_adds_the_updates_as_the_layers_do(made):
    """Bit for bit, so greedy speculation on it stays exact."""
    _, gguf, _, adapter_gguf, _ = made("qwen2_yarn")
    loaded = _loaded(gguf, Adapter(str(adapter_gguf), 0.1), quantization="w8a8")
    assert loaded.model.layers_kernel is not None
    one_call, by_module = _decoder_and_module_logits(loaded)
    assert torch.equal(one_call, by_module)


def _rounded(adapter, out, dtype: torch.dtype, saved: torch.dtype):
    """The PEFT adapter with its matrices rounded to dtype, saved as `saved`."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    save_file({k: t.to(dtype).to(saved) for k, t in tensors.items()}, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    return out


def _kept_formats(loaded) -> set[torch.dtype]:
    return {s.lora_a.dtype for m in loaded.model.modules() if isinstance(m, LowRankAdded) for s in m.sets}


@pytest.mark.parametrize("stored", ["bfloat16 PEFT", "float16 GGUF"])
def test_an_adapter_stored_in_16_bits_is_kept_so_and_computes_what_its_float32_copy_does(made, tmp_path, stored):
    """Bit for bit, in the one-call decoder and layer by layer."""
    folder, gguf, adapter, _, _ = made("qwen2_yarn")
    dtype = torch.bfloat16 if stored.startswith("bfloat16") else torch.float16
    as_float32 = _rounded(adapter, tmp_path / "float32", dtype, torch.float32)
    if stored.endswith("PEFT"):
        path = _rounded(adapter, tmp_path / "16-bit", dtype, dtype)
    else:
        path = convert_lora(as_float32, folder, tmp_path / "adapter-f16.gguf", outtype="f16")
    kept = _loaded(gguf, Adapter(str(path), 0.1), quantization="w8a8")
    widened = _loaded(gguf, Adapter(str(as_float32), 0.1), quantization="w8a8")
    assert _kept_formats(kept) == {dtype} and _kept_formats(widened) == {torch.float32}
    one_call, by_module = _decoder_and_module_logits(kept)
    assert torch.equal(one_call, by_module)
    assert torch.equal(one_call, _logits(widened.model, _prompt(kept.config.vocab_size)))


def test_lora_dtype_rounds_a_float32_adapter_to_16_bits_once_at_load(made, tmp_path):
    _, gguf, adapter, _, _ = made("qwen2_yarn")
    rounded = _loaded(gguf, Adapter(str(adapter), 0.1), quantization="w8a8", lora_dtype="bfloat16")
    as_float32 = _rounded(adapter, tmp_path / "float32", torch.bfloat16, torch.float32)
    widened = _loaded(gguf, Adapter(str(as_float32), 0.1), quantization="w8a8")
    assert _kept_formats(rounded) == {torch.bfloat16}
    ids = _prompt(rounded.config.vocab_size)
    assert torch.equal(_logits(rounded.model, ids), _logits(widened.model, ids))


def test_adapters_of_different_formats_in_one_set_are_kept_in_float32(made, tmp_path):
    folder, _, adapter, _, _ = made("qwen2_yarn")
    half = _rounded(adapter, tmp_path / "16-bit", torch.bfloat16, torch.bfloat16)
    served = {"both": Adapter(str(adapter))}
    assert _kept_formats(_loaded(folder, Adapter(str(half)), served=served)) == {torch.bfloat16, torch.float32}


def test_a_decoder_that_leaves_the_updates_out_computes_otherwise(made, monkeypatch):
    """The broken variant: the projections' structs without their adapters."""
    from specdecode.executor import decoder

    _, gguf, _, adapter_gguf, _ = made("qwen2_yarn")
    built = decoder._projection

    def without_adapter(projection, kept):
        struct = built(projection, kept)
        struct.lora = None
        return struct

    monkeypatch.setattr(decoder, "_projection", without_adapter)
    loaded = _loaded(gguf, Adapter(str(adapter_gguf), 0.1), quantization="w8a8")
    one_call, by_module = _decoder_and_module_logits(loaded)
    assert not torch.allclose(one_call, by_module, atol=1e-2)


def test_a_head_distilled_for_an_adapted_target_records_its_features_apart(made, tmp_path):
    """The recordings of the target's features are kept per adapter (its files as they are now), as the features
    differ while the backend and layers do not."""
    from specdecode.cli import build_parser
    from specdecode.distill.data import _cache_path

    folder, _, adapter, _, _ = made("qwen2_yarn")
    second = tmp_path / "second"
    make_lora(reference_model(folder), second, ("o_proj",), seed=1)
    paths = {
        _cache_path(_loaded(folder, *adapters), ["sonnets"], 16)
        for adapters in ([], [Adapter(str(adapter))], [Adapter(str(adapter), 0.5)], [Adapter(str(second))])
    }
    assert len(paths) == 4
    (second / "adapter_config.json").write_text((second / "adapter_config.json").read_text() + " ")
    assert _cache_path(_loaded(folder, Adapter(str(second))), ["sonnets"], 16) not in paths
    assert build_parser().parse_args(["distill", "--out", "h", "--lora", str(adapter)]).lora == [str(adapter)]
