"""Decoder-only transformer for the Llama/Qwen2 family in plain PyTorch.

One `forward` serves prefill, single-token decode and multi-token verification: the input is a
batch of sequences, each with its own cache slot, start position and number of new tokens.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import MAX_VERIFY_WIDTH as ROWWISE_ATTENTION_MAX_WIDTH
from ..config import ModelConfig
from ..errors import SpecDecodeError
from ..executor.hugepages import move_to_huge_pages
from ..kv_cache import KVCache




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
    mask: torch.Tensor | None  # [B, 1, T, kv_len] bool, for the batched (prefill) attention path
    logit_rows: torch.Tensor | None  # flat rows of the outputs that need logits (None: all)
    # For packed calls: per sequence, (slot, keys visible to each of its new tokens); else None.
    rowwise: list[tuple[int, list[int]]] | None = None

    @classmethod
    def build(cls, slots: list[int], starts: list[int], num_new: list[int], max_len: int, device,
              logits: str = "last", rowwise_width: float = ROWWISE_ATTENTION_MAX_WIDTH) -> "ForwardBatch":
        """`logits`: "last" (last new token of each sequence) or "all" (every valid new token).
        `rowwise_width`: the widest call that is packed and attended row by row."""
        batch, width = len(slots), max(num_new)
        kv_len = max(s + n for s, n in zip(starts, num_new))
        slots_t = torch.tensor(slots, device=device)
        contiguous = slots == list(range(slots[0], slots[0] + batch))
        slot_index = slice(slots[0], slots[0] + batch) if contiguous else slots_t
        if width <= rowwise_width:
            positions = torch.tensor([[s + i for s, n in zip(starts, num_new) for i in range(n)]], device=device)
            token_slots = torch.tensor([[slot for slot, n in zip(slots, num_new) for _ in range(n)]], device=device)
            rowwise = [(slot, [s + i + 1 for i in range(n)]) for slot, s, n in zip(slots, starts, num_new)]
            ends = list(itertools.accumulate(num_new))
            rows = None if logits == "all" else torch.tensor([e - 1 for e in ends], device=device)
            if rows is not None and len(ends) == ends[-1]:  # one token per sequence: every row
                rows = None
            return cls(token_slots, slot_index, positions, kv_len, None, rows, rowwise)
        start_t = torch.tensor(starts, device=device)
        positions = (start_t[:, None] + torch.arange(width, device=device)[None, :]).clamp_(max=max_len - 1)
        mask = (torch.arange(kv_len, device=device)[None, None, :] <= positions[:, :, None])[:, None]
        if logits == "last":
            rows = [b * width + n - 1 for b, n in enumerate(num_new)]
        else:
            rows = [b * width + i for b, n in enumerate(num_new) for i in range(n)]
        logit_rows = None if len(rows) == batch * width else torch.tensor(rows, device=device)
        return cls(slots_t, slot_index, positions, kv_len, mask, logit_rows)

    @property
    def packed(self) -> bool:
        return self.rowwise is not None


class Linear(nn.Linear):
    """A Linear whose output rows do not depend on how many rows are computed together.

    oneDNN's bf16 GEMM kernels give each row the same result for any M >= 2, but M = 1 goes to a GEMV
    kernel that rounds differently. Padding a single row to two (no slower here) keeps a token's logits
    identical whether it is decoded alone or verified with k drafts.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[:-1].numel() == 1:
            y = F.linear(torch.cat([x, x], dim=-2), self.weight)[..., :1, :]  # a contiguous copy: stride-0 views are slow
        else:
            y = F.linear(x, self.weight)
        # The bias is added apart: a fused bias selects other kernels, which are not row-invariant.
        return y if self.bias is None else y + self.bias

    def select_rows(self, ids: torch.Tensor) -> "Linear":
        out = Linear(self.in_features, len(ids), bias=self.bias is not None, device="meta")
        out.weight = nn.Parameter(self.weight.index_select(0, ids), requires_grad=False)
        if self.bias is not None:
            out.bias = nn.Parameter(self.bias.index_select(0, ids), requires_grad=False)
        return out


