"""GGUF loading: dequantization through our loader equals the `gguf` package's reference, tensor
orientation is right, and a model written the way llama.cpp's converter writes it (Llama q/k rows
permuted for interleaved RoPE) loads into a runtime that matches transformers."""

import numpy as np
import pytest
import torch
from conftest import random_hf_weights, tiny_config
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize
from test_runtime import _reference

from specdecode.models.checkpoints import unpermute_rope
from specdecode.models.gguf_loader import dequantize_tensor, load_gguf
from specdecode.models.runtime import build_model

QUANTIZABLE = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0]
TOLERANCE = {Q.F32: 0, Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 0.02, Q.Q5_0: 0.1, Q.Q4_0: 0.2, Q.Q4_1: 0.2}


def _permute_like_llama_cpp(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What convert_hf_to_gguf does to Llama q/k projections (the loader must undo it)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write(path, arch, cfg, tensors: dict[str, np.ndarray], qtype=Q.F32):
    w = GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    for name, arr in tensors.items():
        t = qtype if arr.ndim == 2 else Q.F32
        w.add_tensor(name, quantize(arr, t) if t != Q.F32 else arr, raw_dtype=t if t != Q.F32 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _to_gguf_names(cfg, hf: dict[str, torch.Tensor], arch: str) -> dict[str, np.ndarray]:
    names = {
        "q_proj": "attn_q",
        "k_proj": "attn_k",
        "v_proj": "attn_v",
        "o_proj": "attn_output",
        "gate_proj": "ffn_gate",
        "up_proj": "ffn_up",
        "down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    out = {
        "token_embd.weight": hf["model.embed_tokens.weight"].numpy(),
        "output_norm.weight": hf["model.norm.weight"].numpy(),
        "output.weight": hf["lm_head.weight"].numpy(),
    }
    for key, value in hf.items():
        parts = key.split(".")
        if parts[1] != "layers":
            continue
        module, kind = parts[-2], parts[-1]
        arr = value.numpy()
        if arch == "llama" and module in ("q_proj", "k_proj"):
            arr = _permute_like_llama_cpp(arr, cfg.num_heads if module == "q_proj" else cfg.num_kv_heads)
        out[f"blk.{parts[2]}.{names[module]}.{kind}"] = arr
    return out


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_dequantize_matches_gguf_reference(tmp_path, qtype):
    rng = np.random.default_rng(0)
    original = rng.standard_normal((48, 256)).astype(np.float32)  # [rows, cols] like a torch Linear weight
    cfg = tiny_config()
    _write(tmp_path / "t.gguf", "llama", cfg, {"token_embd.weight": original}, qtype)
    tensor = GGUFReader(str(tmp_path / "t.gguf")).tensors[0]
    ours = dequantize_tensor(tensor)
    assert ours.shape == original.shape  # GGUF's reversed dims are turned back into [rows, cols]
    np.testing.assert_array_equal(ours, dequantize(tensor.data, qtype).reshape(original.shape))
    assert np.abs(ours - original).max() <= TOLERANCE[qtype] * np.abs(original).max() + 1e-7


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.random.default_rng(1).standard_normal((64, 24)).astype(np.float32)
    np.testing.assert_array_equal(unpermute_rope(_permute_like_llama_cpp(w, 4), 4), w)
    assert not np.array_equal(_permute_like_llama_cpp(w, 4), w)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_model_matches_transformers(tmp_path, arch):
    cfg = tiny_config(arch)
    weights = random_hf_weights(cfg, seed=7)
    _write(tmp_path / "m.gguf", arch, cfg, _to_gguf_names(cfg, weights, arch))
    loaded_cfg, tensors = load_gguf(str(tmp_path / "m.gguf"), progress=False)
    assert loaded_cfg.num_kv_heads == cfg.num_kv_heads and loaded_cfg.qkv_bias == (arch == "qwen2")
    ours = build_model(loaded_cfg, tensors, torch.float32, "cpu")
    ids = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    from specdecode.executor.runner import ModelRunner

    runner = ModelRunner(ours, 1, 32)
    got = runner.forward([runner.allocate()], [ids[0].tolist()], "all")
    with torch.no_grad():
        expected = _reference(cfg, weights)(ids).logits[0]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


K_QUANT_BYTES = {Q.Q2_K: 84, Q.Q3_K: 110}  # per 256 weights; the fp16 super-block scale(s) at the end


def _k_quant_blocks(qtype, rows: int, columns: int, seed: int) -> np.ndarray:
    """Valid blocks of a k-quant the low-bit kernel does not compute as stored (gguf has no quantizer for
    them): random quants and sub-block scales, small fp16 super-block scales."""
    rng = np.random.default_rng(seed)
    size, nb = K_QUANT_BYTES[qtype], columns // 256
    blocks = rng.integers(0, 256, size=(rows, nb, size), dtype=np.uint8)
    scales = 2 if qtype == Q.Q2_K else 1  # Q2_K: d and dmin
    d = rng.uniform(0.0005, 0.0015, (rows, nb, scales)).astype(np.float16)
    blocks[..., size - 2 * scales :] = d.view(np.uint8).reshape(rows, nb, 2 * scales)
    return blocks.reshape(rows, nb * size)


def test_k_quants_load_q3_k_as_stored_and_q2_k_requantized_with_a_warning(tmp_path, monkeypatch):
    """Q3_K and Q2_K weights (as in Q2_K files): the float path takes gguf's dequantization; a low-bit
    backend computes Q3_K as stored, requantizes Q2_K with a warning that names it, and tracks the float
    model."""
    from specdecode.executor.backends import build_quantized_model
    from specdecode.executor.runner import ModelRunner
    from specdecode.models.loader import load_low_bit_weights

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    cfg = tiny_config("qwen2", hidden=256, intermediate=512)
    tensors = _to_gguf_names(cfg, random_hf_weights(cfg, seed=3), "qwen2")
    w = GGUFWriter(str(tmp_path / "k.gguf"), "qwen2")
    for key, value in (
        ("block_count", cfg.num_layers),
        ("context_length", cfg.max_position),
        ("embedding_length", cfg.hidden_size),
        ("feed_forward_length", cfg.intermediate_size),
        ("head_count", cfg.num_heads),
        ("head_count_kv", cfg.num_kv_heads),
    ):
        getattr(w, f"add_{key}")(value)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    for i, (name, arr) in enumerate(tensors.items()):
        if arr.ndim == 2 and arr.shape[1] % 256 == 0 and name != "token_embd.weight":
            qtype = Q.Q2_K if "ffn" in name else Q.Q3_K
            w.add_tensor(name, _k_quant_blocks(qtype, arr.shape[0], arr.shape[1], i), raw_dtype=qtype)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    loaded_cfg, floats = load_gguf(str(tmp_path / "k.gguf"), progress=False)
    reader = GGUFReader(str(tmp_path / "k.gguf"))
    q3 = next(t for t in reader.tensors if t.tensor_type == Q.Q3_K)
    np.testing.assert_array_equal(dequantize_tensor(q3), dequantize(q3.data, Q.Q3_K).reshape(-1, int(q3.shape[0])))
    with pytest.warns(UserWarning, match="weights in Q2_K are not computed as stored"):
        _, low_bit = load_low_bit_weights(str(tmp_path / "k.gguf"), "w4a8", progress=False)
    ids = list(range(1, 30))
    models = [
        build_model(loaded_cfg, floats, torch.float32, "cpu"),
        build_quantized_model(loaded_cfg, low_bit, "w4a8", "cpu"),
    ]
    formats = {
        part.format.name for m in models[1].modules() for part in getattr(m, "parts", [m]) if hasattr(part, "format")
    }
    assert "Q3_K" in formats and "Q2_K" not in formats
    reference, got = (ModelRunner(m, 1, 64).forward([0], [ids], "all") for m in models)
    assert ((got - reference).norm() / reference.norm()).item() < 0.03


def test_a_type_gguf_cannot_dequantize_is_refused_with_what_to_use():
    from types import SimpleNamespace

    from specdecode.errors import SpecDecodeError

    tensor = SimpleNamespace(
        name="blk.0.attn_q.weight", tensor_type=Q.Q8_1, shape=[256, 16], data=np.zeros((16, 8 * 36), dtype=np.uint8)
    )
    with pytest.raises(SpecDecodeError, match="Q8_1, which the gguf package cannot dequantize; use a file"):
        dequantize_tensor(tensor)
