"""Memory plan: place the target weights, the draft weights and the KV caches in a budget, and size the KV caches'
pools of blocks (kv_cache.py) to what fits.

The budget is a byte count (`memory_budget`, e.g. "6GiB"; the way to bound a CPU server), or on CUDA a
fraction of the device's memory (`gpu_memory_utilization`, vLLM's name). Without either, the pools hold every
one of `max_num_seqs` sequences at max_model_len tokens, as far as the memory available goes: on a CPU their pages
become resident only as blocks are first taken, so an idle server holds what its requests hold; on a GPU, what the
device has free once the weights are there. The
engine admits a request only while the pool has blocks for its longest length beside those of the running ones,
so a request waits rather than running out of memory."""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..errors import SpecDecodeError
from ..kv_cache import BLOCK_TOKENS, blocks_for

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}


def parse_bytes(size: str | int) -> int:
    """ "6GiB", "512MB", "2.5g" or a plain number of bytes."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(size))
    if not match or match.group(2).lower() not in _UNITS:
        raise SpecDecodeError(f"cannot read the memory size {size!r}; write it like 6GiB, 512MB or 8000000000")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.dim_per_head * torch.empty((), dtype=dtype).element_size()


def activation_reserve(cfg: ModelConfig, dtype: torch.dtype, max_model_len: int, max_num_seqs: int, k_max: int) -> int:
    """A generous bound on transient memory: a prefill forward's MLP and projections (a long prompt is prefilled
    in chunks, the prompts admitted together in calls of as many rows: executor/runner.py), plus the float32 logits
    of the widest verify call. A mixture of experts' row holds, on a GPU, each of its experts' gate/up and float32
    output (executor/grouped_experts.py)."""
    from ..executor.runner import PREFILL_CHUNK

    size = torch.empty((), dtype=dtype).element_size()
    rows = min(max_num_seqs * max_model_len, PREFILL_CHUNK)
    mlp = max(3 * cfg.intermediate_size, cfg.experts_per_token * (2 * cfg.expert_size + 2 * cfg.hidden_size))
    prefill = rows * (mlp + 6 * cfg.hidden_size) * size
    logits = max_num_seqs * (k_max + 1) * cfg.vocab_size * 4
    return prefill + logits


def chained_rounds_reserve(cfg: ModelConfig, max_num_seqs: int, k_max: int) -> int:
    """The most a drafter's chained rounds hold on a GPU (executor/draft_chain.py), per bucket of B sequences (powers
    of two: together under twice the largest): the first round's logits, [B, V] float32, and where they sample q,
    [B, rounds + 1, V] float32 for each number of rounds from 1 to k_max - 1."""
    largest = 1 << (max_num_seqs - 1).bit_length()
    return 2 * largest * (k_max * (k_max + 1) // 2) * cfg.vocab_size * 4


@dataclass
class MemoryPlan:
    budget_bytes: int | None
    target_weight_bytes: int
    draft_weight_bytes: int
    reserve_bytes: int  # activations, and on a GPU what captured graphs and a drafter's chained rounds hold
    kv_bytes_per_token: int  # target and draft caches together, a draft head's unread features, a CPU's text indexes
    max_model_len: int
    num_slots: int  # sequences at once
    num_blocks: int  # KV blocks in each model's pool
    block_size: int = BLOCK_TOKENS
    available_bytes: int | None = None  # without a budget: what the pools were sized by (free GPU or available RAM)

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.block_size * self.kv_bytes_per_token

    @property
    def max_cached_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def fixed_bytes(self) -> int:
        """What does not grow with the tokens held: the weights and the activations' reserve."""
        return self.target_weight_bytes + self.draft_weight_bytes + self.reserve_bytes

    def budget_holding(self, blocks: int) -> int:
        """The memory budget that holds the fixed bytes and this many KV blocks."""
        return self.fixed_bytes + blocks * self.block_size * self.kv_bytes_per_token

    def summary(self) -> str:
        budget = format_bytes(self.budget_bytes) if self.budget_bytes else "none set"
        if self.available_bytes is not None:
            available = format_bytes(self.available_bytes)
            budget += f"; KV cache ≤ {AVAILABLE_SHARE:.0%} of the {available} available beside the activations"
        return (
            f"memory plan (budget {budget}): target weights {format_bytes(self.target_weight_bytes)}, "
            f"draft weights {format_bytes(self.draft_weight_bytes)}, activations ≤ "
            f"{format_bytes(self.reserve_bytes)}, KV cache ≤ {format_bytes(self.kv_cache_bytes)} "
            f"({format_bytes(self.kv_bytes_per_token)}/token, resident as used) = {self.max_cached_tokens} "
            f"tokens in blocks of {self.block_size}, for up to {self.num_slots} sequences of ≤ "
            f"{self.max_model_len} tokens"
        )

    def as_dict(self) -> dict:
        return {**self.__dict__, "kv_cache_bytes": self.kv_cache_bytes, "max_cached_tokens": self.max_cached_tokens}


