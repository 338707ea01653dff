"""Every checkpoint's weights under one set of names, which the runtime and the backends read: Hugging Face's as
Llama and Qwen2 name them, each expert apart ("model.layers.{i}.mlp.experts.{e}.gate_proj.weight", the router
"model.layers.{i}.mlp.gate.weight"), norms as the runtime multiplies them, and a GGUF file's RoPE frequency
factors as "model.rope_freqs"."""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from ..config import ModelConfig
from ..errors import SpecDecodeError
from .families import COHERE_FAMILIES, LATENT_FAMILIES, LONGROPE_TENSORS
from .latent import head_layout, turned_pairs_split

# ---- Hugging Face checkpoints --------------------------------------------------------------------------

MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# families whose RoPE turns adjacent dimensions together (GPT-J's, llama.cpp's "norm" RoPE): their checkpoints' q/k
# rows are reordered to the runtime's pairs (d, d + D/2), as a Llama GGUF's are (gguf_loader); both sources' names
INTERLEAVED_ROPE_FAMILIES = ("ernie4_5", "ernie4_5_moe", "ernie4_5-moe", "glm", "glm4", "chatglm", *COHERE_FAMILIES)
# GLM-4's sandwich norms under Llama's names, one of them for another norm: its post_attention_layernorm is the one
# before the MLP, as in Llama
GLM4_NORMS = {
    "post_self_attn_layernorm": "post_attention_layernorm",
    "post_attention_layernorm": "pre_feedforward_layernorm",
    "post_mlp_layernorm": "post_feedforward_layernorm",
}
# families whose RMSNorm multiplies by (1 + weight): llama.cpp's converter adds the 1 to the stored weights
NORM_OFFSET_FAMILIES = ("gemma3_text", "gemma2")


def canonical_hf_weights(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Hugging Face checkpoint's tensors under the runtime's names."""
    out = {}
    for name, tensor in tensors.items():
        for canonical, part in _canonical_hf(cfg, name, tensor):
            out[canonical] = part
    if cfg.arch in NORM_OFFSET_FAMILIES:
        out = {n: t + 1.0 if n.endswith("norm.weight") else t for n, t in out.items()}
    if cfg.arch in INTERLEAVED_ROPE_FAMILIES:
        out = {n: halves_paired(cfg, n, t) for n, t in out.items()}
    return {n: as_computed(cfg, n, t) for n, t in out.items()}


def unpermute_rope(w, n_heads: int, turned: int | None = None):
    """q/k rows whose RoPE pairs adjacent dimensions (llama.cpp's converter interleaves Llama's so) reordered to the
    runtime's pairs (NeoX layout); numpy or torch rows, whole rows moving (GGUF blocks with them). turned: where RoPE
    turns only a head's first dimensions (GLM's half), those reordered among themselves and the rest left."""
    size = w.shape[0] // n_heads
    turned = turned or size
    order = [*range(0, turned, 2), *range(1, turned, 2), *range(turned, size)]
    return w.reshape(n_heads, size, *w.shape[1:])[:, order].reshape(w.shape)


def halves_paired(cfg: ModelConfig, name: str, tensor):
    """A checkpoint's query or key rows (weights, biases, norms' weights of each head's values; torch or a GGUF's numpy
    rows) in the runtime's RoPE pairs, where they pair adjacent dimensions; any other tensor as it is."""
    m = re.fullmatch(r"model\.layers\.\d+\.self_attn\.(q_proj|k_proj|q_norm|k_norm)\.(weight|bias)", name)
    if not m:
        return tensor
    heads = cfg.num_heads if m[1].startswith("q") else cfg.num_kv_heads
    if m[1].endswith("norm"):  # a head's weights, or each head's (Command R+'s [heads, head size]), reordered alike
        return unpermute_rope(tensor.reshape(-1), heads if cfg.qk_norm_whole else 1, cfg.rotary_dim)
    return unpermute_rope(tensor, heads, cfg.rotary_dim)


