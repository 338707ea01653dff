"""The linear layers of fixed-shape forwards at a few rows, in a Triton kernel that spreads a weight over the device.

At one to a few rows a linear layer only streams its weight, so its time is the weight's bytes over the bandwidth the
kernel reaches. cuBLAS picks tiles for the 1.5B's small projections that leave most of an H200 idle (the QKV
projection in 32 programs, 1.2 TB/s of its 4.1: docs/decisions.md#linear-layers-of-a-few-rows-on-a-gpu). Here a
program takes BLOCK_N of the weight's rows, a configuration may split K across programs too (their sums merged in
split order), and each layer shape takes the configuration, or cuBLAS, that is fastest on this device, timed at
start-up inside a CUDA graph on weights that do not fit in the L2 cache, as a forward reads them.

The kernel can also take in what comes before a layer, which is otherwise a kernel of its own: the residual add and
RMSNorm before the QKV and gate/up projections (models/layers.normed_linear; it writes the residual stream as it goes)
and SwiGLU before the down projection (MLP.down), rounded where the separate kernels round. Start-up checks those too:
where they disagree with the separate steps on a device, its layers take the kernel alone. They are taken only where
TAKES_PROLOGUES says.

A row is computed the same whatever rows are beside it: rows go in tiles of 16 (the matrix unit's height), so a row's
products and their order over K depend only on the layer's configuration, never on how many rows the call has. Greedy
verification then sees, in the layers that take the kernel, the bits plain decoding sees.

Without a GPU (the tests) the kernels run in Triton's interpreter (tests/conftest.py turns it on).
"""

from __future__ import annotations

import functools
import logging
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..models.layers import linear_layers, normed_and_summed
from .cuda_graphs import UNFIT_KERNEL, in_fixed_shapes

log = logging.getLogger(__name__)

TILE_ROWS = 16  # rows a program multiplies at once: tl.dot's least height
MAX_ROWS = 16  # calls of more rows keep cuBLAS, whose tiles then fill the device
TIMED_ROWS = (1, 8)  # decode, and a batch-1 verify of k + 1 rows
CHOICE = "SPECDECODE_GPU_LINEAR"  # "auto" (timed, the default), "cublas" or "triton" (the fastest configuration)
# Whether a layer's kernel takes in the norm or SwiGLU before it (where they agree on the device). Off: on an H100 the
# 1.5B's step was slower with them in at every shape timed, each program summing its rows' squares over all of K
# before its first weight load (docs/decisions.md#linear-layers-of-a-few-rows-on-a-gpu); cuda_check times both.
TAKES_PROLOGUES = False


PLAIN, NORMED, ACTIVATED = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)  # what it does to its input first


# K is an argument, not a constant: one compilation a configuration serves every layer shape (the row count is not
# specialised either: a decode's single row runs the code a verify's rows do).
@triton.jit(do_not_specialize=["M"])
def _gemv(
    x, w, bias, y, part, M, N, K, PART,  # x [M, K] ([M, 2K]: gate, up), w [N, K], y [M, N]; part [SPLITS, M, N] float32
    res, res_out, norm_w, eps,  # NORMED: x (+ res) normalised by norm_w first; the sum written to res_out
    HAS_BIAS: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLITS: tl.constexpr, TILE: tl.constexpr,
):  # fmt: skip
    """Program (j, i, s): rows TILE i.. and columns BLOCK_N j.. of x W^T over K's s-th part (PART columns)."""
    j, i, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = i * TILE + tl.arange(0, TILE)
    cols = j * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = product(x, w, res, res_out, norm_w, eps, rows, cols, s, j == 0, M, N, K, PART, PROLOGUE, HAS_RES, BLOCK_K)
    out = (rows < M)[:, None] & (cols < N)[None, :]
    if SPLITS == 1:
        if HAS_BIAS:
            acc += tl.load(bias + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y + rows[:, None] * N + cols[None, :], acc.to(x.dtype.element_ty).to(y.dtype.element_ty), mask=out)
    else:
        tl.store(part + (s * M + rows[:, None]) * N + cols[None, :], acc, mask=out)


