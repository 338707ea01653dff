"""GGUF block formats as the low-bit kernel computes them (kernels/lowbit.c).

Every format is an integer q per weight, a float scale per sub-block of 32 (16 for Q6_K) weights -- d, or
for the K formats d per super-block times an integer sc -- and a zero point or a float min per sub-block.
`split` turns GGUF blocks into `BlockArrays` (q in weight order, one row per output row), `pack` moves
them into the kernel's layout and `unpack` back; no value is changed on the way. `quantize_q8_0` and
`quantize_4bit` make such arrays from float weights (float checkpoints, and drafts requantized to 4 bits).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from gguf import GGMLQuantizationType as T

GROUP = 16  # output rows per group in the kernel's layout (one vector lane each)


@dataclass(frozen=True)
class Format:
    name: str
    id: int  # the kernel's format number
    bits: int  # 3, 4, 5, 6 or 8 (signed)
    sub: int  # weights per scale
    zero: int  # integer zero point (0: none)
    sc: str | None  # integer scale per sub-block: "u8", "i8" or None
    min: str | None  # float min per 32 weights: "d" (dmin), "d*mn" (dmin times an integer mn) or None


FORMATS = {
    f.name: f
    for f in (
        Format("Q4_0", 0, 4, 32, 8, None, None),
        Format("Q4_1", 1, 4, 32, 0, None, "d"),
        Format("Q5_0", 2, 5, 32, 16, None, None),
        Format("Q5_1", 3, 5, 32, 0, None, "d"),
        Format("Q8_0", 4, 8, 32, 0, None, None),
        Format("Q4_K", 5, 4, 32, 0, "u8", "d*mn"),
        Format("Q5_K", 6, 5, 32, 0, "u8", "d*mn"),
        Format("Q6_K", 7, 6, 16, 32, "i8", None),
        Format("Q3_K", 8, 3, 16, 4, "i8", None),
    )
}
BY_ID = {f.id: f for f in FORMATS.values()}


@dataclass
class BlockArrays:
    """One tensor in a format, per output row: q [rows, K] (uint8; int8 for Q8_0), sc [rows, K/sub],
    mn [rows, K/32], d [rows, K/sub/S], dmin [rows, K/32/S] (float32); S sub-blocks share a d."""

    format: Format
    q: torch.Tensor
    d: torch.Tensor
    S: int = 1
    sc: torch.Tensor | None = None
    mn: torch.Tensor | None = None
    dmin: torch.Tensor | None = None
    rows: int = field(init=False)

    def __post_init__(self):
        self.rows = self.q.shape[0]

    def select(self, ids: torch.Tensor) -> "BlockArrays":
        pick = lambda t: None if t is None else t[ids]  # noqa: E731
        return replace(self, q=self.q[ids], d=self.d[ids], sc=pick(self.sc), mn=pick(self.mn), dmin=pick(self.dmin))

    def padded(self) -> "BlockArrays":
        """Rows up to a multiple of the kernel's groups, the extra ones all zero (weights 0)."""
        extra = -self.rows % GROUP
        if not extra:
            return self
        pad = lambda t: None if t is None else torch.cat([t, t.new_zeros(extra, *t.shape[1:])])  # noqa: E731
        return replace(self, q=pad(self.q), d=pad(self.d), sc=pad(self.sc), mn=pad(self.mn), dmin=pad(self.dmin))