def as_computed(cfg: ModelConfig, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A checkpoint's tensor (under the runtime's name) as the runtime computes with it, from any source (ERNIE 4.5's
    selection bias stored [1, experts], as one group of them)."""
    if name.endswith("gate.selection_bias"):
        return tensor.reshape(-1)
    if cfg.kv_lora_rank:
        return latent_reordered(cfg, name, tensor)
    return rotary_reordered(cfg, name, folded_logit_scale(cfg, name, tensor))


# DeepSeek's latent attention's layers, which the runtime holds in its QKV projection (models/latent.py)
LATENT_LAYERS = re.compile(
    r"(model\.layers\.\d+\.self_attn)\.(q_proj|q_a_proj|q_a_layernorm|q_b_proj|kv_a_proj_with_mqa|kv_a_layernorm|kv_b_proj)\."
)
LATENT_QUERIES = re.compile(r"model\.layers\.\d+\.self_attn\.qkv_proj\.(q_proj|q_b_proj)\.weight")


def latent_reordered(cfg: ModelConfig, name: str, tensor):
    """DeepSeek's latent attention's weights (torch, or a GGUF's rows) as models/latent.py computes with them: each
    query head's rows in head_layout, the turned key's rows split into its pairs' halves, llama.cpp's expansions (per
    head) as two layers."""
    if LATENT_QUERIES.fullmatch(name):
        heads = tensor.reshape(cfg.num_heads, cfg.dim_per_head, *tensor.shape[1:])
        return heads[:, head_layout(cfg.dim_per_head, cfg.rotary_dim)].reshape(tensor.shape)
    if name.endswith("self_attn.qkv_proj.k_b_proj.weight") and tensor.dim() == 3:  # llama.cpp's [heads, latent, rows]
        return tensor.transpose(1, 2).reshape(-1, tensor.shape[1])
    if name.endswith("self_attn.qkv_proj.v_b_proj.weight") and tensor.dim() == 3:
        return tensor.reshape(-1, tensor.shape[2])
    if name.endswith("self_attn.qkv_proj.kv_a_proj.weight"):
        return tensor[turned_pairs_split(tensor.shape[0], cfg.rotary_dim)]
    return tensor


def folded_logit_scale(cfg: ModelConfig, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The final norm's weights divided by the model's logit divisor (Granite's logits_scaling): the LM head is linear
    in them, so the logits come out divided, tied embeddings or not, whatever backend holds the head."""
    if name != "model.norm.weight" or not cfg.logit_scale:
        return tensor
    return tensor / cfg.logit_scale


ROTATED = re.compile(r"model\.layers\.\d+\.self_attn\.(q_proj|k_proj|q_norm|k_norm)\.(weight|bias)")


def rotary_order(head_dim: int, turned: int) -> torch.Tensor:
    """A head's dimensions reordered where RoPE turns only the first `turned`: their pairs (i, i + turned / 2) moved to
    where the runtime's tables pair the whole head's (j, j + head_dim / 2), the dimensions that do not turn into the
    pairs left over (whose frequency is 0: layers.RotaryEmbedding). New dimension j is old dimension order[j]. Queries
    and keys reordered alike keep every score, and values are not reordered: the attention output is the same."""
    pairs, still = turned // 2, list(range(turned, head_dim))
    rest = len(still) // 2
    return torch.tensor([*range(pairs), *still[:rest], *range(pairs, turned), *still[rest:]])


def rotary_reordered(cfg: ModelConfig, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The rows of each query and key head (weights, biases, and the q/k norms' weights) in rotary_order, where RoPE
    turns only part of a head (the rows of a GGUF weight stored in blocks move whole)."""
    if cfg.rotary_dim is None or not ROTATED.fullmatch(name):
        return tensor
    size = cfg.dim_per_head
    heads = tensor.reshape(tensor.shape[0] // size, size, *tensor.shape[1:])
    return heads[:, rotary_order(size, cfg.rotary_dim)].reshape(tensor.shape)


def _canonical_hf(cfg: ModelConfig, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    if cfg.arch in ("ernie4_5_moe", "glm4_moe", *LATENT_FAMILIES):
        if _next_token_prediction(cfg, name):  # which transformers leaves out too
            return
        name = _biased_moe(name)
    if cfg.kv_lora_rank and LATENT_LAYERS.match(name):
        yield from _latent_layer(cfg, name, tensor)
        return
    m = re.fullmatch(r"(model\.layers\.\d+)\.(\w+_layernorm)\.weight", name)
    if m and cfg.arch == "glm4" and m[2] in GLM4_NORMS:
        yield f"{m[1]}.{GLM4_NORMS[m[2]]}.weight", tensor
        return
    m = re.fullmatch(r"(model\.layers\.\d+\.mlp)\.(router\.weight|router\.bias|experts\.\w+)", name)
    if m and cfg.arch == "gpt_oss":
        yield from _gpt_oss_mlp(m[1], m[2], tensor)
        return
    m = re.fullmatch(
        r"(model\.layers\.\d+)\.block_sparse_moe\.(input_linear|output_linear|router\.layer)\.weight", name
    )
    if m:  # Granite's experts, stacked [experts, rows, columns], gate and up in one
        yield from _granite_experts(f"{m[1]}.mlp", m[2], tensor)
        return
    m = re.fullmatch(r"(model\.layers\.\d+)\.block_sparse_moe\.(.+)", name)  # Mixtral's names
    if m:
        expert = re.fullmatch(r"experts\.(\d+)\.(w[123])\.weight", m[2])
        local = f"experts.{expert[1]}.{MIXTRAL_EXPERT[expert[2]]}.weight" if expert else m[2]
        yield _biased_moe(f"{m[1]}.mlp.{local}"), tensor  # (MiniMax-M2's selection bias)
        return
    m = re.fullmatch(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)", name)  # stacked experts
    if m:
        for e, weight in enumerate(tensor):
            if m[2] == "down_proj":
                yield f"{m[1]}.{e}.down_proj.weight", weight
            else:
                gate, up = weight.chunk(2, dim=0)
                yield f"{m[1]}.{e}.gate_proj.weight", gate
                yield f"{m[1]}.{e}.up_proj.weight", up
        return
    m = re.fullmatch(r"(model\.layers\.\d+)\.shared_mlp\.(input_linear|output_linear)\.weight", name)
    if m:  # Granite 4.0's dense MLP, under its hybrid family's name: gate and up in one
        yield from _granite_mlp(f"{m[1]}.mlp", m[2], tensor)
        return
    m = re.fullmatch(r"(model\.layers\.\d+)\.self_attn\.qkv_proj\.weight", name)  # Phi-3's fused projections
    if m:
        for part, rows in zip("qkv", qkv_rows(cfg)):
            yield f"{m[1]}.self_attn.{part}_proj.weight", tensor[rows]
        return
    m = re.fullmatch(r"(model\.layers\.\d+)\.mlp\.gate_up_proj\.weight", name)
    if m:
        gate, up = tensor.chunk(2)
        yield f"{m[1]}.mlp.gate_proj.weight", gate
        yield f"{m[1]}.mlp.up_proj.weight", up
        return
    yield name, tensor


def _latent_layer(cfg: ModelConfig, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """DeepSeek's attention's layers under the runtime's names, in its QKV projection; its kv_b_proj (each head's key
    rows that do not turn, then its value rows) as models/latent.py's two expansions."""
    name = LATENT_LAYERS.sub(r"\1.qkv_proj.\2.", name).replace("_proj_with_mqa.", "_proj.")
    if not name.endswith("self_attn.qkv_proj.kv_b_proj.weight"):
        yield name, tensor
        return
    prefix = name.removesuffix("kv_b_proj.weight")
    heads = tensor.reshape(cfg.num_heads, -1, tensor.shape[-1])
    still = cfg.dim_per_head - cfg.rotary_dim
    yield f"{prefix}k_b_proj.weight", heads[:, :still].reshape(-1, tensor.shape[-1])
    yield f"{prefix}v_b_proj.weight", heads[:, still:].reshape(-1, tensor.shape[-1])


def _next_token_prediction(cfg: ModelConfig, name: str) -> bool:
    """A weight of the next-token prediction layers after the model's own: ERNIE 4.5's `mtp_` ones, GLM-4.5's counted
    among its layers."""
    layer = re.match(r"model\.layers\.(\d+)\.", name)
    return name.startswith("model.mtp_") or (layer is not None and int(layer[1]) >= cfg.num_layers)


def _biased_moe(name: str) -> str:
    """ERNIE 4.5's, GLM-4.5's, DeepSeek's and MiniMax-M2's names: their experts' selection bias (ERNIE's [1, experts],
    under either name transformers reads), their shared experts as one."""
    m = re.fullmatch(r"(model\.layers\.\d+\.mlp)\.(?:gate\.)?(?:moe_statics\.)?e_score_correction_bias", name)
    if m:
        return f"{m[1]}.gate.selection_bias"
    return name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")


def _gpt_oss_mlp(prefix: str, local: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """gpt-oss's router and experts: each expert's weights stored stacked and transposed ([experts, columns, rows]),
    gate and up in one tensor with their rows interleaved (gate, up, gate, ...; llama.cpp's converter splits them
    so), biases beside them."""
    if local.startswith("router."):
        yield f"{prefix}.gate.{local.partition('.')[2]}", tensor
        return
    kind, biases, _ = local.removeprefix("experts.").partition("_bias")
    if kind not in ("gate_up_proj", "down_proj"):
        yield f"{prefix}.{local}", tensor  # refused by name where the weights are matched
        return
    part = "bias" if biases else "weight"
    for e, stored in enumerate(tensor):
        rows = stored if biases else stored.t()
        if kind == "down_proj":
            yield f"{prefix}.experts.{e}.down_proj.{part}", rows.contiguous()
        else:
            yield f"{prefix}.experts.{e}.gate_proj.{part}", rows[0::2].contiguous()
            yield f"{prefix}.experts.{e}.up_proj.{part}", rows[1::2].contiguous()


def _granite_experts(prefix: str, kind: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    if kind == "router.layer":
        yield f"{prefix}.gate.weight", tensor
        return
    for e, weight in enumerate(tensor):
        yield from _granite_mlp(f"{prefix}.experts.{e}", kind, weight)


def _granite_mlp(prefix: str, kind: str, weight: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Granite's MLP weights: input_linear holds gate and up (gate first), output_linear is down."""
    if kind == "output_linear":
        yield f"{prefix}.down_proj.weight", weight
        return
    gate, up = weight.chunk(2, dim=0)
    yield f"{prefix}.gate_proj.weight", gate
    yield f"{prefix}.up_proj.weight", up


def qkv_rows(cfg: ModelConfig) -> list[slice]:
    """The rows of a fused q/k/v projection that are the queries', the keys' and the values'."""
    q, kv = cfg.num_heads * cfg.dim_per_head, cfg.num_kv_heads * cfg.dim_per_head
    return [slice(0, q), slice(q, q + kv), slice(q + kv, q + 2 * kv)]


# ---- GGUF ----------------------------------------------------------------------------------------------

GGUF_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",  # Qwen2-MoE's shared expert
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# DeepSeek's latent attention (llama.cpp's deepseek2): its layers in the runtime's QKV projection (models/latent.py)
LATENT_LAYER = {
    **GGUF_LAYER,
    "attn_q": "self_attn.qkv_proj.q_proj",
    "attn_q_a": "self_attn.qkv_proj.q_a_proj",
    "attn_q_a_norm": "self_attn.qkv_proj.q_a_layernorm",
    "attn_q_b": "self_attn.qkv_proj.q_b_proj",
    "attn_kv_a_mqa": "self_attn.qkv_proj.kv_a_proj",
    "attn_kv_a_norm": "self_attn.qkv_proj.kv_a_layernorm",
    "attn_k_b": "self_attn.qkv_proj.k_b_proj",
    "attn_v_b": "self_attn.qkv_proj.v_b_proj",
}
# llama.cpp's expansions of DeepSeek's compressed keys and values, stored per head ([heads, rows, columns]; the keys'
# transposed across the file's blocks): computed from floats, never as stored blocks
LATENT_FLOAT_TENSORS = ("attn_k_b", "attn_v_b")
# where the attention output has a norm of its own (Gemma), ffn_norm is the one before the MLP
SANDWICH_LAYER = {**GGUF_LAYER, "ffn_norm": "pre_feedforward_layernorm"}
# gpt-oss's: its norm before the experts under another name
GPT_OSS_LAYER = {**GGUF_LAYER, "attn_post_norm": "post_attention_layernorm"}
# tensors without the ".weight" of a layer (sinks; ERNIE 4.5's experts' selection bias, stored as exp_probs_b.bias)
WHOLE_NAMED = {"attn_sinks": "self_attn.sinks", "exp_probs_b": "mlp.gate.selection_bias"}
GGUF_EXPERTS = {
    "ffn_gate_exps": ("gate_proj",),
    "ffn_up_exps": ("up_proj",),
    "ffn_down_exps": ("down_proj",),
    "ffn_gate_up_exps": ("gate_proj", "up_proj"),
}
FUSED_UP_FAMILIES = ("phi3", "glm4", "chatglm")  # GGUF architectures whose ffn_up holds gate and up
GGUF_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def gguf_parts(cfg: ModelConfig, name: str, rows: int) -> list[tuple[str, slice]]:
    """Where the rows of a GGUF tensor go: (runtime name, rows of the tensor). An experts' tensor is stacked
    [experts, rows, columns]: its names hold an "{expert}" field, and the rows are each expert's."""
    if name == "rope_freqs.weight":
        return [("model.rope_freqs", slice(None))]
    if name in LONGROPE_TENSORS:
        return []  # LongRoPE's factors: in the model's description (families.py), not among its weights
    m = re.fullmatch(r"blk\.(\d+)\.([\w.]+)\.(weight|bias)", name)  # (a prediction layer's: nextn.eh_proj)
    if m is None:
        base, _, suffix = name.rpartition(".")
        if base not in GGUF_GLOBAL:
            raise _unknown_tensor(name)
        return [(f"{GGUF_GLOBAL[base]}.{suffix}", slice(None))]
    prefix, kind, suffix = f"model.layers.{m[1]}", m[2], m[3]
    if int(m[1]) >= cfg.num_layers:
        return []  # a next-token prediction layer after the model's own (GLM-4.5's), which llama.cpp's graph leaves out
    if kind in GGUF_EXPERTS:
        return _stacked([f"{prefix}.mlp.experts.{{expert}}.{p}.{suffix}" for p in GGUF_EXPERTS[kind]], rows)
    if kind == "attn_qkv":
        return [(f"{prefix}.self_attn.{p}_proj.{suffix}", rows) for p, rows in zip("qkv", qkv_rows(cfg))]
    if kind == "ffn_up" and cfg.arch in FUSED_UP_FAMILIES:  # gate and up in one, gate first (llama.cpp's SwiGLU halves)
        return _stacked([f"{prefix}.mlp.{p}_proj.{suffix}" for p in ("gate", "up")], rows)
    layer = SANDWICH_LAYER if cfg.sandwich_norms else GPT_OSS_LAYER if cfg.attention_sinks else GGUF_LAYER
    layer = LATENT_LAYER if cfg.kv_lora_rank else layer
    if kind == "exp_probs_b" and cfg.expert_selection_bias or kind == "attn_sinks" and cfg.attention_sinks:
        return [(f"{prefix}.{WHOLE_NAMED[kind]}", slice(None))]
    if kind not in layer:
        raise _unknown_tensor(name)
    return [(f"{prefix}.{layer[kind]}.{suffix}", slice(None))]


def _stacked(names: list[str], rows: int) -> list[tuple[str, slice]]:
    """Equal parts of a tensor's rows stacked one after another, one for each name."""
    size = rows // len(names)
    return [(name, slice(i * size, (i + 1) * size)) for i, name in enumerate(names)]


def _unknown_tensor(name: str) -> SpecDecodeError:
    return SpecDecodeError(
        f"the GGUF file holds a tensor {name!r} that this runtime does not compute; the file is "
        "refused rather than run without it"
    )
