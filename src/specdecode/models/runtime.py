"""The decoder every family runs, in plain PyTorch, shaped by its ModelConfig (models/families.py): norm
placement, q/k norms, activation, attention window, RoPE base and scaling per layer, embedding scale, tied
head, experts.

One `forward` serves prefill, single-token decode and multi-token verification: the input is a
batch of sequences, each with its own cache slot, start position and number of new tokens.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn

from ..config import MAX_VERIFY_WIDTH as ROWWISE_ATTENTION_MAX_WIDTH
from ..config import ModelConfig
from ..errors import SpecDecodeError
from ..executor.hugepages import move_to_huge_pages
from ..kv_cache import KVCache
from ..transfers import to_device
from .latent import LatentProjection
from .layers import (
    MLP,
    HeadwiseLayerNorm,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    SparseMoE,
    apply_rope,
    attention,
    head_sinks,
    longrope_factors,
    normed_and_summed,
    normed_linear,
    pre_norm,
    query_temperature_scales,
    repeated_kv_heads,
    softcapped,
    stream_norm,
)

REPEATS_KV_HEADS = {"cuda"}  # devices where masked attention repeats the KV heads for PyTorch's fused kernels


@dataclass
class ForwardBatch:
    """Attention metadata for one forward call (built once, read by every layer).

    Decode and verify calls are packed: the new tokens of all sequences side by side as one row of
    sum(num_new) tokens, with no padding, so a step where one sequence verifies 4 drafts and the rest
    none costs 4 tokens more than plain decoding, not 4 per sequence. Calls wider than `rowwise_width`
    (prefills, where no attention kernel attends row by row) are padded to [B, width] and use one masked
    attention call."""

    slots: torch.Tensor  # [B] cache slot of each sequence, or [1, N] of each token when packed
    slot_index: slice | torch.Tensor  # the sequences' slots, as a slice when contiguous (reads are then views)
    positions: torch.Tensor  # [B, T] absolute position of every input token ([1, N] when packed)
    kv_len: int  # keys to attend over: max(start + new tokens)
    mask: torch.Tensor | None  # [B, 1, T, kv_len] bool, causal, for the batched (prefill) attention path
    logit_rows: torch.Tensor | None  # flat rows of the outputs that need logits (None: all)
    # For packed calls: per sequence, (slot, keys visible to each of its new tokens); else None.
    rowwise: list[tuple[int, list[int]]] | None = None
    # A fixed-shape batch (executor/cuda_graphs.py) may carry one: the new rows' q, k, v -> their attention outputs,
    # the cache written along the way (executor/paged_attention.py)
    paged_attention = None
    # and its rows' RoPE tables, made beforehand (a chain's rounds: executor/draft_chain.py); None: the model's own
    rope = None
    # A padded call of sequences of several lengths: its real rows (flat, row-major over B, T), their slots and their
    # positions [1, N]. Only these rows are written: a padding row's position lies past its sequence's reserved blocks,
    # where another sequence's entries may be.
    real: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # Each run of flat rows (first, rows, set) and the adapter set it computes with (models/lora.py); None: set 0
    adapter_runs: list[tuple[int, int, int]] | None = None

    @classmethod
    def build(
        cls,
        slots: list[int],
        starts: list[int],
        num_new: list[int],
        max_len: int,
        device,
        logits: str | list[int] = "last",
        rowwise_width: float = ROWWISE_ATTENTION_MAX_WIDTH,
        adapters: list[int] | None = None,
    ) -> "ForwardBatch":
        """`logits`: "last" (last new token of each sequence), "all" (every valid new token), or per sequence how
        many of its last new tokens (a verify's rows beside a prompt chunk's last). `rowwise_width`: the widest
        call that is packed and attended row by row. `adapters`: each sequence's adapter set (None: set 0)."""
        made = cls._build(slots, starts, num_new, max_len, device, logits, rowwise_width)
        if adapters is not None and any(adapters):
            width = max(num_new) if made.rowwise is None else None  # a padded call's rows: B x width
            made.adapter_runs = adapter_runs(adapters, [width or n for n in num_new])
        return made

    @classmethod
    def _build(cls, slots, starts, num_new, max_len, device, logits, rowwise_width) -> "ForwardBatch":
        batch, width = len(slots), max(num_new)
        wanted = logits if isinstance(logits, list) else [n if logits == "all" else 1 for n in num_new]
        kv_len = max(s + n for s, n in zip(starts, num_new))
        slots_t = to_device(slots, device)
        contiguous = slots == list(range(slots[0], slots[0] + batch))
        slot_index = slice(slots[0], slots[0] + batch) if contiguous else slots_t
        if width <= rowwise_width:
            positions = to_device([[s + i for s, n in zip(starts, num_new) for i in range(n)]], device)
            token_slots = to_device([[slot for slot, n in zip(slots, num_new) for _ in range(n)]], device)
            rowwise = [(slot, [s + i + 1 for i in range(n)]) for slot, s, n in zip(slots, starts, num_new)]
            ends = list(itertools.accumulate(num_new))
            picked = [e - i for e, w in zip(ends, wanted) for i in range(w, 0, -1)]
            rows = None if len(picked) == ends[-1] else to_device(picked, device)
            return cls(token_slots, slot_index, positions, kv_len, None, rows, rowwise)
        start_t = to_device(starts, device)
        positions = (start_t[:, None] + torch.arange(width, device=device)[None, :]).clamp_(max=max_len - 1)
        mask = (torch.arange(kv_len, device=device)[None, None, :] <= positions[:, :, None])[:, None]
        rows = [b * width + i for b, (n, w) in enumerate(zip(num_new, wanted)) for i in range(n - w, n)]
        logit_rows = None if len(rows) == batch * width else to_device(rows, device)
        padded = cls(slots_t, slot_index, positions, kv_len, mask, logit_rows)
        if min(num_new) < width:
            real = to_device([b * width + i for b, n in enumerate(num_new) for i in range(n)], device)
            token_slots = slots_t[:, None].expand(batch, width).reshape(1, -1)[:, real]
            padded.real = (real, token_slots, positions.reshape(1, -1)[:, real])
        return padded

    @property
    def packed(self) -> bool:
        return self.rowwise is not None

    def store(self, cache: KVCache, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The new tokens' keys and values [B, Hkv, T, D] into the cache (a padded call's real rows alone)."""
        if self.real is None:
            cache.write(layer, self.slots, self.positions, k, v)
        else:  # [1, Hkv, N, D], a slot per token as a packed call's
            rows, slots, positions = self.real
            kv_heads, dim = k.shape[1], k.shape[3]
            k, v = (t.transpose(1, 2).reshape(-1, kv_heads, dim)[rows].transpose(0, 1)[None] for t in (k, v))
            cache.write(layer, slots, positions, k, v)

    def load(self, cache: KVCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batched path's keys and values [B, Hkv, kv_len, D]."""
        return cache.read(layer, self.slot_index, self.kv_len)

    def attend(self, q, keys, values, window: int | None, scale: float, softcap=None, sinks=None) -> torch.Tensor:
        """The batched path's attention: q [B, H, T, D] over keys and values [B, Hkv, kv_len, D] (sinks: [H] or None).
        On CUDA a mask beside `enable_gqa` leaves PyTorch only its unfused kernel, whose float32 scores [B, H, T,
        kv_len] are 45 GiB at 27k tokens (ComfyUI#15135, transformers' use_gqa_in_sdpa): there the KV heads are
        repeated instead."""
        if q.device.type in REPEATS_KV_HEADS:
            keys, values = repeated_kv_heads(q, keys, values)
        return attention(q, keys, values, scale, self.mask_for(window), softcap, head_sinks(sinks, q.shape[1]))

    def mask_for(self, window: int | None) -> torch.Tensor:
        """The batched path's mask for layers with this sliding window (None: the causal mask): a token sees
        the `window` keys up to itself."""
        if window is None:
            return self.mask
        masks = self.__dict__.setdefault("_window_masks", {})
        if window not in masks:
            keys = torch.arange(self.kv_len, device=self.positions.device)[None, None, :]
            masks[window] = self.mask & (keys > self.positions[:, :, None] - window)[:, None]
        return masks[window]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.dim_per_head
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        # DeepSeek's latent attention: q, k and v of equal heads all the same (models/latent.py)
        latent = LatentProjection(cfg) if cfg.kv_lora_rank else None
        self.qkv_proj = latent or Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        # DeepSeek's values narrower than its heads, padded there (models/latent.py): the padding dropped before o_proj
        self.value_dim = cfg.value_dim if latent is not None else None
        self.o_proj = Linear(self.num_heads * (self.value_dim or self.head_dim), cfg.hidden_size, bias=cfg.o_bias)
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if cfg.attention_sinks else None
        self.whole_qk_norms = cfg.qk_norm and cfg.qk_norm_whole  # weights over each projection's width
        if cfg.qk_norm:
            self.q_norm, self.k_norm = self._qk_norm(cfg, self.num_heads), self._qk_norm(cfg, self.num_kv_heads)
        self.window = cfg.window(layer)
        self.softcap = cfg.attention_softcap
        # which of the model's RoPE tables this layer reads: Gemma 3's sliding layers have their own base, and a NoPE
        # layer's table turns nothing (cos 1, sin 0: every kernel that rotates leaves its queries and keys as they are)
        local = self.window is not None and cfg.local_rope_theta is not None
        self.rope = "none" if layer in cfg.nope_layers else "local" if local else "global"
        self.scale = (local and cfg.local_attention_scale) or cfg.attention_scale or self.head_dim**-0.5
        temperature = (cfg.query_temperature, cfg.query_temperature_floor)
        self.query_temperature = temperature if cfg.query_temperature else None
        # A backend may attach one kernel for q/k norms + rope + KV write + attention of packed batches (see
        # executor/attention.py); it must compute each token as alone, like _rowwise_attention.
        self.rowwise_kernel = None
        self.rope_kernel = apply_rope  # a backend may attach a fused one, same signature

    def _qk_norm(self, cfg: ModelConfig, heads: int) -> RMSNorm | HeadwiseLayerNorm:
        """A query or key norm: each head's RMSNorm with one weight for all heads (Qwen3's), an RMSNorm over the
        projection's whole width (OLMo 2's), or a LayerNorm of each head with weights of its own (Command R+'s)."""
        if not self.whole_qk_norms:
            return RMSNorm(self.head_dim, cfg.rms_norm_eps)
        if cfg.layer_norms:
            return HeadwiseLayerNorm(heads, self.head_dim, cfg.rms_norm_eps)
        return RMSNorm(heads * self.head_dim, cfg.rms_norm_eps)

    @property
    def qk_norms(self) -> tuple[RMSNorm, RMSNorm] | None:
        """The norms of each query and key head (what the attention kernel takes in), None where there are none."""
        return (self.q_norm, self.k_norm) if self.normalises_qk and not self.whole_qk_norms else None

    @property
    def normalises_qk(self) -> bool:
        return hasattr(self, "q_norm")

    def with_whole_qk_norms(self, qkv: torch.Tensor) -> torch.Tensor:
        """The QKV projection [..., q + 2 kv] with its queries and keys normalised over their whole width."""
        q, k, v = qkv.split(self.split, dim=-1)
        return torch.cat([self.q_norm(q), self.k_norm(k), v], dim=-1)

    def normed(self, norm: RMSNorm, x, residual, rope, batch: ForwardBatch, cache: KVCache):
        """(the attention of norm(x + residual)'s new tokens, x + residual), residual None: of norm(x), and x. A
        fixed-shape batch's attention may take the QKV projection's kernel with RoPE and the cache write in."""
        paged = batch.paged_attention
        # the projection's kernel rotates and stores as it projects: no place for the queries' temperature
        fused = paged is not None and self.query_temperature is None
        projected = paged.project(self, norm, x, residual, rope, batch, cache) if fused else None
        if projected is not None:
            queries, residual = projected
            out = paged.attend(batch, cache, self.layer, queries, self.num_heads, self.window, self.scale, self.softcap)
            return self.output(out), residual
        qkv, residual = normed_linear(norm, self.qkv_proj, x, residual)
        return self(qkv, rope, batch, cache), residual

    def forward(self, qkv, rope, batch: ForwardBatch, cache: KVCache):
        """The new tokens after each slot's cached ones, from their QKV projection (the caller's: it may fuse the norm
        before it in)."""
        bsz, width, _ = qkv.shape
        if self.query_temperature is not None:
            qkv = self.with_query_temperature(qkv, batch.positions)
        if batch.rowwise is not None and self.rowwise_kernel is not None:
            out = self.rowwise_kernel(qkv, rope, batch, cache, self)
            return self.output(out.view(bsz, width, -1))
        if batch.paged_attention is not None:
            q, k, v = self.split_heads(qkv)
            paged = batch.paged_attention
            return self.output(paged(batch, cache, self.layer, q, k, v, rope, self.window, self.scale, self.softcap))
        q, k, v = self._heads(qkv, rope)
        batch.store(cache, self.layer, k, v)
        if batch.rowwise is not None:
            out = self._rowwise_attention(q, batch, cache)
        else:
            keys, values = batch.load(cache, self.layer)
            keys, values = keys.to(q.dtype), values.to(q.dtype)
            out = batch.attend(q, keys, values, self.window, self.scale, self.softcap, self.sinks)
        return self.output(out.transpose(1, 2).reshape(bsz, width, -1))

    def with_query_temperature(self, qkv: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The QKV projection with each row's queries multiplied by its position's attention temperature (scaled
        before RoPE rather than after, as transformers does: rotation is linear)."""
        q, kv = qkv.split((self.split[0], qkv.shape[-1] - self.split[0]), dim=-1)
        scales = query_temperature_scales(positions, *self.query_temperature)
        return torch.cat([q * scales.unsqueeze(-1).to(q.dtype), kv], dim=-1)

    def output(self, attended: torch.Tensor) -> torch.Tensor:
        """The output projection of the heads' attention outputs [..., heads x head_dim] (of each value's first
        value_dim, where the values are padded)."""
        if self.value_dim is not None:
            attended = attended.unflatten(-1, (self.num_heads, self.head_dim))[..., : self.value_dim].flatten(-2)
        return self.o_proj(attended)

    def _heads(self, qkv, rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as [B, heads, T, head_dim], q and k normalised (where the family does) and rotated."""
        q, k, v = self.split_heads(qkv)
        q = self.rope_kernel(q.transpose(1, 2), *rope)
        k = self.rope_kernel(k.transpose(1, 2), *rope)
        return q, k, v.transpose(1, 2)

    def split_heads(self, qkv) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as [B, T, heads, head_dim] (views of the projection), q and k normalised where the family does."""
        bsz, width, _ = qkv.shape
        q, k, v = qkv.split(self.split, dim=-1)
        if self.whole_qk_norms:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(bsz, width, self.num_heads, self.head_dim)
        k = k.view(bsz, width, self.num_kv_heads, self.head_dim)
        if self.qk_norms is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v.view(bsz, width, self.num_kv_heads, self.head_dim)

    def visible_keys(self, n: int) -> slice:
        """The cached keys the token at position n - 1 attends to."""
        return slice(0 if self.window is None else max(0, n - self.window), n)

    def _rowwise_attention(self, q, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """One attention call per new token over exactly its visible keys: the same call, bit for bit, as
        when that token is decoded alone. Masked batched attention would reduce over a longer, padded
        key range, whose different rounding can flip a greedy near-tie between verify and plain decode.

        Each call folds the query heads that share a KV head into the query length ([1, Hkv, G, D]
        against [1, Hkv, n, D], no mask: a lone token sees all n keys), which PyTorch's CPU kernel runs
        far faster than [1, H, 1, D] with `enable_gqa`
        (docs/decisions.md#query-heads-folded-into-the-query-length)."""
        kv_heads, group = self.num_kv_heads, self.num_heads // self.num_kv_heads
        rows, token, sinks = [], 0, head_sinks(self.sinks, kv_heads)
        for slot, kv_lens in batch.rowwise:
            keys, values = cache.read(self.layer, slice(slot, slot + 1), max(kv_lens))
            for n in kv_lens:
                query = q[0, :, token].reshape(1, kv_heads, group, self.head_dim)
                seen = self.visible_keys(n)
                seen_keys, seen_values = keys[:, :, seen].to(q.dtype), values[:, :, seen].to(q.dtype)
                rows.append(attention(query, seen_keys, seen_values, self.scale, None, self.softcap, sinks))
                token += 1
        # one [1, Hkv, G, D] per packed token -> [1, H, N, D]
        return torch.stack(rows).view(1, token, self.num_heads, self.head_dim).transpose(1, 2)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = pre_norm(cfg)
        self.self_attn = Attention(cfg, layer)
        self.parallel = cfg.parallel_blocks
        if not self.parallel:
            self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = pre_norm(cfg)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoE(cfg) if cfg.is_sparse(layer) else MLP(cfg)
        self.moves = 0  # of its tensors (Module._apply): a kernel holding their addresses takes them again

    def _apply(self, fn, recurse=True):
        self.moves += 1
        return super()._apply(fn, recurse)

    def forward(self, x, residual, rope, batch, cache):
        """x: the previous layer's MLP output (the embeddings for the first layer, residual None); returns
        this layer's MLP output and the residual stream before it (the next norm adds them).

        With sandwich norms (Gemma, GLM-4) the attention and MLP outputs are normalised before they join the
        residual stream: post_attention_layernorm normalises the attention output, and the add + norm before
        the MLP is pre_feedforward_layernorm's. Without pre-norms (OLMo 2) the add before attention or the MLP is
        all there is (layers.Unnormed)."""
        if self.parallel:
            return self._parallel(x, residual, rope, batch, cache)
        attention = self.self_attn
        attended, residual = attention.normed(self.input_layernorm, x, residual, rope[attention.rope], batch, cache)
        if hasattr(self, "post_feedforward_layernorm"):
            x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(attended), residual)
            return self.post_feedforward_layernorm(self.mlp(x)), residual
        if isinstance(self.mlp, MLP):
            gate_up, residual = normed_linear(self.post_attention_layernorm, self.mlp.gate_up_proj, attended, residual)
            return self.mlp.down(gate_up), residual
        x, residual = self.post_attention_layernorm(attended, residual)
        return self.mlp(x), residual

    def _parallel(self, x, residual, rope, batch, cache):
        """Cohere's block: attention and the MLP read one norm of the stream, and both outputs join it, the attention
        output first (the sum's order transformers adds in)."""
        normed, residual = normed_and_summed(self.input_layernorm, x, residual)
        attention = self.self_attn
        attended = attention(attention.qkv_proj(normed), rope[attention.rope], batch, cache)
        return self.mlp(normed), residual + attended


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = stream_norm(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # RoPE scaled by factors stored with the weights gets its tables from the builder (set_rotary)
        self.rotary = None if dict(cfg.rope_scaling).get("rope_type") == "freq_factors" else self.set_rotary()
        # Token ids of the logits' columns when the LM head is restricted to a vocabulary subset.
        self.vocab_ids: torch.Tensor | None = None
        # The KV cache's element type when it differs from the activations' (set with the attention
        # kernel: a float16 cache halves what attention over a long context streams).
        self.kv_cache_dtype: torch.dtype | None = None

    def set_rotary(self, freq_factors: torch.Tensor | None = None, device=None) -> RotaryEmbedding:
        """The RoPE tables' frequencies: the global layers' (scaled as the config says, by `freq_factors` where
        it says so) and, for a family whose sliding layers have their own base, theirs (unscaled)."""
        cfg = self.cfg
        rotary = RotaryEmbedding(
            cfg.dim_per_head, cfg.rope_theta, cfg.rope_scaling, freq_factors, self.rope_context, cfg.rotary_dim
        )
        self.rotary = rotary.to(device)
        if cfg.local_rope_theta is not None:
            local = RotaryEmbedding(cfg.dim_per_head, cfg.local_rope_theta, rotary_dim=cfg.rotary_dim)
            self.local_rotary = local.to(device)
        return self.rotary

    def fit_rope_to_context(self, context: int) -> None:
        """LongRoPE's factors for sequences up to `context` tokens: the short ones within the original context, else the
        long ones for every position (llama.cpp's choice by its context size; transformers switches within a sequence
        once it grows past the original, whose earlier keys then turned otherwise). Only a model without LongRoPE, or
        fitted to the same factors, takes another context: its tables are not changed under an engine using them."""
        scaling = dict(self.cfg.rope_scaling)
        if scaling.get("rope_type") != "longrope":
            return
        same = longrope_factors(scaling, self.rope_context) == longrope_factors(scaling, context)
        if self.rope_context is not None and not same:
            raise SpecDecodeError(
                f"this loaded model's LongRoPE is fitted to a context of {self.rope_context} tokens, whose factors a "
                f"context of {context} does not share; load it again for that context"
            )
        if self.rope_context is None:
            self.rope_context = context
        if not same:
            kernel = self.rotary.kernel  # a device's fused tables, attached at load
            self.set_rotary(device=self.device)
            self.rotary.kernel = kernel

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) of every input position for each kind of layer (Attention.rope names its kind)."""
        tables = {"global": self.rotary(positions, dtype)}
        if hasattr(self, "local_rotary"):
            tables["local"] = self.local_rotary(positions, dtype)
        if self.cfg.nope_layers:
            cos, sin = tables["global"]
            tables["none"] = (torch.ones_like(cos), torch.zeros_like(sin))
        return tables

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        if self.cfg.embedding_scale is not None:  # in the activations' dtype, as transformers and llama.cpp do
            x = x * torch.tensor(self.cfg.embedding_scale, dtype=x.dtype)
        return x

    @property
    def device(self):
        return self.norm.weight.device

    @property
    def dtype(self):
        """The activations' dtype; low-bit weights keep their own formats."""
        return self.norm.weight.dtype

    @property
    def kv_dtype(self):
        return self.kv_cache_dtype or self.dtype

    # the longest sequence the RoPE tables are for (fit_rope_to_context): None, past any original context
    rope_context: int | None = None
    # how the linear layers compute: set by the builder (see executor.backends)
    backend = "torch"
    # decode and verify forwards replayed as CUDA graphs on a GPU (executor/cuda_graphs.py); False: eager
    capture_graphs = True
    # a backend may attach one call for all layers of packed forwards (executor/decoder.py), same results
    layers_kernel = None
    # which adapter set each row computes with, where the model has LoRA adapters (models/lora.py)
    adapter_route = None

    def weight_bytes(self) -> int:
        """Bytes of all weights: parameters and buffers, tied ones once."""
        return tensor_bytes([*self.parameters(), *self.buffers()])

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, batch: ForwardBatch, cache: KVCache, return_hidden: bool | str = False):
        """tokens [B, T] ([1, N] when packed) -> float32 logits [rows, vocab] for `batch.logit_rows`
        (row-major over B, T); with return_hidden also the last layer's output (before the final norm)
        for those rows, or with return_hidden="all" for every input row ([B * T, hidden])."""
        x = self.embed(tokens)
        if self.adapter_route is not None:
            self.adapter_route.runs = batch.adapter_runs
        rope = batch.rope or self.rope_tables(batch.positions, x.dtype)
        x, residual = run_layers(self, x, rope, batch, cache)
        real = None if batch.real is None else batch.real[0]
        return self.output(
            x.reshape(-1, x.shape[-1]), residual.reshape(-1, x.shape[-1]), batch.logit_rows, return_hidden, real
        )

    def output(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        rows: torch.Tensor | None,
        return_hidden: bool | str,
        inputs: torch.Tensor | None = None,
    ):
        """Logits of the last layer's output at `rows` (None: all), and the hidden states it asks for: "all", those of
        the input rows (a padded call's real ones: `inputs`)."""
        every_row = x + residual if return_hidden == "all" and rows is not None else None  # else the norm's sum
        if every_row is not None and inputs is not None:
            every_row = every_row.index_select(0, inputs)
        logits, hidden = final_logits(self.norm, self.lm_head, x, residual, rows, self.cfg.final_softcap)
        if not return_hidden:
            return logits
        return logits, hidden if every_row is None else every_row

    def restrict_vocab(self, token_ids: torch.Tensor) -> None:
        """Keep only these rows of the LM head (cheaper drafting; see proposers.draft_model). The full head
        is let go, so its memory is freed where it is not the embedding table; restricting a loaded model
        again to the same rows (another LLM sharing it) is a no-op."""
        token_ids = token_ids.to(self.device)
        if self.vocab_ids is not None:
            if torch.equal(self.vocab_ids, token_ids):
                return
            raise SpecDecodeError(
                "the draft's LM head is already restricted to another vocabulary subset; "
                "load the model again to choose a different draft_vocab_size"
            )
        self.lm_head = self.lm_head.select_rows(token_ids)
        move_to_huge_pages(self.lm_head)
        self.vocab_ids = token_ids

    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load weights named as in Hugging Face checkpoints (models/checkpoints.py makes every family's names
        so; q/k/v and gate/up are fused here)."""
        self.load_state_dict(runtime_weights(self, tensors), assign=True, strict=True)
        if self.cfg.tie_word_embeddings or "lm_head.weight" not in tensors:
            self.lm_head.weight = self.embed_tokens.weight
        for p in self.parameters():
            p.requires_grad_(False)


def adapter_runs(sets: list[int], rows: list[int]) -> list[tuple[int, int, int]]:
    """(first row, rows, set) for sequences side by side, neighbours of one set in one run."""
    runs: list[tuple[int, int, int]] = []
    first = 0
    for index, n in zip(sets, rows):
        if runs and runs[-1][2] == index:
            runs[-1] = (runs[-1][0], runs[-1][1] + n, index)
        else:
            runs.append((first, n, index))
        first += n
    return runs


def run_layers(model, x: torch.Tensor, rope, batch: ForwardBatch, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """A Transformer's or a draft head's layers from the embeddings: (last MLP output, residual stream before it). In
    one call where the model has a layers kernel and the batch is packed (decode, verify, prompt chunks)."""
    # the one-call decoder has no place for an attention temperature: called only where it is 1 for every query
    if model.layers_kernel is not None and batch.rowwise is not None and not model.cfg.scales_queries(batch.kv_len):
        return model.layers_kernel(model, x, rope, batch, cache)
    residual = None
    for layer in model.layers:
        x, residual = layer(x, residual, rope, batch, cache)
    return x, residual


def final_logits(
    norm: RMSNorm, lm_head: nn.Module, x: torch.Tensor, residual: torch.Tensor, rows: torch.Tensor | None, softcap=None
):
    """(float32 logits of norm(x + residual), soft-capped where the model is, and x + residual) at rows of [N, hidden]
    x and residual (None: all), the add, the norm and the float32 copy in the LM head's call where its kernel takes
    them in."""
    if rows is not None:
        x, residual = x.index_select(0, rows), residual.index_select(0, rows)
    logits, summed = normed_linear(norm, lm_head, x, residual, out_dtype=torch.float32)  # a cast fewer, if fused
    return softcapped(logits.float(), softcap), summed


def tensor_bytes(tensors) -> int:
    """Bytes these tensors hold, each memory range once: tied weights are one tensor twice, and on huge pages
    every weight is a view into one arena, whose whole size each view's storage reports."""
    seen = {(t.device, t.data_ptr(), t.numel() * t.element_size()) for t in tensors}
    return sum(size for _, _, size in seen)


