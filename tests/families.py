"""Tiny random-weight checkpoints of every family the runtime implements, made and saved by transformers (whose
forward is the reference), with tokenizers their converters accept: a SentencePiece model trained here on the
sonnets, or the byte-level BPE vocabularies of Llama 3 and Qwen that llama.cpp ships for its own tests; and their
GGUF conversions by llama.cpp's own convert_hf_to_gguf.py (from the llama-cpp-python source on PyPI, the source
`../shared/tools/build-llama-cpp.sh` builds from). Nobody here wrote the reference or the conversion."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdecode.models.sources import cache_root

LLAMA_CPP_PYTHON = "0.3.36"
SONNETS = Path(__file__).resolve().parents[1] / "src" / "specdecode" / "bench" / "data" / "sonnets.txt"
SPM_VOCAB = 300
ATTENTION_SOFTCAP, FINAL_SOFTCAP = 4.0, 30.0
SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
)


def _longrope(short: list[float], long: list[float], **rope) -> dict:
    """A Phi3Config's options for LongRoPE over 16 original positions (its rope_parameters and the top-level field
    Phi-3's configs carry), with the sonnets' SentencePiece ids for BOS and EOS."""
    original = 16
    parameters = dict(rope_type="longrope", rope_theta=10000.0, short_factor=short, long_factor=long, **rope)
    return dict(
        rope_parameters=dict(parameters, original_max_position_embeddings=original),
        original_max_position_embeddings=original,
        pad_token_id=None,
        bos_token_id=1,
        eos_token_id=2,
    )


@dataclass(frozen=True)
class Family:
    """A transformers model class and the config options that exercise what the family adds."""

    config: str
    model: str
    options: dict = field(default_factory=dict)
    tokenizer: str = "spm"  # "spm", or a vocabulary file of llama.cpp's models/ folder
    added_tokens: tuple[str, ...] = ()  # special tokens its converter looks up by name
    norm_center: float = 1.0  # what random norm weights scatter around (Gemma stores weight - 1)
    # config.json's per-layer lists, one value every layer, written as the hub's checkpoints write them (transformers 5
    # writes its own names in their place)
    every_layer: dict = field(default_factory=dict)


# Granite 3's four multipliers at values far from 1 (the 8B's residual 0.22, an embedding of 12)
GRANITE_MULTIPLIERS = dict(
    embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.05, logits_scaling=8.0
)

LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=500000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=32,
)

# DeepSeek's latent attention at a small size (both versions'): heads 32 wide, as the attention kernel takes them
DEEPSEEK_ATTENTION = dict(
    num_hidden_layers=3,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=24,
    qk_rope_head_dim=8,
    head_dim=8,  # transformers' own: the turned part's
    v_head_dim=16,
)


def deepseek_yarn(mscale: float) -> dict:
    """YaRN by 4 over 256 positions with DeepSeek's mscale pair, equal as in its checkpoints."""
    return dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=4.0,
        original_max_position_embeddings=256,
        mscale=mscale,
        mscale_all_dim=mscale,
    )


