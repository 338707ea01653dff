"""The KV cache in blocks of BLOCK_TOKENS tokens, and a block table per sequence slot.

A slot takes blocks as its sequence grows and gives them back when it is truncated (rolled back) or freed, so
memory follows the tokens held: a 200-token request holds four blocks, not a slot of max_len tokens. The pool
is one allocation whose pages the OS makes resident only as blocks are first written (a block is zeroed when
taken); the blocks of a slot need not be contiguous. Rolling back rejected draft tokens is moving the length
back (entries past it are overwritten later), and a block past the new length returns to the pool.

A block may be in several slots' tables (counted references): sequences share the full blocks of a common
prefix (prefix_index.py). Only a slot's block at its length is ever written, so that block is kept its own:
where a truncation lands inside a block others hold, the slot gets a copy (copy on write)."""

from __future__ import annotations

import heapq
from collections.abc import Iterable

import torch

from .config import ModelConfig
from .errors import SpecDecodeError
from .executor.hugepages import huge_page_empty
from .prefix_index import PrefixIndex

# Tokens per block: a multiple of 32, the attention kernel's span of values weighed together
# (docs/decisions.md#the-kv-cache-in-blocks)
BLOCK_TOKENS = 64
# Keys are stored in tiles of this many tokens with the dimension outermost ([.., tiles, D, KEY_TILE]): the CPU
# attention kernel scores a tile with one vector lane per key and no transpose (docs/decisions.md#cpu-attention-kernel)
KEY_TILE = 16


