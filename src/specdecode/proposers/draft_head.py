"""A draft head proposes from the target's own hidden states (see models/draft_head.py).

Per sequence the head's KV cache holds one row per position whose target features it has read. The
target's features arrive with every step's feedback (`observe`, also in steps without drafting); the
first drafting round reads them all, the next rounds read the head's own estimate of the features, and
after drafting the cache is rolled back to the rows built from the target's real features: the next
step's feedback brings those for the accepted tokens. Sampling, the confidence stop, grammars and the
draft probabilities returned for verification are the draft model's (the base class).

The head's slots are numbered as the target's. With prefix caching its rows are found again as the target's
blocks are (executor/runner.py), by the tokens they read: row p read the target's features at p, which
follow from the tokens up to p, and token p + 1, so the head's blocks are found by the tokens from the
second on, in a scope of the tenant and the first token (`keep_prefix`)."""

from __future__ import annotations

import os

import torch

from ..errors import SpecDecodeError
from ..models.draft_head import DraftHead, build_head, read_head
from ..models.loader import LoadedModel
from ..timing import StepTimer
from .draft_model import DraftModelProposer, taken_drafts
from .registry import ProposerSetup

BUNDLED_HEADS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "models", "heads")


def head_path(name: str) -> str:
    """A head's path ("head:PATH", or another kind's "KIND:PATH"): as given when it exists, else a head
    bundled with the package under that name."""
    kind, colon, rest = name.partition(":")
    name = rest if colon and "/" not in kind else name
    if os.path.exists(name) or os.path.exists(name + ".json"):
        return name
    return os.path.join(BUNDLED_HEADS, name)


class UnreadFeatures:
    """A sequence's target features the head has not read yet, rows in order, counted as they come. A step's rows are
    views of that step's whole batch; every CHUNK steps they are copied into one tensor of the sequence's own, so that
    a sequence long left undrafted (the policy's choice under load) holds its own rows only, and neither counting
    nor reading them grows with how many steps they came in."""

    CHUNK = 64

    def __init__(self, rows: torch.Tensor | None = None):
        self._chunks: list[torch.Tensor] = []
        self._recent: list[torch.Tensor] = []
        self.rows = 0
        if rows is not None:
            self.add(rows)

    def add(self, rows: torch.Tensor) -> None:
        self._recent.append(rows)
        self.rows += rows.shape[0]
        if len(self._recent) == self.CHUNK:
            self._chunks.append(torch.cat(self._recent))
            self._recent = []

    def read(self) -> torch.Tensor:
        return torch.cat(self._chunks + self._recent)


