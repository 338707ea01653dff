"""Attention of fixed-shape forwards on a GPU, in two Triton kernels that read the KV blocks where they lie.

The PyTorch path of a bucket's forward spends ten kernels a layer on attention: RoPE on queries and keys, the cache
write, the gather of each sequence's blocks into one run of keys and of values, the copies that lay out queries and
outputs, the masked SDPA call. Inside a CUDA graph each costs a few microseconds however small its work, which
makes up most of a 1.5B step (docs/decisions.md#cuda-graphs-and-fused-elementwise-kernels). Here one kernel rotates
the new rows' queries and keys and writes keys and values into their blocks, and one attends each sequence's rows
over the blocks its table lists, reading the queries and writing the outputs in the layouts the projections use.
Where the QKV projection runs in the GEMV kernel, that kernel does the first one's work as it stores its outputs
(executor/qkv_epilogue.py, checked here at start-up), and attention is the one kernel a layer.

Each row's result depends only on its own keys: the keys are taken in spans fixed by position, and a span that a
row does not see leaves its sums as they were, bit for bit. So a token gets the same attention output whether it is
decoded alone or verified beside drafts, in a batch of any size (short of MAX_PARTIALS: see there).

Without a GPU (the tests) the kernels run in Triton's interpreter, which TRITON_INTERPRET=1 turns on before Triton
is imported (tests/conftest.py does).
"""

from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl

from ..config import ModelConfig
from ..kv_cache import KEY_TILE, KVCache
from ..models.layers import apply_rope
from ..models.runtime import Attention
from .cuda_graphs import MAX_PARTIALS, Bucket, StaticBatch
from .gemv import Gemv, GemvConfig, gemv, passes_where_it_fits
from .kv_layout import key_offset, value_offset
from .qkv_epilogue import RopeStore, projected, rotated_projection

log = logging.getLogger(__name__)