# the runtime's fused linear layers, and the Hugging Face layers (in the same module) whose output rows they stack
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# HF names that hold no weight of the runtime's: computed buffers of older checkpoints
IGNORED = ("rotary_emb.inv_freq",)


def hf_parts(name: str) -> list[str]:
    """HF names of the modules behind a runtime module ("layers.3.mlp.gate_up_proj" -> its gate and up)."""
    if name == "lm_head":
        return ["lm_head"]
    parent, _, local = name.rpartition(".")
    return [f"model.{parent}.{part}" for part in FUSED_PARTS[local]] if local in FUSED_PARTS else [f"model.{name}"]


def runtime_weights(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF names -> the model's parameter names, with q/k/v and gate/up concatenated by output rows. A weight
    of the checkpoint that the model has no place for is refused: it would change what the model computes."""
    out, used = {}, set()
    for name in model.state_dict():
        module, _, kind = name.rpartition(".")
        sources = [f"{part}.{kind}" for part in hf_parts(module)]
        if name == "lm_head.weight" and "lm_head.weight" not in tensors:
            sources = ["model.embed_tokens.weight"]  # tied
        missing = [s for s in sources if s not in tensors]
        if missing:
            raise SpecDecodeError(f"the checkpoint has no {missing[0]}, which this {model.cfg.arch} model needs")
        out[name] = tensors[sources[0]] if len(sources) == 1 else torch.cat([tensors[s] for s in sources])
        used.update(sources)
    check_all_used(tensors, used | {"lm_head.weight", "model.rope_freqs"})
    return out


def check_all_used(tensors, used: set[str]) -> None:
    unused = sorted(n for n in tensors if n not in used and not n.endswith(IGNORED))
    if unused:
        raise SpecDecodeError(
            f"the checkpoint holds weights this runtime does not compute ({', '.join(unused[:3])}"
            f"{'...' if len(unused) > 3 else ''}): refused rather than run without them"
        )


def build_model(cfg: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device) -> Transformer:
    """Create the model without initialising random weights, then assign the given ones."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model.set_rotary(tensors.get("model.rope_freqs"), device)  # float32, whatever the weights' dtype
    model.load_hf_state_dict({name: t.to(device=device, dtype=dtype) for name, t in tensors.items()})
    return model.eval()
