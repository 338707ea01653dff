"""Offline API with vLLM's names: LLM(...).generate(prompts, SamplingParams(...)) and .chat(...)."""

from __future__ import annotations

import difflib
import functools
import inspect
from dataclasses import dataclass, field, fields

from ..config import PREFILL_CHUNK_TOKENS, EngineConfig
from ..config import EngineConfig as C  # every default, written once there
from ..errors import SpecDecodeError
from ..executor.runner import ModelRunner, gpu_experts
from ..metrics import RequestMetrics, peak_rss_bytes
from ..models.generation_config import sampling_defaults
from ..models.loader import LoadedModel, load_model
from ..models.lora import Adapter
from ..models.runtime import Transformer
from ..models.tokenizer import template_variables
from ..proposers import Proposer, ProposerSetup, build_proposer, proposer_kind
from ..proposers.registry import DRAFT_MODEL
from ..sampling import SamplingParams, TokenLogprob
from ..timing import StepTimer
from .engine import Engine
from .memory import context_that_fits, format_bytes, plan_memory, resolve_budget
from .policy import make_policy
from .profile import profile_attention_cost, profile_draft_costs, profile_verify_costs
from .sequence import Sequence


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None  # one per token, when SamplingParams.logprobs asks
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (None: EOS, length)

    @classmethod
    def from_sequence(cls, seq: Sequence) -> "CompletionOutput":
        return cls(seq.index, seq.text, list(seq.output_ids), seq.finish_reason, seq.logprobs, seq.stop_reason)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics
    finished: bool = True
    spec: dict = field(default_factory=dict)  # the request's speculation metrics, as a dict
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with SamplingParams.prompt_logprobs

    @classmethod
    def from_group(cls, group: list[Sequence], prompt: str | None) -> "RequestOutput":
        """One prompt's n outputs; metrics are the first output's (its TTFT includes the shared prefill)."""
        first = group[0]
        return cls(
            first.request_id,
            prompt,
            first.prompt_ids,
            [CompletionOutput.from_sequence(s) for s in group],
            first.metrics,
            True,
            first.metrics.as_dict(),
            first.prompt_logprobs,
        )


def per_prompt(
    sampling_params: SamplingParams | list[SamplingParams] | None, prompts: int, defaults: dict
) -> list[SamplingParams]:
    """One SamplingParams for each of `prompts` prompts, from one for all or a list of one each; none: `defaults`."""
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [sampling_params or SamplingParams(**defaults)] * prompts
    params = list(sampling_params)
    if len(params) != prompts or not all(isinstance(p, SamplingParams) for p in params):
        raise SpecDecodeError(
            f"sampling_params must be one SamplingParams or a list of one per prompt; got "
            f"{len(params)} for {prompts} prompts"
        )
    return params


def names_valid_options(init):
    """Options beyond the signature's are EngineConfig's fields; an unknown one is refused with the valid ones
    named (and the nearest, where one is close), instead of Python's bare "unexpected keyword argument"."""
    valid = [name for name in inspect.signature(init).parameters if name not in ("self", "options")]
    valid += [f.name for f in fields(EngineConfig) if f.name not in valid]

    @functools.wraps(init)
    def checked(self, *args, **options):
        unknown = [name for name in options if name not in valid]
        if unknown:
            near = {name: difflib.get_close_matches(name, valid, n=1) for name in unknown}
            hints = "".join(f" ({name!r}: did you mean {close[0]!r}?)" for name, close in near.items() if close)
            raise TypeError(
                f"unknown option(s) {', '.join(map(repr, unknown))} for LLM{hints}; the options are: {', '.join(valid)}"
            )
        return init(self, *args, **options)

    checked.valid_options = valid
    return checked


