"""A draft head: one decoder layer that drafts from the target's own features (EAGLE's design).

Row p of its input is the target's final hidden state at position p (before the last norm) beside the
embedding of token p + 1, the token those features chose. Its output at row p, added to those
features, estimates the target's hidden state at position p + 1, which the target's own final norm and
LM head (restricted to a draft vocabulary) turn into a distribution for token p + 2. The next draft row reads that
estimate beside the drafted token, so drafting k tokens costs k forwards of one layer.

The head owns only its input norms, the fusing projection and the layer; the embedding, final norm and
LM head rows are the target's, shared at load time. A file holds the owned weights, the draft
vocabulary (`vocab_ids`) and a JSON beside it naming the target by a fingerprint of its weights, so a
head is never run on a target it was not trained for."""

from __future__ import annotations

import copy
import hashlib
import json
import os
from dataclasses import MISSING, asdict, dataclass, field, fields, replace

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..errors import SpecDecodeError
from .layers import Linear, RMSNorm
from .runtime import DecoderLayer, ForwardBatch, Transformer, final_logits, run_layers, tensor_bytes

# one layer over [norm(embedding), norm(features)] (EAGLE-1's inputs), its output added to the features
ARCHITECTURE = "feature-head-2"


@dataclass
class HeadSpec:
    """What a head file's JSON says: its shape, the target it reads, and how it was made."""

    target_name: str
    target_fingerprint: str
    intermediate_size: int
    draft_vocab_size: int
    architecture: str = ARCHITECTURE
    recipe: dict = field(default_factory=dict)  # the distill options and data that made it
    measured: dict = field(default_factory=dict)  # held-out acceptance at training's end

    def layer_config(self, target: ModelConfig) -> ModelConfig:
        """The head's layer: a Llama layer at the target's width and heads, whatever the target's family (the
        head is a design of its own; only RoPE follows the target's global layers, see DraftHead)."""
        plain = {
            f.name: f.default
            for f in fields(ModelConfig)
            if f.default is not MISSING
            and f.name
            not in ("rope_theta", "rms_norm_eps", "max_position", "qkv_bias", "tie_word_embeddings", "head_dim")
        }
        return replace(target, num_layers=1, intermediate_size=self.intermediate_size, **plain)


