"""The model families the runtime computes, and how a checkpoint's config.json or a GGUF file's metadata
becomes the ModelConfig that describes one. A field that would change what the model computes and that the
runtime does not implement is refused by name: a model that loads computes what its authors' code does.

Each family's reference is its transformers implementation (config.json) and its llama.cpp graph (GGUF,
where llama.cpp's converter and graph decide what a file means: Gemma 3's query scale and layer pattern,
Qwen3-MoE's normalised expert weights)."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from ..config import ModelConfig
from ..errors import SpecDecodeError
from .layers import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT

HF_FAMILIES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma3_text",
    "gemma2",
    "mixtral",
    "qwen3_moe",
    "smollm3",
    "phi3",
    "granite",
    "granitemoe",
    "granitemoehybrid",
    "ernie4_5",
    "gpt_oss",
    "qwen2_moe",
    "glm",
    "glm4",
    "seed_oss",
    "olmo2",
    "olmo3",
    "exaone4",
    "ernie4_5_moe",
    "cohere",
    "cohere2",
    "glm4_moe",
    "deepseek_v2",
    "deepseek_v3",
    "glm4_moe_lite",
    "minimax_m2",
    "olmoe",
    "ministral3",
)
GGUF_FAMILIES = (
    "llama",
    "qwen2",
    "qwen3",
    "qwen3moe",
    "gemma3",
    "gemma2",
    "smollm3",
    "phi3",
    "granite",
    "granitemoe",
    "ernie4_5",
    "gpt-oss",
    "qwen2moe",
    "glm4",
    "chatglm",
    "seed_oss",
    "olmo2",
    "exaone4",
    "ernie4_5-moe",
    "command-r",
    "cohere2",
    "glm4moe",
    "deepseek2",
    "minimax-m2",
    "olmoe",
    "mistral3",
)
GRANITE_FAMILIES = ("granite", "granitemoe")  # config.json's and GGUF's names alike: the four multipliers
GEMMA_FAMILIES = ("gemma3_text", "gemma3", "gemma2")  # config.json's and GGUF's names: sandwich norms, GeGLU, ...
# OLMo 2 and 3 (config.json's names; GGUF's olmo2 holds both): norms after attention and the MLP, none before them,
# and q/k norms over each projection's whole width
OLMO_FAMILIES = ("olmo2", "olmo3")
# q/k norms with weights over each projection's whole width: OLMo's RMSNorms over it, OLMoE's and MiniMax-M2's on
# pre-norm layers, and Command R+'s LayerNorms of each head (its use_qk_norm; Cohere's layers are LayerNorms)
WHOLE_QK_NORM_FAMILIES = (*OLMO_FAMILIES, "olmoe", "minimax_m2", "cohere")
# q/k norms always (config.json's names), and where use_qk_norm says (GLM-4.5's, Command R+'s; other families ignore it)
QK_NORM_FAMILIES = ("qwen3", "qwen3_moe", "gemma3_text", "exaone4", *OLMO_FAMILIES, "olmoe", "minimax_m2")
USE_QK_NORM_FAMILIES = ("cohere", "glm4_moe")
POST_NORM_FAMILIES = (*OLMO_FAMILIES, "exaone4")  # norms after attention and the MLP only (EXAONE 4's are OLMo 2's)
# Cohere's (config.json's cohere and cohere2, GGUF's command-r and cohere2): LayerNorms, attention and the MLP side by
# side, the logits multiplied by logit_scale
COHERE_FAMILIES = ("cohere", "cohere2", "command-r")
NORM_EPS_KEY = dict.fromkeys(COHERE_FAMILIES, "attention.layer_norm_epsilon")  # a GGUF's LayerNorms' (else RMSNorms')
# attention and MLP outputs normalised before the residual add
SANDWICH_FAMILIES = (*GEMMA_FAMILIES, "glm4", *POST_NORM_FAMILIES)
# families whose sliding layers turn by RoPE of their own: unscaled, and Gemma 3's of another base
LOCAL_ROPE_FAMILIES = ("gemma3_text", "gemma3", "olmo3", "olmo2")
# transformers' DeepSeek latent attention's widths where config.json leaves them out (V2's and V3's alike)
DEEPSEEK_ATTENTION = dict(kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
# what transformers' config classes assume where a config.json leaves a field out, and the runtime reads otherwise
# (GLM's: RoPE over half of each head, 128 wide, biased q/k/v)
HF_DEFAULTS = {
    **dict.fromkeys(("glm", "glm4"), {"partial_rotary_factor": 0.5, "head_dim": 128, "attention_bias": True}),
    "seed_oss": {"head_dim": 128, "attention_bias": True},
    **dict.fromkeys(("cohere", "cohere2"), {"tie_word_embeddings": True, "logit_scale": 0.0625}),
    "glm4_moe": {"partial_rotary_factor": 0.5, "attention_bias": False},
    "deepseek_v2": {
        **DEEPSEEK_ATTENTION,
        **{"n_routed_experts": 64, "n_shared_experts": 2, "moe_intermediate_size": 1407, "first_k_dense_replace": 0},
        **{"routed_scaling_factor": 1.0, "topk_method": "greedy", "norm_topk_prob": False},
    },
    "deepseek_v3": {
        **DEEPSEEK_ATTENTION,
        **{"n_routed_experts": 256, "n_shared_experts": 1, "moe_intermediate_size": 2048, "first_k_dense_replace": 3},
        **{"routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8},
        **{"norm_topk_prob": True, "rope_interleave": True},
    },
    "glm4_moe_lite": {
        **{"kv_lora_rank": 512, "q_lora_rank": 768, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256},
        **{"n_routed_experts": 64, "n_shared_experts": 1, "moe_intermediate_size": 1536, "num_experts_per_tok": 4},
        **{"routed_scaling_factor": 1.8, "norm_topk_prob": True, "rope_interleave": True, "attention_bias": False},
    },
    "minimax_m2": {"head_dim": 128, "rope_theta": 5000000.0, "num_local_experts": 256, "num_experts_per_tok": 8},
    "ministral3": {
        **{"head_dim": 128, "rms_norm_eps": 1e-5, "max_position_embeddings": 262144},
        "rope_parameters": {
            **{"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0, "original_max_position_embeddings": 16384},
            **{"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1},
        },
    },
}
# DeepSeek's multi-head latent attention (config.json's names; GGUF's deepseek2 holds them all): DeepSeek-V2's and
# V3's, and GLM-4.7-Flash's (glm4_moe_lite: V3's attention beside GLM-4.5's experts)
LATENT_FAMILIES = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite")
# layers that slide, where the file does not list them: all but every sixth (Gemma 3), every other from the first
# (Gemma 2, gpt-oss)
WINDOW_PATTERN = {
    **{"gemma3_text": 6, "gemma3": 6, "gemma2": 2, "gpt_oss": 2, "gpt-oss": 2},
    **{"olmo3": 4, "olmo2": 4, "exaone4": 4, "cohere2": 4},
}
EXAONE4_WINDOWED_LAYERS = 64  # llama.cpp slides EXAONE 4's layers only in a file of this many (its 32B)
# Gemma 2's soft caps of attention scores and logits: ModelConfig's field, and the config.json and GGUF key that sets
# it, with llama.cpp's and transformers' default where the file states none
GEMMA2_SOFTCAPS = {
    "attention_softcap": ("attn_logit_softcapping", 50.0),
    "final_softcap": ("final_logit_softcapping", 30.0),
}
NOPE_EVERY = 4  # SmolLM3: every fourth layer has no RoPE (transformers' default interval; llama.cpp's fixed step)
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
YARN_BETAS = {"beta_fast": 32.0, "beta_slow": 1.0}  # the ramp's ends by default, transformers' and llama.cpp's alike
# config.json's attention_bias: q/k/v biased (gpt-oss's o_proj too; Seed-OSS's by its attention_out_bias)
BIASED_ATTENTION = ("gpt_oss", "glm", "glm4", "seed_oss", "glm4_moe")
# multimodal checkpoints of families whose text model runs here: where it is to be had
MULTIMODAL_ADVICE = {
    "gemma3": "use a Gemma 3 text checkpoint (model_type 'gemma3_text') or its GGUF",
    "mistral3": (
        "Ministral 3's and Mistral Small 3.x's: convert the folder with llama.cpp's convert_hf_to_gguf.py, which "
        "keeps the text model, and load the GGUF, or use a text checkpoint (model_type 'ministral3')"
    ),
}
HF_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
LAYER_TYPES = ("full_attention", "sliding_attention")


def refuse(field: str, value: Any, supported: str) -> SpecDecodeError:
    return SpecDecodeError(
        f"this model's {field} is {value!r}, which specdecode does not implement "
        f"(supported: {supported}); it is refused rather than computed wrongly"
    )


# ---- config.json ---------------------------------------------------------------------------------------


def from_hf_config(cfg: dict) -> ModelConfig:
    """The description of a Hugging Face checkpoint, from its config.json."""
    family = cfg.get("model_type", "llama")
    if "text_config" in cfg and family in MULTIMODAL_ADVICE:
        advice = MULTIMODAL_ADVICE[family]
        raise SpecDecodeError(f"this is a multimodal {family} checkpoint; specdecode runs text models: {advice}")
    if family not in HF_FAMILIES:
        raise refuse("model_type", family, ", ".join(HF_FAMILIES))
    cfg, family = _as_transformers_reads(cfg, family)
    _check_common_fields(cfg, family)
    gemma = family in GEMMA_FAMILIES
    heads = cfg["num_attention_heads"]
    theta, scaling = hf_rope(cfg, "full_attention")
    window, sliding = _hf_window(cfg, family)
    described = ModelConfig(
        arch=family,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        rope_theta=theta,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position=int(cfg.get("max_position_embeddings", 4096)),
        qkv_bias=_hf_qkv_bias(cfg, family),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
        head_dim=cfg.get("head_dim"),
        rope_scaling=scaling,
        rotary_dim=_hf_rotary_dim(cfg, cfg.get("head_dim") or cfg["hidden_size"] // heads),
        qk_norm=family in QK_NORM_FAMILIES or (family in USE_QK_NORM_FAMILIES and bool(cfg.get("use_qk_norm"))),
        qk_norm_whole=family in WHOLE_QK_NORM_FAMILIES,
        pre_norms=family not in POST_NORM_FAMILIES,
        activation=_hf_activation(cfg, family),
        sandwich_norms=family in SANDWICH_FAMILIES,
        embedding_scale=math.sqrt(cfg["hidden_size"]) if gemma else None,
        attention_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5 if gemma else None,
        sliding_window=window,
        sliding_layers=sliding,
        local_rope_theta=hf_rope(cfg, "sliding_attention")[0] if family in LOCAL_ROPE_FAMILIES and window else None,
        **_hf_experts(cfg, family),
        nope_layers=_hf_nope_layers(cfg) if family == "smollm3" else _global_nope(family, window, sliding, cfg),
        **_hf_softcaps(cfg, family),
        **_hf_gpt_oss(cfg, family),
        **_hf_output_bias(cfg, family),
        **_hf_cohere(cfg, family),
        **_hf_latent(cfg, family),
        **_hf_query_temperature(cfg, family),
    )
    described = with_rope_attention_factor(described)
    if family not in GRANITE_FAMILIES:
        return described
    names = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
    return with_granite_multipliers(described, *(float(cfg.get(name, 1.0)) for name in names))


def _as_transformers_reads(cfg: dict, family: str) -> tuple[dict, str]:
    """(config.json's fields, family) with transformers' defaults where it leaves them out, under the names the
    runtime reads: Granite 4.0's dense hybrid as a Granite, Cohere's layer_norm_eps as rms_norm_eps, Cohere 2's head
    size dropped (transformers sets it to hidden / heads, whatever config.json says)."""
    if family == "granitemoehybrid":
        cfg, family = granite_hybrid_as_dense(cfg), "granite"
    cfg = {**HF_DEFAULTS.get(family, {}), **cfg}
    if family == "cohere2":
        cfg.pop("head_dim", None)
    if family in COHERE_FAMILIES:
        cfg["rms_norm_eps"] = cfg.get("layer_norm_eps", 1e-5)
    if family in LATENT_FAMILIES:
        cfg = latent_as_heads(cfg)
    if family == "minimax_m2" and cfg.get("rotary_dim") and not cfg.get("partial_rotary_factor"):
        cfg["partial_rotary_factor"] = cfg["rotary_dim"] / cfg["head_dim"]  # as its config class converts it
    return cfg, family


def latent_as_heads(cfg: dict) -> dict:
    """DeepSeek's latent attention as the runtime's heads: as many keys' and values' heads as queries', each head as
    wide as a query's (its part that RoPE turns and the part it does not)."""
    if not cfg.get("rope_interleave", True):
        raise refuse("rope_interleave", False, "true (DeepSeek's RoPE over adjacent dimensions)")
    width = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    if cfg["v_head_dim"] > width:
        raise refuse("v_head_dim", cfg["v_head_dim"], f"at most the query's head size, {width}")
    return {**cfg, "head_dim": width, "num_key_value_heads": cfg["num_attention_heads"]}


def granite_hybrid_as_dense(cfg: dict) -> dict:
    """Granite 4.0's hybrid family where a checkpoint of it is a dense Granite (granite-4.0-micro: attention on every
    layer, no experts, RoPE), as llama.cpp's converter writes it: its MLP is the one it calls shared, that wide. The H
    models' Mamba layers, experts beside a shared one, and attention without RoPE are refused."""
    kinds = [kind for kind in cfg.get("layer_types") or ["mamba"] if kind not in ("attention", "full_attention")]
    if kinds:
        raise refuse(
            "layer_types", kinds[0], "attention on every layer (granite-4.0-micro; Mamba layers are not built)"
        )
    if cfg.get("num_local_experts"):
        raise refuse("num_local_experts", cfg["num_local_experts"], "0 (experts beside a shared one are not built)")
    if cfg.get("position_embedding_type") != "rope":
        raise refuse("position_embedding_type", cfg.get("position_embedding_type"), "rope")
    dense = {k: v for k, v in cfg.items() if k != "layer_types"}
    return {**dense, "model_type": "granite", "intermediate_size": cfg["shared_intermediate_size"]}


def llama_config_fields(cfg: ModelConfig) -> dict:
    """The config.json fields that describe a Llama- or Qwen2-shaped model (the inverse of from_hf_config for
    them), for rebuilding it in transformers; the caller adds tying, biases and dtype as its weights say."""
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position,
    )


