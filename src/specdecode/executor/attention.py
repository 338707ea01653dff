"""Decode/verify attention by this package's kernel (kernels/attention.c): rotary embedding, the KV-cache
write and attention over each token's visible keys in one call per layer, where PyTorch needs about
twenty small operations and one attention call per token."""

from __future__ import annotations

import math

import torch

from ..errors import SpecDecodeError
from .kernels import load

ERRORS = {
    -1: "a head size, group or window the kernel does not take",
    -2: "out of memory for its scratch",
    -3: "a slot or position outside the KV cache",
}


class RowwiseAttentionKernel:
    """Called by `Attention` for packed batches (decode, verify, prompts beside them); returns [N, H * D]."""

    max_width = math.inf  # new tokens a sequence: each is attended as alone

    def __init__(self, lib, num_heads: int, num_kv_heads: int, head_dim: int):
        self.lib, self.num_heads, self.num_kv_heads, self.head_dim = lib, num_heads, num_kv_heads, head_dim
        self._batch, self._flat = None, {}  # per RoPE table, its flat inputs: every layer of a forward shares them

    def __call__(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], batch, cache, attn) -> torch.Tensor:
        n = qkv.shape[-2] * qkv.shape[0]
        if attn.whole_qk_norms:  # the kernel normalises each head; these norms span the projection
            qkv = attn.with_whole_qk_norms(qkv)
        qkv = qkv.reshape(n, -1).contiguous()
        slots, positions, cos, sin = self.flat_inputs(batch, rope, n)
        out = torch.empty(n, self.num_heads * self.head_dim)
        keys, values = cache.k[attn.layer], cache.v[attn.layer]
        norms = attn.qk_norms
        q_norm, k_norm = (0, 0) if norms is None else (norms[0].weight.data_ptr(), norms[1].weight.data_ptr())
        eps = 0.0 if norms is None else norms[0].eps
        attend = self.lib.rowwise_attention_f16 if keys.dtype == torch.float16 else self.lib.rowwise_attention
        code = attend(
            qkv.data_ptr(),
            n,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            slots.data_ptr(),
            positions.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            q_norm,
            k_norm,
            eps,
            attn.scale,
            attn.window or 0,
            attn.softcap or 0.0,
            0 if attn.sinks is None else attn.sinks.data_ptr(),
            keys.data_ptr(),
            values.data_ptr(),
            cache.table.data_ptr(),
            cache.num_slots,
            cache.max_blocks,
            cache.block_size,
            cache.num_blocks,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if code:
            raise SpecDecodeError(f"the attention kernel refused layer {attn.layer}: {ERRORS.get(code, code)}")
        return out

    def flat_inputs(self, batch, rope, n: int):
        """Slots, positions and rotary factors as contiguous [N] / [N, D] tensors, made once per forward."""
        if self._batch is not batch:
            self._batch, self._flat = batch, {}
        key = id(rope[0])
        if key not in self._flat:
            self._flat[key] = (
                batch.slots.reshape(n).contiguous(),
                batch.positions.reshape(n).contiguous(),
                *(t.reshape(n, self.head_dim).contiguous() for t in rope),
                rope,
            )  # rope kept alive
        return self._flat[key][:4]


def attach_attention_kernel(model, kv_cache_dtype: str = "auto") -> bool:
    """Give the model's attention layers the kernel where it applies (float32 activations on the CPU, a
    head size the kernel vectorises); True if it did. kv_cache_dtype (config.KV_CACHE_DTYPES): "auto"
    takes a float16 cache where the kernel reads one, "float16" / "float32" ask for that cache."""
    if kv_cache_dtype != "auto":
        model.kv_cache_dtype = getattr(torch, kv_cache_dtype)
    cfg = model.cfg
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return False
    lib = load("attention")
    if (
        lib is None
        or not lib.attention_dim_ok(cfg.dim_per_head)
        or not lib.attention_group_ok(cfg.num_heads // cfg.num_kv_heads)
    ):
        return False
    if kv_cache_dtype == "auto" and lib.attention_half_ok():
        model.kv_cache_dtype = torch.float16
    if model.kv_dtype == torch.float16 and not lib.attention_half_ok():
        return False  # PyTorch's path reads any cache dtype
    kernel = RowwiseAttentionKernel(lib, cfg.num_heads, cfg.num_kv_heads, cfg.dim_per_head)
    for layer in model.layers:
        layer.self_attn.rowwise_kernel = kernel
    return True