class DraftHeadProposer(DraftModelProposer):
    wants_hidden_states = True

    def __init__(
        self, head: DraftHead, loaded: LoadedModel, timer: StepTimer | None = None, confidence_threshold: float = 0.0
    ):
        super().__init__(loaded, timer, confidence_threshold)
        self._features: dict[str, UnreadFeatures] = {}  # request id -> target features not yet read
        self._estimates: dict[int, torch.Tensor] = {}  # batch row -> the head's last estimated features
        self._real_rows: dict[str, int] = {}  # request id -> head cache rows built from the target's features

    @classmethod
    def from_setup(cls, setup: ProposerSetup) -> "DraftHeadProposer":
        from ..executor.backends import prepare_head

        name = setup.config.speculative_model
        if not name:
            raise SpecDecodeError("the draft-head proposer needs a head: speculative_model='head:PATH'")
        path = head_path(name)
        spec, tensors = read_head(path)
        head = prepare_head(
            build_head(spec, tensors, setup.target.model), setup.config.draft_quantization, setup.config.kv_cache_dtype
        )
        loaded = LoadedModel(f"head:{os.path.basename(path)}", head, setup.target.tokenizer, head.cfg)
        return cls(head, loaded, setup.timer, setup.config.draft_confidence_on(setup.target.model.device.type))

    def keep_prefix(self, seq, kept: int) -> int:
        """Of the `kept` prompt tokens the target found computed, the rows the head finds computed for a prefix
        of them (each row needs the target's features at its position, which the target computes only past
        what it keeps): the target's prefill starts where these end."""
        inputs = seq.token_ids[1:]  # row p pairs with token p + 1
        scope = (seq.tenant, seq.adapter_set, seq.token_ids[0])  # its rows read the target's features, as adapted
        rows = self.runner.take(seq.slot, inputs, scope, min(kept, len(inputs)))
        self._slots[seq.request_id] = seq.slot
        return rows

    def _slot(self, seq) -> int:
        if seq.request_id not in self._slots:
            self.keep_prefix(seq, 0)
        return self._slots[seq.request_id]

    def observe(self, seq, feedback) -> None:
        if feedback.hidden is None:
            return
        slot = self._slots.get(seq.request_id)
        unread = self._features.get(seq.request_id)
        if unread is None:
            unread = self._features[seq.request_id] = UnreadFeatures()
        read = (self.runner.length(slot) if slot is not None else 0) + unread.rows
        if feedback.start != read:  # rows arrive in order, each position once
            raise RuntimeError(f"draft head: features from position {feedback.start}, expected {read}")
        unread.add(feedback.hidden)

    def read_ahead(self, seqs) -> None:
        slots, inputs, features = [], [], []
        for seq in seqs:
            pending = self._features.get(seq.request_id)
            if pending is None or pending.rows < 2:
                continue
            unread = pending.read()
            slot = self._slot(seq)
            start = self.runner.length(slot)
            self._features[seq.request_id] = UnreadFeatures(unread[-1:])  # the first drafting round reads the last row
            slots.append(slot)
            inputs.append(seq.token_ids[start + 1 : start + len(unread)])  # row p pairs with token p + 1
            features.append(unread[:-1])
        if slots:
            self._forward(slots, inputs, prefill=True, features=features)

    def propose(self, seqs, ks, feedback=None):
        ks = [k if self.unseen_tokens(s) else 0 for s, k in zip(seqs, ks)]  # nothing to read: no draft
        try:
            return super().propose(seqs, ks, feedback)
        finally:
            self._estimates.clear()
            for seq, k in zip(seqs, ks):  # forget the rows built on estimates
                if k:
                    slot = self._slots[seq.request_id]
                    self.runner.rollback(slot, self._real_rows[seq.request_id])

    def _draft_forward(self, step, rows, seqs, slots, tokens):
        if step == 0:
            inputs, features = [], []
            for i in rows:
                seq, start = seqs[i], self.runner.length(slots[i])
                read = self._features.pop(seq.request_id).read()
                # row p pairs the target's features at p with token p + 1, the token they chose
                inputs.append(seq.token_ids[start + 1 : start + 1 + len(read)])
                if len(inputs[-1]) != len(read):
                    raise RuntimeError(
                        f"draft head: {len(read)} feature rows from position {start} but the "
                        f"sequence has {seq.num_tokens} tokens"
                    )
                features.append(read)
                self._real_rows[seq.request_id] = start + len(read)
        else:
            inputs = [[tokens[i][-1]] for i in rows]
            features = [self._estimates[i] for i in rows]
        logits, estimates = self._forward(
            [slots[i] for i in rows],
            inputs,
            self._reads_prompt(step, rows, seqs, slots),
            hidden=True,
            features=features,
        )
        for row, i in enumerate(rows):
            self._estimates[i] = estimates[row : row + 1]
        return logits

    chains_rounds = True  # a round is one decoder layer and a 16k-token LM head: cheaper than a round trip to the host

    def queue_drafts(self, seqs, ks, verified, hidden):
        """Each sequence's rows of the verify read at once, its kept drafts and the bonus token beside the target's
        features (rows past the kept ones write positions the next rounds write again before any row attends them),
        its first draft from its row `accepted`, then its rounds chained from there (executor/draft_chain.py)."""
        slots = [self._slots.get(s.request_id) for s in seqs]
        starts = [s.num_tokens - 1 for s in seqs]
        if hidden is None or None in slots or any(self.runner.length(s) != start for s, start in zip(slots, starts)):
            return None  # features left unread from before: the next step reads them first
        n, width = len(seqs), verified.width
        with self.timer.measure("draft") as first:
            logits, estimates = self.runner.forward_picked(
                slots, verified.tokens, [width] * n, features=hidden[verified.rows], logits="all", hidden=True
            )
        at = torch.arange(n, device=logits.device) * width + verified.accepted
        after = ([s + 1 for s in starts], verified.accepted, width - 1)
        return self._chain_queued(slots, starts, ks, first, logits[at], estimates[at], after)

    def take_queued(self, queued, seqs, ks):
        for seq, start, kept, k in zip(seqs, queued.starts, queued.kept, queued.ks):
            slot, end = self._slots[seq.request_id], start + kept + 1
            unread = self._features.pop(seq.request_id)
            if unread.rows != kept + 1:
                raise RuntimeError(f"draft head: {unread.rows} feature rows from position {start}, {kept + 1} read")
            self.runner.settle(slot, start, seq.token_ids[start + 1 : end + 1])  # row p pairs with token p + 1
            self.runner.commit(slot, end)
            self._real_rows[seq.request_id] = end
            seq.metrics.spec.num_draft_forwards += k

        def settle(tokens, probs):
            return [self._stood_by(t, p) for t, p in zip(tokens, probs)]

        return taken_drafts(queued, ks, settle)

    def drop_queued(self, queued, seqs) -> None:
        """Nothing to undo: the queued rounds wrote past the rows built on the target's features, and the features
        they read stay unread until a drafting round reads them again."""

    def _chain_read(self, slots, starts, inputs) -> None:
        """Nothing to settle: the rows the chained rounds wrote were built on estimates, rolled back after drafting."""

    def _estimated_features(self, rows: list[int]) -> torch.Tensor:
        return torch.cat([self._estimates[i] for i in rows])

    def unseen_tokens(self, seq) -> int:
        """Positions whose target features the head has not read yet (its next round reads them)."""
        unread = self._features.get(seq.request_id)
        return unread.rows if unread is not None else 0

    def commit(self, seq, num_valid_tokens: int) -> None:
        """Nothing to do: drafting already rolled back to the rows built from real features."""

    def release(self, seq) -> None:
        self._features.pop(seq.request_id, None)
        self._real_rows.pop(seq.request_id, None)
        super().release(seq)