def _hf_qkv_bias(cfg: dict, family: str) -> bool:
    """Biased q/k/v: Qwen2's always, Qwen2-MoE's by its qkv_bias, gpt-oss's and GLM's by their attention_bias."""
    if family == "qwen2_moe":
        return bool(cfg.get("qkv_bias", True))
    return family == "qwen2" or bool(family in BIASED_ATTENTION and cfg.get("attention_bias", True))


def _hf_activation(cfg: dict, family: str) -> str:
    """The gated MLP's activation (gpt-oss's config.json names SiLU, which its clamped SwiGLU is built on)."""
    if family == "gpt_oss":
        return "swiglu_oai"
    return HF_ACTIVATIONS[cfg.get("hidden_activation") or cfg.get("hidden_act", "silu")]


def _check_common_fields(cfg: dict, family: str) -> None:
    """Fields some configs of these families set to something the runtime does not compute."""
    activation = cfg.get("hidden_activation") or cfg.get("hidden_act", "silu")
    allowed = ("gelu_pytorch_tanh",) if family in GEMMA_FAMILIES else ("silu",)
    if activation not in allowed:
        raise refuse("hidden_act", activation, ", ".join(allowed))
    if family not in ("qwen2", *BIASED_ATTENTION) and cfg.get("attention_bias"):
        raise refuse("attention_bias", True, "false (biased attention projections are Qwen2's, gpt-oss's, GLM's)")
    for name, value in (("swiglu_alpha", SWIGLU_OAI_ALPHA), ("swiglu_limit", SWIGLU_OAI_LIMIT)):
        if family == "gpt_oss" and cfg.get(name, value) != value:
            raise refuse(name, cfg[name], f"{value} (gpt-oss's, which llama.cpp's graph fixes)")
    softcaps = () if family == "gemma2" else ("attn_logit_softcapping", "final_logit_softcapping")
    if (cfg.get("quantization_config") or {}).get("quant_method") == "mxfp4":
        raise refuse(
            "quantization_config",
            "MXFP4",
            "unset; convert the folder with llama.cpp's convert_hf_to_gguf.py, which "
            "keeps its MXFP4 experts, and load the GGUF",
        )
    # (clip_qkv: OLMoE's and DBRX's clamp of q, k and v, which llama.cpp's OLMoE graph leaves out)
    for name in ("mlp_bias", "use_bias", "use_bidirectional_attention", *softcaps, "quantization_config", "clip_qkv"):
        if cfg.get(name):
            raise refuse(name, cfg[name], "unset or false")
    bad = [t for t in cfg.get("layer_types") or () if t not in LAYER_TYPES]
    if bad:
        raise refuse("layer_types", bad[0], ", ".join(LAYER_TYPES))


