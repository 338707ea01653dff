"""The QKV projection of fixed-shape forwards at a few rows, with the attention's first step in its epilogue.

Between the QKV projection and the attention kernel, the paged path runs a kernel of its own
(paged_attention._rotate_and_store) that rotates the new rows' queries and keys and writes keys and values into their
KV blocks: a launch a layer, a few microseconds in a graph however small its work, and a draft model's layers are
bound by their launches (docs/decisions.md#rope-and-the-cache-write-in-the-qkv-projection). Here the projection's
kernel (executor/gemv.py) does it as it writes its outputs: a program takes pairs of columns that RoPE rotates
together (d and d + D/2 of a head), so that both sums of a pair are in one program. Rotated queries go to the
projection's output, where the attention kernel reads them, keys and values straight to their blocks. Where K is
split across programs, the kernel that merges the splits rotates and stores instead.

Each value is rounded where the separate kernels round it (the projection's output type, then RoPE in float32), and
a row's result depends on its own inputs alone. Start-up checks the fused projection against the separate kernels at
each layer shape's configuration; where they disagree, that shape's layers keep the separate kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import triton
import triton.language as tl

from ..kv_cache import KEY_TILE
from ..models.layers import RMSNorm, fused_form
from .gemv import NORMED, PLAIN, TILE_ROWS, GemvConfig, product, split_sums
from .kv_layout import key_offset, value_offset


@dataclass(frozen=True)
class RopeStore:
    """What the epilogue needs of a layer's attention: each row's RoPE tables, and where its keys and values go."""

    cos: torch.Tensor  # [M, D], each row's
    sin: torch.Tensor
    positions: torch.Tensor  # [M]
    row_slots: torch.Tensor  # [M] the cache slot of each row's sequence
    table: torch.Tensor  # [slots, blocks] the cache's block table
    k_cache: torch.Tensor  # the layer's keys [blocks, Hkv, BS / KEY_TILE, D, KEY_TILE]
    v_cache: torch.Tensor  # and values [blocks, Hkv, BS, D]
    heads: int
    kv_heads: int

    @property
    def dim(self) -> int:
        return self.cos.shape[-1]

    def operands(self) -> tuple:
        blocks = self.table.shape[1]
        return self.cos, self.sin, self.positions, self.row_slots, self.table, blocks, self.k_cache, self.v_cache

    def constants(self) -> dict:
        return dict(H=self.heads, HKV=self.kv_heads, D=self.dim, BS=self.v_cache.shape[2], KEY_TILE=KEY_TILE)


@triton.jit(do_not_specialize=["M"])
def _projected(
    x, w, bias, y, M, N, K, res, res_out, norm_w, eps,  # as executor/gemv._gemv's, K in one part
    cos, sin, positions, row_slots, table, max_blocks, k_cache, v_cache,  # RopeStore's
    HAS_BIAS: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, TILE: tl.constexpr,
    H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, KEY_TILE: tl.constexpr,
):  # fmt: skip
    """Program (j, i): rows TILE i.. and the BLOCK_N / 2 column pairs j.. (a pair: column d of a head and d + D/2) of
    x W^T (+ bias), rotated and stored."""
    j, i = tl.program_id(0), tl.program_id(1)
    rows = i * TILE + tl.arange(0, TILE)
    pairs = j * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    first = (pairs // (D // 2)) * D + pairs % (D // 2)
    second = first + D // 2
    cols = tl.reshape(tl.join(first, second), [BLOCK_N])  # a pair's columns side by side
    acc = product(x, w, res, res_out, norm_w, eps, rows, cols, 0, j == 0, M, N, K, K, PROLOGUE, HAS_RES, BLOCK_K)
    if HAS_BIAS:
        acc += tl.load(bias + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    acc = acc.to(y.dtype.element_ty).to(tl.float32)  # the projection's output as the separate kernel reads it
    low, high = tl.split(tl.reshape(acc, [TILE, BLOCK_N // 2, 2]))
    block, at = _rows_blocks(table, row_slots, positions, rows, M, max_blocks, BS)
    operands = (rows, M, N, y, cos, sin, block, at, k_cache, v_cache)
    _rotated_and_stored(low, high, first, *operands, H, HKV, D, BS, KEY_TILE)
    _rotated_and_stored(high, low, second, *operands, H, HKV, D, BS, KEY_TILE)


@triton.jit(do_not_specialize=["M"])
def _merged(
    part, bias, y, M, N, cos, sin, positions, row_slots, table, max_blocks, k_cache, v_cache,
    HAS_BIAS: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr,
    H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, KEY_TILE: tl.constexpr,
):  # fmt: skip
    """Program p: columns BLOCK p.. of every row (M <= TILE), their splits' sums (part [SPLITS, M, N]) added in split
    order as gemv._sum_splits adds them, and their partners' (d + D/2 or d - D/2), rotated and stored."""
    rows = tl.arange(0, TILE)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    partners = tl.where(cols % D < D // 2, cols + D // 2, cols - D // 2)
    values = _split_sums(part, bias, rows, cols, M, N, HAS_BIAS, SPLITS).to(y.dtype.element_ty).to(tl.float32)
    others = _split_sums(part, bias, rows, partners, M, N, HAS_BIAS, SPLITS).to(y.dtype.element_ty).to(tl.float32)
    block, at = _rows_blocks(table, row_slots, positions, rows, M, max_blocks, BS)
    operands = (rows, M, N, y, cos, sin, block, at, k_cache, v_cache)
    _rotated_and_stored(values, others, cols, *operands, H, HKV, D, BS, KEY_TILE)


@triton.jit
def _split_sums(part, bias, rows, cols, M, N, HAS_BIAS: tl.constexpr, SPLITS: tl.constexpr):
    held = (rows < M)[:, None] & (cols < N)[None, :]
    at = rows[:, None] * N + cols[None, :]
    total = tl.load(part + at, mask=held, other=0.0)
    for s in range(1, SPLITS):
        total += tl.load(part + s * M * N + at, mask=held, other=0.0)
    if HAS_BIAS:
        total += tl.load(bias + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    return total


@triton.jit
def _rows_blocks(table, row_slots, positions, rows, M, max_blocks, BS: tl.constexpr):
    """Each row's KV block (int64; rows past M: none, masked) and its position in it."""
    real = rows < M
    position = tl.load(positions + rows, mask=real, other=0)
    block = tl.load(table + tl.load(row_slots + rows, mask=real, other=0) * max_blocks + position // BS, mask=real)
    return block.to(tl.int64), position % BS


@triton.jit
def _rotated_and_stored(
    values, partners, cols, rows, M, N, y, cos, sin, block, at, k_cache, v_cache,
    H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, KEY_TILE: tl.constexpr,
):  # fmt: skip
    """values [rows, cols] of the projection (float32) with their partners' (column d + D/2 of the head where d < D/2,
    else d - D/2): queries rotated into y, keys rotated and values as they are at position `at` of each row's `block`,
    as paged_attention._rotate_and_store computes and places them."""
    real = rows < M
    head, d = cols // D, cols % D
    held = real[:, None] & (cols < N)[None, :]
    sign = tl.where(d < D // 2, -1.0, 1.0)
    c = tl.load(cos + rows[:, None] * D + d[None, :], mask=held, other=0.0).to(tl.float32)
    s = tl.load(sin + rows[:, None] * D + d[None, :], mask=held, other=0.0).to(tl.float32)
    rotated = values * c + sign[None, :] * partners * s
    tl.store(y + rows[:, None] * N + cols[None, :], rotated.to(y.dtype.element_ty), mask=held & (head < H)[None, :])
    base = block[:, None] * HKV + tl.where(head < H + HKV, head - H, head - H - HKV)[None, :]
    key_at = key_offset(base, at[:, None], d[None, :], BS, KEY_TILE, D)
    is_key = (head >= H) & (head < H + HKV)
    tl.store(k_cache + key_at, rotated.to(k_cache.dtype.element_ty), mask=held & is_key[None, :])
    value_at = value_offset(base, at[:, None], d[None, :], BS, D)
    tl.store(v_cache + value_at, values.to(v_cache.dtype.element_ty), mask=held & (head >= H + HKV)[None, :])


MERGED_COLUMNS = 64  # columns of every row a merging program takes


def projected(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: GemvConfig,
    norm: tuple[torch.Tensor, float] | None = None,
    residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    *,
    store: RopeStore,
) -> torch.Tensor:
    """x [M, K] (M <= 16) @ weight [N, K]^T (+ bias), a QKV projection, as gemv.gemv computes it (norm, residual,
    residual_out alike), its queries rotated in the output [M, N] (the rest of it left unwritten), its keys rotated
    and its values written into the cache where `store` says."""
    rows, k = x.shape
    n = weight.shape[0]
    if rows > TILE_ROWS or n != (store.heads + 2 * store.kv_heads) * store.dim or store.dim % 2:
        raise ValueError(f"{rows} rows of {n} columns are not a QKV projection of at most {TILE_ROWS} rows")
    y = torch.empty(rows, n, device=x.device, dtype=x.dtype)
    has = dict(HAS_BIAS=bias is not None, **store.constants())
    if config.splits > 1:
        part = split_sums(x, weight, config, norm, residual, residual_out)
        _merged[(triton.cdiv(n, MERGED_COLUMNS),)](
            part, y if bias is None else bias, y, rows, n, *store.operands(),
            SPLITS=config.splits, BLOCK=MERGED_COLUMNS, TILE=TILE_ROWS, **has,
        )  # fmt: skip
        return y
    norm_weight, eps = norm if norm is not None else (y, 0.0)
    _projected[(triton.cdiv(n, config.block_n), 1)](
        x, weight, y if bias is None else bias, y, rows, n, k,
        y if residual is None else residual, y if residual_out is None else residual_out, norm_weight, eps,
        *store.operands(), PROLOGUE=NORMED if norm is not None else PLAIN, HAS_RES=residual is not None,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, TILE=TILE_ROWS, num_warps=config.warps,
        num_stages=config.stages, **has,
    )  # fmt: skip
    return y


def rotated_projection(attention, norm, x: torch.Tensor, residual: torch.Tensor | None, store: RopeStore):
    """(the layer's QKV projection of norm(x + residual) [..., N], its queries rotated, x + residual), its keys and
    values in the cache: by the projection's kernel (and the merge of K's splits), where it takes this call and passed
    the start-up check; else None."""
    linear = attention.qkv_proj  # (DeepSeek's latent projection has no kernel of its own)
    takes = getattr(getattr(linear, "kernel", None), "rope_epilogue", False) and isinstance(norm, RMSNorm)
    normed = fused_form(linear, "normed") if takes else None
    return None if normed is None else normed(linear, norm, x, residual, partial(projected, store=store))
