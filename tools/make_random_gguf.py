"""Random-weight GGUF files at real models' shapes, made the way users' files are made: a checkpoint saved by
transformers (with the family's real vocabulary), converted by llama.cpp's convert_hf_to_gguf.py and quantized
by its llama-quantize. For speed comparisons with llama.cpp on families no bundled file covers (speed does not
depend on the weights' values; acceptance does, so none is measured on these).

    python tools/make_random_gguf.py SHAPE --bin BIN --out DIR [--type Q4_K_M]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from families import llama_cpp_source, save_spm_tokenizer, vocabulary  # noqa: E402

QWEN_VOCAB, LLAMA_VOCAB = "ggml-vocab-qwen2.gguf", "ggml-vocab-llama-bpe.gguf"
SPM = "spm"  # a SentencePiece model trained here, its pieces padded to the shape's vocab_size by the converter
SHAPES = {
    # Qwen3-1.7B
    "qwen3-1.7b": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        QWEN_VOCAB,
        dict(
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            tie_word_embeddings=True,
            max_position_embeddings=40960,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
    ),
    # Llama-3.2-1B
    "llama3.2-1b": (
        "LlamaConfig",
        "LlamaForCausalLM",
        LLAMA_VOCAB,
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            tie_word_embeddings=True,
            max_position_embeddings=131072,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=32.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            ),
        ),
    ),
    # A Qwen3-MoE of about 0.9B active parameters (3.8B in all): 32 experts, 4 per token
    "qwen3-moe-a0.9b": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        QWEN_VOCAB,
        dict(
            hidden_size=1536,
            intermediate_size=4096,
            moe_intermediate_size=1024,
            num_experts=32,
            num_experts_per_tok=4,
            norm_topk_prob=True,
            num_hidden_layers=24,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=128,
            tie_word_embeddings=False,
            max_position_embeddings=40960,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
    ),
    # the dense model of the same active parameters: the MoE's attention, one MLP as wide as its 4 experts
    "qwen3-dense-0.9b": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        QWEN_VOCAB,
        dict(
            hidden_size=1536,
            intermediate_size=4096,
            num_hidden_layers=24,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=128,
            tie_word_embeddings=False,
            max_position_embeddings=40960,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
    ),
    # Gemma 2 2B: head size 256, every other layer sliding, both soft caps, a 256k vocabulary (tied)
    "gemma2-2b": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        SPM,
        dict(
            vocab_size=256000,
            hidden_size=2304,
            intermediate_size=9216,
            num_hidden_layers=26,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            query_pre_attn_scalar=256,
            sliding_window=4096,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            max_position_embeddings=8192,
        ),
    ),
    # Phi-4-mini: three quarters of each head turned, by LongRoPE past 4k tokens; a 200k vocabulary (tied)
    "phi4-mini": (
        "Phi3Config",
        "Phi3ForCausalLM",
        SPM,
        dict(
            vocab_size=200064,
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=32,
            num_attention_heads=24,
            num_key_value_heads=8,
            tie_word_embeddings=True,
            max_position_embeddings=131072,
            original_max_position_embeddings=4096,
            rope_parameters=dict(
                rope_type="longrope",
                rope_theta=10000.0,
                partial_rotary_factor=0.75,
                original_max_position_embeddings=4096,
                short_factor=[1.0] * 48,
                long_factor=[1.0 + i for i in range(48)],
            ),
            pad_token_id=None,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    # Command R7B's layers (LayerNorms, attention and MLP side by side, three of four sliding, the fourth without
    # RoPE, logits scaled) at Llama-3.2-1B's size, with Qwen's vocabulary (its converter takes byte-level BPE ones
    # only; Command R7B's has 256k tokens), tied
    "cohere2-1b": (
        "Cohere2Config",
        "Cohere2ForCausalLM",
        QWEN_VOCAB,
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            sliding_window=4096,
            logit_scale=0.25,
            rotary_pct=1.0,
            max_position_embeddings=131072,
            rope_parameters=dict(rope_type="default", rope_theta=50000.0),
        ),
    ),
    # GLM-4.5-Air's layers (the first dense, then 8 of 64 experts by sigmoid score plus a bias, times 2.5, beside a
    # shared one; half of each head turned; biased q/k/v) at about 0.45B active of 2.4B parameters, with Qwen's
    # vocabulary (GLM's is as large)
    "glm4.5-moe-a0.45b": (
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        QWEN_VOCAB,
        dict(
            hidden_size=1536,
            intermediate_size=4096,
            moe_intermediate_size=512,
            n_routed_experts=64,
            num_experts_per_tok=8,
            n_shared_experts=1,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            num_hidden_layers=16,
            num_attention_heads=12,
            num_key_value_heads=4,
            head_dim=128,
            attention_bias=True,
            tie_word_embeddings=False,
            max_position_embeddings=131072,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0, partial_rotary_factor=0.5),
        ),
    ),
    # DeepSeek-V2-Lite (latent attention with queries projected directly; 6 of 64 experts 1408 wide and two shared;
    # its first layer dense) with 8 of its experts: its 2.4B active per token, of 3.1B (its 27 layers: llama.cpp reads
    # a file without a query compression only at that count)
    "deepseek-v2-lite-8e": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        LLAMA_VOCAB,  # (128k: its own 102k's file, as this tool saves it, is not one llama.cpp's converter knows)
        dict(
            hidden_size=2048,
            intermediate_size=10944,
            moe_intermediate_size=1408,
            n_routed_experts=8,
            num_experts_per_tok=6,
            n_shared_experts=2,
            first_k_dense_replace=1,
            num_hidden_layers=27,
            num_attention_heads=16,
            num_key_value_heads=16,
            q_lora_rank=None,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            head_dim=64,
            v_head_dim=128,
            tie_word_embeddings=False,
            max_position_embeddings=163840,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=40.0,
                original_max_position_embeddings=4096,
                beta_fast=32,
                beta_slow=1,
                mscale=0.707,
                mscale_all_dim=0.707,
            ),
        ),
    ),
    # GLM-4.7-Flash (DeepSeek-V3's latent attention, 20 heads, values as wide as keys; GLM-4.5's experts, 4 of 64
    # 1536 wide and a shared one; its first layer dense) with 16 of its experts and 12 of its 47 layers: its attention
    # and active experts per layer, 1.1B active of 2.8B. Gating by sigmoid stated, as llama.cpp gates the real model
    "glm4.7-flash-16e": (
        "Glm4MoeLiteConfig",
        "Glm4MoeLiteForCausalLM",
        QWEN_VOCAB,
        dict(
            hidden_size=2048,
            intermediate_size=10240,
            moe_intermediate_size=1536,
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_shared_experts=1,
            first_k_dense_replace=1,
            routed_scaling_factor=1.8,
            scoring_func="sigmoid",
            num_hidden_layers=12,
            num_attention_heads=20,
            num_key_value_heads=20,
            q_lora_rank=768,
            kv_lora_rank=512,
            qk_nope_head_dim=192,
            qk_rope_head_dim=64,
            v_head_dim=256,
            tie_word_embeddings=False,
            max_position_embeddings=202752,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
    ),
    # MiniMax-M2 (48 heads 128 wide over 8 of keys and values, q/k norms over each projection, half of each head
    # turned; 8 of 256 experts 1536 wide chosen by sigmoid and a bias) with 16 of its experts and 8 of its 62 layers:
    # its attention and active experts per layer, 1.7B active of 3.1B (Qwen's vocabulary for its 200k)
    "minimax-m2-16e": (
        "MiniMaxM2Config",
        "MiniMaxM2ForCausalLM",
        QWEN_VOCAB,
        dict(
            hidden_size=3072,
            intermediate_size=1536,
            num_local_experts=16,
            num_experts_per_tok=8,
            scoring_func="sigmoid",
            num_hidden_layers=8,
            num_attention_heads=48,
            num_key_value_heads=8,
            head_dim=128,
            rotary_dim=64,
            bos_token_id=None,
            eos_token_id=None,
            tie_word_embeddings=False,
            max_position_embeddings=196608,
            rope_parameters=dict(rope_type="default", rope_theta=5000000.0),
        ),
    ),
    # Ministral 3 3B's text model (26 layers, 3,072 wide, 32 heads of 128 over 8 of keys and values, 9,216-wide MLPs,
    # tied embeddings), Llama 3's vocabulary for its 131k one; its context and RoPE (YaRN by 16 over 16,384 with its
    # mscale pair and attention temperature) are transformers' defaults for the family
    "ministral3-3b": (
        "Ministral3Config",
        "Ministral3ForCausalLM",
        LLAMA_VOCAB,
        dict(
            hidden_size=3072,
            intermediate_size=9216,
            num_hidden_layers=26,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            tie_word_embeddings=True,
        ),
    ),
}


# special tokens a family's converter looks up by name (GLM's sets its BOS and end-of-turn tokens from them)
ADDED_TOKENS = dict.fromkeys(("glm4.5-moe-a0.45b", "glm4.7-flash-16e"), ("[gMASK]", "<|user|>", "<|observation|>"))


def make(shape: str, bin_dir: str, out: Path, quant: str) -> Path:
    import transformers

    config_class, model_class, vocab, options = SHAPES[shape]
    final = out / f"{shape}-random-{quant.lower()}.gguf"
    if final.exists():
        return final
    folder, f16 = out / f"{shape}-hf", out / f"{shape}-f16.gguf"
    folder.mkdir(parents=True, exist_ok=True)
    if vocab == SPM:
        save_spm_tokenizer(folder)
    else:
        tokenizer = vocabulary(vocab).hf
        tokenizer.add_special_tokens({"additional_special_tokens": list(ADDED_TOKENS.get(shape, ()))})
        tokenizer.save_pretrained(folder)
        options = dict(vocab_size=len(tokenizer), **options)
    config = getattr(transformers, config_class)(**options)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # half the memory of float32 while the weights are made
    model = getattr(transformers, model_class)(config)
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(folder)
    del model
    subprocess.run(
        [
            sys.executable,
            str(llama_cpp_source() / "convert_hf_to_gguf.py"),
            str(folder),
            "--outtype",
            "f16",
            "--outfile",
            str(f16),
        ],
        check=True,
    )
    shutil.rmtree(folder)
    subprocess.run([os.path.join(bin_dir, "llama-quantize"), str(f16), str(final), quant, "2"], check=True)
    f16.unlink()
    return final


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", choices=SHAPES)
    parser.add_argument("--bin", required=True, help="the folder build-llama-cpp.sh printed (llama-quantize)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--type", default="Q4_K_M")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(make(args.shape, args.bin, args.out, args.type))


if __name__ == "__main__":
    main()
