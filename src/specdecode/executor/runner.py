"""The executor seam: one `ModelRunner` per loaded model owns its weights, its KV cache and its forward.

The engine, the draft proposer, the start-up profile and the memory plan talk to runners only; a
backend (weight format, kernels, device) is chosen when the model is built and is invisible past here.

A slot's KV entries are written by `forward` but become context only when committed:
- `forward(slots, inputs)` runs each slot's new tokens after its committed length;
- `commit(slot, n)` makes the first n tokens final (at most what forwards have written);
- `rollback(slot, n)` forgets everything past n (a pointer move, nothing is copied).
"""
from __future__ import annotations

import torch

from ..kv_cache import KVCache
from ..models.runtime import ForwardBatch, Transformer
from .cpu import keep_freed_memory


class ModelRunner:
    def __init__(self, model: Transformer, num_slots: int, max_len: int):
        self.model = model
        if model.device.type == "cpu":
            keep_freed_memory()
        self._cache = KVCache(model.cfg, num_slots, max_len, model.kv_dtype, model.device)
        self._written = [0] * num_slots  # positions written by forwards, committed or not

    # ---- what the model is ----------------------------------------------------------------------
    @property
    def cfg(self):
        return self.model.cfg

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def vocab_ids(self) -> torch.Tensor | None:
        """Token ids of the logits' columns when the LM head covers a vocabulary subset (else None)."""
        return self.model.vocab_ids

    @property
    def num_slots(self) -> int:
        return self._cache.num_slots

    @property
    def num_free(self) -> int:
        return self._cache.num_free

    @property
    def max_len(self) -> int:
        return self._cache.max_len

    def allocate(self) -> int:
        slot = self._cache.allocate()
        self._written[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        self._cache.free(slot)
        self._written[slot] = 0

    def length(self, slot: int) -> int:
        """Committed tokens of the slot: the context its next forward continues."""
        return self._cache.lengths[slot]

    def commit(self, slot: int, length: int) -> None:
        """The slot's first `length` tokens are final; entries written past them are dropped."""
        if not self._cache.lengths[slot] <= length <= self._written[slot]:
            raise ValueError(f"slot {slot}: cannot commit {length} tokens (committed "
                             f"{self._cache.lengths[slot]}, written {self._written[slot]})")
        self._cache.lengths[slot] = self._written[slot] = length

    def rollback(self, slot: int, length: int) -> None:
        """Forget everything past `length` tokens."""
        self._cache.truncate(slot, length)
        self._written[slot] = length

    def copy_slot(self, source: int, dest: int) -> None:
        """dest continues from source's committed tokens (n outputs of one prompt share its prefill)."""
        self._cache.copy(source, dest)
        self._written[dest] = self._cache.lengths[dest]

    def assume_cached(self, slot: int, length: int) -> None:
        """Treat `length` positions as context without computing them: for timing forwards, where the
        cost does not depend on what the cache holds."""
        self._cache.lengths[slot] = self._written[slot] = length

    # ---- the forward -----------------------------------------------------------------------------------
    def forward(self, slots: list[int], inputs: list[list[int]], logits: str = "last", hidden: bool | str = False,
                features: list[torch.Tensor] | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run new tokens (a different number per sequence) after each slot's committed tokens.

        logits: "last" (the last new token of each sequence) or "all" (every new token), flat in
        sequence order. With hidden=True also the final hidden states (before the last norm) of the
        same rows, with hidden="all" of every new token, for proposers that draft from the target's
        features. features: per sequence, one input feature row per new token, for a model that reads
        them beside the tokens (a draft head)."""
        starts, lengths = [self._cache.lengths[s] for s in slots], [len(t) for t in inputs]
        if any(s + n > self.max_len for s, n in zip(starts, lengths)):
            raise ValueError(f"a forward would pass the context of {self.max_len} tokens")
        batch = ForwardBatch.build(slots, starts, lengths, self.max_len, self.device, logits=logits)
        tokens = self._batched(batch, [torch.tensor(t, dtype=torch.long, device=self.device) for t in inputs])
        extra = {} if features is None else {"features": self._batched(batch, features)}
        out = self.model(tokens, batch, self._cache, return_hidden=hidden, **extra)
        for slot, start, n in zip(slots, starts, lengths):
            self._written[slot] = start + n
        return out

    @staticmethod
    def _batched(batch: ForwardBatch, rows: list[torch.Tensor]) -> torch.Tensor:
        """Per-sequence tensors as the forward takes them: side by side in one row when the batch is
        packed ([1, N, ...]), else right-padded with zeros to the longest ([B, width, ...])."""
        if batch.packed:
            return torch.cat(rows)[None]
        return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