class RMSNorm(nn.Module):
    """norm(x); or, given the residual stream, adds x into it first and returns (norm(sum), sum): the
    residual add and the next norm are one step, which a backend's kernel does in one call."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernel = None  # a backend may attach one (see executor/elementwise.py), same signature as forward

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.kernel is not None:
            return self.kernel(self, x, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """NeoX-style rotary embedding (halves rotated); GGUF llama weights are un-permuted to match."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        freqs = positions[..., None].float() * self.inv_freq  # [B, T, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B, 1, T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.dim_per_head
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=False)
        # A backend may attach one kernel for rope + KV write + attention of packed batches (see
        # executor/attention.py); it must compute each token as alone, like _rowwise_attention.
        self.rowwise_kernel = None

    def forward(self, x, rope, batch: ForwardBatch, cache: KVCache):
        """The new tokens after each slot's cached ones."""
        bsz, width, _ = x.shape
        if batch.rowwise is not None and self.rowwise_kernel is not None:
            out = self.rowwise_kernel(self.qkv_proj(x), rope, batch, cache, self.layer)
            return self.o_proj(out.view(bsz, width, -1))
        q, k, v = self._heads(x, rope)
        cache.write(self.layer, batch.slots, batch.positions, k, v)
        if batch.rowwise is not None:
            out = self._rowwise_attention(q, batch, cache)
        else:
            keys, values = (t.to(q.dtype) for t in cache.read(self.layer, batch.slot_index, batch.kv_len))
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=batch.mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, width, -1))

    def _heads(self, x, rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as [B, heads, T, head_dim], q and k rotated."""
        bsz, width, _ = x.shape
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = apply_rope(q.view(bsz, width, self.num_heads, self.head_dim).transpose(1, 2), *rope)
        k = apply_rope(k.view(bsz, width, self.num_kv_heads, self.head_dim).transpose(1, 2), *rope)
        return q, k, v.view(bsz, width, self.num_kv_heads, self.head_dim).transpose(1, 2)

    def _rowwise_attention(self, q, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """One attention call per new token over exactly its visible keys: the same call, bit for bit, as
        when that token is decoded alone. Masked batched attention would reduce over a longer, padded
        key range, whose different rounding can flip a greedy near-tie between verify and plain decode.

        Each call folds the query heads that share a KV head into the query length ([1, Hkv, G, D]
        against [1, Hkv, n, D], no mask: a lone token sees all n keys), which PyTorch's CPU kernel runs
        far faster than [1, H, 1, D] with `enable_gqa` (docs/decisions.md)."""
        kv_heads, group = self.num_kv_heads, self.num_heads // self.num_kv_heads
        rows, token = [], 0
        for slot, kv_lens in batch.rowwise:
            keys, values = cache.k[self.layer][slot:slot + 1], cache.v[self.layer][slot:slot + 1]
            for n in kv_lens:
                query = q[0, :, token].reshape(1, kv_heads, group, self.head_dim)
                rows.append(F.scaled_dot_product_attention(query, keys[:, :, :n].to(q.dtype),
                                                           values[:, :, :n].to(q.dtype)))
                token += 1
        # one [1, Hkv, G, D] per packed token -> [1, H, N, D]
        return torch.stack(rows).view(1, token, self.num_heads, self.head_dim).transpose(1, 2)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.silu_mul_kernel = None  # a backend may attach one: gate_up -> silu(gate) * up in one call

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        if self.silu_mul_kernel is not None:
            return self.down_proj(self.silu_mul_kernel(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, residual, rope, batch, cache):
        """x: the previous layer's MLP output (the embeddings for the first layer, residual None); returns
        this layer's MLP output and the residual stream before it (the next norm adds them)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(x, rope, batch, cache), residual)
        return self.mlp(x), residual


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.dim_per_head, cfg.rope_theta)
        # Token ids of the logits' columns when the LM head is restricted to a vocabulary subset.
        self.vocab_ids: torch.Tensor | None = None
        # The KV cache's element type when it differs from the activations' (set with the attention
        # kernel: a float16 cache halves what attention over a long context streams).
        self.kv_cache_dtype: torch.dtype | None = None

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

    # how the linear layers compute: set by the builder (see executor.backends)
    backend = "torch"

    def weight_bytes(self) -> int:
        """Bytes of all weights: parameters and buffers (shared storage counted once)."""
        seen, total = set(), 0
        for t in list(self.parameters()) + list(self.buffers()):
            key = (t.untyped_storage().data_ptr(), t.device)
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
        return total

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, batch: ForwardBatch, cache: KVCache, return_hidden: bool | str = False):
        """tokens [B, T] ([1, N] when packed) -> float32 logits [rows, vocab] for `batch.logit_rows`
        (row-major over B, T); with return_hidden also the last layer's output (before the final norm)
        for those rows, or with return_hidden="all" for every input row ([B * T, hidden])."""
        x = self.embed_tokens(tokens)
        rope = self.rotary(batch.positions, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, rope, batch, cache)
        return self.output(x.reshape(-1, x.shape[-1]), residual.reshape(-1, x.shape[-1]), batch.logit_rows,
                           return_hidden)

    def output(self, x: torch.Tensor, residual: torch.Tensor, rows: torch.Tensor | None, return_hidden: bool | str):
        """Logits of the last layer's output at `rows` (None: all), and the hidden states it asks for."""
        every_row = x + residual if return_hidden == "all" else None
        if rows is not None:
            x, residual = x.index_select(0, rows), residual.index_select(0, rows)
        normed, hidden = self.norm(x, residual)
        logits = self.lm_head(normed).float()
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
            raise SpecDecodeError("the draft's LM head is already restricted to another vocabulary subset; "
                                  "load the model again to choose a different draft_vocab_size")
        self.lm_head = self.lm_head.select_rows(token_ids)
        move_to_huge_pages(self.lm_head)
        self.vocab_ids = token_ids

    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load weights named as in Hugging Face Llama/Qwen2 checkpoints (q/k/v and gate/up are fused here)."""
        self.load_state_dict(fuse_hf_weights(self.cfg, tensors), assign=True, strict=True)
        if self.cfg.tie_word_embeddings or "lm_head.weight" not in tensors:
            self.lm_head.weight = self.embed_tokens.weight
        for p in self.parameters():
            p.requires_grad_(False)


# the runtime's fused linear layers, and the Hugging Face layers whose output rows they stack
FUSED_PARTS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
               "self_attn.o_proj": ("self_attn.o_proj",),
               "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"), "mlp.down_proj": ("mlp.down_proj",)}


def hf_parts(name: str) -> list[str]:
    """HF names of the layers behind a runtime linear layer ("layers.3.mlp.gate_up_proj" -> gate, up)."""
    if name == "lm_head":
        return ["lm_head"]
    layer, _, local = name.partition(".")[2].partition(".")
    return [f"model.layers.{layer}.{part}" for part in FUSED_PARTS[local]]


def fuse_hf_weights(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF names -> the runtime's, with q/k/v and gate/up concatenated by output rows."""
    embed = tensors["model.embed_tokens.weight"]
    out: dict[str, torch.Tensor] = {"embed_tokens.weight": embed, "norm.weight": tensors["model.norm.weight"],
                                    "lm_head.weight": tensors.get("lm_head.weight", embed)}
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        for name, parts in FUSED_PARTS.items():
            for suffix in ("weight", "bias"):
                if src + f"{parts[0]}.{suffix}" in tensors:
                    out[f"{dst}{name}.{suffix}"] = torch.cat([tensors[f"{src}{p}.{suffix}"] for p in parts])
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{dst}{norm}.weight"] = tensors[f"{src}{norm}.weight"]
    return out


def build_model(cfg: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device) -> Transformer:
    """Create the model without initialising random weights, then assign the given ones."""
    with torch.device("meta"):
        model = Transformer(cfg)
    tensors = {name: t.to(device=device, dtype=dtype) for name, t in tensors.items()}
    model.load_hf_state_dict(tensors)
    model.rotary = RotaryEmbedding(cfg.dim_per_head, cfg.rope_theta).to(device)
    return model.eval()