def target_fingerprint(model: Transformer) -> str:
    """The target's identity, the same under every backend and activation dtype: its shape and three of its
    norm weights (no backend quantizes those), hashed after rounding to bfloat16, the coarsest type a
    target holds them in: a float32 and a bfloat16 target (`--dtype auto` on a CPU with native bf16) of
    the same file agree, and so do the same weights run with a RoPE scaling of the user's (LLM's rope_scaling)."""
    h = hashlib.sha256(repr(getattr(model, "native_cfg", model.cfg)).encode())
    first, last = model.layers[0], model.layers[-1]
    for norm in (model.norm, last.input_layernorm, getattr(first, "post_attention_layernorm", None)):
        if hasattr(norm, "weight"):  # OLMo 2's layers have no input norm (layers.Unnormed), Cohere's no second
            h.update(norm.weight.detach().to(torch.bfloat16).float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


class DraftHead(nn.Module):
    """Forward signature as Transformer's, plus `features` (one target hidden row per input token), so the
    model runner, its KV cache and its rollback serve a head as they serve a draft model."""

    OWNED = ("embed_norm", "feature_norm", "fc", "layers")  # what a head file stores

    def __init__(self, cfg: ModelConfig, target: Transformer, vocab_ids: torch.Tensor):
        super().__init__()
        hidden = cfg.hidden_size
        self.cfg = cfg
        self.embed_norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.feature_norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.fc = Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(cfg, 0)])
        # the target's global frequencies, scaled as its are; its tensors cloned first, as a deep copy of a view
        # copies the whole storage it views (the target's arena of weights)
        self.rotary = copy.deepcopy(target.rotary, {id(t): t.clone() for t in target.rotary.buffers()})
        self.vocab_ids = vocab_ids
        self.norm = target.norm  # the target's final norm (not saved: see OWNED)
        self.final_softcap = target.cfg.final_softcap  # and its logits' cap: the head's logits estimate the target's
        # the target's embedding, not registered: neither saved nor counted as the head's memory
        self._shared = {"embed": target.embed_tokens}
        self.owns_lm_head = target.vocab_ids is None  # else the target's rows are the head's too
        self.lm_head = target.lm_head.select_rows(vocab_ids) if self.owns_lm_head else target.lm_head
        self.kv_cache_dtype: torch.dtype | None = None  # as Transformer's

    @property
    def device(self) -> torch.device:
        return self.rotary.inv_freq.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.kv_cache_dtype or self.dtype

    backend = "torch"
    layers_kernel = None  # as Transformer's
    inputs_kernel = None  # see _input
    capture_graphs = True  # as Transformer's: decode and verify forwards at bucket shapes on a GPU, replayed
    reads_features = True  # the forward takes the target's features beside the tokens (a bucket holds them too)

    def weight_bytes(self) -> int:
        """What the head adds to its target's memory: what it owns and its LM head's rows (the final norm and
        the embedding are the target's)."""
        modules = [self.get_submodule(name) for name in self.OWNED] + [self.lm_head]
        return tensor_bytes([t for m in modules for t in (*m.parameters(), *m.buffers())])

    def own_modules(self) -> nn.ModuleList:
        """The modules the head holds of its own: the stored ones, its rotary tables and its LM head's rows where
        it selected them (what it shares is in its target's memory, on huge pages already: moving it again would
        copy the target's whole arena, which those tensors view)."""
        own = [self.get_submodule(name) for name in self.OWNED] + [self.rotary]
        return nn.ModuleList(own + [self.lm_head] if self.owns_lm_head else own)

    def forward(
        self,
        tokens: torch.Tensor,
        batch: ForwardBatch,
        cache,
        return_hidden: bool | str = False,
        features: torch.Tensor | None = None,
    ):
        """tokens [B, T] and features [B, T, hidden] after each slot's cached rows -> logits over the draft
        vocabulary for the batch's logit rows, and with return_hidden the estimated next features of the
        same rows. (Training runs `unrolled`, which computes the same rounds for every row at once.)"""
        with torch.inference_mode():
            if features is None:  # timing a forward (the profile): contents do not change its cost
                features = torch.zeros(*tokens.shape, self.cfg.hidden_size, device=tokens.device)
            features = features.to(self.dtype)
            x = self._input(tokens, features)
            x, residual = run_layers(self, x, batch.rope or self.rope_tables(batch.positions, x.dtype), batch, cache)
            return self._output(features, x, residual, batch.logit_rows, return_hidden)

    def unrolled(
        self, tokens: torch.Tensor, features: torch.Tensor, steps: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Training-time test: (logits [B*T, V], estimates [B*T, hidden]) for each of `steps` drafting rounds
        at every row, as drafting computes them. Round s at position q reads round s-1's estimate at q-1
        (round 0 reads the target's features) beside token q + 1, and attends to the rows drafting would have
        cached: round 0's at positions up to q - s, then one row of each later round up to its own. Rows
        q < s have no such context and are the caller's to ignore."""
        batch, width, hidden = features.shape
        embedded = self._shared["embed"](tokens).float()
        rope = self.rotary(torch.arange(width, device=features.device)[None], features.dtype)
        layer, keys, values, out = self.layers[0], [], [], []
        for step in range(steps):
            if step:
                previous = out[-1][1].view(batch, width, hidden)
                features = torch.cat([features[:, :1], previous[:, :-1]], 1)
            x = self._fused_input(embedded, features)
            h = layer.input_layernorm(x)
            q, k, v = layer.self_attn._heads(layer.self_attn.qkv_proj(h), rope)
            keys.append(k)
            values.append(v)
            mask = _unrolled_mask(step, width, features.device)
            attended = F.scaled_dot_product_attention(
                q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask, enable_gqa=True
            )
            attended = layer.self_attn.o_proj(attended.transpose(1, 2).reshape(batch, width, -1))
            h, residual = layer.post_attention_layernorm(attended, x)
            out.append(self._output(features, layer.mlp(h), residual, None, True))
        return out

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) of every input position: its one layer's, at the target's global frequencies."""
        return {"global": self.rotary(positions, dtype)}

    def _input(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """fc over [norm(embedding of each token), norm(its features)]: the lookup, both norms and their concatenation
        one kernel where the head has it (a GPU's: executor/cuda_graphs.fuse_elementwise)."""
        e, f, embed = self.embed_norm, self.feature_norm, self._shared["embed"]
        if self.inputs_kernel is not None and isinstance(embed, nn.Embedding):
            return self.fc(self.inputs_kernel(embed.weight, tokens, e.weight, e.eps, f.weight, f.eps, features))
        return self._fused_input(embed(tokens).to(self.dtype), features)

    def _fused_input(self, embedded: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """fc over [norm(embeddings), norm(features)]."""
        return self.fc(torch.cat([self.embed_norm(embedded), self.feature_norm(features)], -1))

    def _output(self, features, out, residual, rows, return_hidden):
        """Logits of the estimate of the target's next hidden state (before its final norm) at `rows` (None: all), and
        with return_hidden the estimate: the features read plus the layer's correction (its output and residual
        stream). Consecutive hidden states share their large, slowly changing components, which a freshly initialised
        layer would otherwise need many steps to produce. The last add is the final norm's (one call with the LM head
        where its kernel takes the norm in). return_hidden="all": every row's estimate, whatever `rows` are."""
        hidden = features.shape[-1]
        x, residual = (features + out).reshape(-1, hidden), residual.reshape(-1, hidden)
        every_row = x + residual if return_hidden == "all" and rows is not None else None
        logits, predicted = final_logits(self.norm, self.lm_head, x, residual, rows, self.final_softcap)
        if not return_hidden:
            return logits
        return logits, predicted if every_row is None else every_row

    def owned_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().contiguous() for k, v in self.state_dict().items() if k.split(".")[0] in self.OWNED}


def _unrolled_mask(step: int, width: int, device) -> torch.Tensor:
    """Which keys row q of drafting round `step` sees: round 0's at positions <= q - step, and round i's
    (1 <= i <= step) at position q - step + i (the rows drafting cached since the last real one)."""
    q = torch.arange(width, device=device)[:, None]
    j = torch.arange(width, device=device)[None, :]
    blocks = [j <= q - step] + [j == q - step + i for i in range(1, step + 1)]
    return torch.cat(blocks, 1)


def save_head(head: DraftHead, spec: HeadSpec, path: str) -> None:
    """PATH.safetensors (owned weights in bf16, the draft vocabulary) and PATH.json (the spec)."""
    from safetensors.torch import save_file

    base = head_base(path)
    tensors = {k: v.to(torch.bfloat16) for k, v in head.owned_state().items()}
    tensors["vocab_ids"] = head.vocab_ids.to(torch.int32).cpu()
    os.makedirs(os.path.dirname(base) or ".", exist_ok=True)
    save_file({k: v.cpu().contiguous() for k, v in tensors.items()}, base + ".safetensors.tmp")
    os.replace(base + ".safetensors.tmp", base + ".safetensors")
    with open(base + ".json", "w") as f:
        json.dump(asdict(spec), f, indent=1)


def head_base(path: str) -> str:
    """A head is named by its path with or without the .safetensors / .json suffix."""
    for suffix in (".safetensors", ".json"):
        if path.endswith(suffix):
            return path[: -len(suffix)]
    return path


def read_head(path: str) -> tuple[HeadSpec, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    base = head_base(path)
    missing = [p for p in (base + ".json", base + ".safetensors") if not os.path.exists(p)]
    if missing:
        raise SpecDecodeError(
            f"draft head {path!r}: {', '.join(missing)} not found; train one with "
            "`specdecode distill --out PATH` or pass an existing head's path"
        )
    with open(base + ".json") as f:
        spec = HeadSpec(**json.load(f))
    if spec.architecture != ARCHITECTURE:
        raise SpecDecodeError(f"draft head {path!r} is a {spec.architecture!r}; this version runs {ARCHITECTURE!r}")
    return spec, load_file(base + ".safetensors")


def build_head(
    spec: HeadSpec, tensors: dict[str, torch.Tensor] | None, target: Transformer, vocab_ids: torch.Tensor | None = None
) -> DraftHead:
    """A head for `target` from stored weights (or freshly initialised ones, to train), in float32."""
    if tensors is not None and spec.target_fingerprint != target_fingerprint(target):
        raise SpecDecodeError(
            f"this draft head was trained for {spec.target_name!r} (fingerprint {spec.target_fingerprint}), and "
            f"the target here is another model (fingerprint {target_fingerprint(target)}); train a head for it "
            "with `specdecode distill --model <target>`"
        )
    ids = (tensors["vocab_ids"] if tensors is not None else vocab_ids).long().to(target.device)
    head = DraftHead(spec.layer_config(target.cfg), target, ids)
    if tensors is not None:
        owned = {k: v.float() for k, v in tensors.items() if k != "vocab_ids"}
        missing, unexpected = head.load_state_dict(owned, strict=False)
        unexpected_owned = [k for k in missing if k.split(".")[0] in DraftHead.OWNED]
        if unexpected_owned or unexpected:
            raise SpecDecodeError(
                f"draft head file does not match its spec: missing {unexpected_owned}, unexpected {unexpected}"
            )
    else:
        init_head(head)
    return head.to(target.device)


def init_head(head: DraftHead) -> None:
    """Small random weights for what the head owns (never the target's LM head rows it holds): an untrained
    head's estimate is close to the features it reads."""
    owned = [head.get_submodule(name) for name in DraftHead.OWNED]
    for module in (m for part in owned for m in part.modules()):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