@triton.jit
def _rotate_and_store(
    q, k, v, q_seq, q_row, q_head, k_seq, k_row, k_head, v_seq, v_row, v_head,  # new rows [B, R, heads, D], strided
    cos, sin, positions, row_slots, table, max_blocks,  # cos, sin [N, D]; positions, row_slots [N]
    k_cache, v_cache, q_out,  # keys [blocks, Hkv, BS / TILE, D, TILE], values [blocks, Hkv, BS, D]; q_out [N, H, D]
    R: tl.constexpr, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BS: tl.constexpr,
    TILE: tl.constexpr,
):  # fmt: skip
    """Program (n, h): query head h of row n (= b * R + r) rotated into q_out, or for h >= H key and value head
    h - H of row n (the key rotated) written at the row's position in its slot's block."""
    n, h = tl.program_id(0), tl.program_id(1)
    b, r = n // R, n % R
    d = tl.arange(0, BLOCK_D)
    inside = d < D
    partner = (d + D // 2) % D  # rotate_half(x)[d] = -x[d + D/2] below the middle, x[d - D/2] above
    sign = tl.where(d < D // 2, -1.0, 1.0)
    c = tl.load(cos + n * D + d, mask=inside).to(tl.float32)
    s = tl.load(sin + n * D + d, mask=inside).to(tl.float32)
    if h < H:
        x = q + b * q_seq + r * q_row + h * q_head
        rotated = tl.load(x + d, mask=inside).to(tl.float32) * c + sign * tl.load(x + partner, mask=inside) * s
        tl.store(q_out + (n * H + h) * D + d, rotated.to(q_out.dtype.element_ty), mask=inside)
    else:
        kv = h - H
        position = tl.load(positions + n)
        block = tl.load(table + tl.load(row_slots + n) * max_blocks + position // BS).to(tl.int64)
        at = position % BS
        x = k + b * k_seq + r * k_row + kv * k_head
        rotated = tl.load(x + d, mask=inside).to(tl.float32) * c + sign * tl.load(x + partner, mask=inside) * s
        base = block * HKV + kv
        tl.store(k_cache + key_offset(base, at, d, BS, TILE, D), rotated.to(k_cache.dtype.element_ty), mask=inside)
        value = tl.load(v + b * v_seq + r * v_row + kv * v_head + d, mask=inside)
        tl.store(v_cache + value_offset(base, at, d, BS, D), value.to(v_cache.dtype.element_ty), mask=inside)


@triton.jit
def _softcapped(scores, cap):
    """cap * tanh(scores / cap) (Gemma 2's soft cap): tanh |y| = (1 - e) / (1 + e), e = exp(-2 |y|), the sign put
    back (kernels/attention.c's form)."""
    y = scores / cap
    e = tl.exp(-2.0 * tl.abs(y))
    magnitude = (1.0 - e) / (1.0 + e)
    return tl.where(y < 0, -magnitude, magnitude) * cap


@triton.jit
def _fold_in(queries, keys, values, sees, scale, best, total, acc, SOFTCAP: tl.constexpr):
    """A span of keys and values folded into the rows' running softmax (best: the highest score so far, total: the
    sum of weights, acc: the weighted values, float32), its scores soft-capped where SOFTCAP > 0; keys a row does
    not see leave its sums as they were."""
    scores = tl.dot(queries, tl.trans(keys.to(queries.dtype)), input_precision="ieee") * scale
    if SOFTCAP > 0:
        scores = _softcapped(scores, SOFTCAP)
    scores = tl.where(sees, scores, float("-inf"))
    new_best = tl.maximum(best, tl.max(scores, 1))
    shift = tl.where(new_best == float("-inf"), 0.0, new_best)  # a row that has seen no key yet
    weights = tl.exp(scores - shift[:, None])
    rescale = tl.exp(best - shift)
    total = total * rescale + tl.sum(weights, 1)
    acc = acc * rescale[:, None] + tl.dot(weights.to(queries.dtype), values.to(queries.dtype), input_precision="ieee")
    return new_best, total, acc


@triton.jit
def _attend(
    q, q_row, out, positions, seq_slots, table, max_blocks, k_cache, v_cache, scale, window,  # window 0: none
    part_best, part_total, part_acc,  # [SPLITS, B * R * H (, D)] float32, where SPLITS > 1
    R: tl.constexpr, H: tl.constexpr, HKV: tl.constexpr, HEADS: tl.constexpr,  # HEADS: query heads a program
    D: tl.constexpr, BLOCK_D: tl.constexpr, BS: tl.constexpr, TILE: tl.constexpr,
    KEYS: tl.constexpr, SPLIT: tl.constexpr, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SOFTCAP: tl.constexpr,  # of the scores (Gemma 2); 0: none
):  # fmt: skip
    """Program (b, p, s): query heads p * HEADS.. (all under one KV head) of sequence b's R rows, q [B * R, H, D]
    (rows q_row apart) and out [B * R, H, D], over the keys each row sees (those up to its position, the last
    `window` of them where set) among keys s * SPLIT.. (s * SPLIT + SPLIT), BLOCK_N at a time with an online softmax
    in float32. KEYS: the bucket's key positions. With one split the outputs are written; with more, each split's
    running max, sum and weighted values, which _combine merges."""
    b, p, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m = tl.arange(0, BLOCK_M)  # the program's (head, row) pairs, head-major
    real = m < HEADS * R
    rows = b * R + m % R
    heads = p * HEADS + m // R
    kv = (p * HEADS) // (H // HKV)
    d = tl.arange(0, BLOCK_D)
    at = (rows[:, None] * H + heads[:, None]) * D + d[None, :]
    both = real[:, None] & (d[None, :] < D)
    queries = tl.load(q + rows[:, None] * q_row + heads[:, None] * D + d[None, :], mask=both, other=0.0)
    position = tl.load(positions + rows, mask=real, other=0)
    slot = tl.load(seq_slots + b)
    seen_max, seen_min = tl.max(tl.where(real, position, 0)), tl.min(tl.where(real, position, 1 << 30))
    reach = tl.where(window > 0, window, 1 << 30)  # keys a row sees, itself included
    first = tl.maximum(seen_min - reach + 1, 0)  # the first key any row sees
    best = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    # Constant bounds and masked spans rather than the rows' own bounds or a branch: Triton's interpreter takes no
    # tensor as a loop bound, and the compiler pipelines the loads of a loop's body, not of a branch in it. A span of
    # no key a row sees changes no sum.
    for i in range(0, SPLIT, BLOCK_N):
        start = split * SPLIT + i
        key = start + n
        live = (key < KEYS) & (key <= seen_max) & (key >= first)
        block = tl.load(table + slot * max_blocks + tl.minimum(key, KEYS - 1) // BS).to(tl.int64)  # each key's own
        base, offset = (block * HKV + kv)[:, None], (key % BS)[:, None]
        wanted = live[:, None] & (d[None, :] < D)
        keys = tl.load(k_cache + key_offset(base, offset, d[None, :], BS, TILE, D), mask=wanted, other=0.0)
        values = tl.load(v_cache + value_offset(base, offset, d[None, :], BS, D), mask=wanted, other=0.0)
        sees = live[None, :] & (key[None, :] <= position[:, None]) & (key[None, :] > position[:, None] - reach)
        best, total, acc = _fold_in(queries, keys, values, sees, scale, best, total, acc, SOFTCAP)
    if SPLITS == 1:
        total = tl.where(total > 0, total, 1.0)  # lanes of no query (BLOCK_M past the rows) may see no key
        tl.store(out + at, (acc / total[:, None]).to(out.dtype.element_ty), mask=both)
    else:
        flat = split * (tl.num_programs(0) * R * H) + rows * H + heads
        tl.store(part_best + flat, best, mask=real)
        tl.store(part_total + flat, total, mask=real)
        tl.store(part_acc + flat[:, None] * D + d[None, :], acc, mask=both)


@triton.jit
def _combine(
    out, part_best, part_total, part_acc, D: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr
):  # fmt: skip
    """Program i: row-head i's output from its splits', merged in split order. A split past the row's keys adds
    exact zeros, so a row's bits do not depend on how many splits its bucket has."""
    i, count = tl.program_id(0), tl.num_programs(0)
    d = tl.arange(0, BLOCK_D)
    best = tl.load(part_best + i)
    for s in range(1, SPLITS):
        best = tl.maximum(best, tl.load(part_best + s * count + i))
    shift = tl.where(best == float("-inf"), 0.0, best)
    weight = tl.exp(tl.load(part_best + i) - shift)
    total = tl.load(part_total + i) * weight
    acc = tl.load(part_acc + i * D + d, mask=d < D, other=0.0) * weight
    for s in range(1, SPLITS):
        weight = tl.exp(tl.load(part_best + s * count + i) - shift)
        total += tl.load(part_total + s * count + i) * weight
        acc += tl.load(part_acc + (s * count + i) * D + d, mask=d < D, other=0.0) * weight
    total = tl.where(total > 0, total, 1.0)
    tl.store(out + i * D + d, (acc / total).to(out.dtype.element_ty), mask=d < D)


# Keys a program attends at most by default: a sequence's heads alone are a few programs on a device of a hundred or
# more cores, so splitting even a short context pays (docs/decisions.md#paged-attention-kernels-in-captured-forwards).
SPLIT_KEYS = 64


class PagedAttention:
    """The attention of a fixed-shape forward (executor/cuda_graphs.StaticBatch): new rows' q, k, v [B, R, heads, D]
    (views of the QKV projection, normalised where the family does) -> outputs [B, R, H * D].

    heads_per_program: query heads one program attends (they share a KV head, whose keys it then reads once). Fewer
    make more programs: a batch of one sequence is otherwise a handful of programs on a device of a hundred cores.
    span: keys a program takes at a time (a power of two, at least a key tile), from one KV block or several; each
    span is a round of loads the next waits on, so at short contexts fewer, wider spans wait less.
    split_keys: where a bucket has more key positions, programs take this many each (split at fixed positions, so a
    row's result stays its own), and a second kernel merges their sums; a multiple of span (default: one span, at
    least SPLIT_KEYS). Short splits keep a device's cores busy where few sequences attend over a short context; they
    widen only where a call would hold more than MAX_PARTIALS partial sums.
    in_projection: RoPE and the cache write in the QKV projection's kernel where it passed its check
    (executor/qkv_epilogue.py), rather than a kernel of their own."""

    def __init__(
        self,
        heads_per_program: int | None = 1,
        span: int = 64,
        split_keys: int | None = None,
        in_projection: bool = True,
    ):
        split_keys = split_keys or max(span, SPLIT_KEYS)
        if span < KEY_TILE or span & (span - 1) or split_keys % span:
            raise ValueError(f"a span is a power of two from {KEY_TILE} dividing split_keys, not {span} ({split_keys})")
        self.heads_per_program, self.span, self.split_keys = heads_per_program, span, split_keys
        self.in_projection = in_projection

    def __call__(
        self, batch, cache: KVCache, layer: int, q, k, v, rope, window: int | None, scale: float, softcap=None
    ):
        bsz, rows, heads, dim = q.shape
        if any(t.stride(3) != 1 for t in (q, k, v)):
            raise ValueError("the new rows' q, k and v must each hold a head's values side by side")
        rotated = rotate_and_store(q, k, v, rope_store(batch, cache, layer, rope, heads, k.shape[2]))
        return self.attend(batch, cache, layer, rotated.view(bsz, rows, heads * dim), heads, window, scale, softcap)

    def project(self, attention, norm, x, residual, rope, batch, cache: KVCache):
        """(the layer's QKV projection of norm(x + residual), its queries rotated, x + residual), its keys and
        values written: one kernel where the projection's takes RoPE and the cache write in (qkv_epilogue.py), and
        this attention does (`in_projection`); else None."""
        if not self.in_projection:
            return None
        store = rope_store(batch, cache, attention.layer, rope, attention.num_heads, attention.num_kv_heads)
        return rotated_projection(attention, norm, x, residual, store)

    def split_of(self, keys: int, rows: int) -> int:
        """The keys each program attends in a call of `rows` rows over `keys` key positions (powers of two, as buckets
        are)."""
        split = min(keys, self.split_keys)
        while rows * (keys // split) > MAX_PARTIALS and split < keys:
            split *= 2
        return split

    def attend(
        self, batch, cache: KVCache, layer: int, queries, heads: int, window: int | None, scale: float, softcap=None
    ):
        """The attention outputs [B, R, H * D] of rotated queries [B, R, >= H * D] (the first H * D of a row's
        values, rows any distance apart), their keys and values already in the cache; scores soft-capped where
        softcap is set."""
        bsz, rows = queries.shape[:2]
        if queries.stride(2) != 1 or queries.stride(0) != rows * queries.stride(1):
            raise ValueError("a row's queries must lie side by side, and the rows of a batch evenly apart")
        kv_heads, dim = cache.k[layer].shape[1], cache.k[layer].shape[3]
        count = bsz * rows
        per_program = min(self.heads_per_program or heads // kv_heads, heads // kv_heads)
        out = torch.empty(bsz, rows, heads, dim, device=queries.device, dtype=queries.dtype)
        keys = batch.kv_len
        split = self.split_of(keys, count)
        splits = -(-keys // split)
        parts = [out] * 3  # one split: not read
        if splits > 1:
            flat = (splits, count * heads)
            parts = [torch.empty(flat, device=out.device), torch.empty(flat, device=out.device)]
            parts.append(torch.empty(*flat, dim, device=out.device))
        width = triton.next_power_of_2(dim)
        _attend[(bsz, heads // per_program, splits)](
            queries, queries.stride(1), out, batch.positions, batch.slot_index, cache.table, cache.table.shape[1],
            cache.k[layer], cache.v[layer], scale, window or 0, *parts,
            R=rows, H=heads, HKV=kv_heads, HEADS=per_program, D=dim, BLOCK_D=width, BS=cache.block_size,
            TILE=KEY_TILE, KEYS=keys, SPLIT=split, SPLITS=splits,
            BLOCK_M=max(16, triton.next_power_of_2(per_program * rows)), BLOCK_N=self.span, SOFTCAP=float(softcap or 0),
            num_warps=4 if self.span <= 64 else 8,
        )  # fmt: skip
        if splits > 1:
            _combine[(count * heads,)](out, *parts, D=dim, BLOCK_D=width, SPLITS=splits)
        return out.view(bsz, rows, heads * dim)


def rope_store(batch, cache: KVCache, layer: int, rope, heads: int, kv_heads: int) -> RopeStore:
    """Where a fixed-shape batch's new rows' keys and values go in a layer's cache, and their RoPE tables."""
    count = batch.positions.numel()
    cos, sin = (t.reshape(count, -1) for t in rope)  # [B, 1, R, D]: contiguous
    return RopeStore(
        cos, sin, batch.positions, batch.slots, cache.table, cache.k[layer], cache.v[layer], heads, kv_heads
    )


def rotate_and_store(q, k, v, store: RopeStore) -> torch.Tensor:
    """The new rows' queries rotated, [B * R, H, D], from q, k, v [B, R, heads, D] (strided), their keys rotated
    and their values written into the cache where `store` says."""
    bsz, rows, heads, dim = q.shape
    count, kv_heads = bsz * rows, k.shape[2]
    rotated = torch.empty(count, heads, dim, device=q.device, dtype=q.dtype)
    strides = [s for t in (q, k, v) for s in t.stride()[:3]]
    block_size, max_blocks = store.v_cache.shape[2], store.table.shape[1]
    _rotate_and_store[(count, heads + kv_heads)](
        q, k, v, *strides, store.cos, store.sin, store.positions, store.row_slots, store.table, max_blocks,
        store.k_cache, store.v_cache, rotated,
        R=rows, H=heads, HKV=kv_heads, D=dim, BLOCK_D=triton.next_power_of_2(dim), BS=block_size, TILE=KEY_TILE,
    )  # fmt: skip
    return rotated


def checked_paged_attention(device, dtype, head_dim: int) -> PagedAttention | None:
    """The kernels, where they compile for this device and agree with PyTorch's attention on a small case at the
    model's head size (what their shared memory grows with); else None (forwards keep PyTorch's attention), with the
    reason logged."""
    attention = PagedAttention()
    try:
        got, want = _small_case(attention, device, dtype, head_dim)
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    except Exception as e:  # a compiler or driver that cannot run them: PyTorch's attention works everywhere
        log.warning("attention in fixed-shape forwards stays PyTorch's: the Triton kernels failed (%s)", e)
        return None
    return attention


@torch.inference_mode()
def _small_case(attention: PagedAttention, device, dtype, head_dim: int):
    """Two sequences of 3 new rows after 70 and 5 cached tokens: the kernels' outputs, then those of the path they
    replace (RoPE, the cache write through the batch, which puts the new entries back as it would have written
    them, the gathered blocks and SDPA), on the same cached entries."""
    cfg = ModelConfig("llama", 1, 4 * head_dim, intermediate_size=1, num_layers=1, num_heads=4, num_kv_heads=2)
    cache = KVCache(cfg, 2, 128, dtype, device, scratch=True)
    starts, rows = [70, 5], 3
    for slot, start in enumerate(starts):
        cache.reserve(slot, start + rows)
    g = torch.Generator(device="cpu").manual_seed(0)
    for part in (cache.k[0], cache.v[0]):
        part.copy_(torch.randn(part.shape, generator=g).to(part))
    batch = StaticBatch(Bucket(2, rows, 128), device)
    batch.fill([0, 1], starts, [[0] * rows] * 2, cache.scratch_row)
    q, k, v = (torch.randn(2, rows, h, head_dim, generator=g).to(device, dtype) for h in (4, 2, 2))
    cos, sin = torch.randn(2, 2, 1, rows, head_dim, generator=g).to(device, dtype)
    got = attention(batch, cache, 0, q, k, v, (cos, sin), None, head_dim**-0.5)
    rotated_q, rotated_k = (apply_rope(t.transpose(1, 2), cos, sin) for t in (q, k))
    batch.store(cache, 0, rotated_k, v.transpose(1, 2))
    want = batch.attend(rotated_q, *batch.load(cache, 0), None, head_dim**-0.5)
    return got, want.transpose(1, 2).reshape(2, rows, -1)


def attach_epilogues(model) -> int:
    """Let each attention layer's QKV kernel take RoPE and the cache write in, where its configuration computes them
    as the separate kernels do on this device (checked once a shape); q/k norms between projection and RoPE keep
    them apart. Returns how many layers take them in."""
    taken = 0
    for attention in (m for m in model.modules() if isinstance(m, Attention)):
        kernel = getattr(attention.qkv_proj, "kernel", None)  # none of its own: DeepSeek's latent projection
        if not isinstance(kernel, Gemv) or attention.normalises_qk:
            continue
        weight = attention.qkv_proj.weight
        shape = (*weight.shape, attention.qkv_proj.bias is not None, attention.num_heads, attention.num_kv_heads)
        kernel.rope_epilogue = _agrees(shape, kernel.config, str(weight.device), weight.dtype)
        taken += kernel.rope_epilogue
    return taken


@functools.cache
def _agrees(shape: tuple, config: GemvConfig, device: str, dtype: torch.dtype) -> bool:
    return passes_where_it_fits(_epilogue_agrees, shape, config, device, dtype)


def _epilogue_agrees(shape: tuple, config: GemvConfig, device: str, dtype: torch.dtype) -> bool:
    got, want = epilogue_case(shape, config, device, dtype)
    agree = all(_close(a, b) for a, b in zip(got, want))
    if not agree:
        log.warning("QKV projections %d x %d keep RoPE and the cache write apart: the epilogue disagrees with the "
                    "separate kernels on this device", *shape[:2])  # fmt: skip
    return agree


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Within a few of the type's last places of the largest value (as gemv.agrees bounds a layer)."""
    bound = max(4 * torch.finfo(want.dtype).eps, 1e-4) * want.float().abs().max()
    return bool((got.float() - want.float()).abs().max() <= bound)


@torch.inference_mode()
def epilogue_case(shape: tuple, config: GemvConfig, device, dtype):
    """A QKV projection of this shape (N, K, bias, heads, KV heads) on 8 rows, 5 of a sequence after 70 cached tokens
    and 3 of one from its start: (the rotated queries, the cache's keys and values) by the fused kernel, then by the
    separate ones (gemv with its norm, _rotate_and_store)."""
    n, width, has_bias, heads, kv_heads = shape
    dim = n // (heads + 2 * kv_heads)
    cfg = ModelConfig("llama", 1, hidden_size=heads * dim, intermediate_size=1, num_layers=1, num_heads=heads,
                      num_kv_heads=kv_heads)  # fmt: skip
    g = torch.Generator(device="cpu").manual_seed(0)
    rand = lambda *size: torch.randn(*size, generator=g).to(device, dtype)  # noqa: E731
    weight, bias = rand(n, width) / width**0.5, rand(n) if has_bias else None
    x, residual, norm = rand(8, width), rand(8, width), (rand(width).abs() + 0.5, 1e-6)
    caches = [KVCache(cfg, 2, 128, dtype, device, scratch=True) for _ in range(2)]
    store = []
    for cache in caches:
        for entries in cache.k + cache.v:
            entries.zero_()
        for slot, length in ((0, 75), (1, 3)):
            cache.reserve(slot, length)
        positions = torch.tensor([70, 71, 72, 73, 74, 0, 1, 2], device=device)
        row_slots = torch.tensor([0] * 5 + [1] * 3, device=device)
        angles = positions[:, None].float() * torch.linspace(0.01, 1.0, dim // 2, device=device)
        angles = torch.cat([angles, angles], -1)
        store.append(RopeStore(angles.cos().to(dtype), angles.sin().to(dtype), positions, row_slots, cache.table,
                               cache.k[0], cache.v[0], heads, kv_heads))  # fmt: skip
    fused = projected(x, weight, bias, config, norm, residual, torch.empty_like(x), store=store[0])
    qkv = gemv(x, weight, bias, config, norm, residual, torch.empty_like(x))
    parts = qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), -1)
    q, k, v = (t.unflatten(-1, (-1, dim))[:, None] for t in parts)
    separate = rotate_and_store(q, k, v, store[1]).view(8, -1)
    return (fused[:, : heads * dim], *caches[0].k, *caches[0].v), (separate, *caches[1].k, *caches[1].v)