def _rope_parameters(cfg: dict) -> dict:
    """config.json's rope_parameters (transformers 5's), {} where it has none."""
    return cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}


def _hf_rotary_dim(cfg: dict, head_dim: int) -> int | None:
    """The head dimensions RoPE turns where only the first ones turn (partial_rotary_factor, at the top of config.json
    or in its rope_parameters, as transformers reads either); None: all of them."""
    if cfg.get("kv_lora_rank"):  # DeepSeek's latent attention: the part of each query and key head that turns
        return rotary_dim(cfg["qk_rope_head_dim"], head_dim, "qk_rope_head_dim")
    params = _rope_parameters(cfg)
    factor = params.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0
    return rotary_dim(int(head_dim * factor), head_dim, "partial_rotary_factor", factor)


def rotary_dim(turned: int, head_dim: int, field: str, value=None) -> int | None:
    """`turned` head dimensions of RoPE (a model's `field` says so: `value`, else that number), None where all turn."""
    if turned == head_dim:
        return None
    if turned % 2 or not 0 < turned < head_dim:
        raise refuse(field, turned if value is None else value, f"an even number of the head's {head_dim} dimensions")
    return turned


def hf_rope(cfg: dict, layer_type: str) -> tuple[float, tuple]:
    """(base, scaling items) of the RoPE of one kind of layer, from transformers 5's rope_parameters (per layer
    type for Gemma 3) or the older rope_theta / rope_scaling (and Gemma 3's rope_local_base_freq)."""
    params = cfg.get("rope_parameters")
    field = "rope_parameters"
    if isinstance(params, dict) and isinstance(params.get(layer_type), dict):
        params, field = params[layer_type], f"rope_parameters.{layer_type}"
    elif params is None:
        field = "rope_scaling"
        params = dict(cfg.get("rope_scaling") or {}) if layer_type == "full_attention" else {}
        local = cfg.get("rope_local_base_freq") if layer_type == "sliding_attention" else None
        params.setdefault("rope_theta", local or cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise refuse(f"{field}.rope_type", rope_type, ", ".join(ROPE_TYPES))
    if params.get("mrope_section"):
        raise refuse(f"{field}.mrope_section", params["mrope_section"], "unset")
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return theta, ()
    if rope_type == "longrope":
        return theta, _hf_longrope(cfg, params, field)
    keys = {
        "linear": ("factor",),
        "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
        "yarn": ("factor", "original_max_position_embeddings"),
    }[rope_type]
    missing = [k for k in keys if params.get(k) is None]
    if missing:
        raise SpecDecodeError(f"this model's {field} is of type {rope_type!r} but has no {missing[0]}")
    items = [("rope_type", rope_type), *((k, float(params[k])) for k in keys)]
    if rope_type == "yarn":
        items += _hf_yarn_items(params, field, bool(cfg.get("kv_lora_rank")))
    return theta, tuple(sorted(items))


def _hf_yarn_items(params: dict, field: str, latent: bool) -> list[tuple[str, float]]:
    """YaRN's optional fields as transformers reads them. DeepSeek's mscale pair: cos and sin scaled by
    mscale(mscale) / mscale(mscale_all_dim) (Ministral 3's, both 1: unscaled), and in DeepSeek's latent attention
    every score by mscale(mscale_all_dim)^2 besides (with_rope_attention_factor). One of the pair alone, which
    transformers ignores, is refused."""
    pair = {name: params.get(name) for name in ("mscale", "mscale_all_dim") if params.get(name)}
    if len(pair) == 1 and not latent:
        name, value = next(iter(pair.items()))
        raise refuse(f"{field}.{name}", value, "unset, or set beside mscale and mscale_all_dim both")
    items = [(k, float(params.get(k) or default)) for k, default in YARN_BETAS.items()]
    factor = float(params["factor"])
    if len(pair) == 2:
        default = yarn_mscale_ratio(factor, pair["mscale"], pair["mscale_all_dim"])
    else:
        default = yarn_attention_factor(factor)
    items += [
        ("truncate", float(params.get("truncate", True))),
        ("attention_factor", float(params.get("attention_factor") or default)),
    ]
    return items + [("mscale_all_dim", float(pair["mscale_all_dim"]))] if latent and "mscale_all_dim" in pair else items


def _hf_longrope(cfg: dict, params: dict, field: str) -> tuple:
    """LongRoPE (Phi-3.5, Phi-4-mini) as transformers reads it: per-dimension divisors of the frequencies for contexts
    up to the original and others past it, and an attention factor from how far the context grew (`factor`, else the
    context over the original)."""
    original = params.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
    needed = {"short_factor": params.get("short_factor"), "long_factor": params.get("long_factor")}
    missing = [k for k, v in {**needed, "original_max_position_embeddings": original}.items() if not v]
    if missing:
        raise SpecDecodeError(f"this model's {field} is of type 'longrope' but has no {missing[0]}")
    factor = params.get("factor") or cfg.get("max_position_embeddings", 4096) / original
    attention = params.get("attention_factor") or longrope_attention_factor(factor, original)
    return longrope_items(params["short_factor"], params["long_factor"], original, attention)


def longrope_attention_factor(factor: float, original: float) -> float:
    """LongRoPE's default scale of cos and sin, sqrt(1 + ln s / ln original), as transformers and llama.cpp's
    converter compute it."""
    return math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0


def longrope_items(short, long, original: float, attention: float) -> tuple:
    items = {
        "rope_type": "longrope",
        "short_factor": tuple(float(f) for f in short),
        "long_factor": tuple(float(f) for f in long),
        "original_max_position_embeddings": float(original),
        "attention_factor": float(attention),
    }
    return tuple(sorted(items.items()))


def yarn_attention_factor(factor: float, mscale: float = 1.0) -> float:
    """YaRN's default scale of cos and sin (0.1 ln s + 1), transformers' and llama.cpp's alike; DeepSeek's mscale
    multiplies its logarithm."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def yarn_mscale_ratio(factor: float, mscale: float, mscale_all_dim: float) -> float:
    """YaRN's scale of cos and sin where DeepSeek's mscale pair is given, as transformers reads it."""
    return yarn_attention_factor(factor, mscale) / yarn_attention_factor(factor, mscale_all_dim)


def with_rope_attention_factor(cfg: ModelConfig) -> ModelConfig:
    """cfg with its YaRN or LongRoPE attention factor m in the query-key scale: transformers and llama.cpp multiply cos
    and sin by m, so queries and keys each by m and their scores by m^2. Where RoPE turns only part of each head, m
    scales only that part: the tables carry it (layers.RotaryEmbedding). DeepSeek's mscale_all_dim scales every score
    by mscale(mscale_all_dim)^2 besides."""
    scaling = dict(cfg.rope_scaling)
    if "mscale_all_dim" in scaling:
        whole = yarn_attention_factor(scaling["factor"], scaling["mscale_all_dim"])
        cfg = replace(cfg, attention_scale=(cfg.attention_scale or cfg.dim_per_head**-0.5) * whole**2)
    factor = scaling.get("attention_factor")
    if factor is None or factor == 1.0 or cfg.rotary_dim is not None:
        return cfg
    scale = cfg.attention_scale or cfg.dim_per_head**-0.5
    local = scale if cfg.local_rope_theta is not None else None  # sliding layers with unscaled RoPE of their own
    return replace(cfg, attention_scale=scale * factor**2, local_attention_scale=local)


def with_rope_scaling(cfg: ModelConfig, scaling: dict | None) -> ModelConfig:
    """cfg with the RoPE scaling of config.json's `rope_scaling` fields on its (global) layers, its base kept, and the
    context that scaling reaches: factor x original_max_position_embeddings (transformers' and vLLM's reading), or
    factor x the model's own context (None or {}: cfg as it is). A model with a scaling of its own keeps it: two would
    not compose."""
    if not scaling:
        return cfg
    if cfg.rope_scaling:
        raise SpecDecodeError(
            f"this model has a RoPE scaling of its own ({dict(cfg.rope_scaling)['rope_type']}); "
            "leave rope_scaling unset"
        )
    if scaling.get("rope_theta", cfg.rope_theta) != cfg.rope_theta:
        raise SpecDecodeError(
            f"rope_scaling scales the model's RoPE, whose base ({cfg.rope_theta:g}) stays; leave rope_theta out of it"
        )
    if (scaling.get("rope_type") or scaling.get("type")) == "longrope":
        raise SpecDecodeError(
            "LongRoPE's factors are a model's own, trained with it: rope_scaling takes linear, llama3 or yarn"
        )
    _, items = hf_rope({"rope_theta": cfg.rope_theta, "rope_scaling": scaling}, "full_attention")
    if not items:
        return cfg
    fields = dict(items)
    context = fields["factor"] * fields.get("original_max_position_embeddings", cfg.max_position)
    return with_rope_attention_factor(replace(cfg, rope_scaling=items, max_position=int(context)))


def with_granite_multipliers(
    cfg: ModelConfig, embedding: float, residual: float, attention: float, logits: float
) -> ModelConfig:
    """Granite's four multipliers as what the runtime computes anyway. Each block's output joins the residual stream
    times `residual`; every block and the final norm read that stream through an RMSNorm, which drops a scale, so the
    stream divided by `residual` computes the same: the embeddings scaled by embedding / residual and the norms' eps
    by 1 / residual^2 (exact in real arithmetic; Granite has no q/k norms), no kernel changed. The attention
    multiplier is the query-key scale; the logits' divisor goes into the final norm's weights (checkpoints.py)."""
    return replace(
        cfg,
        embedding_scale=embedding / residual,
        rms_norm_eps=cfg.rms_norm_eps / residual**2,
        attention_scale=attention,
        logit_scale=logits if logits != 1.0 else None,
    )


def _hf_nope_layers(cfg: dict) -> tuple[int, ...]:
    """SmolLM3's layers without RoPE: a 0 in no_rope_layers, or by default every no_rope_layer_interval-th."""
    layers, every = cfg["num_hidden_layers"], cfg.get("no_rope_layer_interval") or NOPE_EVERY
    uses_rope = cfg.get("no_rope_layers") or [int((i + 1) % every != 0) for i in range(layers)]
    return tuple(i for i, rotates in enumerate(uses_rope[:layers]) if not rotates)


def _global_nope(family: str, window: int | None, sliding: tuple[int, ...] | None, cfg: dict) -> tuple[int, ...]:
    """EXAONE 4's and Cohere 2's full-attention layers, which turn no position into queries and keys where others
    slide."""
    if family not in ("exaone4", "cohere2") or window is None or sliding is None:
        return ()
    return tuple(i for i in range(cfg["num_hidden_layers"]) if i not in sliding)


def _hf_window(cfg: dict, family: str) -> tuple[int | None, tuple[int, ...] | None]:
    """(sliding window, the layers that slide; None: all of them)."""
    window = cfg.get("sliding_window")
    layers = cfg["num_hidden_layers"]
    if family in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "smollm3") and not cfg.get("use_sliding_window"):
        return None, None
    if not window:
        return None, None
    layer_types = cfg.get("layer_types")
    if layer_types is None and family in WINDOW_PATTERN:
        pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern")
        pattern = pattern or WINDOW_PATTERN[family]
        if isinstance(pattern, str):  # EXAONE 4's "LLLG": local or global, repeated
            full = [pattern[i % len(pattern)] == "G" for i in range(layers)]
        else:
            full = [(i + 1) % pattern == 0 for i in range(layers)]
        layer_types = ["full_attention" if f else "sliding_attention" for f in full]
    elif layer_types is None and family in ("qwen2", "qwen3"):
        first = cfg.get("max_window_layers", layers)
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if layer_types is None:
        return int(window), None
    sliding = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    return (int(window), sliding) if sliding else (None, None)


