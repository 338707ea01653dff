"""Names shared without importing torch (the CLI offers them), and the model architecture description."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

# Weight/activation formats a model can be built in (see executor.backends); here so the CLI can offer them
# without importing torch.
QUANTIZATIONS = ("auto", "none", "w8a8", "w8a16", "w4a8", "w4a16", "w4a8-all")
POLICIES = ("adaptive", "fixed", "disable_by_batch_size")  # speculation policies (engine.policy)
LOOKUPS = ("ngram", "suffix")  # proposers that draft at no forward cost, offered beside a drafter
KV_CACHE_DTYPES = ("auto", "float16", "float32")  # auto: float16 where the CPU attention kernel reads it
SUFFIX_SCOPES = ("tenant", "global", "none")  # who shares suffix speculation's cache of earlier outputs
LORA_DTYPES = ("auto", "float16", "bfloat16")  # auto: as stored where that is 16 bits, else float32
# Draft-model defaults, measured on HumanEval with the Qwen2.5-Coder pair: the draft's LM head keeps the 65,536
# lowest token ids, and drafting stops after a token the draft gives less than this probability (both change only
# what is proposed, never what is accepted; docs/decisions.md#draft-confidence-stop-and-a-64k-draft-vocabulary).
DRAFT_VOCAB_SIZE = 65536
DRAFT_CONFIDENCE = 0.8
DEFAULT_K = 4  # the most tokens drafted per sequence and step
# Decode and verify calls of up to this many new tokens per sequence attend row by row over exactly the
# keys each token may see, as it would alone (models/runtime.py); where no attention kernel does that at
# any width, longer (prefill) calls use one masked attention call, whose rounding differs. So no draft may
# be longer than MAX_VERIFY_WIDTH - 1 tokens, or greedy speculation would stop reproducing plain decoding
# token for token.
MAX_VERIFY_WIDTH = 64
DEFAULT_TARGET, DEFAULT_DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"  # the bundled pair
# What `generate` and `serve` draft with for the bundled target: its bundled head, ahead of the 0.5B draft
# model on HumanEval at a seventh of its cost per drafted token
# (docs/decisions.md#the-shipped-head-trained-on-a-gpu)
DEFAULT_HEAD = "head:qwen2.5-coder-1.5b"


# Tokens of a long prompt prefilled per step beside decoding streams, by device. On a 2-core Zen 5 with the 1.5B,
# a 4,096-token prompt beside a chat stream: chunks of 64 cost its first token 1.13x its time alone and the
# stream 8.4x its time per token, 128 1.04x and 18x, 512 1.01x and 70x, the whole prompt 459x
# (docs/decisions.md#chunked-prefill-beside-decoding). A GPU's prefill forward runs eagerly, a launch-bound ~30 ms
# whatever its length, so small chunks would multiply its prefill time there: vLLM's 2,048 (not measured here).
PREFILL_CHUNK_TOKENS = {"cpu": 64, "cuda": 2048}


@dataclass(frozen=True)
class AdaptiveOptions:
    """The adaptive policy's knobs, each explained where the policy uses it (engine/policy/adaptive.py and
    acceptance.py). They change how fast the engine is, never what it outputs."""

    min_gain: float = 0.1  # drafting must beat plain decoding's predicted goodput by this fraction
    refresh_plain_every: int = 32  # speculative steps between plain steps that re-measure plain decoding
    clear_margin: float = 1.25  # where a decision clears the bar this far, plain is re-measured 4x less often
    could_pay_refresh: int = 8  # steps between two checks whether drafting could pay at a batch size
    catch_up_horizon: int = 16  # steps within which a draft's catch-up must pay for itself
    probe_trials: float = 4.0  # below this much evidence on the first draft position, drafting is probed
    probe_budget: float = 0.02  # the fraction of decoding time that probes leading nowhere may cost...
    probe_allowance_steps: float = 10.0  # ... beyond the time of this many plain steps at the batch size probed
    optimistic_acceptance: float = 0.95  # no probe where drafting would not pay even at this acceptance
    prior_acceptance: float = 0.7  # the first draft token's acceptance before any is measured
    acceptance_smoothing: float = 0.1  # per step, on a sequence's first-position outcome
    acceptance_recovery: float = 0.02  # per step without drafting, back towards the prior
    depth_smoothing: float = 0.01  # per outcome, on the pooled deeper positions

    @classmethod
    def of(cls, value: "AdaptiveOptions | dict | None") -> "AdaptiveOptions":
        """From a dict of some of the knobs (the rest default); an unknown one is refused with the valid ones."""
        from .errors import SpecDecodeError

        if value is None or isinstance(value, cls):
            return value or cls()
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise SpecDecodeError(f"unknown adaptive policy option(s) {', '.join(unknown)}; valid: {', '.join(names)}")
        return cls(**value)


def option(default, help: str, **cli):
    """An EngineConfig field: its one default and its help, which `LLM`'s check, the CLI's flags (cli.py) and the
    options table in docs/usage.md all read. cli: how the flag differs from the plain `--field-name VALUE`
    (flags, choices, nargs, const, `none`: the word the command line uses for None; `repeatable`: the metavar of a
    flag given once per item). A default is shared by every config, so it must be immutable (AdaptiveOptions is
    frozen)."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass
class EngineConfig:
    """Every engine option with its one default and help, checked when made. `LLM` takes these as keyword
    arguments; `generate`'s and `serve`'s flags are made from them, and Ray ships them to its replicas."""

    model: str = option(DEFAULT_TARGET, "the target: a bundled name, a .gguf file, a checkpoint folder or a hub id")
    speculative_model: str | None = option(
        None,
        "the drafter: a draft model (bundled name, .gguf, folder, hub id) or a proposer kind (ngram, suffix, "
        "head:PATH); the commands' default: the bundled head with the default target, else a lookup",
        flags=("--speculative-model", "--draft"),
    )
    num_speculative_tokens: int = option(
        DEFAULT_K,
        "the most tokens drafted per sequence and step (the adaptive policy may draft fewer, or none)",
        flags=("-k", "--num-speculative-tokens"),
    )
    device: str | None = option(None, "cpu or cuda (default: cuda if available, else cpu)")
    dtype: str = option("auto", "activations: auto (bf16 on CUDA and bf16-capable CPUs), float32, bfloat16")
    max_model_len: int | None = option(
        None,
        "tokens a sequence holds, prompt and output (default: the model's context, as far as one sequence's KV cache "
        "fits the memory)",
    )
    rope_scaling: str | None = option(
        None,
        "the target's RoPE scaling where its own config has none, in config.json's JSON, e.g. "
        '{"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 32768} (Qwen2.5\'s and Qwen3\'s '
        "recipe for 128k tokens); its context becomes factor x the original",
    )
    lora: tuple[str, ...] = option(
        (),
        "LoRA adapters the target's layers add, each a PEFT adapter's folder or llama.cpp's .gguf of one, as PATH or "
        "PATH:SCALE (llama.cpp's --lora and --lora-scaled); repeatable; on the CPU",
        repeatable="PATH[:SCALE]",
    )
    lora_modules: tuple[str, ...] = option(
        (),
        "LoRA adapters served by name (vLLM's --lora-modules): a request whose `model` is NAME gets the adapter's "
        "updates (on top of --lora's), beside requests of other adapters in the same forwards; as NAME=PATH or "
        "NAME=PATH:SCALE; repeatable; on the CPU",
        repeatable="NAME=PATH[:SCALE]",
    )
    lora_dtype: str = option(
        "auto",
        "LoRA adapters' matrices in memory: auto (float16 or bfloat16 as stored, each value read exactly; else "
        "float32), float16 or bfloat16 (half the bytes a step reads, values rounded; vLLM's --lora-dtype)",
        choices=LORA_DTYPES,
    )
    chat_template: str | None = option(
        None,
        "a Jinja chat template (a file, or the template's text) that chats are rendered with, in place of the "
        "model's own or for a model that has none",
    )
    generation_config: str = option(
        "auto",
        "the sampling defaults of requests that leave temperature, top_p, top_k, min_p, repetition_penalty or "
        "max_tokens unset: auto, the model's recommendation (generation_config.json, a GGUF's general.sampling.*); "
        "vllm, none (temperature 1, no truncation); or a folder holding a generation_config.json",
    )
    max_num_seqs: int = option(8, "most sequences decoded at once")
    forced_accept: bool = option(
        False, "benchmarks only: accept every draft token (an upper bound; the output is NOT the target's)"
    )
    ngram_prompt_lookup_max: int = option(3, "n-gram lookup: the longest n tried")
    ngram_prompt_lookup_min: int = option(1, "n-gram lookup: the shortest n tried")
    # docs/decisions.md#draft-confidence-stop-and-a-64k-draft-vocabulary
    draft_vocab_size: int | None = option(
        DRAFT_VOCAB_SIZE,
        "the draft's LM head keeps this many lowest token ids and the special tokens (0: the whole vocabulary)",
    )
    draft_confidence: float | None = option(
        None,
        "the draft stops after a token it gives less probability than this (0: always drafts what the policy asks; "
        f"None: {DRAFT_CONFIDENCE}, and 0 on CUDA with graphs, where drafting rounds chain on the device: every "
        "round and verify row runs there anyway, and a stop would only drop accepted drafts)",
    )
    quantization: str = option(
        "auto",
        "target weights: auto = the block kernel where it builds with SIMD (w4a8; w4a16 under 200M layer "
        "parameters; bf16/float on CUDA or without it), none = floating weights in dtype, w4a8 = the GGUF's "
        "block formats as stored with int8 activations, w4a16 = the same with activations in two int8 "
        "passes, w4a8-all = every weight requantized to 4 bits (lossy: for drafts), w8a8 = every weight "
        "as Q8_0, w8a16 = int8 weights with bf16 activations",
        choices=QUANTIZATIONS,
    )
    draft_quantization: str = option(
        "auto",
        "the same for the draft model (auto: w4a8-all where the kernel builds, else as the target)",
        choices=QUANTIZATIONS,
    )
    kv_cache_dtype: str = option(
        "auto",
        "KV cache entries: auto = float16 where the CPU attention kernel reads them, else the activations' dtype",
        choices=KV_CACHE_DTYPES,
    )
    speculation_policy: str = option(
        "adaptive",
        "adaptive: k per sequence and step by expected goodput; fixed: always k; disable_by_batch_size: vLLM's rule",
        choices=POLICIES,
        flags=("--policy", "--speculation-policy"),
    )
    speculative_disable_by_batch_size: int | None = option(
        None, "disable_by_batch_size: draft while at most this many sequences run"
    )
    # Not on by default: on a chat with nothing to copy, copies of the prompt's own words displace the head's
    # better drafts (docs/decisions.md#suffix-drafts-beside-the-head-off-by-default).
    prompt_lookup: str | None = option(
        None,
        "the adaptive policy may also take a sequence's drafts from this lookup (ngram, or suffix: long "
        "drafts from the sequence's text and the tenant's earlier outputs) where that predicts more goodput "
        "than the drafter",
        choices=LOOKUPS,
        nargs="?",
        const="ngram",
        none="none",
    )
    suffix_max_tokens: int = option(32, "suffix speculation: the longest draft")
    suffix_min_prob: float = option(
        0.1, "suffix speculation: a draft stops where its frequency estimate falls below this"
    )
    suffix_cache_bytes: int = option(
        256 << 20, "suffix speculation: bytes of earlier outputs kept, over all tenants (least recently used go first)"
    )
    suffix_cache_scope: str = option(
        "tenant",
        "who may draft from whose earlier outputs: tenant (same API key and user), global, none",
        choices=SUFFIX_SCOPES,
    )
    prefix_caching: bool = option(
        True,
        "a prompt starts from the KV blocks that requests of its tenant, running "
        "or finished, computed for its longest prefix",
    )
    memory_budget: str | int | None = option(
        None, "bytes for weights and KV caches, e.g. 6GiB (fewer sequence slots if they do not fit)"
    )
    gpu_memory_utilization: float | None = option(
        0.9, "on CUDA without a memory budget: the fraction of GPU memory to plan with"
    )
    enforce_eager: bool = option(False, "on CUDA: every forward eager, no CUDA graphs (slower; for debugging)")
    # docs/decisions.md#chunked-prefill-beside-decoding
    prefill_chunk_tokens: int | None = option(
        None,
        "a longer prompt arriving while others decode is prefilled "
        "this many tokens a step beside them (0: whole, the others "
        "waiting; default: 64 on a CPU, 2048 on a GPU)",
    )
    adaptive: AdaptiveOptions = option(
        AdaptiveOptions(),
        "the adaptive policy's knobs (AdaptiveOptions, or a dict of some of them): speed only, never the output",
    )

    def __post_init__(self):
        from .errors import SpecDecodeError

        self.adaptive = AdaptiveOptions.of(self.adaptive)
        problems = []
        if not 0 <= self.num_speculative_tokens < MAX_VERIFY_WIDTH:
            problems.append(
                f"num_speculative_tokens (-k) must be in [0, {MAX_VERIFY_WIDTH - 1}], got {self.num_speculative_tokens}"
            )
        if self.max_num_seqs < 1 or (self.max_model_len is not None and self.max_model_len < 2):
            problems.append(
                f"max_num_seqs must be >= 1 and max_model_len >= 2, got {self.max_num_seqs} and {self.max_model_len}"
            )
        if self.prefill_chunk_tokens is not None and self.prefill_chunk_tokens < 0:
            problems.append(f"prefill_chunk_tokens must be >= 0 (0: whole prompts), got {self.prefill_chunk_tokens}")
        if self.draft_confidence is not None and not 0.0 <= self.draft_confidence < 1.0:
            problems.append(f"the draft confidence threshold must be in [0, 1), got {self.draft_confidence}")
        if self.speculation_policy not in POLICIES:
            problems.append(f"unknown speculation policy {self.speculation_policy!r}; use one of {', '.join(POLICIES)}")
        for name in ("quantization", "draft_quantization"):
            if getattr(self, name) not in QUANTIZATIONS:
                problems.append(f"unknown {name} {getattr(self, name)!r}; use one of {', '.join(QUANTIZATIONS)}")
        if self.lora_dtype not in LORA_DTYPES:
            problems.append(f"unknown lora_dtype {self.lora_dtype!r}; use one of {', '.join(LORA_DTYPES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            problems.append(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; use one of {', '.join(KV_CACHE_DTYPES)}")
        if not 1 <= self.ngram_prompt_lookup_min <= self.ngram_prompt_lookup_max:
            problems.append("n-gram lookup needs 1 <= ngram_prompt_lookup_min <= ngram_prompt_lookup_max")
        if self.prompt_lookup not in (None, *LOOKUPS):
            problems.append(f"unknown prompt lookup {self.prompt_lookup!r}; use one of {', '.join(LOOKUPS)}")
        if self.suffix_cache_scope not in SUFFIX_SCOPES:
            problems.append(
                f"unknown suffix cache scope {self.suffix_cache_scope!r}; use one of {', '.join(SUFFIX_SCOPES)}"
            )
        if (
            not 1 <= self.suffix_max_tokens < MAX_VERIFY_WIDTH
            or self.suffix_cache_bytes < 0
            or not 0 <= self.suffix_min_prob <= 1
        ):
            problems.append(
                f"suffix speculation needs suffix_max_tokens in [1, {MAX_VERIFY_WIDTH - 1}], "
                "suffix_cache_bytes >= 0 and suffix_min_prob in [0, 1]"
            )
        problems += self._rope_scaling_problems() + self._lora_problems()
        if problems:
            raise SpecDecodeError("; ".join(problems))
        if self.draft_vocab_size == 0:
            self.draft_vocab_size = None  # 0 on the command line: the whole vocabulary

    def _lora_problems(self) -> list[str]:
        """lora and lora_modules as tuples (one spec may come alone), each spec checked."""
        self.lora, self.lora_modules = (
            (specs,) if isinstance(specs, str) else tuple(specs) for specs in (self.lora, self.lora_modules)
        )
        problems = []
        if not all(isinstance(spec, str) and spec for spec in self.lora):
            problems.append(f"lora is a list of adapter paths (PATH or PATH:SCALE), got {self.lora!r}")
        named = [spec.partition("=") if isinstance(spec, str) else ("", "", "") for spec in self.lora_modules]
        names = [name for name, _, _ in named]
        if not all(name and path for name, _, path in named):
            problems.append(f"lora_modules are NAME=PATH or NAME=PATH:SCALE, got {self.lora_modules!r}")
        elif len(set(names)) < len(names):
            problems.append(f"lora_modules name an adapter twice: {names}")
        return problems

    def _rope_scaling_problems(self) -> list[str]:
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = json.dumps(self.rope_scaling)  # one form, as the command line gives it
        try:
            ok = self.rope_scaling is None or isinstance(json.loads(self.rope_scaling), dict)
        except ValueError:
            ok = False
        example = '{"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 32768}'
        return [] if ok else [f"rope_scaling must be a JSON object such as {example}, got {self.rope_scaling!r}"]

    def draft_confidence_on(self, device_type: str) -> float:
        """draft_confidence; where unset DRAFT_CONFIDENCE, or none on CUDA with graphs: a drafter's rounds chain on
        the device there, every round and verify row runs anyway, and a stop would only drop accepted drafts
        (docs/decisions.md#draft-confidence-stop-and-a-64k-draft-vocabulary)."""
        if self.draft_confidence is not None:
            return self.draft_confidence
        return 0.0 if device_type == "cuda" and not self.enforce_eager else DRAFT_CONFIDENCE

    def rope_scaling_fields(self) -> dict | None:
        """rope_scaling as config.json's fields (None: the target's own scaling)."""
        return None if self.rope_scaling is None else json.loads(self.rope_scaling)

    def as_dict(self) -> dict:
        return asdict(self)