FAMILIES = {
    "llama3": Family(
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True),
        tokenizer="ggml-vocab-llama-bpe.gguf",
    ),
    "mistral": Family("MistralConfig", "MistralForCausalLM", dict(sliding_window=12, tie_word_embeddings=False)),
    "qwen3": Family(
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(head_dim=32, tie_word_embeddings=True),
        tokenizer="ggml-vocab-qwen2.gguf",
    ),
    # six layers: the sixth attends to the whole context (the pattern llama.cpp assumes), the others to 12 keys;
    # the global layers' RoPE linearly scaled, as in the larger Gemma 3 models
    "gemma3": Family(
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            num_hidden_layers=6,
            num_key_value_heads=1,
            sliding_window=12,
            query_pre_attn_scalar=16,
            rope_parameters=dict(
                full_attention=dict(rope_type="linear", rope_theta=1000000.0, factor=8.0),
                sliding_attention=dict(rope_type="default", rope_theta=10000.0),
            ),
        ),
        norm_center=0.0,
    ),
    # four layers, the first and third attending to 12 keys; the scores' soft cap low enough to bend these weights'
    # scores (Gemma 2's own is 50), the logits' Gemma 2's own
    "gemma2": Family(
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            num_hidden_layers=4,
            sliding_window=12,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=ATTENTION_SOFTCAP,
            final_logit_softcapping=FINAL_SOFTCAP,
        ),
        norm_center=0.0,
    ),
    # Qwen2.5's long-context recipe, YaRN: over 64 original positions, head dimensions 1-2 on the ramp between those
    # kept and those divided by the factor, and cos and sin scaled by 0.1 ln 4 + 1
    "qwen2_yarn": Family(
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64),
            max_position_embeddings=256,
            tie_word_embeddings=False,
        ),
    ),
    # four layers: the fourth rotates no position into its queries and keys (NoPE)
    "smollm3": Family(
        "SmolLM3Config",
        "SmolLM3ForCausalLM",
        dict(num_hidden_layers=4, tie_word_embeddings=True, pad_token_id=None, bos_token_id=1, eos_token_id=2),
    ),
    # Phi-3 and Phi-4: q/k/v and gate/up each one tensor (no window: Phi-4's; Phi-3's is checked apart)
    "phi3": Family(
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(original_max_position_embeddings=1024, pad_token_id=None, bos_token_id=1, eos_token_id=2),
    ),
    # Phi-3.5: LongRoPE over 16 original positions (a 20-token prompt is past them, for transformers' switch to the long
    # factors), each dimension's short and long divisors far apart, cos and sin scaled by sqrt(1 + ln 64 / ln 16)
    "phi3_longrope": Family(
        "Phi3Config",
        "Phi3ForCausalLM",
        _longrope(short=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8], long=[1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 18.0]),
    ),
    # Phi-4-mini: RoPE over three quarters of each head (12 of 16 dimensions), by LongRoPE's factors for them
    "phi4_mini": Family(
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            _longrope(
                short=[1.0, 1.2, 1.5, 2.0, 2.6, 3.3], long=[1.0, 2.0, 4.0, 7.0, 11.0, 16.0], partial_rotary_factor=0.75
            ),
            tie_word_embeddings=True,
        ),
    ),
    "granite": Family("GraniteConfig", "GraniteForCausalLM", dict(GRANITE_MULTIPLIERS, tie_word_embeddings=True)),
    # Granite 4.0's dense models (granite-4.0-micro): the hybrid family with attention on every layer and no experts,
    # its MLP named shared, as wide as intermediate_size (as the checkpoints have it; llama.cpp's converter writes a
    # dense Granite whose MLP is intermediate_size wide)
    "granite4_dense": Family(
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        dict(
            GRANITE_MULTIPLIERS,
            num_local_experts=0,
            num_experts_per_tok=0,
            shared_intermediate_size=SMALL["intermediate_size"],
            position_embedding_type="rope",
            tie_word_embeddings=True,
        ),
        every_layer=dict(layer_types="attention"),  # transformers 5 writes "full_attention"
    ),
    # ERNIE 4.5 (the 0.3B): RoPE over adjacent dimensions, as GPT-J's, in the checkpoint and in llama.cpp's conversion
    "ernie4_5": Family("Ernie4_5Config", "Ernie4_5ForCausalLM", dict(tie_word_embeddings=True)),
    "mixtral": Family("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    # Granite 3's mixtures of experts (the 1B-A400M's, 3B-A800M's): the multipliers, and experts stored stacked with
    # gate and up in one tensor
    "granitemoe": Family(
        "GraniteMoeConfig",
        "GraniteMoeForCausalLM",
        dict(GRANITE_MULTIPLIERS, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=True),
    ),
    # gpt-oss: attention sinks, biases on q/k/v/o, the router and the experts, the clamped SwiGLU (gate and up stored
    # interleaved, the experts' gate weights wide enough to pass its limit), every other layer sliding from the
    # first, and YaRN over 64 original positions with its ramp's ends rounded (llama.cpp's reading, which a GGUF
    # gets: the ramp as config.json states it, truncate false in gpt-oss's own, is compared apart)
    "gpt_oss": Family(
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=12,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=150000.0,
                factor=4.0,
                original_max_position_embeddings=64,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=True,
            ),
            max_position_embeddings=256,
            tie_word_embeddings=False,
        ),
        tokenizer="ggml-vocab-qwen2.gguf",
    ),
    # Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): a shared expert beside the routed ones, weighed by a sigmoid gate;
    # top-k weights not renormalised (norm_topk_prob false, its checkpoints' and llama.cpp's graph's)
    "qwen2_moe": Family(
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=96,
            norm_topk_prob=False,
            tie_word_embeddings=False,
        ),
        tokenizer="ggml-vocab-qwen2.gguf",
    ),
    # GLM-4-0414: RoPE over the first half of each head, adjacent dimensions paired (GPT-J's), in the checkpoint and in
    # llama.cpp's conversion; sandwich norms (one named as Llama's norm before the MLP); biased q/k/v; gate and up in
    # one tensor
    "glm4": Family(
        "Glm4Config",
        "Glm4ForCausalLM",
        dict(tie_word_embeddings=False),
        tokenizer="ggml-vocab-qwen2.gguf",
        added_tokens=("<|user|>",),
    ),
    # GLM-4-9B-chat's transformers port: GLM-4-0414's attention and MLP without the sandwich norms; llama.cpp converts
    # it to its chatglm architecture, writing an epsilon of 1e-5 and the context from seq_length whatever config.json
    # says (so both set here as the converter reads them)
    "glm": Family(
        "GlmConfig",
        "GlmForCausalLM",
        dict(rms_norm_eps=1e-5, seq_length=1024, tie_word_embeddings=False),
        tokenizer="ggml-vocab-qwen2.gguf",
        added_tokens=("<|user|>",),
    ),
    # Seed-OSS: Llama's layer with biased q/k/v and a head size of its own; its attention output's bias (off in its
    # checkpoints, and without a place in llama.cpp's graph) on here
    "seed_oss": Family(
        "SeedOssConfig",
        "SeedOssForCausalLM",
        dict(attention_out_bias=True, tie_word_embeddings=False),
        tokenizer="ggml-vocab-qwen2.gguf",
    ),
    # OLMo 2: norms after attention and the MLP only, q/k norms over each projection's whole width
    "olmo2": Family(
        "Olmo2Config", "Olmo2ForCausalLM", dict(tie_word_embeddings=False), tokenizer="ggml-vocab-qwen2.gguf"
    ),
    # OLMo 3: OLMo 2's layers, three of four sliding over 12 keys, YaRN on the full ones only (the sliding ones turn
    # unscaled, without its attention factor)
    "olmo3": Family(
        "Olmo3Config",
        "Olmo3ForCausalLM",
        dict(
            num_hidden_layers=4,
            sliding_window=12,
            rope_parameters=dict(
                full_attention=dict(
                    rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64
                ),
                sliding_attention=dict(rope_type="default", rope_theta=10000.0),
            ),
            max_position_embeddings=256,
            tie_word_embeddings=False,
        ),
        tokenizer="ggml-vocab-qwen2.gguf",
    ),
    # EXAONE 4.0 (the 1.2B): OLMo 2's norms after attention and the MLP only, Qwen3's q/k norms per head, Llama 3's
    # RoPE scaling; no window
    "exaone4": Family(
        "Exaone4Config",
        "Exaone4ForCausalLM",
        dict(sliding_window=None, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False),
        tokenizer="ggml-vocab-qwen2.gguf",
        every_layer=dict(layer_types="full_attention"),
    ),
    # EXAONE 4.0 32B's layers: three of four sliding over 12 keys, the fourth attending to all without RoPE (its GGUF
    # is compared apart: llama.cpp slides the layers of a 64-layer file only)
    "exaone4_hybrid": Family(
        "Exaone4Config",
        "Exaone4ForCausalLM",
        dict(num_hidden_layers=4, sliding_window=12, sliding_window_pattern=4, tie_word_embeddings=False),
        tokenizer="ggml-vocab-qwen2.gguf",
    ),
    # ERNIE 4.5's mixtures of experts (21B-A3B, 300B-A47B): its first layer dense, then experts chosen by probability
    # plus a bias of each (its "statics"), weighed by their renormalised probabilities, beside an ungated shared one;
    # RoPE over adjacent dimensions, as the dense ERNIE's
    "ernie4_5_moe": Family(
        "Ernie4_5_MoeConfig",
        "Ernie4_5_MoeForCausalLM",
        dict(
            num_hidden_layers=3,
            moe_num_experts=4,
            moe_k=2,
            moe_intermediate_size=64,
            moe_num_shared_experts=1,
            moe_layer_start_index=1,
        ),
    ),
    # Command-R and Aya: LayerNorms, attention and the MLP side by side on one norm, RoPE over adjacent dimensions, the
    # logits multiplied by logit_scale (its own 0.0625)
    "cohere": Family("CohereConfig", "CohereForCausalLM", dict(logit_scale=0.0625), tokenizer="ggml-vocab-qwen2.gguf"),
    # Command R+: Cohere's layers with a LayerNorm of each query and key head, each with weights of its own
    "command_r_plus": Family(
        "CohereConfig",
        "CohereForCausalLM",
        dict(logit_scale=0.0625, use_qk_norm=True),
        tokenizer="ggml-vocab-qwen2.gguf",
    ),
    # Command R7B and Command A: Cohere's layers, three of four sliding over 12 keys, the fourth attending to all
    # without RoPE; llama.cpp's converter reads rotary_pct (1 in Command R7B's config.json)
    "cohere2": Family(
        "Cohere2Config",
        "Cohere2ForCausalLM",
        dict(num_hidden_layers=4, sliding_window=12, logit_scale=0.25, rotary_pct=1.0),
        tokenizer="ggml-vocab-qwen2.gguf",
    ),
    # GLM-4.5 and 4.6 (and -Air): its first layer dense, then experts chosen by sigmoid score plus a bias of each,
    # weighed by their renormalised scores times routed_scaling_factor, beside an ungated shared one; biased q/k/v, q/k
    # norms per head (GLM-4.5's, not -Air's), half of each head turned as NeoX turns it; a next-token prediction layer
    # after its own (written by with_prediction_layers), which transformers and llama.cpp's graph leave out
    "glm4_moe": Family(
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        dict(
            num_hidden_layers=3,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            n_shared_experts=1,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            attention_bias=True,
            use_qk_norm=True,
            num_nextn_predict_layers=1,
            tie_word_embeddings=False,
        ),
        tokenizer="ggml-vocab-qwen2.gguf",
        added_tokens=("[gMASK]", "<|user|>", "<|observation|>"),
    ),
    # DeepSeek-V2-Lite: latent attention with queries projected directly, YaRN with the mscale pair equal (as every
    # DeepSeek's); its first layer dense, then experts chosen by softmax probability, weighed by them times
    # routed_scaling_factor, never renormalised, beside an ungated shared MLP two experts wide (V2's groups of experts:
    # test_deepseek_v2s_groups_of_experts_match_transformers)
    "deepseek_v2": Family(
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        dict(
            **DEEPSEEK_ATTENTION,
            q_lora_rank=None,
            rope_parameters=deepseek_yarn(0.707),
            n_routed_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=64,
            n_shared_experts=2,
            first_k_dense_replace=1,
            routed_scaling_factor=1.5,
            tie_word_embeddings=False,
        ),
        tokenizer="ggml-vocab-qwen2.gguf",
    ),
    # DeepSeek-V3 (and R1, Moonlight): latent attention (queries through a compression, keys and values expanded from
    # one, its turned key part shared by all heads, values narrower than keys), YaRN with the mscale pair (every score
    # scaled; the pair unequal: test_an_unequal_mscale_pair_matches_transformers); its first layer dense, then experts
    # chosen among the best 2 of 4 groups by sigmoid score plus a bias of each, weighed by their renormalised scores
    # times routed_scaling_factor, beside an ungated shared one; a next-token prediction layer after its own
    "deepseek_v3": Family(
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            **DEEPSEEK_ATTENTION,
            q_lora_rank=32,
            rope_parameters=deepseek_yarn(0.8),
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            # as its config.json says (transformers' V3 assumes it; llama.cpp's converter reads it)
            scoring_func="sigmoid",
            topk_method="noaux_tc",
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            num_nextn_predict_layers=1,
            tie_word_embeddings=False,
        ),
        tokenizer="ggml-vocab-qwen2.gguf",
    ),
    # GLM-4.7-Flash: DeepSeek-V3's latent attention (values as wide as keys, no YaRN) beside GLM-4.5's experts (its
    # first layer dense, as transformers' mlp_layer_types has it); a next-token prediction layer after its own, which
    # llama.cpp's converter keeps in the file (groups of experts: test_glm_experts_chosen_among_groups_...)
    "glm4_moe_lite": Family(
        "Glm4MoeLiteConfig",
        "Glm4MoeLiteForCausalLM",
        dict(
            **{**DEEPSEEK_ATTENTION, "v_head_dim": 32},
            q_lora_rank=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            n_shared_experts=1,
            # as GLM-4.7-Flash's config.json says (llama.cpp's converter reads it), and a gating function stated
            # (its converter writes none, and llama.cpp's graph then gates by sigmoid only at the real model's shape)
            first_k_dense_replace=1,
            scoring_func="sigmoid",
            routed_scaling_factor=1.8,
            num_nextn_predict_layers=1,
            tie_word_embeddings=False,
        ),
        tokenizer="ggml-vocab-qwen2.gguf",
        added_tokens=("[gMASK]", "<|user|>", "<|observation|>"),
    ),
    # MiniMax-M2: Mixtral's experts chosen by sigmoid score plus a bias of each, weighed by their renormalised scores;
    # q/k norms over each projection's whole width (OLMo's) on pre-norm layers; half of each head turned (rotary_dim),
    # NeoX's pairs; the gating function stated, as its config.json does (llama.cpp's converter reads it)
    "minimax_m2": Family(
        "MiniMaxM2Config",
        "MiniMaxM2ForCausalLM",
        dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            rotary_dim=8,
            scoring_func="sigmoid",
            bos_token_id=None,
            eos_token_id=None,
            tie_word_embeddings=False,
        ),
        tokenizer="ggml-vocab-qwen2.gguf",
    ),
    # OLMoE: q/k norms over each projection's whole width on pre-norm layers, experts chosen by softmax probability,
    # never renormalised (as its checkpoints say, and llama.cpp's graph computes whatever they say)
    "olmoe": Family(
        "OlmoeConfig",
        "OlmoeForCausalLM",
        dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, tie_word_embeddings=False),
        tokenizer="ggml-vocab-qwen2.gguf",
    ),
    # Ministral 3: YaRN with DeepSeek's mscale pair at 1 (cos and sin unscaled) and Llama 4's attention temperature,
    # past 48 positions here: a prompt of 40 and the decoded tokens before the 48th stay within it (the one-call
    # decoder's), those after it are scaled
    "ministral3": Family(
        "Ministral3Config",
        "Ministral3ForCausalLM",
        dict(
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=48,
                mscale=1.0,
                mscale_all_dim=1.0,
                llama_4_scaling_beta=0.5,
            ),
            tie_word_embeddings=False,
            pad_token_id=None,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    "qwen3_moe": Family(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            norm_topk_prob=True,
            tie_word_embeddings=False,
        ),
        tokenizer="ggml-vocab-qwen2.gguf",
    ),
}


