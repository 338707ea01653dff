"""The engine loop: admit requests (prefill), then per step draft -> verify in one target forward ->
accept/reject -> commit (KV pointers move) -> emit, for every running sequence at once. A long prompt that
arrives while others decode is prefilled a chunk a step beside them, so that their streams go on."""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable

import torch

from ..errors import SpecDecodeError
from ..executor.runner import ModelRunner
from ..metrics import SpecCounters
from ..models.tokenizer import Tokenizer
from ..proposers.base import DraftBatch, Preview, Proposer, TargetFeedback
from ..sampling import GrammarMatcher, SamplingParams, TokenLogprob
from ..timing import StepTimer, mark, seconds_between
from ..verify.verifier import ForcedAcceptance
from .admission import BlockBudget
from .ahead import StepAhead
from .chunked_prefill import ChunkedPrefill, ChunkedPrefilling, PromptChunk
from .overlap import QueuingAhead
from .policy import DraftDecision, Policy, make_policy
from .prefill import Prefilling
from .sequence import Sequence, prepare_request, sample_stream
from .step import SequenceUpdate, StepOutput


class Engine(Prefilling, ChunkedPrefilling, QueuingAhead):
    """proposers: at most one that drafts with a model (a draft model or head) and one that previews its
    drafts at no forward cost (prompt lookup, suffix speculation). With both, the policy chooses per
    sequence and step which one drafts; with a previewing one alone, it drafts for everyone.

    prefill_chunk: a prompt longer than this that arrives while other sequences decode is prefilled this many
    tokens a step, after each decoding step (None: every prompt at once, the decoding streams waiting).

    overlap: work queued ahead of the host, a step waiting for the device once (engine/overlap.py; None: where the
    runner replays graphs)."""

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        proposers: list[Proposer] = (),
        num_speculative_tokens: int = 0,
        forced_accept: ForcedAcceptance = False,
        timer: StepTimer | None = None,
        policy: Policy | None = None,
        prefill_chunk: int | None = None,
        overlap: bool | None = None,
    ):
        if num_speculative_tokens < 0:
            raise SpecDecodeError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
        self.runner, self.tokenizer = runner, tokenizer
        self.proposers = list(proposers)
        self.proposer = next((p for p in self.proposers if not p.previews), None)
        self.lookup = next((p for p in self.proposers if p.previews), None)
        self.wants_hidden_states = any(p.wants_hidden_states for p in self.proposers)
        self.policy = policy or make_policy("fixed")
        self.k = num_speculative_tokens if self.proposers else 0
        self.max_model_len = runner.max_len
        self.forced_accept = forced_accept
        self.timer = timer or StepTimer()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefill_chunk = prefill_chunk
        self.prefilling: list[ChunkedPrefill] = []  # admitted, prompt partly computed, oldest first
        self._given: dict[int, tuple[Sequence, int]] = {}  # this step: a sequence given tokens -> where they begin
        self.totals = SpecCounters()
        self.overlap = runner.replays_graphs if overlap is None else overlap
        self._ahead: StepAhead | None = None  # the next plain step, queued on the device
        self._plain_run = 0  # plain decoding steps in a row
        self.blocks = BlockBudget(runner, self.proposers, lambda: self.k)

    @property
    def k(self) -> int:
        """The most tokens drafted per sequence and step (the policy may choose fewer)."""
        return self.policy.k_max

    @k.setter
    def k(self, value: int) -> None:
        self.policy.k_max = value

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """Queue one sequence (params.n must be 1; see add_group)."""
        if params.n != 1:
            raise SpecDecodeError(f"add_request makes one sequence; use add_group for n={params.n}")
        return self.add_group(prompt_ids, params)[0]

    def add_group(self, prompt_ids: list[int], params: SamplingParams, tenant="", adapter="") -> list[Sequence]:
        """Queue params.n sequences of one prompt: admitted together, prefilled once. tenant: who asks (suffix
        speculation drafts from its earlier outputs only); adapter: the served LoRA adapter computing them, or ""."""
        if not prompt_ids:
            raise SpecDecodeError("the prompt is empty; pass at least one token of text")
        if params.n > self.runner.num_slots:
            raise SpecDecodeError(
                f"n={params.n} outputs need as many sequence slots, and this engine has "
                f"{self.runner.num_slots}; ask for fewer or raise max_num_seqs"
            )
        self.runner.check_adapter(adapter)
        prompt_ids = prepare_request(prompt_ids, params, self.tokenizer, self.runner.cfg.vocab_size, self.max_model_len)
        self.blocks.check(len(prompt_ids), params)
        vocab, wanted = self.runner.cfg.vocab_size, params.structured_output
        grammar = None if wanted is None else GrammarMatcher.compile(wanted, self.tokenizer, vocab)
        group: list[Sequence] = []
        for index in range(params.n):
            seq = Sequence(
                list(prompt_ids),
                params,
                sample_stream(params.seed, index, self.runner.device),
                index=index,
                siblings=group,
                logprobs=None if params.logprobs is None else [],
                grammar=grammar.copy() if grammar is not None else None,
                tenant=tenant,
                adapter=adapter,
            )
            seq.metrics.num_prompt_tokens = len(prompt_ids)
            seq.metrics.forced_accept = bool(self.forced_accept) and self.k > 0
            group.append(seq)
        self.waiting.extend(group)
        return group

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling)

    @property
    def num_running(self) -> int:
        """Sequences admitted and not finished: decoding, or their prompt being prefilled in chunks."""
        return len(self.running) + len(self.prefilling)

    def step(self) -> StepOutput:
        """Preempt what the KV cache cannot hold, admit what fits and prefill it, then run one decoding step and one
        chunk of a long prompt's prefill (in the verify's target call where the runner packs them); say what it did. A
        step that admits while nothing decodes ends after the prefill: its first tokens go out at once, and requests
        that arrived meanwhile are admitted in time to decode with them from the first decoding step (with others
        decoding, waiting a prefill out would hold up their tokens)."""
        out = StepOutput()
        self._given = {}
        out.preempted = self._make_room()
        was_decoding = self._busy()
        admitted = self._admit()
        decoding = [s for s in self.running if not s.finished]
        riding = bool(self.prefilling and was_decoding and decoding) and self.runner.packs_any_width
        riding = riding and self._ahead is None  # a step queued ahead has no room for the chunk
        if decoding and (was_decoding or not admitted):
            self._decode_step(decoding, out, self._next_chunk() if riding else None)
        if self.prefilling and was_decoding and not riding:
            self._prefill_chunk()
        out.outputs = [SequenceUpdate.since(seq, start) for seq, start in self._given.values()]
        out.finished = [s for s in self.running if s.finished]
        for seq in out.finished:
            self._release(seq)
        self.running = [s for s in self.running if not s.finished]
        out.draft_cache_bytes = self.lookup.cache_bytes if self.lookup is not None else 0  # outputs just cached too
        return out

    def forget_cached_prefixes(self) -> None:
        """Later prompts are computed whole (benchmarks that compare configurations on the same prompts)."""
        for holder in (self.runner, *self.proposers):
            holder.forget_prefixes()

    def _target_forward(
        self, slots: list[int], inputs: list[list[int]], logits: str | list[int], every_row: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits, and when a proposer reads them the hidden states of the same rows (of every input
        row with every_row: a prompt's, which a draft head reads as its context)."""
        if self.wants_hidden_states:
            return self.runner.forward(slots, inputs, logits, hidden="all" if every_row else True)
        return self.runner.forward(slots, inputs, logits), None

    def _feed_back(self, seq: Sequence, feedback: TargetFeedback) -> None:
        seq.feedback = feedback
        for proposer in self.proposers:
            proposer.observe(seq, feedback)

    # ---- decode: draft, verify, commit ---------------------------------------------------------------
    def _decode_step(self, seqs: list[Sequence], out: StepOutput, chunk: PromptChunk | None = None) -> None:
        step_start, captured = mark(), self._graphs_captured()
        decision, previews = self._decide_drafts(seqs)
        if chunk is None and self._plain(seqs, decision):
            return self._plain_step(seqs, out, step_start, captured)
        self._drop_ahead()  # a step queued as plain and not taken: its rows are written anew
        self._plain_run = 0
        drafts, draft_seconds = self._queued_drafts(seqs, decision, chunk) or self._propose(seqs, decision, previews)
        step_start = self._verify_ahead.since if self._verify_ahead else step_start  # its drafting, the step before
        verify_start = self._verify_ahead.span.start if self._verify_ahead else mark()
        starts = [seq.num_tokens - 1 for seq in seqs]
        # a call that also prefilled a chunk is not a decode forward's time (prefills are counted apart)
        with self.timer.measure("target") if chunk is None and not self._verify_ahead else contextlib.nullcontext():
            logits, hidden, chunk_out = self._verify_forward(seqs, drafts, chunk)
        ahead = self._queue_drafts(seqs, drafts, decision, logits, hidden) if chunk is None else None
        results, widths = self._verified(seqs, drafts, logits, ahead)  # the step's one wait for the device
        out.draft_lengths = drafts.num_tokens
        out.lookup_drafts = sum(1 for k, lookup in zip(drafts.num_tokens, decision.by_lookup) if k and lookup)
        row = 0
        for i, (seq, start, n_draft, (result, logprobs)) in enumerate(zip(seqs, starts, drafts.num_tokens, results)):
            accepted, emitted = result.num_accepted[0], result.tokens[0]
            committed = start + 1 + accepted  # pending token + accepted drafts are now cached
            self.runner.commit(seq.slot, committed)  # rejected drafts' KV stays behind the pointer
            for proposer in self.proposers:
                proposer.commit(seq, committed)
            self._feed_back(
                seq, TargetFeedback(emitted, None if hidden is None else hidden[row : row + len(emitted)], start)
            )
            row += widths[i]
            seq.metrics.spec.record_step(n_draft, accepted, len(emitted))
            out.counters.record_step(n_draft, accepted, len(emitted))
            if decision.by_lookup[i] and n_draft:
                self.policy.observe_lookup(seq.request_id, previews[i].match, n_draft, accepted)
            else:
                self.policy.observe_acceptance(seq.request_id, n_draft, accepted, decision.ks[i])
            self._emit(seq, emitted, logprobs)
        # the policy weighs whole phases: verification's sampling and bookkeeping grow with the drafts too
        end = ahead.verified if ahead is not None else mark()  # the device's work for this step (not the next's drafts)
        one_off = self._graphs_captured() != captured  # a capture's time is not the step's cost
        self.policy.observe_step(
            [w - 1 for w in widths],  # the rows verified: drafts past a confidence stop too, where they were verified
            seconds_between(verify_start, end),
            None if one_off else draft_seconds(),
            seconds_between(step_start, end),
            by_lookup=decision.by_lookup,
            contexts=starts,
            untimed=chunk is not None or one_off,
        )
        self.timer.settle()
        if chunk is not None:
            self._chunk_done(chunk, *chunk_out)

    def _decide_drafts(self, seqs: list[Sequence]) -> tuple[DraftDecision, list[Preview] | None]:
        """The policy's decision, capped per sequence (see _draft_budget), and the lookup proposer's
        previews that it weighed (None without one)."""
        n = len(seqs)
        if not self.proposers:
            return DraftDecision.main_proposer([0] * n), None
        previews = self.lookup.preview(seqs, self.lookup_cap) if self.lookup and self.k else None
        catch_up = [max(0, self.proposer.unseen_tokens(s) - 2) if self.proposer else 0 for s in seqs]  # 1-2: steady
        decision = self.policy.choose(
            [s.request_id for s in seqs],
            catch_up,
            [s.remaining_tokens for s in seqs],
            [(p.match, p.tokens, p.probs) for p in previews] if previews else None,
            drafter=self.proposer is not None,
            contexts=[s.num_tokens - 1 for s in seqs],
        )
        if self.proposer is None:
            decision.by_lookup = [True] * n
        if any(decision.ks):
            decision.ks = [self._draft_budget(seq, k) if k else 0 for seq, k in zip(seqs, decision.ks)]
        return decision, previews

    @property
    def lookup_cap(self) -> int:
        """The longest lookup draft: the proposer's own cap where it has one (suffix speculation's drafts
        cost no forward, so they may run far past k), else k."""
        return (self.lookup.max_draft or self.k) if self.lookup else 0

    def _propose(
        self, seqs: list[Sequence], decision: DraftDecision, previews: list[Preview] | None
    ) -> tuple[DraftBatch, Callable[[], float | None]]:
        """Drafts from each proposer the decision picked (a lookup's are its previews, already made), and the seconds
        of one drafter round (for the policy's cost model; None if it did not run), to be read once the step's results
        are (on a GPU, reading them before would wait for the drafter)."""
        main_ks = [0 if lookup else k for k, lookup in zip(decision.ks, decision.by_lookup)]
        drafts, seconds = DraftBatch.empty(len(seqs)), lambda: None
        if any(main_ks):
            catch_up = sum(max(0, self.proposer.unseen_tokens(s) - 1) for s, k in zip(seqs, main_ks) if k)
            with self.timer.measure("propose") as span:
                drafts = self.proposer.propose(seqs, main_ks, [s.feedback for s in seqs])

            def seconds() -> float | None:
                return self._draft_round_seconds(span.seconds, max(main_ks), catch_up, drafts.round_seconds())

        for i, (k, lookup) in enumerate(zip(decision.ks, decision.by_lookup)):
            if k and lookup:
                drafts.tokens[i], drafts.probs[i] = previews[i].tokens[:k], None
        return drafts, seconds

    def _draft_round_seconds(self, total: float, rounds: int, catch_up: int, timed: list[float]) -> float | None:
        """A draft model's steady cost is a round of single-token forwards (`timed`: each round's seconds); its first
        round may carry a one-off catch-up, timed apart so that drafting does not look expensive for good."""
        rounds = len(timed) or rounds  # a draft that stops early (its confidence stop) ran fewer rounds than k
        if len(timed) < 2:  # one round: a catch-up in it cannot be told apart, so only a clean one counts
            return total / rounds if catch_up < 8 else None
        steady = sum(timed[1:]) / (len(timed) - 1)
        if catch_up >= 8:
            self.policy.observe_draft_prefill(catch_up, timed[0] - steady)
        bookkeeping = (total - sum(timed)) / len(timed)  # sampling and Python around each forward
        return steady + bookkeeping

    def _draft_budget(self, seq: Sequence, k: int) -> int:
        """k, capped so that emitted tokens fit max_tokens and the verified tokens fit the context."""
        return max(0, min(k, seq.remaining_tokens - 1, self.max_model_len - seq.num_tokens))

    def _emit(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> None:
        self._given.setdefault(id(seq), (seq, seq.num_output_tokens))  # where this step's tokens begin
        seq.append(tokens, logprobs, self.tokenizer, self.max_model_len)
