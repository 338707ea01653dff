"""The runtime's building blocks: row-invariant linear maps, RMSNorm, RoPE and its scalings, gated MLPs and
a mixture of experts. Each computes a token's output the same whatever other rows are computed with it, so
a token's logits are identical whether it is decoded alone or verified beside drafts."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..errors import SpecDecodeError


def row_invariant_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T, each output row as it would be computed among others.

    oneDNN's GEMM kernels give each row the same result for any M >= 2, but M = 1 goes to a GEMV kernel
    that rounds differently. Padding a single row to two (no slower here) keeps a token's logits identical
    whether it is decoded alone or verified with k drafts."""
    if x.shape[:-1].numel() == 1:
        return F.linear(torch.cat([x, x], dim=-2), weight)[..., :1, :]  # a contiguous copy: stride-0 views are slow
    return F.linear(x, weight)


def row_by_row_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T with each row its own one-row product in a batched call, for a small W (a LoRA adapter's): every row is
    computed by one kernel for one shape, however many rows come together, where a GEMM of a few dozen columns
    rounds a row differently among four rows or more than among two (Zen 4, torch 2.13)."""
    rows = x.reshape(-1, 1, x.shape[-1])
    y = torch.bmm(rows, weight.t().unsqueeze(0).expand(rows.shape[0], -1, -1))
    return y.reshape(*x.shape[:-1], weight.shape[0])


class Linear(nn.Linear):
    """A Linear whose output rows do not depend on how many rows are computed together."""

    kernel = None  # a backend may attach one (executor/gemv.py): (module, x) -> y, or None where it does not apply

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and (y := self.kernel(self, x)) is not None:
            return y
        if x.is_cuda:  # cuBLAS picks kernels by shape whatever is done here: the bias fused, no padding
            return F.linear(x, self.weight, self.bias)
        y = row_invariant_linear(x, self.weight)
        # The bias is added apart: a fused bias selects other kernels, which are not row-invariant.
        return y if self.bias is None else y + self.bias

    def select_rows(self, ids: torch.Tensor) -> "Linear":
        out = Linear(self.in_features, len(ids), bias=self.bias is not None, device="meta")
        out.weight = nn.Parameter(self.weight.index_select(0, ids), requires_grad=False)
        if self.bias is not None:
            out.bias = nn.Parameter(self.bias.index_select(0, ids), requires_grad=False)
        return out


class Norm(nn.Module):
    """norm(x); or, given the residual stream, adds x into it first and returns (norm(sum), sum): the
    residual add and the next norm are one step, which a backend's kernel does in one call.

    The weight multiplies the normalised values as stored: Gemma's checkpoints hold weight - 1, and their
    loader adds the 1 (as llama.cpp's converter does)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernel = None  # a backend may attach one to an RMSNorm (executor/elementwise.py), forward's signature

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.kernel is not None:
            return self.kernel(self, x, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class RMSNorm(Norm):
    """Each row divided by its root mean square, then weighted: what every backend's norm kernels compute."""

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class LayerNorm(Norm):
    """A LayerNorm without a bias, computed in float32 as transformers computes Cohere's: each row's mean subtracted
    first. No backend's kernel computes it."""

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight.float() * self._standardised(x.float())).to(x.dtype)

    def _standardised(self, x32: torch.Tensor) -> torch.Tensor:
        """Each row less its mean, divided by its standard deviation (eps added to the variance)."""
        centred = x32 - x32.mean(-1, keepdim=True)
        return centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + self.eps)


class HeadwiseLayerNorm(LayerNorm):
    """Command R+'s q/k norms: a LayerNorm of each head (its mean and variance over the head's values), weighted by a
    weight of each value of the projection's whole width (transformers' [heads, head size], flattened)."""

    def __init__(self, heads: int, head_dim: int, eps: float):
        super().__init__(heads * head_dim, eps)
        self.head_dim = head_dim

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        normed = self._standardised(x.float().unflatten(-1, (-1, self.head_dim))).flatten(-2)
        return (self.weight.float() * normed).to(x.dtype)


class Unnormed(nn.Module):
    """RMSNorm's place where a family normalises nothing before attention or the MLP (OLMo 2, whose norms follow
    them): x, or given the residual stream (x + residual, x + residual)."""

    kernel = None  # no backend's kernel computes it

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return x
        x = x + residual
        return x, x


def stream_norm(cfg) -> Norm:
    """A norm of the residual stream: the family's LayerNorm or RMSNorm."""
    return (LayerNorm if cfg.layer_norms else RMSNorm)(cfg.hidden_size, cfg.rms_norm_eps)


def pre_norm(cfg) -> nn.Module:
    """The norm before a layer's attention or MLP, where the family has one."""
    return stream_norm(cfg) if cfg.pre_norms else Unnormed()


def normed_linear(norm: RMSNorm, linear: Linear, x: torch.Tensor, residual: torch.Tensor | None, **out):
    """(linear(norm(x + residual)), x + residual), or where residual is None (the first layer) (linear(norm(x)), x): in
    one call where the linear's kernel takes the norm in. out: out_dtype, the type that call may hold its output in
    (rounded to x's first; elsewhere the caller casts)."""
    fused = fused_form(linear, "normed") if isinstance(norm, RMSNorm) else None
    if fused is not None and (result := fused(linear, norm, x, residual, **out)) is not None:
        return result
    normed, summed = normed_and_summed(norm, x, residual)
    return linear(normed), summed


def normed_and_summed(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None):
    """(norm(x + residual), x + residual), or where residual is None (norm(x), x)."""
    return (norm(x), x) if residual is None else norm(x, residual)


def fused_form(linear: nn.Module, form: str):
    """The linear's kernel's call that takes in what comes before it (Gemv.normed, Gemv.activated), where it has one:
    a backend's own layers (the low-bit BlockLinear) have no kernel."""
    return getattr(getattr(linear, "kernel", None), form, None)


class RotaryEmbedding(nn.Module):
    """NeoX-style rotary embedding (halves rotated; GGUF Llama q/k rows are un-permuted to match), with the
    frequency scalings of ModelConfig.rope_scaling. context: the longest sequence it rotates (LongRoPE's factors
    depend on it; None: past the original). rotary_dim: the dimensions that turn where not all do; the others' pairs
    get a frequency of 0 (cos 1, sin 0: every kernel leaves them as they are), the checkpoint's q/k dimensions
    reordered to match (checkpoints.rotary_order)."""

    kernel = None  # rope_tables in one kernel (a GPU's, executor/cuda_graphs.fuse_elementwise), else None

    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: tuple = (),
        freq_factors: torch.Tensor | None = None,
        context: int | None = None,
        rotary_dim: int | None = None,
    ):
        super().__init__()
        turned = rotary_dim or head_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, turned, 2, dtype=torch.float32) / turned))
        scaling = dict(scaling)
        if scaling.get("rope_type") == "longrope":
            freq_factors = torch.tensor(longrope_factors(scaling, context))
        if freq_factors is not None and freq_factors.numel() != turned // 2:
            raise SpecDecodeError(f"the model's RoPE has {freq_factors.numel()} factors, for {turned // 2} frequencies")
        inv_freq = scaled_frequencies(inv_freq, scaling, freq_factors, theta)
        still = (head_dim - turned) // 2
        self.register_buffer("inv_freq", torch.cat([inv_freq, inv_freq.new_zeros(still)]), persistent=False)
        factor = scaling.get("attention_factor", 1.0)
        amplitude = None  # YaRN's or LongRoPE's factor on the turned dimensions' cos and sin, where not all turn
        if rotary_dim and factor != 1.0:
            half = torch.cat([torch.full((turned // 2,), factor), torch.ones(still)])
            amplitude = torch.cat([half, half])
        self.register_buffer("amplitude", amplitude, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        cos, sin = (self.kernel or rope_tables)(positions, self.inv_freq, dtype)
        if self.amplitude is None:
            return cos, sin
        return cos * self.amplitude.to(dtype), sin * self.amplitude.to(dtype)


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos and sin [B, 1, T, D] of the positions [B, T] at each frequency, both halves alike."""
    freqs = positions[..., None].float() * inv_freq  # [B, T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def scaled_frequencies(
    inv_freq: torch.Tensor, scaling: dict, freq_factors: torch.Tensor | None, theta: float
) -> torch.Tensor:
    """The frequencies of a RoPE scaling (ModelConfig.rope_scaling); YaRN's attention factor is the query-key scale's
    (families.with_rope_attention_factor), so the tables stay cos and sin of these."""
    kind = scaling.get("rope_type")
    if kind is None:
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind in ("freq_factors", "longrope"):
        if freq_factors is None:
            raise ValueError("the model's RoPE is scaled by per-dimension factors, and no rope_freqs tensor came")
        return inv_freq / freq_factors.float().to(inv_freq.device)
    if kind == "llama3":
        return llama3_frequencies(inv_freq, scaling)
    if kind == "yarn":
        return yarn_frequencies(inv_freq, scaling, theta)
    raise ValueError(f"unknown RoPE scaling {kind!r}")


def longrope_factors(scaling: dict, context: int | None) -> tuple[float, ...]:
    """LongRoPE's divisors of the frequencies for sequences up to `context` tokens: the short ones within the original
    context, the long ones past it (None: past it)."""
    within = context is not None and context <= scaling["original_max_position_embeddings"]
    return scaling["short_factor" if within else "long_factor"]


def llama3_frequencies(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1's scaling: long wavelengths divided by `factor`, short ones kept, a smooth blend between."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    context = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < context / high) * ~(wavelen > context / low)
    return torch.where(medium, blended, scaled)


def yarn_frequencies(inv_freq: torch.Tensor, s: dict, theta: float) -> torch.Tensor:
    """YaRN's frequencies (transformers' and llama.cpp's alike): dimensions that turn more than beta_fast times over
    the original context are kept, those turning fewer than beta_slow times divided by `factor`, a linear ramp between
    (its ends rounded outwards with `truncate`)."""
    dim, context = 2 * len(inv_freq), s["original_max_position_embeddings"]

    def dimension_turning(turns: float) -> float:
        return dim * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension_turning(s["beta_fast"]), dimension_turning(s["beta_slow"])
    if s["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low if high != low else 0.001)).clamp(0, 1)
    return inv_freq / s["factor"] * ramp + inv_freq * (1 - ramp)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def query_temperature_scales(positions: torch.Tensor, beta: float, floor: int) -> torch.Tensor:
    """Llama 4's attention temperature of each position's queries, 1 + beta ln(1 + floor(p / floor)), in float32 as
    transformers computes it (llama.cpp's graph alike)."""
    return 1 + beta * torch.log(1 + torch.floor(positions / floor))


def softcapped(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap), Gemma 2's soft cap of attention scores and logits (None: x as it is)."""
    return x if cap is None else torch.tanh(x / cap) * cap


def repeated_kv_heads(q, keys, values) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [B, Hkv, K, D] with each KV head repeated for the query heads that share it (q [B, H, T, D])."""
    if keys.shape[1] == q.shape[1]:
        return keys, values
    return tuple(t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (keys, values))


def attention(
    q, keys, values, scale: float, mask=None, softcap: float | None = None, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """Attention of q [B, H, T, D] over keys and values [B, Hkv, K, D] (mask: the keys each query sees). PyTorch's
    fused kernels take no soft cap and no sinks (gpt-oss's logit per query head, in each softmax's denominator and
    weighing no value; shaped to broadcast over the scores [B, H, T, 1], head_sinks): such a model's scores are
    computed as transformers' eager attention does."""
    if softcap is None and sinks is None:
        gqa = keys.shape[1] != q.shape[1]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)
    keys, values = repeated_kv_heads(q, keys, values)
    scores = softcapped(q @ keys.transpose(-1, -2) * scale, softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ values
    sink = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=torch.float32)[..., :-1]
    return weights.to(q.dtype) @ values


def head_sinks(sinks: torch.Tensor | None, kv_heads: int, rows: int = 1) -> torch.Tensor | None:
    """Sinks [H] as attention() takes them where the query heads that share a KV head are folded into the query
    length, `rows` queries of each ([Hkv, G x rows, 1]); kv_heads = H: unfolded ([H, 1, 1])."""
    if sinks is None:
        return None
    return sinks.view(kv_heads, -1, 1, 1).expand(-1, -1, rows, 1).reshape(kv_heads, -1, 1)


# gpt-oss's SwiGLU: the gate capped above and up clamped at LIMIT, then (up + 1) * gate * sigmoid(ALPHA * gate); its
# constants fixed by transformers' defaults and by llama.cpp's graph alike
SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT = 1.702, 7.0


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    gate = gate.clamp(max=SWIGLU_OAI_LIMIT)
    up = up.clamp(-SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT)
    return (up + 1) * (gate * torch.sigmoid(gate * SWIGLU_OAI_ALPHA))


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


def gated(activation: str, gate_up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up from the gate_up projection's output [..., 2 * inter] (gate first), or gpt-oss's form."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "swiglu_oai":
        return swiglu_oai(gate, up)
    return ACTIVATIONS[activation](gate) * up


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU or GeGLU (gpt-oss's experts: clamped, and every projection biased)."""

    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None, bias: bool = False):
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * inter, bias=bias)
        self.down_proj = Linear(inter, cfg.hidden_size, bias=bias)
        self.activation = cfg.activation
        self.act_mul_kernel = None  # a backend may attach one: gate_up -> act(gate) * up in one call

    def forward(self, x):
        return self.down(self.gate_up_proj(x))

    def down(self, gate_up):
        """The down projection of act(gate) * up, from the gate_up projection's output: in one call where the down
        projection's kernel takes the activation in."""
        fused = fused_form(self.down_proj, "activated")
        if fused is not None and (y := fused(self.down_proj, gate_up, self.activation)) is not None:
            return y
        if self.act_mul_kernel is not None:
            return self.down_proj(self.act_mul_kernel(gate_up))
        return self.down_proj(gated(self.activation, gate_up))


class Router(nn.Module):
    """A mixture of experts' router: softmax over every expert's logit (in float32; gpt-oss's biased), or each logit's
    sigmoid alone (GLM-4.5's); the top k kept (chosen by score, or by score plus a bias of each expert's: ERNIE 4.5's,
    GLM-4.5's), their weights rescaled to sum to one where the family does (Mixtral; Qwen3-MoE by norm_topk_prob;
    gpt-oss's softmax over the top k's logits is that), then multiplied by a scale where it has one (GLM-4.5's
    routed_scaling_factor). DeepSeek's choose among the experts of their best groups only (within_kept_groups)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.bias = nn.Parameter(torch.empty(cfg.num_experts)) if cfg.expert_bias else None
        self.selection_bias = nn.Parameter(torch.empty(cfg.num_experts)) if cfg.expert_selection_bias else None
        self.top_k, self.normalize = cfg.experts_per_token, cfg.normalize_expert_weights
        self.sigmoid, self.scale = cfg.expert_scoring == "sigmoid", cfg.expert_weights_scale
        self.groups, self.groups_kept = cfg.expert_groups, cfg.expert_groups_kept
        self.group_scoring = cfg.expert_group_scoring

    @property
    def plain(self) -> bool:
        """Unbiased, choosing by softmax probability, unscaled: the router the GPU's grouped experts kernels and the
        one-call decoder compute inside their calls (the CPU's experts kernel computes any but gpt-oss's)."""
        unbiased = self.bias is None and self.selection_bias is None
        return unbiased and not self.sigmoid and self.scale == 1.0 and self.groups == 1

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> (weights [N, k] in x's dtype, expert ids [N, k])."""
        logits = row_invariant_linear(x, self.weight)
        if self.sigmoid:
            probs = torch.sigmoid(logits.float())
        else:
            probs = torch.softmax((logits if self.bias is None else logits + self.bias).float(), dim=-1)
        choice = probs if self.selection_bias is None else probs + self.selection_bias.float()
        if self.groups > 1:
            choice = self.within_kept_groups(choice)
        if choice is probs:
            weights, experts = torch.topk(probs, self.top_k, dim=-1)
        else:
            experts = torch.topk(choice, self.top_k, dim=-1).indices
            weights = probs.gather(-1, experts)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights * self.scale).to(x.dtype), experts

    def within_kept_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """The scores experts are chosen by [N, experts], those outside each row's best groups_kept groups at -inf: a
        group scored by its best expert ("max") or its best two summed ("top2")."""
        grouped = choice.unflatten(-1, (self.groups, -1))
        best = grouped.topk(2, dim=-1).values.sum(-1) if self.group_scoring == "top2" else grouped.amax(-1)
        kept = torch.zeros_like(best, dtype=torch.bool).scatter_(-1, best.topk(self.groups_kept, dim=-1).indices, True)
        return grouped.masked_fill(~kept[..., None], float("-inf")).flatten(-2)


class SharedExpertGate(nn.Module):
    """The shared expert's weight per row, sigmoid(w . x): a router of one output, kept in float as routers are."""

    def __init__(self, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(row_invariant_linear(x, self.weight.to(x.dtype)))


class SparseMoE(nn.Module):
    """Experts in place of the MLP. The rows of a call are grouped by expert, so each chosen expert's weights
    are read once per call for all the rows routed to it (a verify of k + 1 rows reads the union of their
    experts). Each row sums its experts' outputs in expert order, as transformers does, whatever the call; then,
    where the family has one, a shared expert's output, weighed by sigmoid(its gate's logit) (Qwen2-MoE) or not
    (ERNIE 4.5)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = nn.ModuleList(MLP(cfg, cfg.expert_size, cfg.expert_bias) for _ in range(cfg.num_experts))
        if cfg.shared_expert_size:
            self.shared_expert = MLP(cfg, cfg.shared_expert_size)
        if cfg.shared_expert_size and cfg.shared_expert_gated:
            self.shared_expert_gate = SharedExpertGate(cfg.hidden_size)
        self.kernel = None  # a backend may attach one for the routed experts (executor/experts.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        routed = self.kernel(self, flat) if self.kernel is not None else self.routed(flat)
        if hasattr(self, "shared_expert_gate"):
            routed = routed + self.shared_expert_gate(flat) * self.shared_expert(flat)
        elif hasattr(self, "shared_expert"):
            routed = routed + self.shared_expert(flat)
        return routed.view_as(x)

    def routed(self, flat: torch.Tensor) -> torch.Tensor:
        """The routed experts' sum for rows [N, hidden]."""
        weights, chosen = self.gate(flat)
        out = torch.zeros_like(flat)
        # (experts called by .forward: a decoded token runs k of them in each layer, and nn.Module's call
        # machinery cost a tenth of a mixture-of-experts model's step)
        if flat.shape[0] == 1:  # a decoded token: the same sums as below, without grouping rows
            for rank in chosen[0].argsort().tolist():
                out.add_(self.experts[int(chosen[0, rank])].forward(flat) * weights[0, rank])
            return out
        for expert in chosen.unique().tolist():  # ascending
            rows, rank = (chosen == expert).nonzero(as_tuple=True)
            y = self.experts[expert].forward(flat.index_select(0, rows))
            out.index_add_(0, rows, y * weights[rows, rank, None])
        return out

    def experts_read(self, x: torch.Tensor) -> int:
        """How many distinct experts a call over these rows reads."""
        return int(self.gate(x.reshape(-1, x.shape[-1]))[1].unique().numel())


def linear_layers(model: nn.Module) -> list[Linear]:
    """The model's linear layers that run as layers: not the experts of a mixture whose kernel multiplies them."""
    moes = (m for m in model.modules() if isinstance(m, SparseMoE) and m.kernel is not None)
    grouped = {id(m) for moe in moes for m in moe.experts.modules()}
    return [m for m in model.modules() if isinstance(m, Linear) and id(m) not in grouped]