def _hf_softcaps(cfg: dict, family: str) -> dict:
    """Gemma 2's soft caps (None in its config.json: none)."""
    if family != "gemma2":
        return {}
    caps = {field: cfg.get(name, default) for field, (name, default) in GEMMA2_SOFTCAPS.items()}
    return {field: float(cap) if cap else None for field, cap in caps.items()}


def _hf_experts(cfg: dict, family: str) -> dict:
    """Mixtral's, Granite's and gpt-oss's routers: a softmax over the top-k logits, which is the softmax over all
    renormalised over the top k (normalize_expert_weights, the default); Qwen3-MoE's renormalises where
    norm_topk_prob says."""
    if family == "ernie4_5_moe":
        return _hf_ernie_experts(cfg)
    if family in ("glm4_moe", "glm4_moe_lite"):
        return _hf_glm4_moe_experts(cfg, family)
    if family in LATENT_FAMILIES:
        return _hf_deepseek_experts(cfg, family)
    if family == "minimax_m2":
        return _hf_minimax_experts(cfg)
    if family not in ("mixtral", "granitemoe", "qwen3_moe", "gpt_oss", "qwen2_moe", "olmoe"):
        return {}
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if family in ("mixtral", "granitemoe", "gpt_oss"):
        top = cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or (4 if family == "gpt_oss" else 2)
        return dict(num_experts=experts, experts_per_token=top)
    layers, step = cfg["num_hidden_layers"], cfg.get("decoder_sparse_step", 1)
    dense = {i for i in range(layers) if i in (cfg.get("mlp_only_layers") or ()) or (i + 1) % step}
    return dict(
        num_experts=experts,
        experts_per_token=cfg.get("num_experts_per_tok", 8),
        expert_intermediate_size=cfg.get("moe_intermediate_size"),
        normalize_expert_weights=bool(cfg.get("norm_topk_prob", False)),
        dense_layers=tuple(sorted(dense)),
        shared_expert_size=int(cfg.get("shared_expert_intermediate_size") or 0) if family == "qwen2_moe" else 0,
    )


