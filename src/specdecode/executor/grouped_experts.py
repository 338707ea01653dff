"""A mixture of experts' MLP on a GPU with no wait on the host, so that its forwards can be captured as CUDA graphs.

PyTorch's path (models/layers.SparseMoE) groups a call's rows by expert on the host: each expert's rows found by
`nonzero`, a decoded token's experts read one by one, each a wait for the device (8 to 128 a layer), and a forward no
graph can hold. Here, as in vLLM's fused_moe, everything stays on the device and its shapes depend on the call's rows
alone:
- `_routed` routes a tile of rows as Router does (logits, softmax, top-k, rescaled where the family does), each row's
  experts in ascending order;
- `_count_pairs` and `_place_pairs` (a program an expert) give each (row, expert) pair a place in its expert's group,
  the groups padded to BLOCK_M places, and each block of BLOCK_M places its expert (NUM_EXPERTS past the last group:
  such programs return at once);
- `_experts_matmul` multiplies a block's pairs by BLOCK_N rows of its expert's weight: gate/up, then down with the
  activation taken in;
- `_sum_experts` sums each row's experts in ascending order, as SparseMoE does.
A row's bits depend on its experts and the tiles alone, never on the rows beside it (tl.dot over tiles of BLOCK_M
rows, K in a fixed order): a verify row gets a decode row's bits, so greedy speculation reproduces plain decoding.

Without a GPU (the tests) the kernels run in Triton's interpreter (tests/conftest.py turns it on).
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from ..models.layers import SparseMoE

log = logging.getLogger(__name__)

BLOCK_M = 16  # pairs a program multiplies at once: tl.dot's least height
BLOCK_N, BLOCK_K, BLOCK_H = 64, 64, 128
PAIR_TILE = 1024  # pairs the places' programs read at a time
ACTIVATION_IDS = {"silu": 1, "gelu_tanh": 2}  # _experts_matmul's ACT (0: its input as it is)


@triton.jit
def _activated(gate, up, ACT: tl.constexpr):
    """act(gate) * up in float32."""
    gate, up = gate.to(tl.float32), up.to(tl.float32)
    if ACT == 1:
        return gate / (1.0 + tl.exp(-gate)) * up
    inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
    return 0.5 * gate * (2.0 - 2.0 / (1.0 + tl.exp(2.0 * inner))) * up  # 1 + tanh(inner)


@triton.jit
def _experts_matmul(
    x, w, y, pair_at, block_expert, N, K,  # x [rows, K] ([pairs, 2K] gate, up: ACT), w [experts, N, K], y [pairs, N]
    PER_ROW: tl.constexpr, ACT: tl.constexpr, NUM_EXPERTS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Program (i, j): the pairs at places BLOCK_M i.. times columns BLOCK_N j.. of their expert's weight. A pair's
    input is row pair // PER_ROW of x."""
    i, j = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert + i)
    if expert < NUM_EXPERTS:
        pairs = tl.load(pair_at + i * BLOCK_M + tl.arange(0, BLOCK_M))
        real = pairs >= 0
        weight = w + expert.to(tl.int64) * N * K
        rows = tl.where(real, pairs // PER_ROW, 0).to(tl.int64)
        cols = j * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            inside = real[:, None] & (ks < K)[None, :]
            if ACT == 0:
                a = tl.load(x + rows[:, None] * K + ks[None, :], mask=inside, other=0.0)
            else:
                gate = tl.load(x + rows[:, None] * (2 * K) + ks[None, :], mask=inside, other=0.0)
                up = tl.load(x + rows[:, None] * (2 * K) + K + ks[None, :], mask=inside, other=0.0)
                a = _activated(gate, up, ACT).to(x.dtype.element_ty)  # rounded where PyTorch's path rounds it
            held = (cols < N)[None, :] & (ks < K)[:, None]
            ws = tl.load(weight + cols[None, :] * K + ks[:, None], mask=held, other=0.0)
            acc += tl.dot(a, ws, input_precision="ieee")
        out = real[:, None] & (cols < N)[None, :]
        tl.store(y + pairs.to(tl.int64)[:, None] * N + cols[None, :], acc.to(y.dtype.element_ty), mask=out)


@triton.jit(do_not_specialize=["M"])
def _routed(
    x, router, chosen, weights, M, K,  # x [M, K], router [NUM_EXPERTS, K]; chosen, weights [M, TOP_K]
    NUM_EXPERTS: tl.constexpr, EXPERTS: tl.constexpr, TOP_K: tl.constexpr, NORMALIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Program i: rows BLOCK_M i.. routed as Router does (softmax over every expert's logit in float32, the top
    TOP_K kept, rescaled to sum to one where NORMALIZE), each row's experts written in ascending order beside their
    weights. EXPERTS: a power of two covering NUM_EXPERTS."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.arange(0, EXPERTS)
    logits = tl.zeros([BLOCK_M, EXPERTS], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        inside = (rows < M)[:, None] & (ks < K)[None, :]
        a = tl.load(x + rows.to(tl.int64)[:, None] * K + ks[None, :], mask=inside, other=0.0)
        held = (ids < NUM_EXPERTS)[None, :] & (ks < K)[:, None]
        w = tl.load(router + ids[None, :] * K + ks[:, None], mask=held, other=0.0)
        logits += tl.dot(a, w, input_precision="ieee")
    logits = tl.where((ids < NUM_EXPERTS)[None, :], logits, float("-inf"))
    probs = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    probs = probs / tl.sum(probs, axis=1)[:, None]
    left, kept = probs, tl.zeros([BLOCK_M, EXPERTS], dtype=tl.int32)
    for _ in tl.static_range(TOP_K):  # the most likely expert left, the lowest id on a tie
        best = tl.argmax(left, axis=1)
        kept = tl.where(ids[None, :] == best[:, None], 1, kept)
        left = tl.where(ids[None, :] == best[:, None], -1.0, left)
    weight = tl.where(kept > 0, probs, 0.0)
    if NORMALIZE:
        weight = weight / tl.sum(weight, axis=1)[:, None]
    at = rows.to(tl.int64)[:, None] * TOP_K + tl.cumsum(kept, axis=1) - 1  # ascending ids: a kept expert's rank
    out = (kept > 0) & (rows < M)[:, None]
    tl.store(chosen + at, tl.broadcast_to(ids[None, :], [BLOCK_M, EXPERTS]), mask=out)
    tl.store(weights + at, weight, mask=out)


@triton.jit
def _count_pairs(chosen, counts, P, TILE: tl.constexpr):
    """Program e: how many pairs (of the P in chosen) have expert e."""
    e = tl.program_id(0)
    total = 0
    for p0 in range(0, P, TILE):
        p = p0 + tl.arange(0, TILE)
        total += tl.sum((tl.load(chosen + p, mask=p < P, other=-1) == e).to(tl.int32), axis=0)
    tl.store(counts + e, total)


@triton.jit
def _place_pairs(
    chosen, counts, pair_at, block_expert, P, PLACES,  # pair_at [PLACES], block_expert [PLACES // BLOCK_M]
    NUM_EXPERTS: tl.constexpr, EXPERTS: tl.constexpr, TILE: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """Program e: expert e's pairs (in pair order) at its group's places, after the groups of the experts before it,
    each padded to BLOCK_M places (-1); its blocks' expert e; program 0 also gives the blocks past the last group
    NUM_EXPERTS. EXPERTS: a power of two covering NUM_EXPERTS."""
    e = tl.program_id(0)
    ids = tl.arange(0, EXPERTS)
    every = tl.load(counts + ids, mask=ids < NUM_EXPERTS, other=0)
    padded = (every + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.sum(tl.where(ids < e, padded, 0), axis=0)
    mine = tl.load(counts + e)
    end = start + (mine + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    tail = tl.where(e == 0, tl.sum(padded, axis=0), PLACES)  # program 0 marks the blocks past the last group
    seen = 0
    for p0 in range(0, P, TILE):
        p = p0 + tl.arange(0, TILE)
        here = (tl.load(chosen + p, mask=p < P, other=-1) == e).to(tl.int32)
        tl.store(pair_at + start + seen + tl.cumsum(here, axis=0) - 1, p, mask=here > 0)
        seen += tl.sum(here, axis=0)
    pad = start + mine + tl.arange(0, BLOCK_M)
    tl.store(pair_at + pad, tl.full([BLOCK_M], -1, tl.int32), mask=pad < end)
    for b0 in range(0, PLACES // BLOCK_M, TILE):
        b = b0 + tl.arange(0, TILE)
        ours = (b * BLOCK_M >= start) & (b * BLOCK_M < end)
        past = (b * BLOCK_M >= tail) & (b < PLACES // BLOCK_M)
        tl.store(block_expert + b, tl.where(ours, e, NUM_EXPERTS), mask=ours | past)


@triton.jit
def _sum_experts(y, weights, out, H, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program (n, j): row n's columns BLOCK_H j.. summed over its experts in their (ascending) order."""
    n, j = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = j * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for e in tl.static_range(TOP_K):
        weight = tl.load(weights + n * TOP_K + e).to(tl.float32)
        acc += weight * tl.load(y + (n * TOP_K + e) * H + cols, mask=cols < H, other=0.0)
    tl.store(out + n * H + cols, acc.to(out.dtype.element_ty), mask=cols < H)


def _places(chosen: torch.Tensor, experts: int, places: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each place's pair (-1: padding) and each block's expert, for the pairs' experts `chosen` [N, k]."""
    pairs, device = chosen.numel(), chosen.device
    counts = torch.empty(experts, dtype=torch.int32, device=device)
    pair_at = torch.empty(places, dtype=torch.int32, device=device)
    block_expert = torch.empty(places // BLOCK_M, dtype=torch.int32, device=device)
    tile = max(BLOCK_M, min(PAIR_TILE, triton.next_power_of_2(pairs)))
    _count_pairs[(experts,)](chosen, counts, pairs, TILE=tile)
    _place_pairs[(experts,)](
        chosen, counts, pair_at, block_expert, pairs, places, NUM_EXPERTS=experts,
        EXPERTS=triton.next_power_of_2(experts), TILE=tile, BLOCK_M=BLOCK_M,
    )  # fmt: skip
    return pair_at, block_expert


def _places_for(pairs: int, num_experts: int) -> int:
    """Places the groups of `pairs` pairs may take, padded: at most min(num_experts, pairs) groups are not empty."""
    most = pairs + min(num_experts, pairs) * (BLOCK_M - 1)
    return triton.cdiv(most, BLOCK_M) * BLOCK_M


class GroupedExperts:
    """SparseMoE's kernel on a GPU: (the SparseMoE, its flat input rows [N, hidden]) -> [N, hidden]. Its experts'
    weights stacked ([experts, 2I, hidden], [experts, hidden, I]); each expert's layers are views into them."""

    def __init__(self, moe: SparseMoE):
        self.gate_up = _stacked([e.gate_up_proj for e in moe.experts])
        self.down = _stacked([e.down_proj for e in moe.experts])
        self.act = ACTIVATION_IDS[moe.experts[0].activation]
        self.router = moe.gate.weight.detach().to(self.gate_up.dtype)  # tl.dot takes one type (a view where it is)

    def __call__(self, moe: SparseMoE, flat: torch.Tensor) -> torch.Tensor:
        flat = flat.contiguous()
        rows, hidden = flat.shape
        weights, chosen = self.routed(moe, flat)
        experts, inter = self.gate_up.shape[0], self.down.shape[2]
        pairs = chosen.numel()
        places = _places_for(pairs, experts)
        pair_at, block_expert = _places(chosen, experts, places)
        gate_up = flat.new_empty(pairs, 2 * inter)
        self._matmul(flat, self.gate_up, gate_up, pair_at, block_expert, per_row=chosen.shape[1], act=0)
        down = torch.empty(pairs, hidden, dtype=torch.float32, device=flat.device)
        self._matmul(gate_up, self.down, down, pair_at, block_expert, per_row=1, act=self.act)
        out = torch.empty_like(flat)
        top = chosen.shape[1]
        _sum_experts[(rows, triton.cdiv(hidden, BLOCK_H))](down, weights, out, hidden, TOP_K=top, BLOCK_H=BLOCK_H)
        return out

    def routed(self, moe: SparseMoE, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's experts in ascending order [N, k] and their weights (Router's definitions, float32)."""
        rows, (experts, width), top = flat.shape[0], self.router.shape, moe.gate.top_k
        chosen = torch.empty(rows, top, dtype=torch.int32, device=flat.device)
        weights = torch.empty(rows, top, dtype=torch.float32, device=flat.device)
        _routed[(triton.cdiv(rows, BLOCK_M),)](
            flat, self.router, chosen, weights, rows, width, NUM_EXPERTS=experts,
            EXPERTS=max(16, triton.next_power_of_2(experts)), TOP_K=top, NORMALIZE=moe.gate.normalize,
            BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K,
        )  # fmt: skip
        return weights, chosen

    @staticmethod
    def _matmul(x, w, y, pair_at, block_expert, per_row: int, act: int) -> None:
        experts, n, k = w.shape
        _experts_matmul[(block_expert.numel(), triton.cdiv(n, BLOCK_N))](
            x, w, y, pair_at, block_expert, n, k, PER_ROW=per_row, ACT=act, NUM_EXPERTS=experts,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        )  # fmt: skip


def _stacked(layers) -> torch.Tensor:
    """The layers' weights in one tensor [layers, N, K], each layer's weight then a view into it (no second copy)."""
    stacked = torch.stack([layer.weight.detach() for layer in layers])
    for i, layer in enumerate(layers):
        layer.weight = torch.nn.Parameter(stacked[i], requires_grad=False)
    return stacked


def attach_grouped_experts(model) -> int:
    """Give the model's mixture-of-experts layers the kernels, where they agree with PyTorch's path on the first
    layer's experts on this device (else every layer keeps PyTorch's path, the reason logged); how many it did."""
    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    if not layers or not all(m.gate.plain and m.experts[0].activation in ACTIVATION_IDS for m in layers):
        return 0
    for moe in layers:
        moe.kernel = GroupedExperts(moe)
    try:
        _check(layers[0])
    except Exception as e:  # a compiler or driver that cannot run them: PyTorch's path works everywhere
        log.warning("mixture-of-experts layers keep PyTorch's path, whose forwards wait on the host: %s", e)
        for moe in layers:
            moe.kernel = None
        return 0
    return len(layers)


@torch.inference_mode()
def _check(moe: SparseMoE) -> None:
    """The kernels against PyTorch on 19 rows through the layer's own weights: the router's weights of the experts
    the kernel chose, and each row's output as the sum of those experts' MLPs (routing compared apart: where two
    experts' probabilities nearly tie, another order of sums may choose the other)."""
    router = moe.gate.weight
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(19, router.shape[1], generator=g).to(router.device, router.dtype)
    weights, chosen = moe.kernel.routed(moe, x)
    probs = torch.softmax(torch.nn.functional.linear(x, router).float(), dim=-1).gather(1, chosen)
    if moe.gate.normalize:
        probs = probs / probs.sum(dim=-1, keepdim=True)
    torch.testing.assert_close(weights, probs, atol=2e-2, rtol=0)
    got = moe.kernel(moe, x)
    want = torch.stack([
        sum(w * moe.experts[int(e)](row[None])[0].float() for w, e in zip(ws, es))
        for row, ws, es in zip(x, weights, chosen)
    ])  # fmt: skip
    scale = want.abs().max().item() or 1.0
    torch.testing.assert_close(got.float() / scale, want / scale, atol=2e-2, rtol=0)