class LLM:
    """Target model plus an optional proposer: `speculative_model` names a registered proposer kind
    ("ngram": prompt lookup; see proposers.registry) or a draft model (name, path or hub id).

    quantization / draft_quantization pick the backend of models loaded by name ("auto": the fastest
    measured for this machine; see executor.backends), kv_cache_dtype their KV caches' element type
    ("auto": float16 where the CPU attention kernel reads it, else the activations' dtype). Models passed
    as `target`/`draft` are used as built.

    A draft model's LM head keeps `draft_vocab_size` token ids (None or 0: all of them), and it stops drafting after a
    token it gives less than `draft_confidence` probability (0: always drafts what the policy asks; None: 0.8, or 0 on
    CUDA with graphs); neither changes the output. With `prefix_caching`, a prompt starts from the KV blocks that
    requests of the same tenant, running or finished, computed for its longest prefix."""

    @names_valid_options
    def __init__(
        self,
        model: str = C.model,
        speculative_model: str | None = C.speculative_model,
        num_speculative_tokens: int = C.num_speculative_tokens,
        *,
        progress: bool = True,
        target: LoadedModel | None = None,
        draft: LoadedModel | None = None,
        **options,
    ):
        """options: EngineConfig's other fields (config.py: each with its default and what it does)."""
        self.config = config = EngineConfig(
            model=model, speculative_model=speculative_model, num_speculative_tokens=num_speculative_tokens, **options
        )
        if target is not None and (config.lora or config.lora_modules or config.lora_dtype != "auto"):  # left out
            raise SpecDecodeError(
                "lora, lora_modules and lora_dtype adapt a target the LLM loads; give a target loaded apart its "
                "adapters with load_model(..., lora=..., served_lora=..., lora_dtype=...)"
            )
        k, disable_above = config.num_speculative_tokens, config.speculative_disable_by_batch_size
        policy = make_policy(config.speculation_policy, k, disable_above, config.adaptive)
        self.target = target or load_model(
            config.model,
            config.device,
            config.dtype,
            progress,
            config.quantization,
            kv_cache_dtype=config.kv_cache_dtype,
            rope_scaling=config.rope_scaling_fields(),
            lora=[Adapter.parse(spec) for spec in config.lora],
            served_lora=Adapter.served(config.lora_modules),
            lora_dtype=config.lora_dtype,
        )
        # what generate() without sampling params, and requests leaving a field unset, take (vLLM's)
        self.sampling_defaults = sampling_defaults(config.generation_config, self.target.recommended_sampling)
        self.tokenizer = self.target.tokenizer
        if config.chat_template is not None:
            self.tokenizer = self.tokenizer.with_chat_template(config.chat_template)
        self.timer = StepTimer()
        self.target.model.fit_rope_to_context(self.max_model_len)  # before a draft head copies its tables
        # the threshold in force, as llm.config reports it (a proposer built apart resolves it the same way)
        config.draft_confidence = config.draft_confidence_on(self.target.model.device.type)
        proposers = self._proposers(ProposerSetup(self.target, config, draft, progress, self.timer), policy)
        self.draft = next((p.loaded for p in proposers if p.loaded is not None), None)
        for loaded in (self.target, self.draft):
            if loaded is not None:
                loaded.model.capture_graphs = not config.enforce_eager
                if loaded.model.device.type == "cuda":
                    gpu_experts(loaded.model)  # before the memory plan, which reserves captured forwards' outputs
        if self.draft is not None and isinstance(self.draft.model, Transformer):  # a draft head's tables are copies
            self.draft.model.fit_rope_to_context(self.max_model_len)
        self.engine = self._engine(proposers, policy)
        # a policy that weighs the draft's cost at every number of drafting sequences (the adaptive one) gets
        # it timed now rather than extrapolated; that cost jumps between batch sizes
        self.profile_seconds = (
            profile_attention_cost(self.engine) + profile_draft_costs(self.engine) + profile_verify_costs(self.engine)
            if policy.wants_draft_costs
            else 0.0
        )

    @functools.cached_property
    def max_model_len(self) -> int:
        """The longest sequence served: the option, within the target's context; without it, the target's context as
        far as one sequence's KV cache fits the memory (memory.context_that_fits)."""
        context = self.target.config.max_position
        if self.config.max_model_len:
            return min(self.config.max_model_len, context)
        config, model = self.config, self.target.model
        budget = resolve_budget(model.device, config.memory_budget, config.gpu_memory_utilization)
        return context_that_fits(model, context, budget, config.max_num_seqs, config.num_speculative_tokens)

    def _engine(self, proposers: list[Proposer], policy) -> Engine:
        """The memory plan, the KV caches it allows (the target's and each proposer's), and the engine over them."""
        config, device, max_model_len = self.config, self.target.model.device, self.max_model_len
        budget = resolve_budget(device, config.memory_budget, config.gpu_memory_utilization)
        draft_model = next((p.model for p in proposers if p.model is not None), None)
        features = any(p.wants_hidden_states for p in proposers)
        k = config.num_speculative_tokens
        indexes = sum(p.host_bytes_per_token for p in proposers)
        plan = plan_memory(
            self.target.model, draft_model, max_model_len, config.max_num_seqs, k, budget, features, indexes
        )
        self.memory_plan = plan
        for proposer in proposers:
            proposer.reserve(plan.num_slots, max_model_len, config.prefix_caching, plan.num_blocks)
        runner = ModelRunner(self.target.model, plan.num_slots, max_model_len, config.prefix_caching, plan.num_blocks)
        chunk = config.prefill_chunk_tokens
        if chunk is None:
            chunk = PREFILL_CHUNK_TOKENS.get(device.type, PREFILL_CHUNK_TOKENS["cuda"])
        return Engine(runner, self.tokenizer, proposers, k, config.forced_accept, self.timer, policy, chunk or None)

    def _proposers(self, setup: ProposerSetup, policy) -> list[Proposer]:
        """The main proposer, and a lookup proposer beside it where the policy may choose per sequence."""
        kind = DRAFT_MODEL if setup.loaded is not None else proposer_kind(setup.config.speculative_model)
        proposers: list[Proposer] = [build_proposer(kind, setup)] if kind else []
        lookup = setup.config.prompt_lookup
        if (
            lookup
            and proposers
            and not proposers[0].previews
            and policy.chooses_proposers
            and not setup.config.forced_accept
        ):
            proposers.append(build_proposer(lookup, setup))
        return proposers

    def startup_summary(self) -> str:
        """Each model's backend, weight bytes and load time, the peak memory so far, and on a GPU the kernels of the
        captured forwards."""
        parts = [
            f"{role} {m.name}: {m.model.backend}, {format_bytes(m.model.weight_bytes())} of weights, "
            f"loaded in {m.load_seconds:.1f} s"
            for role, m in (("target", self.target), ("draft", self.draft))
            if m is not None and m.load_seconds
        ]
        captured = self.engine.runner.captured_kernels()
        return "; ".join(parts + [f"peak RSS {format_bytes(peak_rss_bytes())}"] + ([captured] if captured else []))

    def get_default_sampling_params(self) -> SamplingParams:
        """The model's recommended sampling settings (--generation-config), as vLLM's method of this name."""
        return SamplingParams(**self.sampling_defaults)

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        adapter: str | list[str] = "",
    ) -> list[RequestOutput]:
        """Prompts are strings or token-id lists; sampling_params one for all of them, or one per prompt (as in
        vLLM); adapter: the served LoRA adapter (lora_modules) that computes them, or one per prompt ("": none).
        Outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = per_prompt(sampling_params, len(prompts), self.sampling_defaults)
        texts = [p if isinstance(p, str) else None for p in prompts]
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        adapters = [adapter] * len(prompts) if isinstance(adapter, str) else list(adapter)
        return self._run(texts, ids, params, adapters)

    def chat(
        self,
        conversations: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        tools: list[dict] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        adapter: str = "",
    ) -> list[RequestOutput]:
        """Conversations are lists of {"role", "content"} messages; the model's chat template is applied, with
        `tools` (OpenAI function tools) where it renders them (the calls stay in the output's text), and vLLM's
        options: continue_final_message (add_generation_prompt off) goes on with the last message; the template's own
        variables in chat_template_kwargs (Qwen3's enable_thinking)."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        options = template_variables(chat_template_kwargs) | dict(
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message
        )
        texts = [self.tokenizer.apply_chat_template(c, tools=tools, **options) for c in conversations]
        return self.generate(texts, sampling_params, adapter)

    def _run(self, texts, ids, params: list[SamplingParams], adapters: list[str]) -> list[RequestOutput]:
        """Every prompt to its end; a prompt refused, or anything raised on the way, aborts the call's others, which
        would otherwise run (and be paid for) in the next call."""
        groups = []
        try:
            for prompt, sampling, adapter in zip(ids, params, adapters, strict=True):
                groups.append(self.engine.add_group(prompt, sampling, adapter=adapter))
            while self.engine.has_unfinished():
                self.engine.step()
        except BaseException:
            for seq in (s for group in groups for s in group if not s.finished):
                self.engine.abort(seq)
            raise
        return [RequestOutput.from_group(g, t) for g, t in zip(groups, texts)]
