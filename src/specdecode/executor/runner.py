"""The executor seam: one `ModelRunner` per loaded model owns its weights, its KV cache and its forward.

The engine, the draft proposer, the start-up profile and the memory plan talk to runners only; a
backend (weight format, kernels, device) is chosen when the model is built and is invisible past here.

A slot's KV entries are written by `forward` but become context only when committed:
- `forward(slots, inputs)` runs each slot's new tokens after its committed length, taking KV blocks as needed;
- `commit(slot, n)` makes the first n tokens final (at most what forwards have written);
- `rollback(slot, n)` forgets everything past n (a pointer move, nothing is copied).
Blocks past a slot's length go back to the pool (kv_cache.py), so memory follows the tokens held.

With `reuse_prefixes`, computed blocks are found again by their tokens (prefix_index.py): `allocate(tokens,
scope)` starts a slot from the blocks of the same scope holding the longest prefix of `tokens`, the full ones
shared with whoever holds them (a running request with the same system prompt, the `n` samples of a prompt)
and a partly matching one copied (a finished turn's last block). Committed full blocks become findable at once,
a finished sequence's last block when it is freed. Scopes keep one tenant's blocks from shortening another's
prefill, which would tell them what the other sent. Blocks no slot holds stay findable until the pool needs
them, the one released longest ago first.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Callable, Hashable

import torch

from ..config import MAX_VERIFY_WIDTH as ROWWISE_ATTENTION_MAX_WIDTH
from ..errors import SpecDecodeError
from ..kv_cache import KVCache
from ..models.layers import SparseMoE, linear_layers
from ..models.runtime import Attention, ForwardBatch, Transformer
from ..prefix_index import Match, PrefixIndex
from ..sampling import SamplingParams
from ..sampling.per_row import kinds_of
from ..transfers import to_device
from .cpu import keep_freed_memory
from .cuda_graphs import BucketedForward, fuse_elementwise
from .draft_chain import DraftChain

log = logging.getLogger(__name__)

# A prompt longer than this is prefilled in forwards of this many tokens: its activations stay bounded whatever
# its length (a 32k-token prompt's MLP alone would hold gigabytes), and with the attention kernel the rows'
# results do not depend on the call they are in
PREFILL_CHUNK = 2048
CHUNKS_EVERY_PROMPT = {"cuda"}  # devices that prefill a long prompt in chunks even without the attention kernel
# devices where prompts of several lengths share a padded call (the padding's arithmetic costs less than a call's
# launches); elsewhere, without the attention kernel, only prompts of one length share a call
PADS_PROMPTS_TOGETHER = {"cuda"}
_UNSETTLED = -1  # a written position whose token id is still on the device
NO_ADAPTERS_AT_FIXED_SHAPES = "served LoRA adapters are computed in eager forwards: leave out fixed_shapes"


class ModelRunner:
    def __init__(
        self,
        model: Transformer,
        num_slots: int,
        max_len: int,
        reuse_prefixes: bool = False,
        num_blocks: int | None = None,
        fixed_shapes: bool | None = None,
    ):
        """num_slots sequences of at most max_len tokens over num_blocks KV blocks (default: enough for every
        slot at max_len; the memory plan sets fewer under a budget). fixed_shapes: decode and verify forwards
        at bucket shapes (executor/cuda_graphs.py), captured as CUDA graphs on a GPU; None: on a GPU, unless the
        model says it runs eagerly (`capture_graphs`) or its forward waits on the host (experts' routing)."""
        self.model = model
        if model.device.type == "cpu":
            keep_freed_memory()
        if model.device.type == "cuda":
            gpu_experts(model)  # before the choice of fixed shapes: with them, its forwards never wait on the host
        fixed_shapes = fixed_shapes_by_default(model) if fixed_shapes is None else fixed_shapes
        self._route = getattr(model, "adapter_route", None)  # a Transformer's with LoRA adapters (a head has none)
        if fixed_shapes and self._route is not None and len(self._route.sets) > 1:
            raise SpecDecodeError(NO_ADAPTERS_AT_FIXED_SHAPES)
        capture = fixed_shapes and model.device.type == "cuda"
        if capture:  # timed before the KV cache takes the device's memory
            gpu_linear_layers(model)
        self._cache = KVCache(
            model.cfg, num_slots, max_len, model.kv_dtype, model.device, num_blocks, scratch=fixed_shapes
        )
        self._fixed = BucketedForward(model, self._cache, capture=capture) if fixed_shapes else None
        attention = gpu_attention(model) if model.device.type == "cuda" else None  # eager calls' too
        if capture:
            fuse_elementwise(model)
            self._fixed.attention = attention
        self._rounds = None if self._fixed is None else DraftChain(self._fixed, model.vocab_ids, model.cfg.vocab_size)
        self._written = [0] * num_slots  # positions written by forwards, committed or not
        # where a forward queued on the device before the host knew where it starts (forward_after) may write up to:
        # the slot's blocks are kept that far until its rows are taken (wrote_again) or dropped
        self._queued_end: dict[int, int] = {}
        self.reuse_prefixes = reuse_prefixes
        self._tokens: list[list[int]] = [[] for _ in range(num_slots)]  # token ids of the written positions
        self._scope: list[Hashable | None] = [None] * num_slots  # None: the slot's blocks are never findable
        self._chain: list[list[int]] = [[] for _ in range(num_slots)]  # the prefix uid of each findable full block
        self._sets = [0] * num_slots  # each slot's adapter set (models/lora.py's AdapterRoute): 0, the model's own

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

    def graphs_captured(self) -> int:
        """How many graphs its forwards have captured so far (none without a GPU)."""
        return len(self._fixed.capture_seconds) if self._fixed is not None else 0

    def captured_kernels(self) -> str | None:
        """What the captured forwards run beside PyTorch's own operations (None where nothing is captured)."""
        if self._fixed is None or not self._fixed.capture:
            return None
        layers = linear_layers(self.model)
        attention = "PyTorch's SDPA" if self._fixed.attention is None else "the paged Triton kernels"
        kernels = [m.kernel for m in layers if m.kernel is not None]
        alone = sum(not getattr(k, "prologues", True) for k in kernels)
        rotating = sum(getattr(k, "rope_epilogue", False) for k in kernels)
        projections = sum(isinstance(m, Attention) for m in self.model.modules())
        said = [
            f"captured forwards: attention by {attention}",
            f"{len(kernels)} of {len(layers)} linear layers by the Triton kernel at up to 16 rows, the rest by cuBLAS "
            "(as timed at start-up)",
        ]
        if alone:
            said.append(f"{alone} of them without the norm or SwiGLU before them (their check failed)")
        if rotating:
            said.append(f"RoPE and the cache write in the kernel of {rotating} of {projections} QKV projections")
        grouped = sum(m.kernel is not None for m in self.model.modules() if isinstance(m, SparseMoE))
        if grouped:
            said.append(f"the experts of {grouped} mixture-of-experts layers by the grouped Triton kernels")
        return "; ".join(said)

    @property
    def num_free(self) -> int:
        return self._cache.num_free

    @property
    def max_len(self) -> int:
        return self._cache.max_len

    @property
    def num_blocks(self) -> int:
        return self._cache.num_blocks

    @property
    def block_size(self) -> int:
        return self._cache.block_size

    def blocks_in_use(self) -> int:
        """Distinct blocks held by slots in use (blocks only the prefix index holds not counted: they are spare)."""
        return self._cache.blocks_in_use()

    def blocks_held(self, slot: int) -> int:
        """Blocks in the slot's table, its own and shared."""
        return len(self._cache.tables[slot])

    def allocate(self, tokens: list[int] | None = None, scope: Hashable = "", adapter: str = "") -> int:
        """A free slot. With reuse_prefixes and the tokens it will hold: starting from the computed blocks of
        `scope` that hold the longest prefix of them (`length` says how long; the last token is always left to
        compute, for its logits). adapter: the served LoRA adapter its forwards compute with ("": none); its
        blocks are found by the slots of that adapter only."""
        set_index = self._adapter_set(adapter)
        slot = self._cache.allocate()
        self._sets[slot] = set_index
        self._start(slot, tokens, _scoped(scope, set_index), len(tokens) - 1 if tokens else 0)
        return slot

    @property
    def adapters(self) -> list[str]:
        """The served LoRA adapters' names, which requests give to compute with one."""
        return [] if self._route is None else [name for name in self._route.sets if name]

    def check_adapter(self, adapter: str) -> None:
        """Refuses an adapter no slot could compute with."""
        self._adapter_set(adapter)

    def adapter_set(self, slot: int) -> int:
        """The adapter set the slot's forwards compute with."""
        return self._sets[slot]

    def adapters_may_change(self) -> None:
        """Refuses adapters served at run time where forwards run at fixed shapes (they take no adapters)."""
        if self._fixed is not None:
            raise SpecDecodeError(NO_ADAPTERS_AT_FIXED_SHAPES)

    def adapters_changed(self) -> None:
        """The model's served adapters were loaded or unloaded (engine/adapters.py): read its route again."""
        self._route = getattr(self.model, "adapter_route", None)

    def _adapter_set(self, adapter: str) -> int:
        if not adapter:
            return 0
        if self._route is None:
            raise SpecDecodeError(f"the LoRA adapter {adapter!r} is not served: this model has no served adapters")
        return self._route.set_of(adapter)

    def take(self, slot: int, tokens: list[int], scope: Hashable, limit: int) -> int:
        """This free slot, for a model whose slots follow another runner's, starting as allocate() does from at
        most `limit` of `tokens`; how many positions it starts from."""
        self._cache.take(slot)
        self._cache.truncate(slot, 0)
        return self._start(slot, tokens, scope, limit)

    def _start(self, slot: int, tokens: list[int] | None, scope: Hashable, limit: int) -> int:
        found = self._cache.index.match(scope, tokens, limit) if self.reuse_prefixes and tokens else Match()
        self._cache.share(slot, (entry.block for entry in found.shared))
        if found.partial is not None:
            self._cache.append_copy(slot, found.partial.block)
        n = found.length(self.block_size)
        self._scope[slot], self._chain[slot] = scope, [entry.uid for entry in found.shared]
        self._tokens[slot] = list(tokens[:n]) if n else []
        self._cache.lengths[slot] = self._written[slot] = n
        return n

    def cached_prefix(self, tokens: list[int], scope: Hashable = "", adapter: str = "") -> int:
        """How many of `tokens` allocate(tokens, scope, adapter) would find computed already."""
        if not self.reuse_prefixes or not tokens:
            return 0
        scope = _scoped(scope, self._adapter_set(adapter))
        return self._cache.index.match(scope, tokens, len(tokens) - 1).length(self.block_size)

    def free(self, slot: int) -> None:
        """The slot's blocks go back, its last one findable too (a next turn continues from it)."""
        self._queued_end.pop(slot, None)
        self._publish(slot, self._cache.lengths[slot], last=True)
        self._cache.free(slot)
        self._written[slot] = self._sets[slot] = 0
        self._tokens[slot], self._chain[slot], self._scope[slot] = [], [], None

    def _publish(self, slot: int, length: int, last: bool = False) -> None:
        """The slot's full blocks within its first `length` positions become findable (and, with `last`, the
        block they end in), each under the prefix before it."""
        if not self.reuse_prefixes or self._scope[slot] is None:
            return
        size, chain, tokens = self.block_size, self._chain[slot], self._tokens[slot]
        ends = [(i + 1) * size for i in range(len(chain), length // size)]
        if last and length % size and len(chain) == length // size:
            ends.append(length)
        for end in ends:
            parent = chain[-1] if chain else PrefixIndex.root(self._scope[slot])
            begin = len(chain) * size
            held = tuple(tokens[begin:end])
            if _UNSETTLED in held:  # findable once its ids are back from the device (a later commit publishes it)
                break
            uid = self._cache.index.register(parent, held, self._cache.tables[slot][len(chain)])
            if end - begin == size:
                chain.append(uid)

    def forget_prefixes(self) -> None:
        """No computed block is found again from now on (until more are committed)."""
        self._cache.forget_registered()
        for chain in self._chain:
            chain.clear()

    def length(self, slot: int) -> int:
        """Committed tokens of the slot: the context its next forward continues."""
        return self._cache.lengths[slot]

    def commit(self, slot: int, length: int) -> None:
        """The slot's first `length` tokens are final; entries written past them are dropped (their blocks kept
        where a forward queued on the device writes: `queued_end`)."""
        if not self._cache.lengths[slot] <= length <= self._written[slot]:
            raise ValueError(
                f"slot {slot}: cannot commit {length} tokens (committed "
                f"{self._cache.lengths[slot]}, written {self._written[slot]})"
            )
        self._cut(slot, length, hold=self.queued_end(slot))
        self._publish(slot, length)

    def rollback(self, slot: int, length: int) -> None:
        """Forget everything past `length` tokens (a forward queued past them too)."""
        self._queued_end.pop(slot, None)
        self._cut(slot, length, forget=True)

    def queued_end(self, slot: int) -> int:
        """Where a forward queued on the device (forward_after), neither taken nor dropped yet, may write up to in
        the slot (0: none)."""
        return self._queued_end.get(slot, 0)

    def drop_queued(self, slot: int) -> None:
        """The forward queued for the slot will not be taken: its blocks go with the slot's next commit or forward."""
        self._queued_end.pop(slot, None)

    def _cut(self, slot: int, length: int, forget: bool = False, hold: int = 0) -> None:
        self._cache.truncate(slot, length, forget, hold)
        self._written[slot] = length
        del self._tokens[slot][length:]
        del self._chain[slot][length // self.block_size :]

    def copy_slot(self, source: int, dest: int) -> None:
        """dest continues from source's committed tokens (n outputs of one prompt share its prefill, and its
        full blocks)."""
        self._cache.copy(source, dest)
        n = self._written[dest] = self._cache.lengths[dest]
        self._tokens[dest] = self._tokens[source][:n]
        self._scope[dest], self._sets[dest] = self._scope[source], self._sets[source]
        self._chain[dest] = self._chain[source][: n // self.block_size]

    def assume_cached(self, slot: int, length: int) -> None:
        """Treat `length` positions as context without computing them: for timing forwards, where the
        cost does not depend on what the cache holds (no token matches them later)."""
        self._cache.reserve(slot, length)
        self._cache.lengths[slot] = self._written[slot] = length
        self._tokens[slot], self._scope[slot] = [_UNSETTLED] * length, None

    # ---- the forward -----------------------------------------------------------------------------------
    def forward(
        self,
        slots: list[int],
        inputs: list[list[int]],
        logits: str | list[int] = "last",
        hidden: bool | str = False,
        features: list[torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run new tokens (a different number per sequence) after each slot's committed tokens.

        logits: "last" (the last new token of each sequence), "all" (every new token), or per sequence how many of its
        last new tokens (only where the call packs any width), flat in sequence order. With hidden=True also the final
        hidden states (before the last norm) of the same rows, with hidden="all" of every new token, for proposers that
        draft from the target's features. features: per sequence, one input feature row per new token, for a model that
        reads them beside the tokens (a draft head)."""
        if isinstance(logits, list):
            if not self.packs_any_width:
                raise ValueError("logits per sequence need a call that packs any width (the attention kernel)")
            return self._forward_call(slots, inputs, logits, hidden, features)
        pads, lengths = self.device.type in PADS_PROMPTS_TOGETHER, [len(tokens) for tokens in inputs]
        ends = [self._cache.lengths[slot] + n for slot, n in zip(slots, lengths)]
        fixed = self._fixed is not None and (features is None or self._fixed.reads_features)
        serves = self._fixed.serves if fixed else None  # the calls it serves replay a graph
        calls = forward_calls(lengths, self._rowwise_width(), PREFILL_CHUNK, pads, ends, serves)
        if len(calls) > 1:
            return self._forward_apart(calls, slots, inputs, logits, hidden, features)
        return self._forward_one(slots, inputs, logits, hidden, features)

    def _forward_one(self, slots, inputs, logits, hidden, features):
        """One call, or a long input's chunks where the device prefills in chunks."""
        chunked = self.packs_any_width or self.device.type in CHUNKS_EVERY_PROMPT
        if len(inputs) == 1 and len(inputs[0]) > PREFILL_CHUNK and chunked:
            return self._forward_in_chunks(slots[0], inputs[0], logits, hidden, features)
        return self._forward_call(slots, inputs, logits, hidden, features)

    def forward_picked(
        self,
        slots: list[int],
        picked: torch.Tensor,
        widths: list[int] | None = None,
        first: list[int] | None = None,
        features: list[torch.Tensor] | None = None,
        **outputs,
    ):
        """Each slot's new tokens read where the device holds them, so that this forward is queued before they reach
        the host: `picked` [n, w], slot i's tokens the first widths[i] (default 1) of its row (tokens a step picked,
        drafts a drafter left there), or with `first` (a token per slot, from the host) its widths[i] - 1 after that
        one. Their rows are written; the runner learns the picked ids from `settle` before they are committed.
        outputs: `logits` and `hidden` as for forward (default: the logits of each last row); `features` as for
        forward, or a tensor [n, w, width] of as many rows each."""
        widths = widths or [1] * len(slots)
        known = [[] for _ in slots] if first is None else [[token] for token in first]
        at = len(known[0])
        if max(widths) > self._rowwise_width() or picked.shape[1] < max(widths) - at:
            raise ValueError(f"picked tokens: {max(widths) - at} a sequence, of {picked.shape[1]} given")
        inputs = [ids + [_UNSETTLED] * (w - at) for ids, w in zip(known, widths)]
        logits, hidden = outputs.get("logits", "last"), outputs.get("hidden", False)
        return self._forward_call(slots, inputs, logits, hidden, features, picked=(picked, at))

    def forward_after(self, slots, starts, picked: torch.Tensor, offsets: torch.Tensor, reach: int, **outputs):
        """A forward queued before the host knows where it starts: slot i's picked.shape[1] tokens (on the device)
        from starts[i] + offsets[i] on (offsets [n] on the device, each at most `reach`), at fixed shapes; None where
        none serves (an eager forward's rows are placed by the host). Its rows are written and not committed, their
        blocks kept (`queued_end`) until the caller says which ids they hold, once it knows where they are
        (`wrote_again`), or drops them (`drop_queued`). outputs as forward_picked's."""
        width = picked.shape[1]
        if self._fixed is None or any(s + reach + width > self.max_len for s in starts):
            return None
        for slot, start in zip(slots, starts):
            self._cache.reserve(slot, start + reach + width)
        inputs = [[_UNSETTLED] * width for _ in slots]
        logits, hidden = outputs.get("logits", "last"), outputs.get("hidden", False)
        out = self._fixed(slots, starts, inputs, logits, hidden, None, picked, 0, offsets, reach)
        if out is not None:
            self._queued_end.update((slot, start + reach + width) for slot, start in zip(slots, starts))
        return out

    def wrote_again(self, slot: int, start: int, tokens: list[int], end: int) -> None:
        """The slot's rows from `start` hold these ids (written again, whatever the runner held for them), and those
        after them up to `end` are written, their ids to be settled: a queued forward's rows, taken."""
        self._queued_end.pop(slot, None)
        self._wrote(slot, start, list(tokens) + [_UNSETTLED] * (end - start - len(tokens)))

    def settle(self, slot: int, position: int, tokens: list[int]) -> None:
        """The token ids a forward_picked (or chained drafting) wrote from `position` of the slot, now on the host."""
        held = self._tokens[slot][position : position + len(tokens)]
        if held != [_UNSETTLED] * len(tokens):
            raise ValueError(f"slot {slot}: positions from {position} hold tokens {held} already")
        self._tokens[slot][position : position + len(tokens)] = tokens

    def _forward_in_chunks(self, slot: int, tokens: list[int], logits, hidden, features):
        """One sequence's long input in forwards of PREFILL_CHUNK tokens, each after the ones before: the same
        rows as one call where every row is attended alone (the attention kernel), in bounded memory (on a GPU, where
        a whole prompt's masked attention would hold [heads, T, T] scores, the rows' last bits those of the chunks)."""
        start, outs = self._cache.lengths[slot], []
        for at in range(0, len(tokens), PREFILL_CHUNK):
            last = at + PREFILL_CHUNK >= len(tokens)
            part = None if features is None else [features[0][at : at + PREFILL_CHUNK]]
            out = self._forward_call([slot], [tokens[at : at + PREFILL_CHUNK]], logits, hidden, part, [start + at])
            if logits == "all" or last:
                outs.append(out if isinstance(out, tuple) else (out,))
            elif hidden == "all":  # every row's hidden state, the logits of the last only
                outs.append((out[0][:0], out[1]))
        joined = [torch.cat([o[k] for o in outs]) for k in range(len(outs[0]))]
        return joined[0] if len(joined) == 1 else tuple(joined)

    def _forward_apart(self, calls: list[list[int]], slots, inputs, logits, hidden, features):
        """The sequences in the calls `forward_calls` chose (each a list of their indices); the outputs come back in
        sequence order, as from one call."""
        parts: list[list[torch.Tensor]] = [[] for _ in inputs]  # per sequence: its logits (and hidden) rows
        for group in calls:
            out = self._forward_one(
                [slots[i] for i in group],
                [inputs[i] for i in group],
                logits,
                hidden,
                None if features is None else [features[i] for i in group],
            )
            lengths = [len(inputs[i]) for i in group]
            for tensor in out if isinstance(out, tuple) else (out,):
                # a row per new token or a row per sequence (the two agree when every input is one token)
                counts = lengths if tensor.shape[0] == sum(lengths) else [1] * len(group)
                for i, rows in zip(group, tensor.split(counts)):
                    parts[i].append(rows)
        joined = [torch.cat([p[k] for p in parts]) for k in range(len(parts[0]))]
        return joined[0] if len(joined) == 1 else tuple(joined)

    def _forward_call(self, slots, inputs, logits, hidden, features, starts: list[int] | None = None, picked=None):
        """One forward; starts: where each sequence's new tokens begin (default: after its committed ones); picked:
        (tokens, at), each sequence's new tokens from the at-th on, on the device, read in place of its inputs
        (forward_picked)."""
        starts = starts or [self._cache.lengths[s] for s in slots]
        lengths = [len(t) for t in inputs]
        if any(s + n > self.max_len for s, n in zip(starts, lengths)):
            raise ValueError(f"a forward would pass the context of {self.max_len} tokens")
        for slot, start, n in zip(slots, starts, lengths):
            self._queued_end.pop(slot, None)  # a forward queued before, not taken: this one writes in its place
            self._cache.reserve(slot, start + n)
        out = None
        if self._fixed is not None and isinstance(logits, str) and (features is None or self._fixed.reads_features):
            out = self._fixed(slots, starts, inputs, logits, hidden, features, *picked or ())
        if out is None:
            sets = None if self._route is None else [self._sets[s] for s in slots]
            batch = ForwardBatch.build(
                slots, starts, lengths, self.max_len, self.device, logits, self._rowwise_width(), sets
            )
            rows = self._on_device(inputs)
            if picked is not None:
                tokens, at = picked
                rows = [torch.cat([row[:at], mine[: len(row) - at]]) for row, mine in zip(rows, tokens)]
            tokens = self._batched(batch, rows)
            extra = {} if features is None else {"features": self._batched(batch, features)}
            out = self.model(tokens, batch, self._cache, return_hidden=hidden, **extra)
        for slot, start, new in zip(slots, starts, inputs):
            self._wrote(slot, start, new)
        return out

    def _on_device(self, inputs) -> list[torch.Tensor]:
        """Each sequence's new tokens on the device: lists of ids in one copy queued behind the device's work (a copy
        each would wait for the device once each)."""
        if not all(isinstance(t, list | tuple) for t in inputs):
            return [torch.as_tensor(t, dtype=torch.long, device=self.device) for t in inputs]
        return list(to_device([i for t in inputs for i in t], self.device).split([len(t) for t in inputs]))

    def _wrote(self, slot: int, start: int, tokens) -> None:
        """A forward wrote these tokens' rows from `start` on (written, not committed)."""
        self._written[slot] = start + len(tokens)
        del self._tokens[slot][start:]
        self._tokens[slot].extend(int(t) for t in tokens)

    def chained_rounds(
        self,
        slots: list[int],
        logits: torch.Tensor,
        features: torch.Tensor | None,
        rounds: list[int],
        sampling: tuple[list[SamplingParams], torch.Tensor] | None = None,
        after: tuple[list[int], torch.Tensor, int] | None = None,
    ):
        """Drafting after a round whose `logits` (a row per slot) the caller has: each slot's draft from them and
        rounds[i] more, each round reading the draft before it (and, for a draft head, the features it estimated:
        `features`), chained on the device (executor/draft_chain.py). Greedy, or where `sampling` gives each slot's
        settings and its uniforms [n, max(rounds) + 1], greedy or sampled a row by its settings. The drafts (target
        ids), the drafter's probability of each, [n, max(rounds) + 1] on the device, slot i's the first rounds[i] + 1,
        and where sampled each draft's distribution [n, max(rounds) + 1, V] (else None): nothing waits for them, and
        the next chained drafting overwrites them. The rounds' rows are written, not committed, their ids settled once
        read (`settle`). None where the rounds do not chain (no fixed shapes, no bucket): the caller drafts round by
        round. after: (starts, offsets, reach), rounds that start where the device says, at starts[i] + offsets[i]
        (offsets [n] on the device, each at most `reach`), in place of each slot's committed length: drafting queued
        before the host knows how many drafts the verify before it kept."""
        starts, offsets, reach = after or ([self._cache.lengths[s] for s in slots], None, 0)
        if self._rounds is None or any(s + reach + r > self.max_len for s, r in zip(starts, rounds)):
            return None
        kinds = None if sampling is None else kinds_of(sampling[0], self.cfg.vocab_size)
        chain = self._rounds.prepare([s + reach for s in starts], rounds, kinds)
        if chain is None:
            return None
        for slot, start, r in zip(slots, starts, rounds):
            self._cache.reserve(slot, start + reach + r)
        drafts = self._rounds.run(chain, slots, starts, logits, features, rounds, sampling, offsets)
        for slot, start, r in zip(slots, starts, rounds):
            self._wrote(slot, start, [_UNSETTLED] * (reach + r))  # its r chained rounds read its drafts before the last
        return drafts

    @property
    def replays_graphs(self) -> bool:
        """Whether decode forwards replay CUDA graphs: queued with one launch, they run while the host goes on."""
        return self._fixed is not None and self._fixed.capture

    @property
    def packs_any_width(self) -> bool:
        """Whether one call takes sequences of any lengths side by side, each row attended over its own keys: a
        prompt's chunk can then ride in a verify's call, sharing its read of the weights."""
        return math.isinf(self._rowwise_width())

    def _rowwise_width(self) -> float:
        """The widest call attended row by row over exactly each token's keys: what the model's attention kernel
        takes (the CPU's any: a prompt's rows then get the bits decoding them would, so a prompt continued from a
        kept prefix computes what a whole prefill does); else ROWWISE_ATTENTION_MAX_WIDTH (PyTorch's row-by-row
        path costs a call per token)."""
        kernel = getattr(self.model.layers[0].self_attn, "rowwise_kernel", None)
        return ROWWISE_ATTENTION_MAX_WIDTH if kernel is None else kernel.max_width

    @staticmethod
    def _batched(batch: ForwardBatch, rows: list[torch.Tensor]) -> torch.Tensor:
        """Per-sequence tensors as the forward takes them: side by side in one row when the batch is
        packed ([1, N, ...]), else right-padded with zeros to the longest ([B, width, ...])."""
        if batch.packed:
            return torch.cat(rows)[None]
        return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)


def _scoped(scope: Hashable, adapter_set: int) -> Hashable:
    """The prefix index's scope of a slot: its KV entries differ by the adapter set its forwards compute with (a
    set's number is never another adapter's, even after it is unloaded)."""
    return (scope, "lora", adapter_set) if adapter_set else scope


def forward_calls(
    lengths: list[int],
    rowwise_width: float,
    most_rows: int,
    pads: bool,
    ends: list[int] | None = None,
    serves: Callable[[list[int], int], bool] | None = None,
) -> list[list[int]]:
    """Which sequences (indices into `lengths`, their new tokens) share a forward, in as few calls as hold at most
    `most_rows` rows each (padding counted; one sequence longer than that goes alone, to be chunked): where the
    call packs any width (`rowwise_width` infinite), side by side in order; else those of at most `rowwise_width`
    packed together and the longer ones in padded calls, by length (the least padding), of several lengths where
    the device `pads` and else of one. A padded call gathers each sequence's keys to the furthest end (`ends`:
    start + new tokens): no more in all than `most_rows` or the furthest one alone would. Where fixed-shape forwards
    serve calls (`serves(lengths, furthest end)`: a graph's replay), the short ones are packed only as far as one
    serves them: an eager call launches each of its kernels from Python (those no fixed shape serves share one)."""
    every, ends = list(range(len(lengths))), ends or lengths

    def packed(call: list[int], i: int) -> bool:
        return sum(lengths[j] for j in call) + lengths[i] <= most_rows

    if math.isinf(rowwise_width):
        return [every] if sum(lengths) <= most_rows else _filled(every, packed)

    def served(call: list[int], i: int) -> bool:  # grows while it replays a graph, or while it runs eagerly anyway
        def fits(part: list[int]) -> bool:
            return serves([lengths[j] for j in part], max(ends[j] for j in part))

        return packed(call, i) and (fits([*call, i]) or not fits(call))

    short = [i for i in every if lengths[i] <= rowwise_width]
    if len(short) == len(every) and sum(lengths) <= most_rows and (serves is None or serves(lengths, max(ends))):
        return [every]  # a decode or verify step
    most_keys = max(most_rows, max(ends))

    def padded(call: list[int], i: int) -> bool:
        both = [*call, i]
        rows, keys = (len(both) * max(sizes[j] for j in both) for sizes in (lengths, ends))
        return rows <= most_rows and keys <= most_keys and (pads or lengths[i] == lengths[call[0]])

    long = sorted((i for i in every if lengths[i] > rowwise_width), key=lengths.__getitem__)
    return _filled(long, padded) + _filled(short, packed if serves is None else served)


def _filled(order: list[int], fits) -> list[list[int]]:
    """`order` cut into consecutive calls, each growing while `fits(call, next)`."""
    calls: list[list[int]] = []
    for i in order:
        if calls and fits(calls[-1], i):
            calls[-1].append(i)
        else:
            calls.append([i])
    return calls


def fixed_shapes_by_default(model: Transformer) -> bool:
    """Graphs on a GPU, for a model that has not been told to run eagerly and whose forward never waits on the
    host."""
    return model.device.type == "cuda" and getattr(model, "capture_graphs", False) and not waits_on_host(model)


def waits_on_host(model) -> bool:
    """Whether the model's forward waits on the host: a mixture of experts whose layers group their rows by expert
    there (PyTorch's path; the GPU's kernels, executor/grouped_experts.py, group them on the device)."""
    return any(isinstance(m, SparseMoE) and m.kernel is None for m in model.modules())


EXPERTS_CHOICE = "SPECDECODE_GPU_EXPERTS"  # "triton" (the default) or "pytorch"


def gpu_experts(model) -> int:
    """A GPU model's mixture-of-experts layers by the grouped Triton kernels, unless SPECDECODE_GPU_EXPERTS=pytorch,
    Triton is missing, or they fail their check on this device (their forwards then wait on the host and run
    eagerly). Layers that have them keep them. Returns how many layers have them."""
    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    choice = os.environ.get(EXPERTS_CHOICE, "triton")
    if choice not in ("triton", "pytorch"):
        raise ValueError(f"{EXPERTS_CHOICE} is 'triton' or 'pytorch', not {choice!r}")
    if choice == "pytorch" or not layers or layers[0].kernel is not None:
        return sum(m.kernel is not None for m in layers)
    try:
        from .grouped_experts import attach_grouped_experts
    except ImportError as e:
        log.warning("mixture-of-experts layers keep PyTorch's path, whose forwards wait on the host: %s", e)
        return 0
    return attach_grouped_experts(model)


ATTENTION_CHOICE = "SPECDECODE_GPU_ATTENTION"  # "triton" (the default) or "sdpa"


def gpu_attention(model):
    """The attention of the model's captured forwards: the paged Triton kernels (executor/paged_attention.py), unless
    SPECDECODE_GPU_ATTENTION=sdpa, Triton is missing, or the kernels fail their check on this device: then None
    (PyTorch's gather and SDPA), as for a model with attention sinks. Where they are taken, they attend its packed
    eager calls too (paged_rows.py)."""
    choice = os.environ.get(ATTENTION_CHOICE, "triton")
    if choice not in ("triton", "sdpa"):
        raise ValueError(f"{ATTENTION_CHOICE} is 'triton' or 'sdpa', not {choice!r}")
    if model.cfg.attention_sinks:  # the kernels' softmax has no term outside the keys (gpt-oss's sinks)
        return None
    attention = _checked_kernels(str(model.device), model.dtype, model.cfg.dim_per_head) if choice == "triton" else None
    if attention is not None:
        from .paged_attention import attach_epilogues
        from .paged_rows import attach_packed_row_attention

        attach_epilogues(model)
        attach_packed_row_attention(model, attention)
    return attention


def gpu_linear_layers(model) -> dict:
    """Each linear layer's kernel in captured forwards at a few rows, chosen by timing on this device
    (executor/gemv.py); cuBLAS where Triton is missing. Returns the timings by layer shape."""
    try:
        from .gemv import attach_gemv
    except ImportError as e:
        log.warning("linear layers in captured forwards stay cuBLAS's: %s", e)
        return {}
    return attach_gemv(model)


@functools.cache  # one check a process for each device, type and head size: a target and its draft share it
def _checked_kernels(device: str, dtype: torch.dtype, head_dim: int):
    try:
        from .paged_attention import checked_paged_attention
    except ImportError as e:
        log.warning("attention in captured forwards stays PyTorch's: %s", e)
        return None
    return checked_paged_attention(device, dtype, head_dim)