# ---- GGUF blocks -> BlockArrays ------------------------------------------------------------------------------
def _f16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).float().squeeze(-1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes per 32 weights (low nibbles first, then high) -> the 32 values."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """4 bytes (a little-endian uint32, bit i for weight i) -> [.., 32] of 0/16."""
    bits = torch.stack([(qh >> i) & 1 for i in range(8)], dim=-1)  # [.., 4 bytes, 8]
    return bits.reshape(*qh.shape[:-1], 32) << 4


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins for eight sub-blocks."""
    p = packed.int()
    low, high, tail = p[..., 0:4], p[..., 4:8], p[..., 8:12]
    sc = torch.cat([low & 63, (tail & 0xF) | ((low >> 6) << 4)], dim=-1)
    mn = torch.cat([high & 63, (tail >> 4) | ((high >> 6) << 4)], dim=-1)
    return sc.to(torch.uint8), mn.to(torch.uint8)


def split(qtype: T, blocks: torch.Tensor) -> BlockArrays:
    """GGUF blocks [rows, bytes per row] of `qtype` -> BlockArrays (values as stored)."""
    rows = blocks.shape[0]
    fmt = FORMATS.get(qtype.name)
    if fmt is None:
        raise ValueError(f"no kernel for GGUF type {qtype.name}")
    size = {
        "Q4_0": 18,
        "Q4_1": 20,
        "Q5_0": 22,
        "Q5_1": 24,
        "Q8_0": 34,
        "Q4_K": 144,
        "Q5_K": 176,
        "Q6_K": 210,
        "Q3_K": 110,
    }
    b = blocks.reshape(rows, -1, size[fmt.name])
    flat = lambda t: t.reshape(rows, -1)  # noqa: E731
    if fmt.name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        has_min, five = fmt.min is not None, fmt.bits == 5
        at = 4 if has_min else 2
        q = _nibbles(b[..., at + 4 * five :])
        if five:
            q = q | _fifth_bits(b[..., at : at + 4])
        return BlockArrays(
            fmt, flat(q).to(torch.uint8), flat(_f16(b[..., 0:2])), dmin=flat(-_f16(b[..., 2:4])) if has_min else None
        )
    if fmt.name == "Q8_0":
        return BlockArrays(fmt, flat(b[..., 2:].contiguous().view(torch.int8)), flat(_f16(b[..., 0:2])))
    if fmt.name == "Q6_K":
        ql, qh = b[..., :128].reshape(rows, -1, 2, 64), b[..., 128:192].reshape(rows, -1, 2, 32)
        low = torch.stack([ql[..., :32] & 0xF, ql[..., 32:] & 0xF, ql[..., :32] >> 4, ql[..., 32:] >> 4], dim=-2)
        top = torch.stack([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], dim=-2)
        return BlockArrays(
            fmt,
            flat(low | (top << 4)),
            flat(_f16(b[..., 208:210])),
            S=16,
            sc=flat(b[..., 192:208].contiguous().view(torch.int8)),
        )
    if fmt.name == "Q3_K":
        return _split_q3_k(fmt, b, rows)
    sc, mn = _k_scales(b[..., 4:16])  # Q4_K, Q5_K
    if fmt.name == "Q4_K":
        q = _nibbles(b[..., 16:].reshape(rows, -1, 4, 32))  # 64 weights per 32 bytes
    else:
        low = _nibbles(b[..., 48:].reshape(rows, -1, 4, 32)).reshape(rows, -1, 8, 32)
        qh = b[..., 16:48].unsqueeze(-2)  # bit i of byte l: weight l of sub-block i
        q = low | (((qh >> torch.arange(8, dtype=torch.uint8).view(8, 1)) & 1) << 4)
    return BlockArrays(
        fmt, flat(q), flat(_f16(b[..., 0:2])), S=8, sc=flat(sc), mn=flat(mn), dmin=flat(_f16(b[..., 2:4]))
    )


def _split_q3_k(fmt: Format, b: torch.Tensor, rows: int) -> BlockArrays:
    """Q3_K's 110 bytes per 256 weights: a high bit per weight (bit i of byte l: weight 32 i + l), two low
    bits (bits 2s of byte 32 h + l: weight 32 (4 h + s) + l), sixteen 6-bit scales stored plus 32 (low
    nibbles of bytes 0-7, then their high nibbles; top bit pairs in bytes 8-11), and d."""
    hmask, qs, packed = b[..., 0:32], b[..., 32:96].reshape(rows, -1, 2, 1, 32), b[..., 96:108]
    low = ((qs >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)) & 3).reshape(rows, -1, 256)
    high = ((hmask.unsqueeze(-2) >> torch.arange(8, dtype=torch.uint8).view(8, 1)) & 1).reshape(rows, -1, 256)
    nibbles = torch.cat([packed[..., :8] & 0xF, packed[..., :8] >> 4], dim=-1)
    tops = torch.cat([(packed[..., 8:12] >> shift) & 3 for shift in (0, 2, 4, 6)], dim=-1)
    sc = ((nibbles | (tops << 4)).to(torch.int16) - 32).to(torch.int8)
    return BlockArrays(
        fmt,
        (low | (high << 2)).reshape(rows, -1),
        _f16(b[..., 108:110]).reshape(rows, -1),
        S=16,
        sc=sc.reshape(rows, -1),
    )


# ---- BlockArrays <-> the kernel's layout ---------------------------------------------------------------------
def _by_group(per_row: torch.Tensor) -> torch.Tensor:
    """[rows, n] -> [groups, n, 16]: the 16 rows of a group side by side, one per lane."""
    return per_row.reshape(-1, GROUP, per_row.shape[1]).transpose(1, 2).contiguous()


def _by_row(per_group: torch.Tensor) -> torch.Tensor:
    return per_group.transpose(1, 2).reshape(-1, per_group.shape[1])