@triton.jit
def product(
    x, w, res, res_out, norm_w, eps, rows, cols, s, writes_stream, M, N, K, PART,
    PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The rows' products with the weight rows `cols` over K's s-th part, float32 [rows, cols], what PROLOGUE says
    done to x first (NORMED: the residual stream written to res_out where writes_stream)."""
    ks = tl.arange(0, BLOCK_K)
    if PROLOGUE == NORMED:  # each row's inverse root mean square, over all of K whatever this program's part
        squares = tl.zeros([rows.shape[0]], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            h = _summed(x, res, rows, k0 + ks, M, K, HAS_RES)
            squares += tl.sum(h * h, 1)
        rstd = tl.rsqrt(squares / K + eps)
    acc = tl.zeros([rows.shape[0], cols.shape[0]], tl.float32)
    for k0 in range(0, PART, BLOCK_K):
        at = s * PART + k0 + ks
        inside = at < K
        held = (rows < M)[:, None] & inside[None, :]
        if PROLOGUE == NORMED:
            h = _summed(x, res, rows, at, M, K, HAS_RES)
            if HAS_RES and writes_stream:  # the residual stream, once
                tl.store(res_out + rows[:, None] * K + at[None, :], h.to(res_out.dtype.element_ty), mask=held)
            scale = tl.load(norm_w + at, mask=inside, other=0.0).to(tl.float32)
            xs = ((h * rstd[:, None]).to(x.dtype.element_ty).to(tl.float32) * scale[None, :]).to(x.dtype.element_ty)
        elif PROLOGUE == ACTIVATED:
            gate = tl.load(x + rows[:, None] * 2 * K + at[None, :], mask=held, other=0.0).to(tl.float32)
            up = tl.load(x + rows[:, None] * 2 * K + K + at[None, :], mask=held, other=0.0).to(tl.float32)
            xs = (gate * tl.sigmoid(gate) * up).to(x.dtype.element_ty)
        else:
            xs = tl.load(x + rows[:, None] * K + at[None, :], mask=held, other=0.0)
        ws = tl.load(w + cols[:, None] * K + at[None, :], mask=(cols < N)[:, None] & inside[None, :], other=0.0)
        acc += tl.dot(xs, tl.trans(ws), input_precision="ieee")
    return acc


@triton.jit
def _summed(x, res, rows, at, M, K, HAS_RES: tl.constexpr):
    """A block of the rows' residual stream, x + res rounded to x's type as a separate add rounds it, in float32."""
    held = (rows < M)[:, None] & (at < K)[None, :]
    h = tl.load(x + rows[:, None] * K + at[None, :], mask=held, other=0.0).to(tl.float32)
    if HAS_RES:
        h += tl.load(res + rows[:, None] * K + at[None, :], mask=held, other=0.0).to(tl.float32)
        h = h.to(x.dtype.element_ty).to(tl.float32)
    return h


@triton.jit(do_not_specialize=["M"])
def _sum_splits(x, part, bias, y, M, N, HAS_BIAS: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """Program p: entries BLOCK p.. of y, their splits' sums added in split order (and the bias), rounded to x's type
    (y may hold them wider)."""
    at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = at < M * N
    total = tl.load(part + at, mask=inside, other=0.0)
    for s in range(1, SPLITS):
        total += tl.load(part + s * M * N + at, mask=inside, other=0.0)
    if HAS_BIAS:
        total += tl.load(bias + at % N, mask=inside, other=0.0).to(tl.float32)
    tl.store(y + at, total.to(x.dtype.element_ty).to(y.dtype.element_ty), mask=inside)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int  # weight rows (output columns) a program takes
    block_k: int  # K columns a program loads at once
    splits: int = 1  # programs that share each block of columns, each over its part of K
    warps: int = 4
    stages: int = 3  # blocks of K in flight a program (the loop's software pipeline)

    def part(self, k: int) -> int:
        """K columns a split covers: whole blocks."""
        return math.ceil(k / self.splits / self.block_k) * self.block_k


# What a program takes, from narrow (a program for each 16 weight rows: ~a hundred for a 1.5B's 1,536-row layers, one
# an H200 core) to wide, and how many of K's blocks it keeps in flight; K split where N alone makes few programs (8
# splits: the down projection's long K, which cuBLAS read at 1.85 TB/s of an H100's ~3 and 4 splits at 1.79).
CONFIGS = (
    GemvConfig(16, 256),
    GemvConfig(16, 256, stages=5),
    GemvConfig(16, 512, warps=8, stages=4),
    GemvConfig(32, 256),
    GemvConfig(64, 128),
    GemvConfig(16, 256, splits=2),
    GemvConfig(16, 256, splits=4),
    GemvConfig(16, 256, splits=8),
)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: GemvConfig,
    norm: tuple[torch.Tensor, float] | None = None,
    residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    activated: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [M, K] (contiguous) @ weight [N, K]^T (+ bias) -> [M, N], rounded to x's dtype (and held as out_dtype where
    given: a float32 copy of the rounded values without a cast of its own). norm (weight, eps): x + residual (or x)
    normalised first as RMSNorm does, the sum written to residual_out; activated: x is [M, 2K], gate then up, and
    SiLU(gate) * up is taken first (SwiGLU, as one rounding)."""
    rows, n = x.shape[0], weight.shape[0]
    y = torch.empty(rows, n, device=x.device, dtype=out_dtype or x.dtype)
    prologue = (norm, residual, residual_out, activated)
    if config.splits == 1:
        _launch(x, weight, bias, y, y, config, *prologue)
        return y
    part = split_sums(x, weight, config, *prologue)
    block = 1024
    _sum_splits[(triton.cdiv(rows * n, block),)](
        x, part, y if bias is None else bias, y, rows, n, HAS_BIAS=bias is not None, SPLITS=config.splits, BLOCK=block
    )
    return y


def split_sums(x, weight, config, norm=None, residual=None, residual_out=None, activated=False) -> torch.Tensor:
    """The sums of each of a split configuration's parts of K, [splits, M, N] float32, the prologue taken in as gemv
    takes it."""
    part = torch.empty(config.splits, x.shape[0], weight.shape[0], device=x.device, dtype=torch.float32)
    _launch(x, weight, None, part, part, config, norm, residual, residual_out, activated)
    return part


def _launch(x, weight, bias, y, part, config, norm, residual, residual_out, activated) -> None:
    rows, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    prologue = NORMED if norm is not None else ACTIVATED if activated else PLAIN
    norm_weight, eps = norm if norm is not None else (y, 0.0)
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(rows, TILE_ROWS), config.splits)
    _gemv[grid](
        x, weight, y if bias is None else bias, y, part, rows, n, k, config.part(k),
        y if residual is None else residual, y if residual_out is None else residual_out, norm_weight, eps,
        HAS_BIAS=bias is not None, PROLOGUE=prologue, HAS_RES=residual is not None, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, SPLITS=config.splits, TILE=TILE_ROWS, num_warps=config.warps, num_stages=config.stages,
    )  # fmt: skip


