"""DeepSeek's multi-head latent attention (MLA), as a projection the runtime's attention takes like any other.

MLA's queries come from a projection of their own (through a compression of q_lora_rank where the model has one); its
keys and values from one compressed vector per token (kv_lora_rank, RMS-normalised), expanded per head, and one key
part that RoPE turns, shared by all heads. The runtime's attention (models/runtime.py) takes one projection of equal
heads [..., q | k | v]: here the expansion happens before the cache, as transformers' eager attention computes it,
each head's key in the runtime's RoPE layout (head_layout) and each value padded to the head's width with zeros (the
attention output's padding dropped before the output projection: runtime.Attention.output). So every attention
kernel computes MLA unchanged. The cache then holds heads x head width per token for keys and values alike, where
llama.cpp and vLLM cache the compressed vector (kv_lora_rank + the turned part): more memory per token, the same
results.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ..config import ModelConfig
from .layers import Linear, RMSNorm

LATENT_NORM_EPS = 1e-6  # transformers' DeepSeek builds the compressions' norms with its default eps, not the model's


def head_layout(width: int, turned: int) -> torch.Tensor:
    """A head's dimensions in the runtime's order, from DeepSeek's [not turned | turned, pairs adjacent]: the runtime's
    RoPE pairs (j, j + width / 2) for the first turned / 2 j (layers.RotaryEmbedding's partial rotary), so each pair's
    first dimension goes to j, its second to j + width / 2, and the dimensions that do not turn fill the rest in order.
    New dimension j is old dimension layout[j]."""
    still, pairs, half = width - turned, turned // 2, width // 2
    firsts = [still + 2 * i for i in range(pairs)]
    seconds = [still + 2 * i + 1 for i in range(pairs)]
    return torch.tensor([*firsts, *range(half - pairs), *seconds, *range(half - pairs, still)])


def turned_pairs_split(rows: int, turned: int) -> list[int]:
    """The compressed projection's rows [latent | turned key, pairs adjacent] with the turned key's pairs split into
    their first dimensions, then their second (the halves NeoX's RoPE pairs)."""
    latent = rows - turned
    return [*range(latent), *range(latent, rows, 2), *range(latent + 1, rows, 2)]


class LatentProjection(nn.Module):
    """x [..., hidden] -> [..., q | k | v], each heads x head width: queries in head_layout (their rows reordered at
    load), keys assembled in it, values padded with zeros."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        heads, width, turned, rank = cfg.num_heads, cfg.dim_per_head, cfg.rotary_dim, cfg.kv_lora_rank
        self.heads, self.width, self.turned, self.rank, self.value_dim = heads, width, turned, rank, cfg.value_dim
        if cfg.q_lora_rank:
            self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(cfg.q_lora_rank, heads * width, bias=False)
        else:
            self.q_proj = Linear(cfg.hidden_size, heads * width, bias=False)
        self.kv_a_proj = Linear(cfg.hidden_size, rank + turned, bias=False)  # the checkpoints' kv_a_proj_with_mqa
        self.kv_a_layernorm = RMSNorm(rank, LATENT_NORM_EPS)
        # the compressed vector's expansion into each head's key part that does not turn, and into its value (one
        # kv_b_proj in the checkpoints, two in llama.cpp's files: the keys' stored transposed)
        self.k_b_proj = Linear(rank, heads * (width - turned), bias=False)
        self.v_b_proj = Linear(rank, heads * cfg.value_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if hasattr(self, "q_b_proj") else self.q_proj(x)
        latent, turned_key = self.kv_a_proj(x).split([self.rank, self.turned], dim=-1)
        latent = self.kv_a_layernorm(latent)
        still_key = self.k_b_proj(latent).unflatten(-1, (self.heads, -1))
        value = self.v_b_proj(latent).unflatten(-1, (self.heads, -1))
        keys = self.keys(still_key, turned_key.unsqueeze(-2).expand(*still_key.shape[:-1], self.turned))
        values = F.pad(value, (0, self.width - self.value_dim))
        return torch.cat([q, keys.flatten(-2), values.flatten(-2)], dim=-1)

    def keys(self, still: torch.Tensor, turned: torch.Tensor) -> torch.Tensor:
        """Each head's key [..., heads, width] in head_layout, from its part that does not turn and the turned part
        (its pairs' first dimensions, then their second: turned_pairs_split)."""
        pairs, first_still = self.turned // 2, self.width // 2 - self.turned // 2
        parts = (turned[..., :pairs], still[..., :first_still], turned[..., pairs:], still[..., first_still:])
        return torch.cat(parts, dim=-1)