def resolve_budget(
    device: torch.device, memory_budget: str | int | None, gpu_memory_utilization: float | None
) -> int | None:
    if memory_budget is not None:
        return parse_bytes(memory_budget)
    if gpu_memory_utilization is None or device.type != "cuda":
        return None
    if not 0 < gpu_memory_utilization <= 1:
        raise SpecDecodeError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    return int(torch.cuda.get_device_properties(device).total_memory * gpu_memory_utilization)


# Of the memory available when no budget is set (beside the activations' reserve), what the KV pools may come to hold
AVAILABLE_SHARE = 0.8


def kv_share(available: int, reserve: int) -> int:
    """What the KV pools may come to hold of `available` bytes beside the activations' reserve, with no budget set."""
    return int((available - reserve) * AVAILABLE_SHARE)


def available_memory(device: torch.device) -> int | None:
    """Bytes this process could take now: what a GPU has free, or what the OS could give (Linux's MemAvailable); None
    where it does not say."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] if torch.cuda.is_available() else None
    try:
        with open("/proc/meminfo") as f:
            line = next(line for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None
    return int(line.split()[1]) * 1024


def split_sums_reserve(models: list) -> int:
    """The float32 partial sums one call of a GPU's paged attention kernels holds at most (MAX_PARTIALS rows x splits,
    a query head's max, total and weighted values each): made layer by layer in an eager call (executor/paged_rows.py),
    whatever its rows' MLP and logits take."""
    from ..executor.cuda_graphs import MAX_PARTIALS

    return max(MAX_PARTIALS * m.cfg.num_heads * (m.cfg.dim_per_head + 2) * 4 for m in models)


def captured_outputs_reserve(models: list, max_model_len: int, max_num_seqs: int) -> int:
    """What the models' captured graphs keep in outputs at most (executor/cuda_graphs.kept_output_bytes)."""
    from ..executor.cuda_graphs import kept_output_bytes
    from ..executor.runner import fixed_shapes_by_default

    keys = blocks_for(max_model_len) * BLOCK_TOKENS
    return sum(kept_output_bytes(m, max_num_seqs, keys) for m in models if fixed_shapes_by_default(m))