def _hf_minimax_experts(cfg: dict) -> dict:
    """MiniMax-M2's experts, as transformers computes them whatever its config.json's router fields say: the top k
    chosen by sigmoid score plus a bias of each expert's (e_score_correction_bias), weighed by their scores
    renormalised; no shared expert, no dense layer."""
    return dict(
        num_experts=cfg["num_local_experts"],
        experts_per_token=cfg["num_experts_per_tok"],
        normalize_expert_weights=True,
        shared_expert_gated=False,
        expert_selection_bias=True,
        expert_scoring="sigmoid",
    )


def _hf_ernie_experts(cfg: dict) -> dict:
    """ERNIE 4.5's experts: every moe_layer_interval-th layer from moe_layer_start_index to moe_layer_end_index (-1:
    the last) sparse; the top k chosen by probability plus a bias of each expert's, weighed by their probabilities
    renormalised; shared experts beside them, ungated, as one MLP moe_num_shared_experts times an expert's width."""
    layers, width = cfg["num_hidden_layers"], cfg.get("moe_intermediate_size", 1536)
    start, every = cfg.get("moe_layer_start_index", 1), cfg.get("moe_layer_interval", 1)
    end = cfg.get("moe_layer_end_index", -1) % layers
    return dict(
        num_experts=cfg.get("moe_num_experts") or cfg.get("num_experts", 64),
        experts_per_token=cfg.get("moe_k") or cfg.get("num_experts_per_tok", 6),
        expert_intermediate_size=width,
        dense_layers=tuple(i for i in range(layers) if not (start <= i <= end and (i + 1) % every == 0)),
        shared_expert_size=width * cfg.get("moe_num_shared_experts", 2),
        shared_expert_gated=False,
        expert_selection_bias=True,
    )


def _hf_glm4_moe_experts(cfg: dict, family: str) -> dict:
    """GLM-4.5's experts (and GLM-4.7-Flash's): the top k chosen by sigmoid score plus a bias of each expert's, among
    the best topk_group of n_group groups scored by their best two (V3's), weighed by their scores (renormalised where
    norm_topk_prob says) times routed_scaling_factor; an ungated shared MLP n_shared_experts experts wide beside them.
    GLM-4.5's first first_k_dense_replace layers are dense; GLM-4.7-Flash's as its mlp_layer_types says, else its first
    (transformers' reading, which leaves first_k_dense_replace out)."""
    width, layers = cfg.get("moe_intermediate_size", 1408), cfg["num_hidden_layers"]
    if family == "glm4_moe_lite":
        kinds = cfg.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1)
        if set(kinds) - {"dense", "sparse"} or len(kinds) != layers:
            raise refuse("mlp_layer_types", kinds, f"{layers} of 'dense' or 'sparse', one for each layer")
        dense = tuple(i for i, kind in enumerate(kinds) if kind == "dense")
    else:
        dense = tuple(range(min(cfg.get("first_k_dense_replace", 1), layers)))
    groups = cfg.get("n_group") or 1
    return dict(
        num_experts=cfg.get("n_routed_experts", 128),
        experts_per_token=cfg.get("num_experts_per_tok", 8),
        expert_intermediate_size=width,
        normalize_expert_weights=bool(cfg.get("norm_topk_prob", True)),
        dense_layers=dense,
        shared_expert_size=width * cfg.get("n_shared_experts", 1),
        shared_expert_gated=False,
        expert_selection_bias=True,
        expert_scoring="sigmoid",
        expert_weights_scale=float(cfg.get("routed_scaling_factor", 1.0)),
        **expert_groups(groups, cfg.get("topk_group") or groups, "top2"),
    )


def _hf_deepseek_experts(cfg: dict, family: str) -> dict:
    """DeepSeek's experts, as transformers computes them: after first_k_dense_replace dense layers, the top k chosen
    among the best topk_group of n_group groups, weighed by their scores times routed_scaling_factor, with an ungated
    shared MLP n_shared_experts experts wide beside them. V2's scores are a softmax over all, its groups scored by
    their best (topk_method group_limited_greedy; greedy: no groups), never renormalised (transformers leaves
    norm_topk_prob out; DeepSeek's own code applied it, so it is refused); V3's are sigmoids, chosen with a bias of each
    expert's, groups scored by their best two, renormalised where norm_topk_prob says."""
    v3, layers, width = family == "deepseek_v3", cfg["num_hidden_layers"], cfg["moe_intermediate_size"]
    method = cfg.get("topk_method") or "greedy"
    if not v3 and method not in ("greedy", "group_limited_greedy"):
        raise refuse("topk_method", method, "greedy, group_limited_greedy")
    if not v3 and cfg.get("norm_topk_prob"):
        raise refuse(
            "norm_topk_prob", True, "false (transformers' DeepSeek-V2 leaves it out, DeepSeek's code does not)"
        )
    if cfg.get("moe_layer_freq", 1) != 1:
        raise refuse("moe_layer_freq", cfg["moe_layer_freq"], "1")
    groups = (cfg.get("n_group") or 1) if v3 or method == "group_limited_greedy" else 1
    kept = cfg.get("topk_group") or groups
    return dict(
        num_experts=cfg["n_routed_experts"],
        experts_per_token=cfg["num_experts_per_tok"],
        expert_intermediate_size=width,
        normalize_expert_weights=v3 and bool(cfg.get("norm_topk_prob")),
        dense_layers=tuple(range(min(cfg.get("first_k_dense_replace") or 0, layers))),
        shared_expert_size=width * (cfg.get("n_shared_experts") or 0),
        shared_expert_gated=False,
        expert_selection_bias=v3,
        expert_scoring="sigmoid" if v3 else "softmax",
        expert_weights_scale=float(cfg.get("routed_scaling_factor") or 1.0),
        **expert_groups(groups, kept, "top2" if v3 else "max"),
    )


def expert_groups(groups: int, kept: int, scoring: str) -> dict:
    """The fields of experts chosen among `kept` of `groups` groups (none where all are kept)."""
    if kept >= groups:
        return {}
    return dict(expert_groups=groups, expert_groups_kept=kept, expert_group_scoring=scoring)


def _hf_latent(cfg: dict, family: str) -> dict:
    """DeepSeek's latent attention's widths (latent_as_heads made its heads)."""
    if family not in LATENT_FAMILIES:
        return {}
    return dict(kv_lora_rank=cfg["kv_lora_rank"], q_lora_rank=cfg.get("q_lora_rank") or 0, value_dim=cfg["v_head_dim"])


def _hf_gpt_oss(cfg: dict, family: str) -> dict:
    """gpt-oss's attention sinks, and biases on the attention output, the router and every expert."""
    if family != "gpt_oss":
        return {}
    return dict(attention_sinks=True, o_bias=bool(cfg.get("attention_bias", True)), expert_bias=True)


def _hf_output_bias(cfg: dict, family: str) -> dict:
    """Seed-OSS's attention output bias, by its own field (off in its checkpoints); any other family's refused."""
    if family != "seed_oss" and cfg.get("attention_out_bias"):
        raise refuse("attention_out_bias", True, "false (an output bias is Seed-OSS's and gpt-oss's only)")
    return dict(o_bias=True) if cfg.get("attention_out_bias") else {}


