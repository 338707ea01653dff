"""A small draft model proposes k tokens autoregressively, keeping its own KV cache in step with the
accepted text. Tokens it has not seen yet (the last emitted token, a bonus token, or a stretch decoded
without speculation) are fed in its first forward, so its cache catches up lazily."""

from __future__ import annotations

import torch

from ..errors import SpecDecodeError
from ..executor.draft_chain import over_target_vocab
from ..executor.runner import ModelRunner
from ..models.loader import LoadedModel, load_model
from ..sampling import argmax_probability, probs_of_rows, sample_at, uniform_rows
from ..sampling.grammar import mask_grammars
from ..sampling.processors import History, process_rows
from ..timing import Span, StepTimer, mark
from ..transfers import to_device
from .base import DraftBatch, DraftsOnDevice, Proposer, QueuedDrafts
from .registry import ProposerSetup
from .vocabulary import check_same_vocabulary, restrict_draft_vocab


class DraftModelProposer(Proposer):
    reuses_prefixes = True  # its cache rows are a function of the tokens alone

    def __init__(self, draft: LoadedModel, timer: StepTimer | None = None, confidence_threshold: float = 0.0):
        if not 0.0 <= confidence_threshold < 1.0:
            raise SpecDecodeError(f"the draft confidence threshold must be in [0, 1), got {confidence_threshold}")
        self.loaded = draft
        self.confidence_threshold = confidence_threshold
        self.model = draft.model
        self.timer = timer or StepTimer()
        self.runner: ModelRunner | None = None  # built by reserve(), once the memory plan is known
        self._slots: dict[str, int] = {}  # request id -> the draft's KV-cache slot for it
        self._found: dict[str, int] = {}  # request id without a slot -> its tokens the draft's cache holds
        self._round_spans: list[tuple[Span, int]] = []
        self._vocab: list[int] | None = None  # the draft vocabulary's target ids, on the host (None: all of them)

    @classmethod
    def from_setup(cls, setup: ProposerSetup) -> "DraftModelProposer":
        if setup.loaded is None and setup.config.speculative_model is None:
            raise SpecDecodeError("the draft-model proposer needs a draft model (a name, path or hub id)")
        config = setup.config
        draft = setup.loaded or load_model(
            config.speculative_model,
            str(setup.target.model.device),
            config.dtype,
            setup.progress,
            config.draft_quantization,
            draft=True,
            kv_cache_dtype=config.kv_cache_dtype,
        )
        check_same_vocabulary(setup.target, draft.name, draft.tokenizer)
        if config.draft_vocab_size and draft.model is not setup.target.model:  # a self-draft must not alter the target
            restrict_draft_vocab(draft, config.draft_vocab_size)
        return cls(draft, setup.timer, config.draft_confidence_on(setup.target.model.device.type))

    def reserve(
        self, num_slots: int, max_model_len: int, reuse_prefixes: bool = False, num_blocks: int | None = None
    ) -> None:
        self.runner = ModelRunner(
            self.model, num_slots, max_model_len, reuse_prefixes and self.reuses_prefixes, num_blocks
        )
        self._vocab = None if self.runner.vocab_ids is None else self.runner.vocab_ids.tolist()

    def forget_prefixes(self) -> None:
        self.runner.forget_prefixes()

    def kv_pool(self) -> ModelRunner | None:
        return self.runner

    def kv_slot(self, seq) -> int | None:
        return self._slots.get(seq.request_id)

    def propose(self, seqs, ks, feedback=None) -> DraftBatch:
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = [i for i, k in enumerate(ks) if k > 0]
        self._round_spans, on_device = [], None
        slots = {i: self._slot(seqs[i]) for i in active}
        unsure: set[int] = set()  # sequences whose last draft was below the confidence threshold
        uniforms = self._uniforms(seqs, ks, active)
        try:
            for step in range(max((ks[i] for i in active), default=0)):
                rows = [i for i in active if ks[i] > step and i not in unsure]
                if not rows:
                    break
                logits = self._draft_forward(step, rows, seqs, slots, tokens)
                if step == 0 and (
                    on_device := self._chained(logits, rows, seqs, [slots[i] for i in rows], ks, uniforms)
                ):
                    break
                at = None if uniforms is None else uniforms[to_device(rows, uniforms.device), step]
                drawn = self._argmax_drafts(logits, rows, seqs) | self._processed_drafts(logits, rows, seqs, tokens, at)
                for row, i in enumerate(rows):
                    seqs[i].metrics.spec.num_draft_forwards += 1
                    token, confidence, q = drawn[row]
                    tokens[i].append(token)
                    if confidence < self.confidence_threshold:
                        unsure.add(i)
                    if seqs[i].grammar is not None:  # the next draft position's mask follows this token
                        seqs[i].grammar.draft(token)
                    if q is not None:
                        probs[i].append(q)
        finally:
            for i in active:
                if seqs[i].grammar is not None:
                    seqs[i].grammar.undo_drafts()
        return DraftBatch(tokens, [torch.stack(p) if p else None for p in probs], self._round_spans, on_device)

    def read_ahead(self, seqs) -> None:
        slots = [self._slot(seq) for seq in seqs]
        unseen = [seq.token_ids[self.runner.length(slot) : -1] for seq, slot in zip(seqs, slots)]
        reading = [i for i, tokens in enumerate(unseen) if tokens]
        if reading:
            self._forward([slots[i] for i in reading], [unseen[i] for i in reading], prefill=True)

    def _draft_forward(
        self, step: int, rows: list[int], seqs, slots: dict[int, int], tokens: list[list[int]]
    ) -> torch.Tensor:
        """Logits for the next draft token of seqs[i], i in rows. The first round catches up on everything
        the draft has not seen, then drafts the first token; later rounds read the last drafted token."""
        if step == 0:
            inputs = [seqs[i].token_ids[self.runner.length(slots[i]) :] for i in rows]
        else:
            inputs = [[tokens[i][-1]] for i in rows]
        return self._forward([slots[i] for i in rows], inputs, self._reads_prompt(step, rows, seqs, slots))

    def _reads_prompt(self, step: int, rows: list[int], seqs, slots: dict[int, int]) -> bool:
        """Whether this round's forward still reads prompt tokens: the draft's prefill, timed apart."""
        return step == 0 and any(self.runner.length(slots[i]) < seqs[i].num_prompt_tokens - 1 for i in rows)

    def _slot(self, seq) -> int:
        if seq.request_id not in self._slots:
            self._found.pop(seq.request_id, None)
            self._slots[seq.request_id] = self.runner.allocate(seq.token_ids, seq.tenant)
        return self._slots[seq.request_id]

    def _forward(self, slots: list[int], inputs: list[list[int]], prefill: bool = False, **extra):
        """One timed draft forward (logits of each sequence's last input); the inputs become context."""
        which = "draft_prefill" if prefill else "draft"
        with self.timer.measure(which) as span:
            out = self.runner.forward(slots, inputs, logits="last", **extra)
        self._round_spans.append((span, 1))
        for slot, tokens in zip(slots, inputs):
            self.runner.commit(slot, self.runner.length(slot) + len(tokens))
        return out

    def _uniforms(self, seqs, ks: list[int], active: list[int]) -> torch.Tensor | None:
        """Each sampled sequence's uniform draws for this call's drafts, its k at once from its own stream, whether its
        rounds chain or run one by one and however early a confidence stop ends them: [len(seqs), max k] float64 on
        the device (rows of greedy sequences zero), or None where no sequence samples."""
        sampled = [i for i in active if not seqs[i].params.greedy]
        if not sampled:
            return None
        width, device = max(ks[i] for i in active), self.runner.device
        drawn = uniform_rows(
            [seqs[i].generator for i in sampled], [ks[i] for i in sampled], width, device, torch.float64
        )
        uniforms = torch.zeros(len(seqs), width, dtype=torch.float64, device=device)
        uniforms[to_device(sampled, device)] = drawn
        return uniforms

    def _chained(
        self, logits: torch.Tensor, rows: list[int], seqs, slots: list[int], ks, uniforms: torch.Tensor | None
    ) -> DraftsOnDevice | None:
        """Where every row picks its draft from its logits and settings alone (greedy or sampled, no processor or
        grammar), the rounds after the first chained on the device (one launch: ModelRunner.chained_rounds), their
        drafts left there: each sequence's up to its k, stood by up to the first under the confidence threshold once
        read, a sampled one's q beside them. None where they do not chain: the rounds run one by one."""
        rounds = [ks[i] - 1 for i in rows]
        if not self.chains_rounds or max(rounds) < 1 or not all(seqs[i].picks_by_settings for i in rows):
            return None
        sampling = None
        if not all(seqs[i].params.greedy for i in rows):
            sampling = [seqs[i].params for i in rows], uniforms[to_device(rows, uniforms.device)]
        start = mark()
        drafts = self.runner.chained_rounds(slots, logits, self._estimated_features(rows), rounds, sampling)
        if drafts is None:
            return None
        span = Span(start, mark())
        self.timer.record("draft", span, calls=max(rounds))
        self._round_spans.append((span, max(rounds)))
        starts = [self.runner.length(slot) for slot in slots]
        for i, slot, r in zip(rows, slots, rounds):
            self.runner.commit(slot, self.runner.length(slot) + r)
            seqs[i].metrics.spec.num_draft_forwards += r + 1

        def settle(tokens: list[list[int]], probs: list[list[float]]) -> list[list[int]]:
            self._chain_read(slots, starts, [t[:r] for t, r in zip(tokens, rounds)])
            return [self._stood_by(t, p) for t, p in zip(tokens, probs)]

        sampled = None if sampling is None else [not seqs[i].params.greedy for i in rows]
        return DraftsOnDevice(rows, [r + 1 for r in rounds], *drafts[:2], settle, drafts[2], sampled)

    def queue_drafts(self, seqs, ks, verified, hidden):
        """Each sequence's token at the position of its last kept draft (or its last token) and the bonus token, read
        where the verify left them, as the first round (the first written again as it was: one width whatever was
        kept, its rows placed on the device), then its rounds chained from there. Until they are taken or dropped the
        sequence's rows past what it keeps stay (`commit` leaves them)."""
        slots = [self._slots.get(s.request_id) for s in seqs]
        starts = [s.num_tokens - 1 for s in seqs]
        if not self.chains_rounds or None in slots or any(self.runner.length(s) <= t for s, t in zip(slots, starts)):
            return None
        reach, accepted = verified.width - 1, verified.accepted
        known = torch.cat([to_device([s.token_ids[-1] for s in seqs], accepted.device)[:, None], verified.tokens], 1)
        pair = known.gather(1, torch.stack([accepted, accepted + 1], 1))
        with self.timer.measure("draft") as first:
            logits = self.runner.forward_after(slots, starts, pair, accepted, reach)
        if logits is None:
            return None
        queued = self._chain_queued(slots, starts, ks, first, logits, None, ([s + 2 for s in starts], accepted, reach))
        if queued is None:  # the first round wrote past what the verify keeps alone: the step's commit drops it
            for slot in slots:
                self.runner.drop_queued(slot)
        return queued

    def _chain_queued(self, slots, starts, ks, first: Span, logits, features, after) -> QueuedDrafts | None:
        """The rounds after a queued first round (timed as `first`), chained from where the device says (`after`,
        as chained_rounds takes it), each timed: the queued drafts, or None where the rounds do not chain."""
        rounds, start = [k - 1 for k in ks], mark()
        drafts = self.runner.chained_rounds(slots, logits, features, rounds, after=after)
        if drafts is None:
            return None
        chain = Span(start, mark())
        self.timer.record("draft", chain, calls=max(rounds))
        return QueuedDrafts(starts, list(ks), *drafts[:2], [(first, 1), (chain, max(rounds))])

    def take_queued(self, queued, seqs, ks):
        slots, starts = [], []
        for seq, start, kept, k in zip(seqs, queued.starts, queued.kept, queued.ks):
            slot, rounds_from = self._slots[seq.request_id], start + kept + 2  # past the bonus token
            end = rounds_from + k - 1
            if self.runner.length(slot) > end:  # drafts of the step before past these rows (it drafted more)
                self.runner.rollback(slot, end)
            self.runner.wrote_again(slot, start + 1, seq.token_ids[start + 1 : rounds_from], end)
            self.runner.commit(slot, end)
            seq.metrics.spec.num_draft_forwards += k
            slots.append(slot)
            starts.append(rounds_from)
        taken = [i for i, k in enumerate(ks) if k]

        def settle(tokens, probs):  # the taken sequences' drafts: the ids of the rows their rounds wrote
            rows = [t[: queued.ks[i] - 1] for i, t in zip(taken, tokens)]  # a chain's rows read all drafts but its last
            self._chain_read([slots[i] for i in taken], [starts[i] for i in taken], rows)
            return [self._stood_by(t, p) for t, p in zip(tokens, probs)]

        return taken_drafts(queued, ks, settle)

    def drop_queued(self, queued, seqs) -> None:
        for seq in seqs:
            slot = self._slots.get(seq.request_id)
            if slot is not None:
                self.runner.drop_queued(slot)
                self.commit(seq, seq.num_tokens - 1)

    def _chain_read(self, slots: list[int], starts: list[int], inputs: list[list[int]]) -> None:
        """The chained rounds' inputs, read: the ids of the rows they wrote from `starts`."""
        for slot, start, tokens in zip(slots, starts, inputs):
            self.runner.settle(slot, start, tokens)

    def _stood_by(self, tokens: list[int], probs: list[float]) -> list[int]:
        """Drafts up to the first under the confidence threshold."""
        for n, p in enumerate(probs):
            if p < self.confidence_threshold:
                return tokens[: n + 1]
        return tokens

    @property
    def chains_rounds(self) -> bool:
        """Whether greedy rounds chain where the runner can: a chain runs every round it was allowed, so a draft
        model, whose round costs a fair share of a target step, chains only where no confidence stop would have
        ended its drafting early."""
        return self.confidence_threshold == 0.0

    def _estimated_features(self, rows: list[int]) -> torch.Tensor | None:
        """What a drafter that reads features beside its tokens estimated in its last round, a row per sequence."""
        return None

    def _argmax_drafts(self, logits: torch.Tensor, rows: list[int], seqs) -> dict[int, tuple[int, float, None]]:
        """Each row of a greedy sequence with nothing to apply to its logits: its draft (the argmax, as a target id),
        the draft's softmax probability of it (its confidence) and no q (one-hot), all in one copy to the host: a copy
        per row would each wait on the device."""
        plain = [row for row, i in enumerate(rows) if seqs[i].takes_argmax]
        if not plain:
            return {}
        picked = logits if len(plain) == len(rows) else logits[to_device(plain, logits.device)]
        ids, probs = torch.stack([picked.argmax(-1).double(), argmax_probability(picked).double()]).tolist()
        return {row: (self._vocab[int(t)] if self._vocab else int(t), p, None) for row, t, p in zip(plain, ids, probs)}

    def _processed_drafts(
        self, logits: torch.Tensor, rows: list[int], seqs, drafted: list[list[int]], uniforms: torch.Tensor | None
    ) -> dict[int, tuple[int, float, torch.Tensor | None]]:
        """Each row of a sequence that processes its logits or samples, as verification will: the request's logits
        processors (seeing the drafts so far, as the target's verify rows will) and grammar over the full vocabulary
        (tokens outside a restricted draft vocabulary get q = 0); greedy ones draft the argmax (q one-hot, their
        confidence the raw softmax's), sampled ones draw from q at their row's uniform (uniforms[row], float64; q
        returned for verification; their confidence q's). One pass for all of them, one copy to the host."""
        other = [row for row, i in enumerate(rows) if not seqs[i].takes_argmax]
        if not other:
            return {}
        chosen = [seqs[rows[row]] for row in other]
        picked = logits[to_device(other, logits.device)]
        seen = [s.processed_output(drafted[rows[row]]) for s, row in zip(chosen, other)]  # output and drafts so far
        histories = [
            History(s.params, s.distinct_prompt_ids, ids, (), 1, s.thinking_from_prompt, s.prompt_ids)
            for s, ids in zip(chosen, seen)
        ]
        confidence = argmax_probability(picked)  # before processing, which may be in place
        processed = over_target_vocab(picked, self.runner.vocab_ids, self.runner.cfg.vocab_size)
        processed = process_rows(processed, histories, self.loaded.tokenizer.eos_token_ids)
        processed = mask_grammars(processed, [s.grammar for s in chosen], [[] for _ in chosen])
        tokens = processed.argmax(-1)
        sampled = [n for n, s in enumerate(chosen) if not s.params.greedy]
        q = None
        if sampled:
            at = to_device(sampled, logits.device)
            q = probs_of_rows(processed[at], [chosen[n].params for n in sampled])
            tokens[at] = sample_at(q, uniforms[to_device([other[n] for n in sampled], uniforms.device)])
            confidence[at] = q.gather(-1, tokens[at][:, None])[:, 0].to(confidence.dtype)
        ids, sure = torch.stack([tokens.double(), confidence.double()]).tolist()
        qs = dict(zip(sampled, q)) if sampled else {}
        return {row: (int(t), p, qs.get(n)) for n, (row, t, p) in enumerate(zip(other, ids, sure))}

    def unseen_tokens(self, seq) -> int:
        """Tokens of the sequence the draft's cache has not read yet (its next round feeds them)."""
        slot = self._slots.get(seq.request_id)
        if slot is None:  # looked up once: a walk of the prefix index each step would cost in proportion to it
            found = self._found.get(seq.request_id)
            if found is None:
                found = self._found[seq.request_id] = self.runner.cached_prefix(seq.token_ids, seq.tenant)
            return seq.num_tokens - found
        return seq.num_tokens - self.runner.length(slot)

    def commit(self, seq, num_valid_tokens: int) -> None:
        slot = self._slots.get(seq.request_id)
        if slot is None or self.runner.queued_end(slot):  # drafting queued past them: taken or dropped first
            return
        if self.runner.length(slot) > num_valid_tokens:  # it drafted past what was accepted
            self.runner.rollback(slot, num_valid_tokens)

    def graphs_captured(self) -> int:
        return self.runner.graphs_captured()

    def release(self, seq) -> None:
        self._found.pop(seq.request_id, None)
        slot = self._slots.pop(seq.request_id, None)
        if slot is not None:
            self.runner.free(slot)


def taken_drafts(queued: QueuedDrafts, ks: list[int], settle) -> DraftBatch:
    """Queued drafts as a step takes them: sequence i's first ks[i] (those drafting nothing now left out), on the
    device; `settle` does the drafter's bookkeeping once they are read."""
    rows = [i for i, k in enumerate(ks) if k]
    tokens, probs = queued.tokens, queued.probs
    if len(rows) < len(ks):
        at = to_device(rows, tokens.device)
        tokens, probs = tokens[at], probs[at]
    on_device = DraftsOnDevice(rows, [ks[i] for i in rows], tokens, probs, settle)
    return DraftBatch([[] for _ in ks], [None] * len(ks), queued.round_spans, on_device)