class Gemv:
    """A Linear's kernel (models/layers.Linear.kernel): its calls of at most MAX_ROWS rows inside fixed-shape forwards
    by the Triton kernel at one configuration; None for the others, which the Linear computes itself."""

    def __init__(self, config: GemvConfig, prologues: bool = True):
        """prologues: whether it computes the norm or SwiGLU before its layer as the separate steps do on this device
        (it takes them in where TAKES_PROLOGUES too; else the model runs those apart)."""
        self.config, self.prologues = config, prologues
        self.rope_epilogue = False  # a QKV projection's: whether it takes RoPE and the cache write in (qkv_epilogue.py)

    @property
    def takes_prologues(self) -> bool:
        return self.prologues and TAKES_PROLOGUES

    def __call__(self, module, x: torch.Tensor) -> torch.Tensor | None:
        return self._run(module, x) if takes(x) else None

    def normed(self, module, norm, x: torch.Tensor, residual: torch.Tensor | None, compute=None, **out):
        """(module(norm(x + residual)), x + residual), residual None: (module(norm(x)), x), in one call
        (models/layers.normed_linear); None where the kernel does not apply. compute: gemv, or a function of its
        signature that computes the layer with more in it (qkv_epilogue.projected); out: gemv's out_dtype. Where the
        kernel does not take prologues in, the norm is computed apart and the kernel takes the rest."""
        if not takes(x):
            return None
        if not self.takes_prologues:
            h, summed = normed_and_summed(norm, x, residual)
            return self._run(module, h, compute, **out), summed
        normed = dict(norm=(norm.weight, norm.eps), **out)
        if residual is None:
            return self._run(module, x, compute, **normed), x
        summed = torch.empty_like(x, memory_format=torch.contiguous_format)
        added, stream = (t.reshape(-1, x.shape[-1]) for t in (residual.contiguous(), summed))
        return self._run(module, x, compute, residual=added, residual_out=stream, **normed), summed

    def activated(self, module, gate_up: torch.Tensor, activation: str) -> torch.Tensor | None:
        """module(SiLU(gate) * up) from the gate_up projection's output, in one call (MLP.down); None where the
        kernel does not apply (GeGLU among them)."""
        if not (self.takes_prologues and activation == "silu" and takes(gate_up)):
            return None
        return self._run(module, gate_up, activated=True)

    def _run(self, module, x: torch.Tensor, compute=None, **prologue) -> torch.Tensor:
        """The kernel over x's rows, flattened, and its output in x's leading shape (by `compute`, else gemv)."""
        compute = compute or gemv
        y = compute(x.reshape(-1, x.shape[-1]).contiguous(), module.weight, module.bias, self.config, **prologue)
        return y.view(*x.shape[:-1], y.shape[-1])