def _hf_query_temperature(cfg: dict, family: str) -> dict:
    """Ministral 3's attention temperature, as transformers computes it: its rope_parameters' llama_4_scaling_beta,
    with their original_max_position_embeddings as the floor (other families' config classes ignore the field)."""
    params = _rope_parameters(cfg)
    if family != "ministral3" or not params.get("llama_4_scaling_beta"):
        return {}
    floor = params.get("original_max_position_embeddings")
    if not floor:
        raise SpecDecodeError(
            "this model's rope_parameters have a llama_4_scaling_beta but no original_max_position_embeddings, "
            "the positions its attention temperature steps by"
        )
    return dict(query_temperature=float(params["llama_4_scaling_beta"]), query_temperature_floor=int(floor))


def _hf_cohere(cfg: dict, family: str) -> dict:
    """Cohere's LayerNorms, attention and MLP side by side, and its logits multiplied by logit_scale (the runtime's
    logit_scale divides); a rotary_pct short of 1, which transformers ignores and llama.cpp's converter writes as
    partial rotary, is refused. (Command R+'s q/k norms, use_qk_norm: WHOLE_QK_NORM_FAMILIES.)"""
    if family not in COHERE_FAMILIES:
        return {}
    if cfg.get("rotary_pct", 1.0) != 1.0:
        raise refuse(
            "rotary_pct", cfg["rotary_pct"], "1 (transformers turns every dimension, llama.cpp's converter not)"
        )
    return cohere_layers(float(cfg["logit_scale"]))


def cohere_layers(logit_multiplier: float) -> dict:
    """Cohere's description, from config.json or a GGUF: LayerNorms, attention and the MLP side by side, and the logits
    multiplied by logit_multiplier (the runtime's logit_scale divides)."""
    inverted = 1.0 / logit_multiplier if logit_multiplier != 1.0 else None
    return dict(layer_norms=True, parallel_blocks=True, logit_scale=inverted)


# ---- GGUF ----------------------------------------------------------------------------------------------


# GGUF's expert gating functions (llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE) the runtime computes, and llama.cpp's
# where a file states none (or 0): GLM-4.5's sigmoid, else softmax
GATING = {1: "softmax", 2: "sigmoid"}
# (deepseek2's, where silent, llama.cpp's softmax: DeepSeek-V2's, but GLM_LITE_SHAPE); MiniMax-M2's sigmoid, its only
# router (llama.cpp's graph stops at a file of it that states none)
GATING_DEFAULT = {"glm4moe": 2, "minimax-m2": 2}
# the layer counts and vocabulary by which llama.cpp knows a deepseek2 file that states no gating for GLM-4.7-Flash's,
# whose converter writes none, and gates it by sigmoid
GLM_LITE_SHAPE = {"layers": (47, 48), "vocab": 154880}
# GGUF architectures whose llama.cpp graph leaves out the next-token prediction layers a file holds after its own
# (GLM-4.5's, GLM-4.7-Flash's)
NEXTN_FAMILIES = ("glm4moe", "deepseek2")
# ... and those whose graph scales the routed experts' weights by expert_weights_scale (GLM-4.5's routed_scaling_factor)
SCALED_EXPERTS_FAMILIES = ("glm4moe", "deepseek2")