LOSSY_NOTE = "forced_accept: every draft token accepted -- an upper bound, NOT the target's distribution"


@dataclass(frozen=True, repr=False)
class ModelConfig:
    """What a decoder-only transformer computes, layer by layer. models/families.py reads it from GGUF metadata
    or a config.json and refuses what the runtime does not implement; the defaults are Llama's."""

    arch: str  # the family as its source names it ("llama", "qwen2", "qwen3", "gemma3", "qwen3moe", ...)
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
    # -- what the families beyond Llama and Qwen2 add (models/families.py) --
    # RoPE frequency scaling of the (global) attention layers: () none, or sorted (name, value) items:
    # ("rope_type", "linear"), ("factor", f); ("rope_type", "llama3") with factor, low_freq_factor,
    # high_freq_factor and original_max_position_embeddings; ("rope_type", "yarn") with factor,
    # original_max_position_embeddings, beta_fast, beta_slow, truncate and attention_factor (which attention_scale
    # holds, squared); ("rope_type", "longrope") with short_factor and long_factor (per-dimension divisors, tuples),
    # original_max_position_embeddings and attention_factor (held as YaRN's); ("rope_type", "freq_factors"):
    # per-dimension divisors stored with the weights (GGUF's rope_freqs tensor).
    rope_scaling: tuple = ()
    # head dimensions RoPE turns, the first ones (NeoX halves of them paired; Phi-4-mini's partial rotary); None: all
    rotary_dim: int | None = None
    qk_norm: bool = False  # an RMSNorm over each query and key head before RoPE (Qwen3, Gemma 3)
    # the q/k norms' weights over each projection's whole width, not one head's (OLMo 2's RMSNorms over it, Command R+'s
    # LayerNorms of each head where layer_norms)
    qk_norm_whole: bool = False
    # of the gated MLP: "silu" (SwiGLU), "gelu_tanh" (GeGLU) or "swiglu_oai" (gpt-oss's clamped SwiGLU, layers.gated)
    activation: str = "silu"
    sandwich_norms: bool = False  # attention and MLP outputs normalised before the residual add (Gemma, GLM-4)
    pre_norms: bool = True  # attention and MLP inputs normalised; OLMo 2's read the residual stream as it is
    embedding_scale: float | None = None  # embeddings multiplied by it (Gemma: sqrt(hidden))
    attention_scale: float | None = None  # of the query-key scores; None: head_dim ** -0.5
    sliding_window: int | None = None  # keys a sliding layer's token sees, itself included
    sliding_layers: tuple[int, ...] | None = None  # layers that slide; None: all, when sliding_window is set
    local_rope_theta: float | None = None  # RoPE base of sliding layers (unscaled); None: rope_theta
    # their query-key scale where it differs: the global RoPE's attention factor left out (OLMo 3's YaRN)
    local_attention_scale: float | None = None
    num_experts: int = 0  # mixture of experts: experts per sparse layer (0: dense)
    experts_per_token: int = 0
    expert_intermediate_size: int | None = None  # None: intermediate_size
    normalize_expert_weights: bool = True  # the chosen experts' router probabilities rescaled to sum to 1
    dense_layers: tuple[int, ...] = ()  # layers of a mixture-of-experts model with a dense MLP
    nope_layers: tuple[int, ...] = ()  # layers that rotate no position into queries and keys (SmolLM3's every fourth)
    logit_scale: float | None = None  # the logits divided by it (Granite): folded into the final norm's weights at load
    # Gemma 2's soft caps, cap * tanh(x / cap): of each attention score after the query-key scale, and of the logits
    attention_softcap: float | None = None
    final_softcap: float | None = None
    # gpt-oss: a learned logit per query head in each softmax's denominator, its weight given to no value ("sinks")
    attention_sinks: bool = False
    o_bias: bool = False  # the attention output projection biased (gpt-oss; q/k/v too, by qkv_bias)
    expert_bias: bool = False  # the router and every expert's projections biased (gpt-oss)
    # an MLP beside the routed experts that every token takes, weighed by sigmoid(a gate's logit) (Qwen2-MoE) or
    # not (shared_expert_gated False: ERNIE 4.5's); 0: none
    shared_expert_size: int = 0
    shared_expert_gated: bool = True
    # a per-expert bias added to the router's probabilities to choose the top k, not to weigh them (ERNIE 4.5's)
    expert_selection_bias: bool = False
    # how the router scores each expert: "softmax" over all, or "sigmoid" of each logit alone (GLM-4.5's); the chosen
    # experts' weights (renormalised or not) then multiplied by expert_weights_scale (its routed_scaling_factor)
    expert_scoring: str = "softmax"
    expert_weights_scale: float = 1.0
    layer_norms: bool = False  # norms subtract each row's mean first (LayerNorm without a bias: Cohere's); else RMSNorm
    # attention and the MLP both read one norm of the stream, and their outputs join it together (Cohere)
    parallel_blocks: bool = False
    # DeepSeek's multi-head latent attention: each token's keys and values expanded from a compressed vector of
    # kv_lora_rank (RMS-normalised), its keys' turned part (rotary_dim wide) one for all heads; its queries from one of
    # q_lora_rank (0: projected directly). Each head's values value_dim wide, padded to head_dim with zeros
    # (models/latent.py). 0: attention as Llama's.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    value_dim: int | None = None
    # experts chosen among groups first (DeepSeek's): the top expert_groups_kept of expert_groups, each scored by its
    # best expert ("max", DeepSeek-V2's) or its best two summed ("top2", V3's); 1: no groups
    expert_groups: int = 1
    expert_groups_kept: int = 1
    expert_group_scoring: str = "max"
    # Llama 4's attention temperature (Ministral 3's llama_4_scaling_beta): the queries at position p multiplied by
    # 1 + query_temperature * ln(1 + floor(p / query_temperature_floor)), which is 1 short of the floor; 0: none
    query_temperature: float = 0.0
    query_temperature_floor: int = 0

    def __post_init__(self):
        # read back from JSON, tuples arrive as lists
        for name in ("rope_scaling", "sliding_layers", "dense_layers", "nope_layers"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(tuple(v) if isinstance(v, list) else v for v in value))

    def __repr__(self) -> str:
        """Every Llama/Qwen2 field, then the others that differ from their defaults: a Llama or Qwen2 model
        reads as it always has (a draft head names its target by a hash of this text)."""
        items = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)[:_LLAMA_FIELDS]]
        items += [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in fields(self)[_LLAMA_FIELDS:]
            if getattr(self, f.name) != f.default
        ]
        return f"ModelConfig({', '.join(items)})"

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def is_llama_or_qwen2(self) -> bool:
        """What transformers' Llama and Qwen2 classes compute: one of those families with none of the others'
        features (the fields past Llama's at their defaults)."""
        extra = fields(self)[_LLAMA_FIELDS:]
        return self.arch in ("llama", "qwen2") and all(getattr(self, f.name) == f.default for f in extra)

    @property
    def expert_size(self) -> int:
        return self.expert_intermediate_size or self.intermediate_size

    @property
    def latent_attention_parameters(self) -> int:
        """A latent attention layer's weights: queries (through their compression, where they have one), the keys' and
        values' compression and expansion, the output."""
        heads, width, rank = self.num_heads, self.dim_per_head, self.kv_lora_rank
        queries = (
            self.q_lora_rank * (self.hidden_size + heads * width)
            if self.q_lora_rank
            else self.hidden_size * heads * width
        )
        kv = self.hidden_size * (rank + self.rotary_dim) + rank * heads * (width - self.rotary_dim + self.value_dim)
        return queries + kv + heads * self.value_dim * self.hidden_size

    def scales_queries(self, keys: int) -> bool:
        """Whether the attention temperature scales any query of a call attending over `keys` keys (positions below
        it): only past its floor."""
        return self.query_temperature != 0.0 and keys > self.query_temperature_floor

    def window(self, layer: int) -> int | None:
        """The sliding window of a layer (None: it attends to the whole context)."""
        if self.sliding_window is None or (self.sliding_layers is not None and layer not in self.sliding_layers):
            return None
        return self.sliding_window

    def is_sparse(self, layer: int) -> bool:
        """Whether a layer's MLP is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def layer_parameters(self) -> int:
        """Weights of the decoder layers' linear maps that each decoded token streams and multiplies (of a
        mixture of experts, the experts_per_token it is routed to)."""
        attention = self.hidden_size * (self.num_heads + 2 * self.num_kv_heads + self.num_heads) * self.dim_per_head
        if self.kv_lora_rank:
            attention = self.latent_attention_parameters
        dense = 3 * self.hidden_size * self.intermediate_size
        routed = self.experts_per_token * self.expert_size + self.shared_expert_size
        sparse = 3 * self.hidden_size * routed + self.num_experts * self.hidden_size
        return sum(attention + (sparse if self.is_sparse(i) else dense) for i in range(self.num_layers))


_LLAMA_FIELDS = 13  # ModelConfig's fields up to head_dim: what it held when it described Llama and Qwen2 only