def takes(x: torch.Tensor) -> bool:
    """Whether the kernel takes a call: inside a fixed-shape forward, at most MAX_ROWS rows."""
    return x.numel() // x.shape[-1] <= MAX_ROWS and in_fixed_shapes()


@dataclass
class Timed:
    """One layer shape's seconds a call at TIMED_ROWS, by cuBLAS and by each configuration; the one chosen (None:
    cuBLAS)."""

    cublas: list[float]
    configs: dict[GemvConfig, list[float]]
    chosen: GemvConfig | None
    prologues: bool = False  # whether the chosen configuration takes in the norm and SwiGLU as the separate steps do


def attach_gemv(model) -> dict[tuple, Timed]:
    """Give each of the model's linear layers the kernel at its shape's fastest configuration, where that beats
    cuBLAS on this device (SPECDECODE_GPU_LINEAR: "auto"; "triton" takes the fastest configuration whatever cuBLAS
    does; "cublas" none). Shapes are timed once a process (a target and its draft share them). Returns each shape's
    timings, by (N, K, bias, dtype)."""
    choice = os.environ.get(CHOICE, "auto")
    if choice not in ("auto", "cublas", "triton"):
        raise ValueError(f"{CHOICE} is 'auto', 'cublas' or 'triton', not {choice!r}")
    timed = {}
    for module in linear_layers(model):
        module.kernel = None
        if choice != "cublas":
            shape = layer_shape(module)
            timed[shape] = _timed_shape(shape, str(module.weight.device), choice == "triton")
            module.kernel = None if timed[shape].chosen is None else Gemv(timed[shape].chosen, timed[shape].prologues)
    return timed


def layer_shape(module) -> tuple:
    n, k = module.weight.shape
    return n, k, module.bias is not None, module.weight.dtype


@functools.cache
def _timed_shape(shape: tuple, device: str, triton_always: bool) -> Timed:
    n, k, has_bias, dtype = shape
    copies = _weights_past_the_cache(n, k, has_bias, dtype, device)
    cublas = [seconds_a_call(copies, rows, None) for rows in TIMED_ROWS]
    configs = {c: _seconds_where_it_fits(copies, c) for c in CONFIGS}
    fastest = min(configs, key=lambda c: sum(configs[c]))
    faster = sum(configs[fastest]) < 0.97 * sum(cublas)  # 3%: the timing's noise
    chosen = fastest if math.isfinite(sum(configs[fastest])) and (triton_always or faster) else None
    if chosen is not None and not agrees(*copies[0], chosen):
        log.warning("linear layers %d x %d stay cuBLAS's: the kernel disagrees with it on this device", n, k)
        chosen = None
    prologues = chosen is not None and passes_where_it_fits(prologues_agree, *copies[0], chosen)
    if chosen is not None and not prologues:
        log.warning("linear layers %d x %d take the kernel without the norm or SwiGLU before them: its prologues "
                    "disagree with the separate steps on this device", n, k)  # fmt: skip
    del copies
    if device != "cpu":
        torch.cuda.empty_cache()  # the copies' memory back to the device, for the KV cache allocated next
    log.info("linear layers %d x %d: %s", n, k, "cuBLAS" if chosen is None else chosen)
    return Timed(cublas, configs, chosen, prologues)