def field(reader, key: str, default=None):
    """A GGUF metadata value (or default where the file has none)."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def one_for_every_layer(name: str, value):
    """A value GGUF may list per layer (head counts, MLP widths: llama.cpp's hybrid converters list them) where every
    layer has the same; layers that differ are refused."""
    if not isinstance(value, list):
        return value
    if len(set(value)) != 1:
        raise refuse(name, "a value per layer", "one value for every layer")
    return value[0]


def from_gguf(reader) -> ModelConfig:
    """The description of a GGUF file, from its metadata (and which tensors it holds), as llama.cpp reads it."""
    arch = field(reader, "general.architecture")
    if arch not in GGUF_FAMILIES:
        raise refuse("GGUF architecture", arch, ", ".join(GGUF_FAMILIES))

    def key(name, default=None, per_layer=False):
        value = field(reader, f"{arch}.{name}", default)
        return value if per_layer else one_for_every_layer(f"{arch}.{name}", value)

    names = {t.name for t in reader.tensors}
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    hidden, heads = key("embedding_length"), key("attention.head_count")
    layers = key("block_count") - key("nextn_predict_layers", 0)  # GLM-4.5's prediction layers counted among them
    latent = arch == "deepseek2"  # its key_length and value_length are the compressed vector's; the heads' are these
    head_dim = key("attention.key_length_mla" if latent else "attention.key_length")
    dims = head_dim or hidden // heads
    _check_gguf_fields(key, arch, dims)
    gemma = arch in GEMMA_FAMILIES
    window, sliding = _gguf_window(key, arch, layers)
    described = ModelConfig(
        arch=arch,
        vocab_size=int(embd.shape[1]),
        hidden_size=hidden,
        intermediate_size=key("feed_forward_length"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads if latent else key("attention.head_count_kv", heads),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rms_norm_eps=float(key(NORM_EPS_KEY.get(arch, "attention.layer_norm_rms_epsilon"), 1e-6)),
        max_position=int(key("context_length", 4096)),
        qkv_bias=bool({"blk.0.attn_q.bias", "blk.0.attn_qkv.bias"} & names),
        tie_word_embeddings="output.weight" not in names,
        head_dim=head_dim,
        rotary_dim=rotary_dim(key("rope.dimension_count", dims), dims, f"{arch}.rope.dimension_count"),
        rope_scaling=_gguf_rope_scaling(key, arch, {t.name: t for t in reader.tensors if t.name in ROPE_TENSORS}),
        qk_norm="blk.0.attn_q_norm.weight" in names,
        qk_norm_whole=_values(reader, "blk.0.attn_q_norm.weight") > dims,
        pre_norms="blk.0.attn_norm.weight" in names,
        activation="gelu_tanh" if gemma else "swiglu_oai" if arch == "gpt-oss" else "silu",
        sandwich_norms=arch in SANDWICH_FAMILIES,
        embedding_scale=math.sqrt(hidden) if gemma else None,
        attention_scale=_gemma_attention_scale(arch, hidden, heads, head_dim, layers) if gemma else None,
        sliding_window=window,
        sliding_layers=sliding,
        local_rope_theta=_gguf_local_rope_theta(key, arch) if arch in LOCAL_ROPE_FAMILIES and window else None,
        **_gguf_experts(key, reader, names, layers, arch),
        nope_layers=_gguf_nope_layers(arch, layers, window, sliding),
        **_gguf_softcaps(key, arch),
        **_gguf_biases(arch, names),
        **_gguf_cohere(key, arch, names),
        **_gguf_latent(key, arch, names),
        **_gguf_query_temperature(key, arch),
    )
    described = with_rope_attention_factor(described)
    if arch not in GRANITE_FAMILIES:
        return described
    default = 1.0 / math.sqrt(described.dim_per_head)  # llama.cpp's query scale where the file states none
    names = (("embedding_scale", 1.0), ("residual_scale", 1.0), ("attention.scale", default), ("logit_scale", 1.0))
    return with_granite_multipliers(described, *(float(key(name, value)) for name, value in names))


def _gguf_cohere(key, arch: str, names: set[str]) -> dict:
    """Cohere's LayerNorms, attention and MLP side by side, and its logits multiplied by the file's logit_scale (by
    none where it states none, as llama.cpp's graph). (Command R+'s q/k norms: where the file holds them, as any
    family's, their weights over the projections' whole width.)"""
    if arch not in COHERE_FAMILIES:
        return {}
    return cohere_layers(float(key("logit_scale", 1.0)))


def _gguf_latent(key, arch: str, names: set[str]) -> dict:
    """DeepSeek's latent attention's widths, as llama.cpp's deepseek2 reads them (queries projected directly where the
    file holds attn_q: DeepSeek-V2-Lite's)."""
    if arch != "deepseek2":
        return {}
    queries = 0 if "blk.0.attn_q.weight" in names else key("attention.q_lora_rank")
    return dict(
        kv_lora_rank=key("attention.kv_lora_rank"), q_lora_rank=queries, value_dim=key("attention.value_length_mla")
    )


def _gguf_nope_layers(arch: str, layers: int, window: int | None, sliding: tuple[int, ...] | None) -> tuple[int, ...]:
    """llama.cpp's layers without RoPE: SmolLM3's every fourth, and EXAONE 4's full ones where others slide."""
    if arch == "smollm3":
        return tuple(i for i in range(layers) if (i + 1) % NOPE_EVERY == 0)
    return _global_nope(arch, window, sliding, {"num_hidden_layers": layers})


def _values(reader, name: str) -> int:
    """How many values a GGUF tensor holds (a norm's weights: Command R+'s are [heads, head size]), 0 where the file
    has none."""
    return next((int(t.n_elements) for t in reader.tensors if t.name == name), 0)


def _gguf_local_rope_theta(key, arch: str) -> float:
    """The RoPE base of sliding layers, as llama.cpp reads it: the file's freq_base_swa, else Gemma 3's 10,000 or
    OLMo 3's global base (its sliding layers turn unscaled)."""
    return float(key("rope.freq_base_swa", 10000.0 if arch == "gemma3" else key("rope.freq_base", 10000.0)))


def _check_gguf_fields(key, arch: str, head_dim: int) -> None:
    if arch != "deepseek2" and key("attention.value_length", head_dim) != head_dim:
        raise refuse(f"{arch}.attention.value_length", key("attention.value_length"), f"the key length, {head_dim}")
    softcaps = () if arch == "gemma2" else ("final_logit_softcapping", "attn_logit_softcapping")
    # a shared expert beside routed ones (llama.cpp writes its width for Granite 4.0's dense models too, unused there),
    # but Qwen2-MoE's
    shared = ("expert_shared_count", "expert_shared_feed_forward_length") if key("expert_count") else ()
    shared = () if arch in ("qwen2moe", "ernie4_5-moe", "glm4moe", "deepseek2") else shared
    # next-token prediction layers after the model's own, which llama.cpp's graph leaves out (GLM-4.5's; GLM-4's
    # counted among its blocks as if they were its own)
    nextn = () if arch in NEXTN_FAMILIES else ("nextn_predict_layers",)
    for name in (*softcaps, *shared, *nextn):
        if key(name):
            raise refuse(f"{arch}.{name}", key(name), "unset")
    if arch not in SCALED_EXPERTS_FAMILIES and key("expert_weights_scale", 0.0) not in (0.0, 1.0):
        raise refuse(f"{arch}.expert_weights_scale", key("expert_weights_scale"), "unset, 0 or 1")
    if arch == "mistral3" and key("expert_count"):  # llama.cpp's graph has a branch for them; no such file is known
        raise refuse("mistral3.expert_count", key("expert_count"), "unset (Ministral 3 and Mistral Small 3 are dense)")
    if (key("expert_gating_func") or 1) not in GATING:
        raise refuse(f"{arch}.expert_gating_func", key("expert_gating_func"), "1 (softmax), 2 (sigmoid)")


# a GGUF's RoPE factors: per dimension (Llama 3's scaling), or LongRoPE's short and long ones (the rows of runtime's
# tables, read into the description rather than loaded as weights)
LONGROPE_TENSORS = ("rope_factors_short.weight", "rope_factors_long.weight")
ROPE_TENSORS = ("rope_freqs.weight", *LONGROPE_TENSORS)


def _gguf_rope_scaling(key, arch: str, tensors: dict) -> tuple:
    """The RoPE scaling llama.cpp computes from a file's rope.scaling metadata and its RoPE factor tensors (where a
    rope_freqs tensor is there, llama.cpp reads it and not LongRoPE's)."""
    kind = key("rope.scaling.type", "none")
    if kind not in ("none", "linear", "yarn"):
        raise refuse(f"{arch}.rope.scaling.type", kind, "none, linear, yarn (and llama3 as a rope_freqs tensor)")
    longrope = [tensors.get(name) for name in LONGROPE_TENSORS]
    if kind != "none" and tensors:
        raise refuse(f"{arch}.rope.scaling.type", kind, "none beside RoPE factor tensors")
    if "rope_freqs.weight" in tensors:
        return (("rope_type", "freq_factors"),)
    if any(t is not None for t in longrope):
        if not all(t is not None for t in longrope):
            raise SpecDecodeError("this GGUF file has one of LongRoPE's two factor tensors (short and long), not both")
        return _gguf_longrope(key, *(t.data for t in longrope))
    attention = key("rope.scaling.attn_factor")
    if kind != "yarn" and attention is not None and not math.isclose(attention, 1.0):
        raise refuse(f"{arch}.rope.scaling.attn_factor", attention, "unset or 1 (without YaRN or LongRoPE)")
    factor = float(key("rope.scaling.factor", 1.0))
    if kind == "linear" and factor != 1.0:
        return (("factor", factor), ("rope_type", "linear"))
    if kind == "yarn":
        return _gguf_yarn(key, arch, factor)
    return ()


def _gguf_longrope(key, short, long) -> tuple:
    """LongRoPE as llama.cpp reads it: the factor tensors, the original context, and the attention factor the converter
    wrote (transformers' default, from the context over the original)."""
    attention = float(key("rope.scaling.attn_factor", 1.0))
    return longrope_items(short.tolist(), long.tolist(), _gguf_original_context(key), attention)


def _gguf_original_context(key) -> float:
    """The context a scaled RoPE was trained at: the file's original_context_length, else its context_length."""
    return float(key("rope.scaling.original_context_length", key("context_length")))


def _gguf_yarn(key, arch: str, factor: float) -> tuple:
    """YaRN as llama.cpp computes it: its ramp between the dimensions kept and those divided by the factor, and cos and
    sin scaled by 0.1 ln(factor) + 1, or where the file states a yarn_log_multiplier m by mscale(1) / mscale(m)
    (Ministral 3's converter writes its mscale_all_dim there), whatever the file's yarn_attn_factor says (llama.cpp
    overrides it), which is therefore refused where it says otherwise, as are the factors llama.cpp applies beside
    YaRN's own. DeepSeek's
    (deepseek2): its mscale pair taken as equal, so cos and sin unscaled and every score scaled by
    mscale(mscale_all_dim)^2, mscale_all_dim written as yarn_log_multiplier / 0.1 (transformers' reading where the
    pair is equal, as in every DeepSeek's config.json); a file without it, where llama.cpp scales cos and sin and the
    scores both, is refused."""
    multiplier = key("rope.scaling.yarn_log_multiplier")
    deepseek = arch == "deepseek2"
    if deepseek and multiplier is None:
        raise refuse("deepseek2.rope.scaling.yarn_log_multiplier", None, "DeepSeek's 0.1 mscale_all_dim")
    if deepseek:
        attention = 1.0
    elif multiplier:  # llama.cpp's reading outside DeepSeek: transformers' of an mscale of 1 beside mscale_all_dim m
        attention = yarn_mscale_ratio(factor, 1.0, multiplier)
    else:
        attention = yarn_attention_factor(factor)
    allowed = {
        "rope.scaling.yarn_ext_factor": 1.0,
        "rope.scaling.yarn_attn_factor": attention,
        "rope.scaling.attn_factor": 1.0,
    }
    for name, value in allowed.items():
        if key(name) is not None and not math.isclose(key(name), value):
            raise refuse(f"{arch}.{name}", key(name), f"unset or {value:.6g}")
    items = {
        "rope_type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": _gguf_original_context(key),
        **{name: float(key(f"rope.scaling.yarn_{name}", default)) for name, default in YARN_BETAS.items()},
        "truncate": 1.0,
        "attention_factor": attention,
        **({"mscale_all_dim": float(multiplier) / 0.1} if deepseek else {}),
    }
    return tuple(sorted(items.items()))


def _gguf_query_temperature(key, arch: str) -> dict:
    """Llama 4's attention temperature as llama.cpp's graphs compute it from the file's temperature_scale: Ministral
    3's (mistral3) stepping every original context (the one YaRN was trained at), Mistral Large 3's (deepseek2, as
    llama.cpp's converter of Mistral's own format writes it) every temperature_length positions."""
    beta = key("attention.temperature_scale")
    if not beta:
        return {}
    if arch not in ("mistral3", "deepseek2"):
        raise refuse(f"{arch}.attention.temperature_scale", beta, "unset (Ministral 3's and Mistral Large 3's alone)")
    floor = _gguf_original_context(key) if arch == "mistral3" else key("attention.temperature_length")
    if not floor:
        raise refuse(f"{arch}.attention.temperature_length", floor, "the positions its temperature steps by")
    return dict(query_temperature=float(beta), query_temperature_floor=int(floor))


def _gguf_softcaps(key, arch: str) -> dict:
    """Gemma 2's soft caps: llama.cpp applies both, at its defaults where the file states none."""
    if arch != "gemma2":
        return {}
    return {field: float(key(name, default)) for field, (name, default) in GEMMA2_SOFTCAPS.items()}


def _gguf_window(key, arch: str, layers: int) -> tuple[int | None, tuple[int, ...] | None]:
    """llama.cpp's reading: a window applies where the file states one (Gemma 2's is 4096 where it does not), but
    Phi-3's (llama.cpp turns it off); Gemma's layers slide but every sixth (Gemma 3) or every other (Gemma 2), or as
    its sliding_window_pattern says (gpt-oss's every other, as Gemma 2's); any other family's all slide."""
    window = key("attention.sliding_window", 4096 if arch in ("gemma2", "exaone4") else None)
    if not window or arch == "phi3" or (arch == "exaone4" and layers != EXAONE4_WINDOWED_LAYERS):
        return None, None
    if arch not in WINDOW_PATTERN:
        return int(window), None
    pattern = key("attention.sliding_window_pattern", WINDOW_PATTERN[arch], per_layer=True)
    if isinstance(pattern, list):
        sliding = tuple(i for i, slides in enumerate(pattern) if slides)
    else:
        sliding = tuple(i for i in range(layers) if i % pattern < pattern - 1)
    return int(window), sliding


# the 27B models' layer counts, whose query scale llama.cpp takes from hidden / heads
GEMMA_27B_LAYERS = {"gemma3": 62, "gemma2": 46}


def _gemma_attention_scale(arch: str, hidden: int, heads: int, head_dim: int | None, layers: int) -> float:
    """llama.cpp's Gemma query scale: 1/sqrt(head size), but 1/sqrt(hidden / heads) for the 27B models, as Google's
    reference code does (GGUF does not store query_pre_attn_scalar)."""
    big = layers == GEMMA_27B_LAYERS[arch]
    return 1.0 / math.sqrt(hidden / heads if big else head_dim or hidden // heads)


def _gguf_experts(key, reader, names: set[str], layers: int, arch: str) -> dict:
    """The experts as llama.cpp routes them; gpt-oss's graph takes the softmax of the chosen experts' logits (which
    is renormalising) whatever the file says."""
    experts = key("expert_count", 0)
    if not experts:
        return {}
    dense = tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in names)
    sparse = next((i for i in range(layers) if i not in dense), 0)
    return dict(
        num_experts=experts,
        experts_per_token=key("expert_used_count"),
        expert_intermediate_size=key("expert_feed_forward_length"),
        normalize_expert_weights=_gguf_normalizes_experts(key, arch),
        dense_layers=dense,
        shared_expert_size=_gguf_shared_expert_size(key, reader, names, arch, sparse),
        shared_expert_gated=f"blk.{sparse}.ffn_gate_inp_shexp.weight" in names,
        expert_selection_bias=f"blk.{sparse}.exp_probs_b.bias" in names,
        expert_scoring=GATING[_gguf_gating(key, arch, layers, reader)],
        expert_weights_scale=float(key("expert_weights_scale") or 1.0) if arch in SCALED_EXPERTS_FAMILIES else 1.0,
        # llama.cpp's graph scores any family's groups by their best two experts (V3's), DeepSeek-V2's too
        **expert_groups(key("expert_group_count", 1), key("expert_group_used_count", 1), "top2"),
    )


def _gguf_gating(key, arch: str, layers: int, reader) -> int:
    """The file's expert gating function, or llama.cpp's for the architecture where it states none (for deepseek2,
    sigmoid in a file of GLM-4.7-Flash's shape)."""
    if key("expert_gating_func"):
        return key("expert_gating_func")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = key("vocab_size") or (len(tokens.data) if tokens else 0)
    if arch == "deepseek2" and layers in GLM_LITE_SHAPE["layers"] and vocab == GLM_LITE_SHAPE["vocab"]:
        return 2
    return GATING_DEFAULT.get(arch, 1)


def _gguf_normalizes_experts(key, arch: str) -> bool:
    """llama.cpp's graphs: gpt-oss's softmax over the chosen logits renormalises, as ERNIE 4.5's and MiniMax-M2's
    graphs do, Qwen2-MoE's and OLMoE's never do (whatever a checkpoint's norm_topk_prob), GLM-4.5's where the file says
    (not where it is silent), the others as the file says."""
    if arch in ("glm4moe", "deepseek2"):
        return bool(key("expert_weights_norm", False))
    always = ("gpt-oss", "ernie4_5-moe", "minimax-m2")
    return arch in always or (arch not in ("qwen2moe", "olmoe") and bool(key("expert_weights_norm", True)))


def _gguf_shared_expert_size(key, reader, names: set[str], arch: str, layer: int) -> int:
    """The shared expert's width: Qwen2-MoE's as the file states it, else the dense MLP's (llama.cpp's default);
    ERNIE 4.5's and GLM-4.5's as their tensors hold it (ERNIE's converter states a width of its own reckoning, which
    llama.cpp's loader checks against them; GLM's states a count of experts)."""
    if arch in ("ernie4_5-moe", "glm4moe", "deepseek2"):
        return next((int(t.shape[1]) for t in reader.tensors if t.name == f"blk.{layer}.ffn_up_shexp.weight"), 0)
    if arch != "qwen2moe" or "blk.0.ffn_gate_inp_shexp.weight" not in names:
        return 0
    return int(key("expert_shared_feed_forward_length") or key("feed_forward_length"))


def _gguf_biases(arch: str, names: set[str]) -> dict:
    """gpt-oss's attention sinks and biases, as llama.cpp's graph loads them (each required there), and Seed-OSS's
    attention output bias where its file holds one."""
    if arch == "gpt-oss":
        return dict(attention_sinks=True, o_bias=True, expert_bias=True)
    return dict(o_bias=True) if arch == "seed_oss" and "blk.0.attn_output.bias" in names else {}
