"""Offline API with vLLM's names: LLM(...).generate(prompts, SamplingParams(...)) and .chat(...)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import SpecDecodeError
from ..executor.runner import ModelRunner
from ..metrics import RequestMetrics, StepTimer, peak_rss_bytes
from ..models.loader import LoadedModel, load_model
from ..models.sources import DEFAULT_TARGET
from ..proposers import DraftModelProposer, NgramProposer
from ..sampling import SamplingParams
from .engine import Engine
from .memory import plan_memory, resolve_budget
from .policy import SpeculationPolicy
from .profile import profile_draft_costs
from .sequence import Sequence

NGRAM_NAMES = ("ngram", "[ngram]")


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics
    finished: bool = True
    spec: dict = field(default_factory=dict)  # the request's speculation metrics, as a dict

    @classmethod
    def from_sequence(cls, seq: Sequence, prompt: str | None) -> "RequestOutput":
        out = CompletionOutput(0, seq.text, list(seq.output_ids), seq.finish_reason)
        return cls(seq.request_id, prompt, seq.prompt_ids, [out], seq.metrics, True, seq.metrics.as_dict())


class LLM:
    """Target model plus an optional proposer: a draft model name/path, or "ngram" (prompt lookup).

    quantization / draft_quantization pick the backend of models loaded by name ("auto": the fastest
    measured for this machine; see executor.backends). Models passed as `target`/`draft` are used as built."""

    def __init__(self, model: str = DEFAULT_TARGET, speculative_model: str | None = None,
                 num_speculative_tokens: int = 4, *, device: str | None = None, dtype: str = "auto",
                 max_model_len: int = 4096, max_num_seqs: int = 8, forced_accept: bool = False,
                 ngram_prompt_lookup_max: int = 3, ngram_prompt_lookup_min: int = 1,
                 draft_vocab_size: int | None = None, quantization: str = "auto", draft_quantization: str = "auto",
                 speculation_policy: str = "fixed", speculative_disable_by_batch_size: int | None = None,
                 prompt_lookup: bool = False,
                 memory_budget: str | int | None = None, gpu_memory_utilization: float | None = 0.9,
                 progress: bool = True,
                 target: LoadedModel | None = None, draft: LoadedModel | None = None):
        if num_speculative_tokens < 0:
            raise SpecDecodeError(f"num_speculative_tokens (-k) must be >= 0, got {num_speculative_tokens}")
        self.target = target or load_model(model, device, dtype, progress, quantization)
        self.tokenizer = self.target.tokenizer
        self.timer = StepTimer()
        max_model_len = min(max_model_len, self.target.config.max_position)
        self.draft: LoadedModel | None = None
        proposer = None
        if speculative_model in NGRAM_NAMES:
            proposer = NgramProposer(ngram_prompt_lookup_max, ngram_prompt_lookup_min)
        elif speculative_model is not None or draft is not None:
            self.draft = draft or load_model(speculative_model, str(self.target.model.device), dtype, progress,
                                             draft_quantization, draft=True)
            check_same_vocabulary(self.target, self.draft)
            if draft_vocab_size and self.draft.model is not self.target.model:  # a self-draft must not alter the target
                restrict_draft_vocab(self.draft, draft_vocab_size)
        budget = resolve_budget(self.target.model.device, memory_budget, gpu_memory_utilization)
        self.memory_plan = plan_memory(self.target.model, self.draft.model if self.draft else None, max_model_len,
                                       max_num_seqs, num_speculative_tokens, budget)
        max_num_seqs = self.memory_plan.num_slots
        if self.draft is not None:
            proposer = DraftModelProposer(ModelRunner(self.draft.model, max_num_seqs, max_model_len), self.timer)
        policy = SpeculationPolicy(speculation_policy, num_speculative_tokens, speculative_disable_by_batch_size)
        # the adaptive policy may also draft by prompt lookup, per sequence, where the draft model does not pay
        lookup = None
        if prompt_lookup and self.draft is not None and speculation_policy == "adaptive" and not forced_accept:
            lookup = NgramProposer(ngram_prompt_lookup_max, ngram_prompt_lookup_min)
        runner = ModelRunner(self.target.model, max_num_seqs, max_model_len)
        self.engine = Engine(runner, self.tokenizer, proposer, num_speculative_tokens, forced_accept, self.timer,
                             policy, lookup)
        # the adaptive policy weighs the draft's cost at every number of drafting sequences, and that cost
        # jumps between them: time it now rather than extrapolate (0 s where there is no draft model)
        self.profile_seconds = profile_draft_costs(self.engine) if speculation_policy == "adaptive" else 0.0

    def startup_summary(self) -> str:
        """Each model's backend, weight bytes and load time, and the peak memory so far."""
        from .memory import format_bytes

        parts = [f"{role} {m.name}: {m.model.backend}, {format_bytes(m.model.weight_bytes())} of weights, "
                 f"loaded in {m.load_seconds:.1f} s" for role, m in (("target", self.target), ("draft", self.draft))
                 if m is not None and m.load_seconds]
        return "; ".join(parts + [f"peak RSS {format_bytes(peak_rss_bytes())}"])

    def generate(self, prompts: str | list[str] | list[list[int]],
                 sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        """Prompts are strings or token-id lists. Outputs come back in prompt order."""
        params = sampling_params or SamplingParams()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        texts = [p if isinstance(p, str) else None for p in prompts]
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        return self._run(texts, ids, params)

    def chat(self, conversations: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        """Conversations are lists of {"role", "content"} messages; the model's chat template is applied."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        texts = [self.tokenizer.apply_chat_template(c) for c in conversations]
        return self.generate(texts, sampling_params)

    def _run(self, texts, ids, params: SamplingParams) -> list[RequestOutput]:
        seqs = [self.engine.add_request(p, params) for p in ids]
        while self.engine.has_unfinished():
            self.engine.step()
        return [RequestOutput.from_sequence(s, t) for s, t in zip(seqs, texts)]


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
        raise SpecDecodeError(
            f"draft {draft.name!r} and target {target.name!r} have different vocabularies "
            f"({draft.tokenizer.vocab_size} vs {target.tokenizer.vocab_size} tokens); "
            "pick a draft from the target's model family, or use --ngram")


def restrict_draft_vocab(draft: LoadedModel, size: int) -> None:
    """Keep the draft LM head's `size` lowest token ids (byte-level BPE ranks ≈ frequency) plus the
    special tokens. The draft stays a valid proposer (q = 0 elsewhere), so verification stays lossless;
    the head of a 0.5B draft is ~25% of its weights, so this cuts the draft's step cost."""
    vocab = draft.config.vocab_size
    if size >= vocab:
        return
    special = [i for i in sorted(draft.tokenizer.special_ids) if i < vocab]
    ids = torch.unique(torch.cat([torch.arange(size), torch.tensor(special, dtype=torch.long)]))
    draft.model.restrict_vocab(ids)