def _seconds_where_it_fits(copies: list[tuple], config: GemvConfig) -> list[float]:
    """Seconds a call at each of TIMED_ROWS; infinite where the configuration does not fit this device."""
    try:
        return [seconds_a_call(copies, rows, config) for rows in TIMED_ROWS]
    except UNFIT_KERNEL as e:
        log.info("the linear layers' kernel at %s does not fit this device (%s)", config, e)
        return [math.inf] * len(TIMED_ROWS)


def passes_where_it_fits(check, *args) -> bool:
    """A start-up check whose kernels may not fit this device: where they do not, it fails (they are not taken)."""
    try:
        return check(*args)
    except UNFIT_KERNEL as e:
        log.info("%s: its kernels do not fit this device (%s)", check.__name__, e)
        return False


def _weights_past_the_cache(n: int, k: int, has_bias: bool, dtype, device: str) -> list[tuple]:
    """Copies of a random weight (and bias) whose bytes together are twice the device's L2 cache: calls over them in
    turn read each from memory, as a forward reads its layers."""
    cache = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20) if device != "cpu" else 0
    count = max(2, min(64, math.ceil(2 * cache / (n * k * torch.finfo(dtype).bits // 8))))
    weights = [torch.randn(n, k, device=device, dtype=dtype) for _ in range(count)]
    return [(w, torch.randn(n, device=device, dtype=dtype) if has_bias else None) for w in weights]


def agrees(weight: torch.Tensor, bias: torch.Tensor | None, config: GemvConfig) -> bool:
    """Whether the kernel computes x W^T (+ bias) at this configuration, within a few of the output type's last
    places, on TIMED_ROWS[-1] random rows."""
    x = torch.randn(TIMED_ROWS[-1], weight.shape[1], device=weight.device, dtype=weight.dtype)
    return _computes(gemv(x, weight, bias, config), x, weight, bias)


def prologues_agree(weight: torch.Tensor, bias: torch.Tensor | None, config: GemvConfig) -> bool:
    """Whether the kernel at this configuration takes in what the separate steps compute before its layer, within
    `agrees`' bound: RMSNorm of x + residual (the sum written as an add rounds it), and SwiGLU of gate and up."""
    rows, k, dtype = TIMED_ROWS[-1], weight.shape[1], weight.dtype
    x, residual, gate_up = (torch.randn(rows, n, device=weight.device, dtype=dtype) for n in (k, k, 2 * k))
    norm_weight = torch.rand(k, device=weight.device, dtype=dtype) + 0.5
    stream = torch.empty_like(x)
    normed = gemv(x, weight, bias, config, (norm_weight, 1e-6), residual, stream)
    summed = x + residual
    h = summed.float()
    want_normed = norm_weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    gate, up = gate_up.float().chunk(2, -1)
    activated = gemv(gate_up, weight, bias, config, activated=True)
    return (
        torch.equal(stream, summed)
        and _computes(normed, want_normed, weight, bias)
        and _computes(activated, (F.silu(gate) * up).to(dtype), weight, bias)
    )


def _computes(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether got is x W^T (+ bias) within a few of the output type's last places."""
    want = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    error = (got.float() - want).abs().max()
    return bool(error <= max(4 * torch.finfo(weight.dtype).eps, 1e-4) * want.abs().max())  # float32: sums' order


def seconds_a_call(copies: list[tuple], rows: int, config: GemvConfig | None) -> float:
    """A call's device time at `rows` rows over the copies in turn, by cuBLAS (config None) or the kernel: the calls
    captured in one CUDA graph and replayed, so that the host's launches are not what is timed."""
    x = torch.randn(rows, copies[0][0].shape[1], device=copies[0][0].device, dtype=copies[0][0].dtype)

    def calls():
        for weight, bias in copies:
            F.linear(x, weight, bias) if config is None else gemv(x, weight, bias, config)

    return graph_seconds(calls) / len(copies)


def graph_seconds(work, replays: int = 5) -> float:
    """Seconds a replay of `work` takes, captured as a CUDA graph (after a warm-up run outside it)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        work()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        work()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / replays
