"""The attention of packed eager calls on a GPU, by the paged kernels of captured forwards (paged_attention.py).

A packed call (a verify or decode step that no captured graph serves, every step of a mixture of experts, prompts
of at most ROWWISE_ATTENTION_MAX_WIDTH tokens side by side) must attend each token over exactly the keys it sees, as
decoding it alone would. PyTorch's path does that with an attention call per token and a read of each sequence's
blocks (a verify of 64 sequences x 5 rows launches 468 kernels a layer). Here each token is a sequence of one row for
the paged kernels (three launches a layer), and it gets the bits a decode row of a captured forward gets (the same
kernels and tiles; short of MAX_PARTIALS). Wider calls (long prompts) keep the masked SDPA path, whose flash kernel
reads each key once for many rows where these kernels would read it once a row."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from ..config import MAX_VERIFY_WIDTH as ROWWISE_ATTENTION_MAX_WIDTH
from ..kv_cache import KVCache
from .cuda_graphs import MIN_KEYS
from .paged_attention import PagedAttention, rotate_and_store
from .qkv_epilogue import RopeStore


@dataclass
class _Rows:
    """The packed tokens as the kernels' sequences of one row each (the attributes of a batch they read)."""

    positions: torch.Tensor  # [N]
    slot_index: torch.Tensor  # [N] each token's slot
    kv_len: int  # key positions (a kernel constant: rounded up, as a bucket's are, to few values)
    rope: dict[int, tuple]  # by a RoPE table's id: its [N, D] cos and sin, and the table (kept, so the id is its)


class PackedRowAttention:
    """A model's `rowwise_kernel` on a GPU: q, k, v of a packed call [1, N, .] -> the tokens' attention [N, H * D],
    their keys and values written into their slots' blocks."""

    max_width = ROWWISE_ATTENTION_MAX_WIDTH

    def __init__(self, attention: PagedAttention):
        self.attention = attention
        self._batch, self._rows = None, None  # of the call last seen: every layer of a forward shares them

    def __call__(self, qkv: torch.Tensor, rope, batch, cache: KVCache, attn) -> torch.Tensor:
        q, k, v = (t.reshape(-1, 1, *t.shape[2:]) for t in attn.split_heads(qkv))  # [N, 1, heads, D]
        rows = self._rows_of(batch, cache)
        if id(rope[0]) not in rows.rope:
            rows.rope[id(rope[0])] = (*(t.reshape(len(rows.positions), -1) for t in rope), rope)
        cos, sin, _ = rows.rope[id(rope[0])]
        layer, heads, kv_heads = attn.layer, attn.num_heads, attn.num_kv_heads
        store = RopeStore(cos, sin, rows.positions, rows.slot_index, cache.table, cache.k[layer], cache.v[layer],
                          heads, kv_heads)  # fmt: skip
        queries = rotate_and_store(q, k, v, store).view(-1, 1, heads * attn.head_dim)
        out = self.attention.attend(rows, cache, layer, queries, heads, attn.window, attn.scale, attn.softcap)
        return out.view(-1, heads * attn.head_dim)

    def _rows_of(self, batch, cache: KVCache) -> _Rows:
        if self._batch is not batch:
            positions, slots = batch.positions.reshape(-1), batch.slots.reshape(-1)
            # no further than a block table reaches: the kernel reads the table at its last key position
            keys = min(max(MIN_KEYS, triton.next_power_of_2(batch.kv_len)), cache.max_blocks * cache.block_size)
            self._batch, self._rows = batch, _Rows(positions, slots, keys, {})
        return self._rows


def attach_packed_row_attention(model, attention: PagedAttention) -> None:
    """The kernels for the model's packed eager calls (where they passed their check on this device)."""
    kernel = PackedRowAttention(attention)
    for layer in model.layers:
        layer.self_attn.rowwise_kernel = kernel