CONVERTERS = ("convert_hf_to_gguf.py", "convert_lora_to_gguf.py")


def llama_cpp_source() -> Path:
    """llama.cpp's source tree as the llama-cpp-python sdist vendors it: the build tool's copy where it is
    there, else fetched from PyPI once into the specdecode cache (what the tests read of it)."""
    home = Path(os.environ.get("LLAMA_CPP_HOME", Path.home() / ".cache" / "llama.cpp-reference"))
    built = home / LLAMA_CPP_PYTHON / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    if (built / "convert_hf_to_gguf.py").exists():
        return built
    root = Path(cache_root()) / f"llama-cpp-python-{LLAMA_CPP_PYTHON}"
    source = root / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    if not all((source / script).exists() for script in CONVERTERS):
        root.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--no-binary",
                ":all:",
                f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
                "-d",
                str(root),
            ],
            check=True,
        )
        wanted = (*CONVERTERS, "conversion/", "gguf-py/", "models/ggml-vocab-")
        with tarfile.open(root / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz") as tar:
            members = [m for m in tar.getmembers() if m.name.partition("/vendor/llama.cpp/")[2].startswith(wanted)]
            tar.extractall(root, members=members, filter="data")
    return source


def make_checkpoint(name: str, folder: Path, seed: int = 0, **overrides) -> Path:
    """A random-weight checkpoint of the family saved by transformers, with its tokenizer files."""
    import transformers

    family = FAMILIES[name]
    folder.mkdir(parents=True, exist_ok=True)
    vocab = _save_tokenizer(family, folder)
    options = {**SMALL, "vocab_size": vocab, **family.options, **overrides}
    per_layer = {name: [value] * options["num_hidden_layers"] for name, value in family.every_layer.items()}
    config = getattr(transformers, family.config)(**options, **per_layer)
    torch.manual_seed(seed)
    model = getattr(transformers, family.model)(config).float()
    _randomise(model, family.norm_center, seed)
    model.save_pretrained(folder)
    if options.get("num_nextn_predict_layers"):
        with_prediction_layers(folder, options["num_hidden_layers"], options["num_nextn_predict_layers"])
    if per_layer:
        written = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**written, **per_layer}))
    return folder


