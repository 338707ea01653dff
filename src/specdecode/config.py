"""Names shared without importing torch (the CLI offers them), and the model architecture description."""
from __future__ import annotations

from dataclasses import dataclass

# Weight/activation formats a model can be built in (see executor.backends); here so the CLI can offer them
# without importing torch.
QUANTIZATIONS = ("auto", "none", "w8a8", "w8a16", "w4a8", "w4a8-all")
POLICIES = ("adaptive", "fixed", "disable_by_batch_size")  # speculation policies (engine.policy)
# Draft-model defaults, measured on HumanEval with the Qwen2.5-Coder pair (docs/decisions.md): the draft's LM
# head keeps the 65,536 lowest token ids, and drafting stops after a token the draft gives less than this
# probability (both change only what is proposed, never what is accepted).
DRAFT_VOCAB_SIZE = 65536
DRAFT_CONFIDENCE = 0.8
LOSSY_NOTE = "forced_accept: every draft token accepted -- an upper bound, NOT the target's distribution"


@dataclass(frozen=True)
class ModelConfig:
    """Decoder-only Llama/Qwen2-family architecture."""

    arch: str  # "llama" or "qwen2" (informational; the runtime is the same)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position: int = 4096
    qkv_bias: bool = False
    tie_word_embeddings: bool = False
    head_dim: int | None = None

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> "ModelConfig":
        arch = cfg.get("model_type", "llama")
        return cls(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=cfg["num_attention_heads"],
            num_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position=int(cfg.get("max_position_embeddings", 4096)),
            qkv_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            head_dim=cfg.get("head_dim"),
        )
