"""Preallocated KV cache. Each sequence owns a slot; its cached length is a pointer, so rolling back
rejected draft tokens is moving that pointer back (the stale entries are simply overwritten later)."""
from __future__ import annotations

import torch

from .config import ModelConfig
from .errors import SpecDecodeError
from .executor.hugepages import huge_page_zeros


class KVCache:
    def __init__(self, cfg: ModelConfig, num_slots: int, max_len: int, dtype: torch.dtype, device):
        shape = (2, cfg.num_layers, num_slots, cfg.num_kv_heads, max_len, cfg.dim_per_head)
        # one allocation, on huge pages on a CPU: attention over a long context streams all of it
        kv = huge_page_zeros(shape, dtype) if torch.device(device).type == "cpu" else torch.zeros(
            shape, dtype=dtype, device=device)
        self.k, self.v = list(kv[0]), list(kv[1])
        self.max_len = max_len
        self.num_slots = num_slots
        self.lengths = [0] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise SpecDecodeError(f"all {self.num_slots} KV-cache slots are in use; wait for a request to finish")
        slot = self._free.pop()
        self.lengths[slot] = 0
        return slot

    @property
    def free_slots(self) -> list[int]:
        return list(self._free)

    def take(self, slot: int) -> None:
        """Allocate this free slot (its entries and length are the caller's to set)."""
        self._free.remove(slot)

    def free(self, slot: int) -> None:
        self.lengths[slot] = 0
        self._free.append(slot)

    def truncate(self, slot: int, length: int) -> None:
        """Roll back: forget everything past `length` (no copy)."""
        assert 0 <= length <= self.lengths[slot], (length, self.lengths[slot])
        self.lengths[slot] = length

    def copy(self, source: int, dest: int) -> None:
        """dest gets source's cached tokens (a shared prompt prefilled once)."""
        n = self.lengths[source]
        for k, v in zip(self.k, self.v):
            k[dest, :, :n] = k[source, :, :n]
            v[dest, :, :n] = v[source, :, :n]
        self.lengths[dest] = n

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Store k/v [B, Hkv, T, D] at `positions` [B, T]; slots: [B], one per sequence, or [B, T], one
        per token (a packed batch holds several sequences in one row)."""
        slot_index = slots[:, None, None] if slots.dim() == 1 else slots[:, None, :]
        index = (slot_index, torch.arange(k.shape[1], device=k.device)[None, :, None], positions[:, None, :])
        self.k[layer][index] = k.to(self.k[layer].dtype)
        self.v[layer][index] = v.to(self.v[layer].dtype)

    def read(self, layer: int, slot_index, kv_len: int):
        """Keys/values [B, Hkv, kv_len, D] of the batch's slots, in the cache's dtype (a view when the
        slots are contiguous)."""
        return self.k[layer][slot_index, :, :kv_len], self.v[layer][slot_index, :, :kv_len]