def pack(a: BlockArrays) -> dict[str, torch.Tensor]:
    """The kernel's buffers (see lowbit.c): lo (and hi for 5/6 bits), sc, mn, d, dmin by group of 16 rows."""
    a = a.padded()
    rows, cols = a.q.shape
    groups = rows // GROUP
    out = {name: _by_group(t) for name in ("sc", "mn", "d", "dmin") if (t := getattr(a, name)) is not None}
    if a.format.bits == 8:
        out["lo"] = a.q.reshape(groups, GROUP, cols // 4, 4).permute(0, 2, 1, 3).contiguous().view(torch.uint8)
        return out
    q = a.q.reshape(groups, GROUP, cols // 8, 8).permute(0, 2, 1, 3)  # [G, K/8, 16 rows, 8 weights]
    low, top = q & 0xF, q >> 4
    out["lo"] = (low[..., :4] | (low[..., 4:] << 4)).contiguous()  # [G, K/8, 16, 4]: lane = row * 4 + e
    if a.format.bits > 4:
        pairs = (top[..., :4] | (top[..., 4:] << 2)).reshape(groups, cols // 8, 64)  # per lane: (e, 4+e)
        out["hi"] = (pairs[..., :32] | (pairs[..., 32:] << 4)).contiguous()
    return out


def unpack(fmt: Format, S: int, packed: dict[str, torch.Tensor]) -> BlockArrays:
    """The inverse of pack (rows padded by pack included)."""
    lo = packed["lo"]
    if fmt.bits == 8:
        q = lo.view(torch.int8).permute(0, 2, 1, 3).reshape(lo.shape[0] * GROUP, -1)
    else:
        groups, chunks = lo.shape[:2]
        q = torch.stack([lo & 0xF, lo >> 4], dim=3)  # [G, K/8, 16, 2, 4]
        if fmt.bits > 4:
            pairs = torch.cat([packed["hi"] & 0xF, packed["hi"] >> 4], dim=-1).reshape(groups, chunks, GROUP, 4)
            q = q | (torch.stack([pairs & 3, pairs >> 2], dim=3) << 4)
        q = q.permute(0, 2, 1, 3, 4).reshape(groups * GROUP, -1)
    rows = {name: _by_row(packed[name]) for name in ("sc", "mn", "dmin") if name in packed}
    return BlockArrays(fmt, q, _by_row(packed["d"]), S=S, **rows)


# ---- float weights -> BlockArrays ----------------------------------------------------------------------------
# MXFP4's 4-bit codes as integers: E2M1 values (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives) times 2, with the
# block's scale 2^(e - 127) halved to match (ggml's kvalues_mxfp4)
MXFP4_VALUES = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.int8)


def mxfp4_as_q8_0(blocks: torch.Tensor) -> BlockArrays:
    """MXFP4 blocks [rows, 17 bytes per 32 weights: the shared exponent e, then 32 codes, the first 16 in the low
    nibbles] -> Q8_0 arrays holding the same values exactly: each code's integer, under the power of two 2^(e - 128)
    as the block's float32 scale. gpt-oss's experts come so (twice MXFP4's bytes, none of a requantization's error)."""
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, 17)
    codes = _nibbles(b[..., 1:]).long()
    scales = torch.ldexp(torch.ones(b.shape[:-1]), b[..., 0].to(torch.int32) - 128)
    return BlockArrays(FORMATS["Q8_0"], MXFP4_VALUES[codes].reshape(rows, -1), scales)


# GGUF block types that no kernel computes as stored but Q8_0 holds exactly: each type's conversion of its blocks
EXACTLY_AS_Q8_0 = {"MXFP4": mxfp4_as_q8_0}


def quantize_q8_0(w: torch.Tensor) -> BlockArrays:
    """Float weights [rows, K] -> int8 per weight with a float scale per 32 (llama.cpp's Q8_0, with a
    float32 d): near-lossless, for float checkpoints and the w8a8 backend."""
    rows, cols = w.shape
    g = w.float().reshape(rows, cols // 32, 32)
    d = g.abs().amax(-1) / 127
    q = (g / d.clamp(min=1e-30)[..., None]).round().clamp(-127, 127).to(torch.int8)
    return BlockArrays(FORMATS["Q8_0"], q.reshape(rows, cols), d)


def quantize_4bit(w: torch.Tensor) -> BlockArrays:
    """Float weights [rows, K] -> Q4_K-style arrays: 4-bit values with an 8-bit scale and min per 32 weights
    and float d, dmin per (up to) 8 such sub-blocks. Lossy: for draft models, whose weights only propose."""
    rows, cols = w.shape
    nsub = cols // 32
    per_super = max(s for s in range(1, 9) if nsub % s == 0)
    g = w.float().reshape(rows, nsub, 32)
    low, high = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    step, shift = ((high - low) / 15).reshape(rows, -1, per_super), (-low).reshape(rows, -1, per_super)
    d = step.amax(-1).clamp(min=1e-12) / 255
    dmin = shift.amax(-1).clamp(min=1e-12) / 255
    sc = (step / d[..., None]).round().clamp(1, 255)
    mn = (shift / dmin[..., None]).round().clamp(0, 255)
    scale, offset = (d[..., None] * sc).reshape(rows, nsub, 1), (dmin[..., None] * mn).reshape(rows, nsub, 1)
    q = ((g + offset) / scale).round().clamp(0, 15).to(torch.uint8).reshape(rows, cols)
    return BlockArrays(
        FORMATS["Q4_K"],
        q,
        d,
        S=per_super,
        sc=sc.to(torch.uint8).reshape(rows, -1),
        mn=mn.to(torch.uint8).reshape(rows, -1),
        dmin=dmin,
    )
