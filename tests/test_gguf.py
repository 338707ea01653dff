"""GGUF loading: dequantization through our loader equals the `gguf` package's reference, tensor
orientation is right, and a model written the way llama.cpp's converter writes it (Llama q/k rows
permuted for interleaved RoPE) loads into a runtime that matches transformers."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize

from specdecode.models.gguf_loader import dequantize_tensor, load_gguf, unpermute_rope
from specdecode.models.runtime import build_model

from conftest import random_hf_weights, tiny_config
from test_runtime import _reference

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
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    out = {"token_embd.weight": hf["model.embed_tokens.weight"].numpy(),
           "output_norm.weight": hf["model.norm.weight"].numpy(), "output.weight": hf["lm_head.weight"].numpy()}
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