def context_that_fits(
    model: torch.nn.Module, context: int, budget_bytes: int | None, max_num_seqs: int = 1, k_max: int = 0
) -> int:
    """`context`, or where one sequence of it would not fit its model's KV cache in the memory it may take (what the
    budget leaves beside the weights and activations, else AVAILABLE_SHARE of what is available now beside the
    activations, as plan_memory reckons), the most whole blocks that do, said in a warning (DeepSeek's cache, expanded
    per head, would take 51 GiB at V2-Lite's 163,840 tokens). A draft's cache takes its share later (plan_memory),
    which may then refuse."""
    per_token = kv_bytes_per_token(model.cfg, model.kv_dtype)
    reserve = activation_reserve(model.cfg, model.dtype, context, max_num_seqs, k_max)
    if budget_bytes is not None:
        room = budget_bytes - model.weight_bytes() - reserve
    else:
        available = available_memory(model.device)
        room = None if available is None else kv_share(available, reserve)
    if room is None or context * per_token <= room:
        return context
    fits = max(BLOCK_TOKENS, room // per_token // BLOCK_TOKENS * BLOCK_TOKENS)
    warnings.warn(
        f"the model's context of {context:,} tokens would take {format_bytes(context * per_token)} of KV cache, more "
        f"than the memory there is for it ({format_bytes(max(room, 0))}): sequences are served up to {fits:,} tokens; "
        "set max_model_len to choose",
        stacklevel=4,
    )
    return fits


def _bytes_per_token(target, draft, features: bool, host_bytes_per_token: int) -> int:
    """What each token of a running sequence holds: the target's KV entries, a draft's (a self-draft's too: its own
    pool), a head's unread feature row, and on a CPU the proposers' indexes of the text."""
    per_token = kv_bytes_per_token(target.cfg, target.kv_dtype)
    if draft is not None:
        per_token += kv_bytes_per_token(draft.cfg, draft.kv_dtype)
    if features:
        per_token += target.cfg.hidden_size * torch.empty((), dtype=target.dtype).element_size()
    return per_token + (host_bytes_per_token if target.device.type == "cpu" else 0)


def _blocks_available(device: torch.device, plan: MemoryPlan, per_block: int) -> int:
    """The blocks of an unbudgeted plan: all it wants, as far as the memory available goes beside the reserve (on a
    CPU at least one sequence's, its pages resident only as used; a GPU's pools are taken whole at start-up)."""
    available = plan.available_bytes = available_memory(device)
    if available is None:
        return plan.num_blocks
    one_sequence = blocks_for(plan.max_model_len)
    share = kv_share(available, plan.reserve_bytes)
    if device.type == "cuda" and share < one_sequence * per_block:
        raise SpecDecodeError(
            f"the GPU has {format_bytes(available)} free beside the weights, short of the activations "
            f"({format_bytes(plan.reserve_bytes)}) and one sequence of {plan.max_model_len} tokens "
            f"({format_bytes(one_sequence * per_block)} of KV cache) with room to spare; lower max_model_len or "
            "max_num_seqs, or set gpu_memory_utilization"
        )
    return max(one_sequence, min(plan.num_blocks, share // per_block))


def plan_memory(
    target: torch.nn.Module,
    draft: torch.nn.Module | None,
    max_model_len: int,
    max_num_seqs: int,
    k_max: int,
    budget_bytes: int | None,
    features: bool = False,
    host_bytes_per_token: int = 0,
) -> MemoryPlan:
    """Blocks for max_num_seqs sequences of max_model_len tokens, as many as the budget (or the machine's available
    memory) holds. features: a proposer reads the target's hidden states, and holds those it has not read yet (at
    most a row per position of each sequence, as long as its context may be continued). host_bytes_per_token: what
    proposers hold in host memory for each token of a running sequence (indexes of its text), in a CPU's budget."""
    if max_num_seqs < 1 or max_model_len < 2:
        raise SpecDecodeError(
            f"max_num_seqs must be >= 1 and max_model_len >= 2 (got {max_num_seqs} and {max_model_len})"
        )
    separate_draft = draft is not None and draft is not target  # a self-draft shares the target's weights
    per_token = _bytes_per_token(target, draft, features, host_bytes_per_token)
    wanted = max_num_seqs * blocks_for(max_model_len)
    reserve = activation_reserve(target.cfg, target.dtype, max_model_len, max_num_seqs, k_max)
    if target.device.type == "cuda" and (draft is not None or features):  # a drafter whose rounds chain there
        reserve += chained_rounds_reserve(target.cfg, max_num_seqs, k_max)
    models = [target] + [draft] * separate_draft
    reserve += captured_outputs_reserve(models, max_model_len, max_num_seqs)
    if target.device.type == "cuda":
        reserve += split_sums_reserve(models)
    plan = MemoryPlan(
        budget_bytes,
        target.weight_bytes(),
        draft.weight_bytes() if separate_draft else 0,
        reserve,
        per_token,
        max_model_len,
        max_num_seqs,
        wanted,
    )
    per_block = BLOCK_TOKENS * per_token
    if budget_bytes is None:
        plan.num_blocks = _blocks_available(target.device, plan, per_block)
        return plan
    free = budget_bytes - plan.fixed_bytes
    one_sequence = blocks_for(max_model_len) * per_block
    if free < one_sequence:
        fixed = format_bytes(plan.fixed_bytes)
        if free < per_block:
            raise SpecDecodeError(
                f"the memory budget ({format_bytes(budget_bytes)}) is smaller than the weights "
                f"and activations ({fixed}); raise the memory budget"
            )
        raise SpecDecodeError(
            f"the memory budget ({format_bytes(budget_bytes)}) holds the weights and activations ({fixed}) but "
            f"not one sequence of {max_model_len} tokens ({format_bytes(one_sequence)} of KV cache); raise the "
            f"memory budget or lower max_model_len to at most {free // per_block * BLOCK_TOKENS}"
        )
    plan.num_blocks = int(min(wanted, free // per_block))
    return plan