def with_prediction_layers(folder: Path, layers: int, count: int) -> None:
    """The checkpoint with `count` next-token prediction layers after its `layers` own, named as GLM-4.5's hub
    checkpoints name theirs (transformers' model has none to save): a copy of its last layer, and the projection and
    norms that feed such a layer."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    last = f"model.layers.{layers - 1}."
    hidden = tensors["model.norm.weight"].shape[0]
    g = torch.Generator().manual_seed(layers)
    for extra in range(layers, layers + count):
        prefix = f"model.layers.{extra}."
        tensors |= {prefix + name[len(last) :]: t.clone() for name, t in tensors.items() if name.startswith(last)}
        tensors[prefix + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=g)
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            tensors[f"{prefix}{norm}.weight"] = torch.ones(hidden)
    save_file(tensors, str(path), metadata={"format": "pt"})


def reference_model(folder: Path):
    """transformers' model of a checkpoint folder, in float32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def convert(folder: Path, out: Path) -> Path:
    """llama.cpp's conversion of a checkpoint folder (float32 weights)."""
    source = llama_cpp_source()
    done = subprocess.run(
        [sys.executable, str(source / "convert_hf_to_gguf.py"), str(folder), "--outtype", "f32", "--outfile", str(out)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def make_lora(
    reference, folder: Path, targets: tuple[str, ...], rank: int = 4, alpha: float = 8.0, seed: int = 0
) -> dict[str, torch.Tensor]:
    """A random LoRA adapter of transformers' model saved as PEFT saves one (adapter_config.json and
    adapter_model.safetensors), on every linear layer whose name ends in one of targets; returns each adapted
    weight's update, (alpha / rank) B A, by the layer's name."""
    from safetensors.torch import save_file

    g, tensors, updates = torch.Generator().manual_seed(seed), {}, {}
    for name, module in reference.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets:
            a = 0.3 * torch.randn(rank, module.in_features, generator=g)
            b = 0.3 * torch.randn(module.out_features, rank, generator=g)
            tensors |= {f"base_model.model.{name}.lora_A.weight": a, f"base_model.model.{name}.lora_B.weight": b}
            updates[name] = alpha / rank * b @ a
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets), "bias": "none"}
    (folder / "adapter_config.json").write_text(json.dumps(settings))
    return updates


