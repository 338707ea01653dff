"""Decode and verify forwards at fixed shapes, replayed as CUDA graphs.

On a GPU a small model's decode step is bound by kernel launches, not bytes: each of the 1.5B's ~850 kernels launched
from Python costs more than the bytes it reads (docs/decisions.md#cuda-tests). A CUDA graph replays
a whole captured forward with one launch, but fixes every shape. So a forward runs at the shape of a bucket: B sequences
of R new tokens each, attending over K key positions, each rounded up. Padding rows write their keys into a scratch KV
block that no sequence holds, and their outputs are dropped. A forward outside every bucket (a prompt, a context past
the largest K, a model whose forward waits on the host, like a mixture of experts' routing) runs eagerly, as before.
On a GPU a bucket's attention is two Triton kernels that read the KV blocks in place (executor/paged_attention.py),
where they pass their check at start-up; else PyTorch's gather and SDPA.

The same fixed-shape forward runs without capture on a CPU, where the tests check it against the eager one.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import MAX_VERIFY_WIDTH
from ..kv_cache import KVCache
from ..models.draft_head import DraftHead
from ..models.layers import MLP, RMSNorm, RotaryEmbedding, apply_rope, attention, head_sinks, rope_tables
from ..models.runtime import Attention
from ..transfers import copy_into, to_device

log = logging.getLogger(__name__)


def _unfit_kernel_errors() -> tuple[type[Exception], ...]:
    """What Triton raises for a kernel this device cannot hold (more shared memory than a program may have, a
    register count ptxas refuses) or its compiler cannot build for it (an architecture whose instructions a kernel's
    code does not map onto): a configuration or a capture meeting it goes without that kernel, as Triton's own
    autotuner drops such configurations."""
    try:
        from triton.compiler.errors import CompilationError
        from triton.runtime.errors import OutOfResources, PTXASError
    except ImportError:  # no Triton: no kernel of ours runs
        return ()
    return OutOfResources, PTXASError, CompilationError


UNFIT_KERNEL = _unfit_kernel_errors()
# what a forward's capture meets where it cannot be captured (it waits on the host) or its kernels do not fit
UNCAPTURABLE = (RuntimeError, *UNFIT_KERNEL)

MIN_KEYS = 256  # the smallest K bucket: below it a step's attention costs next to nothing either way
MAX_SEQS = 256
MAX_TOKENS = 1024  # B x R: the largest verify call a graph is kept for
# B x K: keys gathered per layer and step (each sequence's blocks are copied into one [K, D] run per KV head);
# past this an eager forward gathers only what each sequence holds
MAX_GATHERED_KEYS = 64 * 4096
# Partial sums a call of the paged attention kernels holds at most, in rows x splits (each a query head's float32
# sums): what 512-key splits held in the largest buckets (64 rows a sequence x MAX_GATHERED_KEYS). Where more would
# be held (verifies of many rows over long contexts) the call's splits widen, and its rows' bits are then those of
# its size (executor/paged_attention.py).
MAX_PARTIALS = 64 * MAX_GATHERED_KEYS // 512


@dataclass(frozen=True)
class Bucket:
    seqs: int  # B
    rows: int  # R new tokens per sequence
    keys: int  # K key positions each sequence attends over
    last_logits: bool = False  # logits of each sequence's last row alone (prompts), not of every row (verifies)


def _at_least(n: int) -> int:
    """The smallest power of two >= n."""
    return 1 << max(0, n - 1).bit_length()


# Rows of outputs (each row's float32 logits and hidden state) the captured graphs keep at most: a graph's outputs are
# its own, so a server meeting many shapes would otherwise hold every one it met; past this the least recently
# replayed graphs are let go, captured again if met again. Four times the widest bucket: about two key lengths' worth
# of every bucket of up to 64 sequences of up to 8 rows.
KEPT_OUTPUT_ROWS = 4 * MAX_TOKENS


def kept_output_bytes(model, max_seqs: int, max_keys: int) -> int:
    """The most the model's captured graphs hold in outputs with this many sequences and key positions: every bucket's
    they may meet, or KEPT_OUTPUT_ROWS rows where that is less (what the memory plan reserves)."""
    columns = model.cfg.vocab_size if model.vocab_ids is None else len(model.vocab_ids)
    row = 4 * columns + model.cfg.hidden_size * model.dtype.itemsize
    key_lengths = (_at_least(max_keys) // MIN_KEYS).bit_length() or 1
    seqs = [1 << i for i in range(_at_least(min(max_seqs, MAX_SEQS)).bit_length())]
    widths = [1 << i for i in range(MAX_VERIFY_WIDTH.bit_length())]
    rows = key_lengths * sum(b * r for b in seqs for r in widths if b * r <= MAX_TOKENS)
    return min(rows, KEPT_OUTPUT_ROWS) * row


def bucket_for(num_new: list[int], kv_len: int, max_keys: int, logits: str = "all") -> Bucket | None:
    """The bucket a forward of these sequences runs in, or None where it runs eagerly. max_keys: the most key
    positions a sequence's block table reaches. logits: "last" where the caller keeps each sequence's last row's
    alone (a bucket of one row a sequence serves both)."""
    keys = min(max(MIN_KEYS, _at_least(kv_len)), max_keys)
    rows = _at_least(max(num_new))
    bucket = Bucket(_at_least(len(num_new)), rows, keys, last_logits=logits == "last" and rows > 1)
    fits = (
        kv_len <= keys
        and bucket.seqs <= MAX_SEQS
        and bucket.rows <= MAX_VERIFY_WIDTH
        and bucket.seqs * bucket.rows <= MAX_TOKENS
        and bucket.seqs * bucket.keys <= MAX_GATHERED_KEYS
    )
    return bucket if fits else None


class StaticBatch:
    """A ForwardBatch's part for one bucket, in tensors whose addresses never change (a graph reads them): the
    tokens, positions and KV slot of every row ([B, R]) and each sequence's slot ([B]), in one buffer filled by
    one copy a step; for a model that reads the target's features beside the tokens (a draft head), those too
    ([B, R, width])."""

    rowwise = None
    logit_rows = None  # every row's logits: the caller keeps the rows it asked for
    paged_attention = None  # set: attention by it (executor/paged_attention.py), not by store / load / attend
    rope = None  # set: the rows' RoPE tables, made beforehand (with_rows)
    real = None  # padding rows write the scratch block

    def __init__(self, bucket: Bucket, device, features: tuple[int, torch.dtype] | None = None):
        self.bucket, self.kv_len = bucket, bucket.keys
        self.features = None  # features: (width, dtype) of the rows a draft head reads
        if features is not None:
            self.features = torch.zeros(bucket.seqs, bucket.rows, features[0], dtype=features[1], device=device)
        rows = bucket.seqs * bucket.rows
        lasts = bucket.seqs if bucket.last_logits else 0  # each sequence's last row: the LM head reads those alone
        self.ints = torch.zeros(3 * rows + bucket.seqs + lasts, dtype=torch.long, device=device)
        shape = (bucket.seqs, bucket.rows)
        self.tokens, self.positions, self.slots = (self.ints[i * rows : (i + 1) * rows].view(shape) for i in range(3))
        self.slot_index = self.ints[3 * rows : 3 * rows + bucket.seqs]
        if lasts:
            self.logit_rows = self.ints[3 * rows + bucket.seqs :]
        self._per_forward: dict = {}  # see _derived

    def fill(
        self,
        slots: list[int],
        starts: list[int],
        inputs: list[list[int]],
        scratch_row: int,
        features=None,
        picked: torch.Tensor | None = None,
        picked_at: int = 0,
        offsets: torch.Tensor | None = None,
    ) -> None:
        """These sequences' new tokens (and feature rows); every other row is padding (token 0 at position 0 of the
        scratch slot; its features whatever a forward left there). picked: [n, w] on the device, sequence i's new tokens
        from the picked_at-th on its row's first ones, in place of the inputs' (tokens a step picked, drafts a drafter
        left there, copied on the device: the host never waits for them; columns past a sequence's width land in
        padding rows). offsets: [n] on the device, added there to each sequence's positions."""
        b, r = self.bucket.seqs, self.bucket.rows
        tokens, positions, row_slots = [0] * (b * r), [0] * (b * r), [scratch_row] * (b * r)
        for i, (slot, start, new) in enumerate(zip(slots, starts, inputs)):
            at = i * r
            tokens[at : at + len(new)] = new
            positions[at : at + len(new)] = range(start, start + len(new))
            row_slots[at : at + len(new)] = [slot] * len(new)
        seq_slots = list(slots) + [scratch_row] * (b - len(slots))
        lasts = []
        if self.logit_rows is not None:
            lasts = [i * r + len(new) - 1 for i, new in enumerate(inputs)] + [i * r for i in range(len(inputs), b)]
        copy_into(self.ints, tokens + positions + row_slots + seq_slots + lasts)
        if picked is not None:
            width = min(picked.shape[1], r - picked_at)
            self.tokens[: len(picked), picked_at : picked_at + width].copy_(picked[:, :width])
        if isinstance(features, torch.Tensor):  # [n, w, width]: every sequence's rows in one copy
            self.features[: features.shape[0], : features.shape[1]].copy_(features)
        else:
            for i, rows in enumerate(features or ()):
                self.features[i, : len(rows)].copy_(rows)
        if offsets is not None:
            self.positions[: len(offsets)] += offsets[:, None]
        self.forget()

    def forget(self) -> None:
        """Before a forward that is not a replay: what the last forward derived is stale."""
        self._per_forward.clear()

    def with_rows(self, tokens, positions, slots, features=None, rope=None) -> StaticBatch:
        """This batch's sequences with other tensors of its rows' tokens, positions and KV slots ([B, R]), and
        features and RoPE tables where given: a chained round's, which a graph reads where they lie, none copied in."""
        rows = copy.copy(self)
        rows.tokens, rows.positions, rows.slots, rows.rope = tokens, positions, slots, rope
        rows.features = self.features if features is None else features
        rows._per_forward = {}
        return rows

    def store(self, cache: KVCache, layer: int, k, v) -> None:
        cache.write_at(layer, self._derived("entries", lambda: cache.entries(self.slots, self.positions)), k, v)

    def load(self, cache: KVCache, layer: int):
        return cache.read_blocks(
            layer, self._derived("blocks", lambda: cache.block_rows(self.slot_index, self.kv_len)), self.kv_len
        )

    def _derived(self, name, make):
        """What every layer reads the same (KV indices, masks): made by the first layer of a forward, so within
        a graph once a replay."""
        if name not in self._per_forward:
            self._per_forward[name] = make()
        return self._per_forward[name]

    def attend(self, q, keys, values, window: int | None, scale: float, softcap=None, sinks=None) -> torch.Tensor:
        """q [B, H, R, D] over keys and values [B, Hkv, K, D] (sinks: [H] or None), each row seeing the keys up to its
        position. The query heads that share a KV head are folded into the query length ([B, Hkv, G x R, D]): one
        memory-efficient attention call, where `enable_gqa` with a mask falls back to the unfused one."""
        batch, heads, rows, dim = q.shape
        kv_heads = keys.shape[1]
        group = heads // kv_heads
        mask = self._derived(
            ("folded", window, group),
            lambda: (
                self.mask_for(window)[:, :, None]
                .expand(batch, 1, group, rows, self.kv_len)
                .reshape(batch, 1, group * rows, -1)
            ),
        )
        folded = q.reshape(batch, kv_heads, group * rows, dim)
        out = attention(folded, keys, values, scale, mask, softcap, head_sinks(sinks, kv_heads, rows))
        return out.reshape(batch, heads, rows, dim)  # CUDA's kernels may return another layout

    def mask_for(self, window: int | None) -> torch.Tensor:
        """[B, 1, R, K]: a row sees the keys up to its own position (the last `window` of them where set)."""

        def make():
            keys = torch.arange(self.kv_len, device=self.ints.device)
            mask = keys <= self.positions[..., None]
            if window is not None:
                mask &= keys > self.positions[..., None] - window
            return mask[:, None]

        return self._derived(("mask", window), make)


