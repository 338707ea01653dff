"""Where the GPU's Triton kernels find a position's key and value in a layer's KV blocks, laid out as kv_cache.KVCache
lays them: keys [blocks, Hkv, BS / TILE, D, TILE] (a tile of positions, dimension-major), values [blocks, Hkv, BS, D].
`base` is block * Hkv + the KV head (int64); the arguments broadcast, so one call places a row, a tile or a span."""

import triton
import triton.language as tl


@triton.jit
def key_offset(base, at, d, BS: tl.constexpr, TILE: tl.constexpr, D: tl.constexpr):
    """The element of the key at position `at` of its block, dimension d."""
    return (base * (BS // TILE) + at // TILE) * D * TILE + d * TILE + at % TILE


@triton.jit
def value_offset(base, at, d, BS: tl.constexpr, D: tl.constexpr):
    """The element of the value at position `at` of its block, dimension d."""
    return (base * BS + at) * D + d