def merged_reference(folder: Path, updates: dict[str, torch.Tensor], scale: float = 1.0):
    """transformers' model of a checkpoint with an adapter's updates merged into its weights."""
    model = reference_model(folder)
    with torch.no_grad():
        for name, update in updates.items():
            model.get_submodule(name).weight += scale * update
    return model


def convert_lora(adapter: Path, base: Path, out: Path, outtype: str = "f32") -> Path:
    """llama.cpp's conversion of a PEFT adapter of the base checkpoint (its matrices in outtype)."""
    script = llama_cpp_source() / "convert_lora_to_gguf.py"
    options = ["--base", str(base), "--outtype", outtype, "--outfile", str(out)]
    done = subprocess.run([sys.executable, str(script), str(adapter), *options], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _randomise(model, norm_center: float, seed: int) -> None:
    """Weights large enough that the logits spread far past float rounding (transformers' initialisation gives
    near-uniform outputs, whose greedy choices are ties): matrices at 0.15, embeddings and routers wider, norms
    scattered around their centre."""
    g = torch.Generator().manual_seed(seed)
    gpt_oss = model.config.model_type == "gpt_oss"
    with torch.no_grad():
        # (GLM-4.5 holds its experts' selection bias as a buffer, saved as weights are)
        biases = [(n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
        for name, p in [*model.named_parameters(), *biases]:
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(norm_center + 0.2 * noise)
            elif "embed_tokens" in name or name.endswith("lm_head.weight"):
                p.copy_(noise)
            elif name.endswith("mlp.gate.weight") or "block_sparse_moe.gate" in name or "moe.router" in name:
                p.copy_(noise)  # routers: experts far apart, no near-ties in the top-k
            elif name.endswith("e_score_correction_bias"):
                p.copy_(0.3 * noise)  # ERNIE 4.5's, GLM-4.5's: large enough beside the scores to change some choices
            elif name.endswith(("mlp.router.weight", "self_attn.sinks")):
                p.copy_(noise)  # gpt-oss's router, and its sinks as large as scores
            elif gpt_oss and name.endswith("experts.gate_up_proj"):
                p.copy_(0.3 * noise)  # gpt-oss's gates, past its SwiGLU's limit now and then
            else:
                p.copy_(0.15 * noise)


def _save_tokenizer(family: Family, folder: Path) -> int:
    """The tokenizer files of a family's checkpoint; returns its vocabulary size."""
    if family.tokenizer == "spm":
        return save_spm_tokenizer(folder)
    tokenizer = _bpe_tokenizer(family.tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": list(family.added_tokens)})
    tokenizer.save_pretrained(folder)
    return len(tokenizer)


def save_spm_tokenizer(folder: Path, control_symbols: tuple[str, ...] = (), extra_text: tuple[str, ...] = ()) -> int:
    """A SentencePiece model of SPM_VOCAB pieces trained on the sonnets (and extra_text, every character of it a
    piece), saved as a Llama tokenizer; returns its size (llama.cpp's converter pads a larger vocab_size with unused
    pieces). control_symbols: special tokens, as Mistral's [TOOL_CALLS] is in its SentencePiece vocabularies."""
    import sentencepiece as spm

    text = SONNETS.read_text().splitlines() + list(extra_text)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text),
        control_symbols=list(control_symbols),
        character_coverage=1.0 if extra_text else 0.9995,
        model_prefix=str(folder / "tokenizer"),
        vocab_size=SPM_VOCAB,
        model_type="bpe",
        bos_id=1,
        eos_id=2,
        unk_id=0,
        pad_id=-1,
        minloglevel=2,
    )
    (folder / "tokenizer.vocab").unlink()
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    )
    return SPM_VOCAB


def vocabulary(vocab_file: str):
    """The Tokenizer of one of llama.cpp's vocabulary files, as specdecode reads GGUF (kept in the cache: reading
    a BPE vocabulary of 150k tokens takes some seconds)."""
    from specdecode.models.tokenizer import Tokenizer

    cache = Path(cache_root()) / "test-vocabularies" / vocab_file
    cache.mkdir(parents=True, exist_ok=True)
    return Tokenizer.from_gguf(str(llama_cpp_source() / "models" / vocab_file), str(cache))


def _bpe_tokenizer(vocab_file: str):
    return vocabulary(vocab_file).hf


def with_metadata(
    source,
    out,
    extra: dict[str, int | float],
    strings: dict[str, str] | None = None,
    extra_tensor: str | None = None,
    dropped: tuple[str, ...] = (),
    mxfp4: str | None = None,
):
    """A copy of a GGUF file with more integer or float (and string) metadata, or one more tensor, or without the
    `dropped` keys, or with the tensors whose names end in `mxfp4` stored as MXFP4 (as llama.cpp's converter writes
    gpt-oss's experts)."""
    from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
    from gguf.quants import quantize

    from specdecode.models.gguf_loader import MappedReader, dequantize_tensor

    reader = MappedReader(str(source))
    writer = GGUFWriter(str(out), reader.fields["general.architecture"].contents())
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in (strings or {}) or key in dropped:
            continue
        value_type = f.types[0]
        sub_type = f.types[-1] if value_type == GGUFValueType.ARRAY else None
        writer.add_key_value(key, f.contents(), value_type, sub_type=sub_type)
    for key, value in extra.items():
        writer.add_float32(key, value) if isinstance(value, float) else writer.add_uint32(key, value)
    for key, value in (strings or {}).items():
        writer.add_string(key, value)
    if extra_tensor:
        writer.add_tensor(extra_tensor, torch.zeros(4).numpy())
    for t in reader.tensors:
        if mxfp4 and t.name.endswith(mxfp4):
            in_mxfp4 = GGMLQuantizationType.MXFP4
            writer.add_tensor(t.name, quantize(dequantize_tensor(t), in_mxfp4), raw_dtype=in_mxfp4)
        else:
            shape = list(reversed([int(d) for d in t.shape]))
            writer.add_tensor(t.name, t.data, raw_shape=shape, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