class _Entry:
    """One bucket's batch, and its captured graph with the graph's outputs (None: run without capture)."""

    def __init__(self, batch: StaticBatch, graph=None, outputs=None):
        self.batch, self.graph, self.outputs = batch, graph, outputs


class BucketedForward:
    """The runner's decode and verify forwards at bucket shapes: captured as CUDA graphs (`capture`) the first
    time a bucket is met, replayed after; or run at those shapes without capture (a CPU, in tests)."""

    def __init__(self, model, cache: KVCache, capture: bool, attention=None):
        """attention: a PagedAttention for every bucket's forwards (None: PyTorch's, through the batch)."""
        if cache.scratch_row is None:
            raise ValueError("fixed-shape forwards need a KV cache with a scratch block")
        self.model, self.cache, self.capture, self.attention = model, cache, capture, attention
        self.max_keys = cache.max_blocks * cache.block_size
        self.kept_bytes = kept_output_bytes(model, cache.num_slots, self.max_keys)
        self.let_go = 0  # graphs let go to keep their outputs within kept_bytes
        self._entries: dict[Bucket, _Entry] = {}  # the least recently used first
        self._held = 0  # bytes of their graphs' outputs
        self._refused: set[Bucket] = set()
        self._pool = torch.cuda.graph_pool_handle() if capture else None  # one memory pool for all buckets
        self.capture_seconds: list[float] = []  # each capture's, its warm-up runs included

    @property
    def buckets(self) -> list[Bucket]:
        """The buckets prepared so far."""
        return list(self._entries)

    def serves(self, num_new: list[int], kv_len: int) -> bool:
        """Whether a forward of sequences with these numbers of new tokens, reaching kv_len keys, runs at a bucket's
        shape (its graph replayed, where captured) rather than eagerly."""
        bucket = bucket_for(num_new, kv_len, self.max_keys)
        return bucket is not None and bucket not in self._refused

    @property
    def reads_features(self) -> bool:
        """Whether the model reads the target's features beside its tokens (a draft head)."""
        return getattr(self.model, "reads_features", False)

    def __call__(
        self,
        slots: list[int],
        starts: list[int],
        inputs: list[list[int]],
        logits: str,
        hidden: bool | str,
        features=None,
        picked: torch.Tensor | None = None,
        picked_at: int = 0,
        offsets: torch.Tensor | None = None,
        reach: int = 0,
    ):
        """The forward's output as Transformer.forward gives it, or None where this forward runs eagerly. features:
        per sequence, a feature row per new token, where the model reads them; picked, picked_at, offsets: see
        StaticBatch.fill (offsets each at most `reach`)."""
        num_new = [len(t) for t in inputs]
        bucket = bucket_for(num_new, max(s + n for s, n in zip(starts, num_new)) + reach, self.max_keys, logits)
        if bucket is None or bucket in self._refused:
            return None
        entry = self._entries.pop(bucket, None) or self._prepare(bucket)
        if entry is None:
            return None
        self._entries[bucket] = entry  # the most recently used
        entry.batch.fill(slots, starts, inputs, self.cache.scratch_row, features, picked, picked_at, offsets)
        if entry.graph is not None:
            entry.graph.replay()
            every_logit, every_hidden = entry.outputs
        else:
            every_logit, every_hidden = self.run(entry.batch)
        return _selected(every_logit, every_hidden, bucket, num_new, logits, hidden)

    def rope_tables(self, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The model's RoPE tables of these positions [B, T], as its fixed-shape forwards make them."""
        with _fixed_shapes():
            return self.model.rope_tables(positions, self.model.dtype)

    def run(self, batch: StaticBatch):
        """The batch's forward at its bucket's shape, eagerly: (every row's logits, every row's hidden state)."""
        extra = {} if batch.features is None else {"features": batch.features}
        with _fixed_shapes():
            return self.model(batch.tokens, batch, self.cache, return_hidden="all", **extra)

    def _prepare(self, bucket: Bucket) -> _Entry | None:
        entry = _Entry(self.new_batch(bucket))
        if self.capture:
            try:
                entry.graph, entry.outputs = self.capture_graph(entry.batch, lambda: self.run(entry.batch))
            except UNCAPTURABLE as e:  # it runs eagerly, with PyTorch's kernels
                log.warning("forwards of %s run eagerly: their capture failed (%s)", bucket, e)
                self._refused.add(bucket)
                return None
            self._held += _bytes(entry.outputs)
            self._let_go_past_the_bound()
        return entry

    def _let_go_past_the_bound(self) -> None:
        """Let the least recently replayed graphs go while the graphs' outputs hold more than kept_bytes (their
        memory stays in the graphs' pool, for the captures that follow)."""
        for bucket in list(self._entries):
            if self._held <= self.kept_bytes:
                return
            self._held -= _bytes(self._entries.pop(bucket).outputs)
            self.let_go += 1

    def new_batch(self, bucket: Bucket) -> StaticBatch:
        features = (self.model.cfg.hidden_size, self.model.dtype) if self.reads_features else None
        batch = StaticBatch(bucket, self.cache.table.device, features)
        batch.paged_attention = self.attention
        return batch

    def capture_graph(self, batch: StaticBatch, run):
        """A graph of `run` (a bucket's work on `batch`), the batch's rows all padding while captured (they write the
        scratch block); and what run returned while captured (tensors a replay overwrites)."""
        start = time.perf_counter()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: one-off work (workspaces, kernel choice) stays out of the graph
            for _ in range(2):
                batch.fill([], [], [], self.cache.scratch_row)  # anew: a run may move the rows on (drafting rounds)
                run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        batch.fill([], [], [], self.cache.scratch_row)
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = run()
        self.capture_seconds.append(time.perf_counter() - start)
        return graph, outputs


def _bytes(outputs) -> int:
    return sum(t.nbytes for t in outputs if t is not None) if outputs is not None else 0


def _selected(
    every_logit: torch.Tensor,
    every_hidden: torch.Tensor,
    bucket: Bucket,
    num_new: list[int],
    logits: str,
    hidden: bool | str,
):
    """The rows the caller asked for, as Transformer.forward returns them (copies: a graph's outputs are
    overwritten by its next replay). every_logit holds every row's, or in a last_logits bucket each sequence's last
    row's; every_hidden every row's."""
    rows = bucket.rows
    last = [i * rows + n - 1 for i, n in enumerate(num_new)]
    every = [i * rows + j for i, n in enumerate(num_new) for j in range(n)]
    picked = to_device(last if logits == "last" else every, every_logit.device)
    out = every_logit[: len(num_new)].clone() if bucket.last_logits else every_logit.index_select(0, picked)
    if not hidden:
        return out
    return out, every_hidden.index_select(0, to_device(every, picked.device) if hidden == "all" else picked)


# ---- elementwise steps fused on the GPU -------------------------------------------------------------------
# In a graph each kernel still costs a few microseconds to run however small its work: an RMSNorm is eight
# kernels in eager PyTorch, RoPE five, SwiGLU two. torch.compile fuses each into one (shapes left symbolic,
# so one compilation serves every bucket). Only fixed-shape forwards take the compiled kernels: an eager
# forward's shapes (prompts) vary from call to call, and each new rank or size class would recompile, or
# pass through the compiler's guards at a cost larger than the kernel's; past its recompile limit the
# compiler runs a function eagerly for good, and graphs captured after that would be left unfused.

_FIXED = [False]  # whether a fixed-shape forward is running (they run on one thread: the engine's)
# Variants a compiled kernel may have: per model (a target and its draft share the kernels' code, which the
# compiler caches by) x rank x sizes of 1 (which it specialises). Only captures call them, so a larger cache
# costs nothing at replay; PyTorch's default (8) is met by two models and leaves later buckets unfused.
RECOMPILE_LIMIT = 64


def in_fixed_shapes() -> bool:
    """Whether a fixed-shape forward is running (its kernels may then differ from an eager forward's)."""
    return _FIXED[0]


@contextlib.contextmanager
def _fixed_shapes():
    outer, _FIXED[0] = _FIXED[0], True
    try:
        with torch._dynamo.config.patch(
            recompile_limit=RECOMPILE_LIMIT, accumulated_recompile_limit=16 * RECOMPILE_LIMIT
        ):
            yield
    finally:
        _FIXED[0] = outer


def _rms_norm(weight, eps: float, x):
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _add_rms_norm(weight, eps: float, x, residual):
    x = x + residual
    return _rms_norm(weight, eps, x), x


def _head_inputs(table, tokens, weight_a, eps_a: float, weight_b, eps_b: float, features):
    """[norm_a(table[tokens]), norm_b(features)] in the features' type: a draft head's input before its fusing
    projection, the embedding looked up in the same kernel."""
    embedded = F.embedding(tokens, table).to(features.dtype)
    return torch.cat([_rms_norm(weight_a, eps_a, embedded), _rms_norm(weight_b, eps_b, features)], -1)


def _silu_mul(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class _InFixedShapes:
    """A compiled kernel inside fixed-shape forwards, its eager self elsewhere."""

    def __init__(self, compiled, eager):
        self.compiled, self.eager = compiled, eager

    def __call__(self, *args):
        return (self.compiled if _FIXED[0] else self.eager)(*args)


class _FusedNorm:
    def __init__(self, norm, add_norm):
        self.norm, self.add_norm = norm, add_norm

    def __call__(self, norm, x, residual=None):
        if residual is None:
            return self.norm(norm.weight, norm.eps, x)
        return self.add_norm(norm.weight, norm.eps, x, residual)


def fuse_elementwise(model) -> bool:
    """Give the model's norms, RoPE (its tables and their use) and SwiGLU MLPs compiled kernels, and a draft head's
    input (its tokens' embeddings looked up, both input norms) one, once; a module that already has a backend's kernel
    keeps it. Where compiling fails (no compiler for the device), the model stays as it was: False."""
    if getattr(model, "elementwise_fused", False):
        return True
    eager = (_rms_norm, _add_rms_norm, _silu_mul, _rope, rope_tables, _head_inputs)
    compiled = [torch.compile(f, dynamic=True) for f in eager]
    try:
        _try_compiled(compiled, model.device, model.dtype)
    except Exception as e:  # any compiler failure leaves the eager kernels, which work
        log.warning("elementwise steps stay unfused: compiling them failed (%s)", e)
        return False
    norm = _FusedNorm(_InFixedShapes(compiled[0], _rms_norm), _InFixedShapes(compiled[1], _add_rms_norm))
    silu_mul, rope = _InFixedShapes(compiled[2], _silu_mul), _InFixedShapes(compiled[3], apply_rope)
    tables, inputs = _InFixedShapes(compiled[4], rope_tables), _InFixedShapes(compiled[5], _head_inputs)
    if isinstance(model, DraftHead) and model.inputs_kernel is None:
        model.inputs_kernel = inputs
    for module in model.modules():
        if isinstance(module, RMSNorm) and module.kernel is None:
            module.kernel = norm
        elif isinstance(module, RotaryEmbedding) and module.kernel is None:
            module.kernel = tables
        elif isinstance(module, MLP) and module.activation == "silu" and module.act_mul_kernel is None:
            module.act_mul_kernel = silu_mul
        elif isinstance(module, Attention) and module.rope_kernel is apply_rope:
            module.rope_kernel = rope
    model.elementwise_fused = True
    return True


@torch.inference_mode()  # as the model's forward runs: another grad mode or tensor kind would compile anew
def _try_compiled(compiled, device, dtype) -> None:
    """Run each compiled function once (compiling it), against its eager self."""
    x = torch.randn(3, 2, 8, device=device, dtype=dtype)
    weight = torch.nn.Parameter(torch.ones(8, device=device, dtype=dtype), requires_grad=False)  # as a norm's
    tolerance = max(2e-3, 8 * torch.finfo(dtype).eps)  # a few last places: the fused kernels round otherwise
    positions = torch.arange(6, device=device).view(2, 3) * 1000  # large angles: where cos and sin may differ most
    tokens = torch.tensor([[7, 49]] * 3, device=device)  # a token for each of x's rows
    cases = [
        (_rms_norm, (weight, 1e-6, x)),
        (_add_rms_norm, (weight, 1e-6, x, x)),
        (_silu_mul, (x,)),
        (_rope, (x, x, x)),
        (rope_tables, (positions, torch.rand(4, device=device), dtype)),
        (_head_inputs, (torch.randn(50, 8, device=device, dtype=dtype), tokens, weight, 1e-6, weight, 1e-5, -x)),
    ]
    for fn, (eager, args) in zip(compiled, cases):
        got, want = fn(*args), eager(*args)
        for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            torch.testing.assert_close(g, w, atol=tolerance, rtol=tolerance)