def blocks_for(tokens: int, block_size: int = BLOCK_TOKENS) -> int:
    return -(-tokens // block_size)


class KVCache:
    def __init__(
        self,
        cfg: ModelConfig,
        num_slots: int,
        max_len: int,
        dtype: torch.dtype,
        device,
        num_blocks: int | None = None,
        block_size: int = BLOCK_TOKENS,
        scratch: bool = False,
    ):
        """num_slots sequences of at most max_len tokens each, over num_blocks blocks (default: enough for every
        slot at max_len). With `scratch`, one more block that no slot ever takes, reached through table row
        `scratch_row`: where the padding rows of a fixed-shape forward (a CUDA graph's bucket) write and read."""
        if block_size % 32:
            raise ValueError(f"a KV block holds a multiple of 32 tokens, not {block_size}")
        self.block_size, self.max_len, self.num_slots = block_size, max_len, num_slots
        self.max_blocks = blocks_for(max_len, block_size)  # a slot's table row
        self.num_blocks = num_blocks or num_slots * self.max_blocks
        shape = (2, cfg.num_layers, self.num_blocks + scratch, cfg.num_kv_heads, block_size, cfg.dim_per_head)
        keys, values = _pool(shape, dtype, device)
        self.k = [layer.view(*shape[2:4], block_size // KEY_TILE, cfg.dim_per_head, KEY_TILE) for layer in keys]
        self.v = list(values)
        self.tables: list[list[int]] = [[] for _ in range(num_slots)]
        # the tables as the attention kernel reads them: row s holds slot s's blocks (unused entries 0)
        self.table = torch.zeros(num_slots + scratch, self.max_blocks, dtype=torch.int32, device=device)
        self.scratch_row = num_slots if scratch else None
        if scratch:
            self.table[num_slots] = self.num_blocks
            for part in self.k + self.v:
                part[self.num_blocks].zero_()
        self.lengths = [0] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        # a heap: the lowest free block is taken first, so the pages in use stay few while few tokens are held
        self._free_blocks = list(range(self.num_blocks))
        self._refs = [0] * self.num_blocks  # the tables holding each block
        self.index = PrefixIndex(block_size)  # blocks found by their tokens; those no table holds are spare

    # ---- slots ---------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise SpecDecodeError(f"all {self.num_slots} KV-cache slots are in use; wait for a request to finish")
        slot = self._free.pop()
        self.truncate(slot, 0)
        return slot

    def take(self, slot: int) -> None:
        """Allocate this free slot (its length and contents are the caller's to set)."""
        self._free.remove(slot)

    def free(self, slot: int) -> None:
        """The slot is free to allocate; its blocks go back, the last first (registered ones stay findable)."""
        self.truncate(slot, 0)
        self._free.append(slot)

    # ---- blocks --------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks a slot may take: unused ones and registered ones no slot holds."""
        return len(self._free_blocks) + self.index.num_idle

    def blocks_in_use(self) -> int:
        """Distinct blocks that slots hold."""
        return self.num_blocks - self.num_free_blocks

    def references(self, block: int) -> int:
        return self._refs[block]

    def reserve(self, slot: int, tokens: int) -> None:
        """Blocks for the slot's first `tokens` positions, no more (a forward writes up to there; blocks past them
        held stale entries of an earlier, longer forward)."""
        if tokens > self.max_len:
            raise ValueError(f"a forward would pass the context of {self.max_len} tokens")
        self._release_past(slot, blocks_for(tokens, self.block_size))
        need = blocks_for(tokens, self.block_size) - len(self.tables[slot])
        if need > self.num_free_blocks:
            raise SpecDecodeError(
                f"the KV cache is out of blocks ({need} more needed, {self.num_free_blocks} free "
                f"of {self.num_blocks}); wait for a request to finish"
            )
        for _ in range(max(need, 0)):
            self._append(slot, self._new_block())

    def share(self, slot: int, blocks: Iterable[int]) -> None:
        """The slot's next blocks are these, held with whoever holds them."""
        for block in blocks:
            if self._refs[block] == 0 and self.index.is_registered(block):
                self.index.busy(block)
            self._refs[block] += 1
            self._append(slot, block)

    def append_copy(self, slot: int, block: int) -> None:
        """The slot's next block is a copy of this one (whose first entries it continues from)."""
        self._append(slot, self._new_block(like=block))

    def truncate(self, slot: int, length: int, forget: bool = False, hold: int = 0) -> None:
        """The slot holds its first `length` tokens (no copy); the blocks past them (and past its first `hold`
        positions: a forward queued on the device writes there) return to the pool (with `forget`, those nobody
        else holds are no longer findable: they held rejected tokens), and the block it writes next becomes its own."""
        self.lengths[slot] = length
        self._release_past(slot, blocks_for(max(length, hold), self.block_size), forget)
        if length % self.block_size and length // self.block_size < len(self.tables[slot]):
            self._own(slot, length // self.block_size)

    def _own(self, slot: int, i: int) -> None:
        """The slot's i-th block is written by it alone: a copy where others hold it, else no longer findable."""
        block = self.tables[slot][i]
        if self._refs[block] > 1:
            mine = self._new_block(like=block)
            self._drop(block)
            self.tables[slot][i] = mine
            self.table[slot, i].fill_(mine)
        elif self.index.is_registered(block):
            self.index.unregister(block)

    def _release_past(self, slot: int, kept: int, forget: bool = False) -> None:
        """The slot's blocks past its first `kept` go back, the last first."""
        for block in reversed(self.tables[slot][kept:]):
            self._drop(block, forget)
        del self.tables[slot][kept:]

    def _append(self, slot: int, block: int) -> None:
        # fill_ queues a kernel with the value; an assignment copies it from the host, on a GPU waiting for its queue
        self.table[slot, len(self.tables[slot])].fill_(block)
        self.tables[slot].append(block)

    def _new_block(self, like: int | None = None) -> int:
        """A block for one table: an unused one, else the registered block released longest ago; zeroed, or a
        copy of `like`."""
        block = heapq.heappop(self._free_blocks) if self._free_blocks else self.index.evict()
        if block is None:
            raise SpecDecodeError(f"the KV cache is out of blocks (all {self.num_blocks} are held)")
        for part in self.k + self.v:
            if like is None:
                part[block].zero_()
            else:
                part[block].copy_(part[like])
        self._refs[block] = 1
        return block

    def _drop(self, block: int, forget: bool = False) -> None:
        self._refs[block] -= 1
        if self._refs[block]:
            return
        if forget and self.index.is_registered(block):
            self.index.unregister(block)
        if self.index.is_registered(block):
            self.index.idle(block)
        else:
            heapq.heappush(self._free_blocks, block)

    def forget_registered(self) -> None:
        """No block is findable by its tokens any more; those no slot holds go back to the pool."""
        for block in self.index.clear():
            heapq.heappush(self._free_blocks, block)

    def copy(self, source: int, dest: int) -> None:
        """dest continues from source's cached tokens (a shared prompt prefilled once): it shares their full
        blocks and copies the one they end in."""
        n = self.lengths[source]
        self.truncate(dest, 0)
        full, rest = divmod(n, self.block_size)
        self.share(dest, self.tables[source][:full])
        if rest:
            self.append_copy(dest, self.tables[source][full])
        self.lengths[dest] = n

    # ---- entries -------------------------------------------------------------------------------------
    def _places(self, slots: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) of each (slot, position)."""
        return self.table[slots, positions // self.block_size].long(), positions % self.block_size

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Store k/v [B, Hkv, T, D] at `positions` [B, T]; slots: [B], one per sequence, or [B, T], one
        per token (a packed batch holds several sequences in one row)."""
        self.write_at(layer, self.entries(slots, positions), k, v)

    def entries(self, slots: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The index of the entries at `positions` of `slots` (as `write` takes them), for write_at: the same
        for every layer."""
        per_token = slots[:, None].expand_as(positions) if slots.dim() == 1 else slots
        blocks, offsets = self._places(per_token, positions)
        heads = torch.arange(self.k[0].shape[1], device=positions.device)
        return blocks[:, None, :], heads[None, :, None], offsets[:, None, :]

    def write_at(self, layer: int, entries: tuple[torch.Tensor, ...], k: torch.Tensor, v: torch.Tensor):
        blocks, heads, offsets = entries
        self.k[layer][blocks, heads, offsets // KEY_TILE, :, offsets % KEY_TILE] = k.to(self.k[layer].dtype)
        self.v[layer][entries] = v.to(self.v[layer].dtype)

    def read(self, layer: int, slots, kv_len: int):
        """Keys/values [B, Hkv, kv_len, D] of the slots (a slice or a tensor of them), in the cache's dtype:
        their blocks gathered in order (a copy)."""
        return self.read_blocks(layer, self.block_rows(slots, kv_len), kv_len)

    def block_rows(self, slots, kv_len: int) -> torch.Tensor:
        """[B, blocks]: the blocks holding the slots' first kv_len entries, for read_blocks (the same for every
        layer)."""
        return self.table[slots, : blocks_for(kv_len, self.block_size)].long()

    def read_blocks(self, layer: int, blocks: torch.Tensor, kv_len: int):
        return _gathered(self.k[layer], blocks, kv_len, tiled=True), _gathered(self.v[layer], blocks, kv_len)

    def keys(self, layer: int, slot: int, n: int) -> torch.Tensor:
        """The slot's first n keys [Hkv, n, D] (a copy)."""
        return self.read(layer, slice(slot, slot + 1), n)[0][0]

    def values(self, layer: int, slot: int, n: int) -> torch.Tensor:
        return self.read(layer, slice(slot, slot + 1), n)[1][0]


def tiled_keys(keys: torch.Tensor) -> torch.Tensor:
    """Keys [.., B, D] (B a multiple of KEY_TILE) as the cache stores them: [.., B / KEY_TILE, D, KEY_TILE] (a copy)."""
    *outer, rows, dim = keys.shape
    return keys.reshape(*outer, rows // KEY_TILE, KEY_TILE, dim).transpose(-1, -2).contiguous()


def untiled_keys(tiles: torch.Tensor) -> torch.Tensor:
    """The cache's keys [.., B / KEY_TILE, D, KEY_TILE] as rows [.., B, D]."""
    *outer, count, dim, tile = tiles.shape
    return tiles.transpose(-1, -2).reshape(*outer, count * tile, dim)


def _gathered(pool: torch.Tensor, table: torch.Tensor, kv_len: int, tiled: bool = False) -> torch.Tensor:
    """pool [blocks, Hkv, block, D] (`tiled`: keys [blocks, Hkv, tiles, D, tile]) read through table [B, n] ->
    [B, Hkv, kv_len, D] (one copy)."""
    batch, n = table.shape
    blocks = pool[table.reshape(-1)].view(batch, n, *pool.shape[1:])  # [B, n, Hkv, block, D] or tiled
    if tiled:  # [B, n, Hkv, tiles, D, tile] -> [B, n, Hkv, tiles, tile, D]
        blocks = blocks.transpose(-1, -2)
    kv_heads, dim = pool.shape[1], blocks.shape[-1]
    return blocks.transpose(1, 2).reshape(batch, kv_heads, -1, dim)[:, :, :kv_len]


def _pool(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """One allocation for every block, left unwritten: its pages become resident as blocks are first taken
    (on huge pages on a CPU, where a long context's attention streams it)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = 1
    for d in shape:
        nbytes *= d
    raw, _ = huge_page_empty(nbytes * dtype.itemsize)
    return raw.view(dtype).view(shape)
