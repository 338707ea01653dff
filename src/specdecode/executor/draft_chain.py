"""A drafter's rounds chained on the device, replayed as one CUDA graph.

Each drafting round after the first reads one token per sequence: the draft of the round before (and, for a draft
head, the features that round estimated). Driven from the host, every round waits for its draft to be copied back
before the next is launched, and k rounds pay k launches and k synchronisations. Here the rounds after the first run
in one replay, the pick from the first round's logits with them (a copy of those in, where picking outside the
graph would launch its kernels one by one): each round reads the draft (and estimated features) of the round
before where that round left them, at positions, slots and RoPE tables made for all rounds at once, so a round
launches its forward and its pick and nothing else (each copy is a kernel in a graph), and every round's draft and
its probability come back together. A greedy row drafts its argmax; a
sampled row (no logits processor, no grammar: those need the host) draws from its distribution by its own settings
(sampling/per_row.py) at a uniform its sequence drew beforehand from its own stream, and that distribution, q, stays
on the device for verification.

Sequences that draft fewer rounds than the longest write their extra rounds' keys into the scratch block, never past
the rows they would have written round by round; their extra drafts are dropped, as are the drafts after one under
the confidence threshold (a stop that depends on the drafts alone, so verification stays exact).

Without capture (a CPU, in tests) the same rounds run at the same fixed shapes.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from ..sampling import SamplingParams, argmax_probability, sample_at
from ..sampling.per_row import RowSettings, probs_of_settings
from ..transfers import copy_into
from .cuda_graphs import UNCAPTURABLE, BucketedForward, StaticBatch, bucket_for

log = logging.getLogger(__name__)


def over_target_vocab(logits: torch.Tensor, vocab_ids: torch.Tensor | None, vocab: int) -> torch.Tensor:
    """A drafter's logits rows over the target's vocabulary of `vocab` ids, float32: where its LM head covers a subset
    (vocab_ids, the target ids of its columns), -inf outside it, so a distribution made from them gives q = 0 there."""
    if vocab_ids is None:
        return logits.float()
    full = torch.full((logits.shape[0], vocab), float("-inf"), device=logits.device)
    return full.index_copy_(1, vocab_ids, logits.float())


class _Chain:
    """One bucket's rounds: its batch, the first round's logits ([B, columns], copied in), how many rounds each
    sequence drafts after the first, and every draft and its probability, the first round's pick in column 0 ([B,
    rounds + 1], written by each run or replay). Where it samples: each row's settings, whether it is greedy, its
    uniforms a draft and every draft's distribution over the target's vocabulary ([B, rounds + 1, V])."""

    def __init__(
        self, batch: StaticBatch, rounds: int, first: torch.Tensor, kinds: frozenset[str] | None, q: torch.Tensor | None
    ):
        device, seqs, drafts = batch.ints.device, batch.bucket.seqs, rounds + 1
        self.batch, self.rounds, self.graph, self.first, self.q = batch, rounds, None, first, q
        self.limits = torch.zeros(seqs, dtype=torch.long, device=device)
        self.round_ids = torch.arange(rounds, device=device)[:, None]
        self.tokens = torch.zeros(seqs, drafts, dtype=torch.long, device=device)
        self.probs = torch.zeros(seqs, drafts, dtype=torch.float32, device=device)
        self.sampling = None if kinds is None else RowSampling.allocate(seqs, drafts, kinds, q.shape[-1], device)


@dataclass
class RowSampling:
    """How each row of a chain picks its drafts: greedy or by its settings, at its uniforms ([rows, rounds] float64,
    drawn beforehand from its sequence's stream)."""

    settings: RowSettings
    greedy: torch.Tensor  # bool [rows]
    uniforms: torch.Tensor

    @classmethod
    def allocate(cls, rows: int, rounds: int, kinds: frozenset[str], vocab: int, device) -> RowSampling:
        greedy = torch.ones(rows, dtype=torch.bool, device=device)
        uniforms = torch.zeros(rows, rounds, dtype=torch.float64, device=device)
        return cls(RowSettings.allocate(rows, kinds, vocab, device), greedy, uniforms)

    def fill(self, params: list[SamplingParams], uniforms: torch.Tensor, vocab: int) -> None:
        """The first len(params) rows' ways and uniforms; rows past them greedy."""
        self.settings.fill(params, vocab)
        copy_into(self.greedy, [p.greedy for p in params] + [True] * (self.greedy.shape[0] - len(params)))
        self.uniforms[: len(params)] = uniforms[:, : self.uniforms.shape[1]]


class DraftChain:
    """The chained rounds of a runner's fixed-shape forwards: one graph per bucket, number of rounds and truncations
    sampled, captured the first time it is met."""

    def __init__(self, forward: BucketedForward, vocab_ids: torch.Tensor | None, vocab: int):
        """vocab_ids: the target's ids of the logits' columns, where the drafter's LM head covers a subset (else its
        logits cover the vocabulary); vocab: the target's vocabulary size (a sampled draft's q covers it)."""
        self.forward, self.vocab_ids, self.vocab = forward, vocab_ids, vocab
        self.columns = vocab if vocab_ids is None else len(vocab_ids)
        self._greedy = None  # the greedy pick, compiled where chains are captured: set by the first chain
        self._chains: dict[tuple, _Chain] = {}
        self._refused: set[tuple] = set()
        # chains of one bucket share the first round's logits, and sampled chains of one bucket and number of rounds
        # their q (one chain runs at a time, and its q is verified before the next drafting): [B, rounds + 1, V]
        # float32, 156 MB for 64 sequences, 3 rounds after the first, 152k ids (engine/memory.py reserves them)
        self._first: dict[int, torch.Tensor] = {}
        self._q: dict[tuple[int, int], torch.Tensor] = {}

    def prepare(self, starts: list[int], rounds: list[int], kinds: frozenset[str] | None = None) -> _Chain | None:
        """The chain for sequences whose rounds start at these positions (None where they fit no bucket); kinds:
        the truncations its sampled rows ask for (None: every row greedy)."""
        longest = max(rounds)
        bucket = bucket_for([1] * len(starts), max(starts) + longest, self.forward.max_keys)
        key = (bucket, longest, kinds)
        if bucket is None or key in self._refused:
            return None
        return self._chains.get(key) or self._prepare(key)

    def run(
        self,
        chain: _Chain,
        slots,
        starts,
        logits: torch.Tensor,
        features: torch.Tensor | None,
        rounds: list[int],
        sampling: tuple[list[SamplingParams], torch.Tensor] | None = None,
        offsets: torch.Tensor | None = None,
    ):
        """Each sequence's draft picked from `logits` (its row of the round before) and its drafts of the rounds after
        it, their probabilities, [n, max(rounds) + 1] on the device (sequence i's first rounds[i] + 1 are its own),
        and where the chain samples their distributions [n, max(rounds) + 1, V]: the chain's buffers, which its next
        run overwrites. features: each sequence's features estimated in the round before (a draft head's);
        sampling: each sequence's settings and its uniforms for these drafts; offsets: [n] on the device, added to
        each sequence's start there."""
        n, batch = len(slots), chain.batch
        batch.fill(slots, starts, [[0]] * n, self.forward.cache.scratch_row)
        if offsets is not None:
            batch.positions[:n, 0] += offsets
        chain.first[:n] = logits
        if features is not None:
            batch.features[:n, 0] = features
        copy_into(chain.limits, rounds + [0] * (batch.bucket.seqs - n))
        if chain.sampling is not None:
            chain.sampling.fill(*sampling, self.vocab)
        if chain.graph is not None:
            chain.graph.replay()
        else:
            self._run(chain)
        return chain.tokens[:n], chain.probs[:n], None if chain.q is None else chain.q[:n]

    @torch.inference_mode()
    def _run(self, chain: _Chain) -> None:
        batch = chain.batch
        drafts = [self._pick(chain, chain.first, 0)]
        # each round's position and KV slot of each row, at once: past its own rounds a sequence writes into the
        # scratch block
        positions = batch.positions[:, 0] + chain.round_ids
        slots = torch.where(chain.limits > chain.round_ids, batch.slots[:, 0], self.forward.cache.scratch_row)
        tables = self.forward.rope_tables(positions.view(-1, 1))  # [rounds * B, 1, 1, D] each
        estimates, seqs = None, batch.bucket.seqs
        for r in range(chain.rounds):
            rope = {kind: tuple(t[r * seqs : (r + 1) * seqs] for t in pair) for kind, pair in tables.items()}
            logits, estimates = self.forward.run(
                self._next_round(batch, drafts[-1][0], positions[r], slots[r], estimates, rope)
            )
            drafts.append(self._pick(chain, logits, r + 1))
        torch.stack([tokens for tokens, _ in drafts], 1, out=chain.tokens)
        torch.stack([probs for _, probs in drafts], 1, out=chain.probs)

    def _pick(self, chain: _Chain, logits: torch.Tensor, at: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's draft from its logits and its probability (where the chain samples, q into column `at` of its
        distributions)."""
        if chain.sampling is None:
            return self.pick(logits)
        tokens, probs, chain.q[:, at] = self.pick(logits, chain.sampling, at)
        return tokens, probs

    def pick(self, logits: torch.Tensor, sampling: RowSampling | None = None, at: int = 0):
        """Each row's draft (a target id) and the drafter's probability of it, on the device: the argmax and its
        softmax probability; where `sampling` holds the row's settings, a draw from its distribution q at its uniform
        `at` and q's probability of it, q returned too."""
        if sampling is None:
            return (self._greedy or greedy_drafts)(logits, self.vocab_ids)
        argmax = logits.argmax(-1)
        tokens = argmax if self.vocab_ids is None else self.vocab_ids[argmax]
        q = probs_of_settings(over_target_vocab(logits, self.vocab_ids, self.vocab), sampling.settings)
        drawn = sample_at(q, sampling.uniforms[:, at])
        greedy = sampling.greedy
        chosen = torch.where(greedy, tokens, drawn)
        sure = torch.where(greedy, argmax_probability(logits), q.gather(-1, drawn[:, None])[:, 0])
        return chosen, sure, q

    @staticmethod
    def _next_round(batch: StaticBatch, drafts, positions, slots, estimates, rope) -> StaticBatch:
        """The batch of a round: each sequence's draft of the round before at its position and slot (and the RoPE
        tables of those), beside the features a head estimated in it (the first round: those the batch holds)."""
        features = None if estimates is None or batch.features is None else estimates.view(batch.features.shape)
        return batch.with_rows(drafts[:, None], positions[:, None], slots[:, None], features, rope)

    def _prepare(self, key: tuple) -> _Chain | None:
        bucket, rounds, kinds = key
        device = self.forward.cache.table.device
        if self._greedy is None:
            self._greedy = fused_greedy_drafts(device.type) if self.forward.capture else greedy_drafts
        first = _shared(self._first, bucket.seqs, (bucket.seqs, self.columns), device)
        q = None
        if kinds is not None:
            q = _shared(self._q, (bucket.seqs, rounds), (bucket.seqs, rounds + 1, self.vocab), device)
        chain = _Chain(self.forward.new_batch(bucket), rounds, first, kinds, q)
        if self.forward.capture:
            try:
                chain.graph, _ = self.forward.capture_graph(chain.batch, lambda: self._run(chain))
            except UNCAPTURABLE as e:  # rounds one by one
                log.warning("drafting rounds of %s run one by one: their capture failed (%s)", bucket, e)
                self._refused.add(key)
                return None
        self._chains[key] = chain
        return chain


def greedy_drafts(logits: torch.Tensor, vocab_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's argmax (a target id: its column's in vocab_ids where the logits cover a subset) and its softmax
    probability."""
    argmax = logits.argmax(-1)
    return argmax if vocab_ids is None else vocab_ids[argmax], argmax_probability(logits)


@functools.cache
def fused_greedy_drafts(device_type: str):
    """greedy_drafts compiled, once a process (shapes symbolic: one compilation serves every bucket), where the
    compiler serves this device and agrees with the eager form; else the eager form. In a graph every kernel costs a
    few microseconds however small, and the eager form is eight a round."""
    compiled = torch.compile(greedy_drafts, dynamic=True)
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)).to(device_type)
    ids = torch.arange(100, 150, device=device_type)
    try:
        with torch.inference_mode():  # as chains run: another grad mode would compile anew
            for vocab_ids in (None, ids):
                got, want = compiled(logits, vocab_ids), greedy_drafts(logits, vocab_ids)
                torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    except Exception as e:  # any compiler failure leaves the eager kernels, which work
        log.warning("greedy drafts of chained rounds stay unfused: compiling them failed (%s)", e)
        return greedy_drafts
    return compiled


def _shared(buffers: dict, key, shape: tuple[int, ...], device) -> torch.Tensor:
    """The float32 buffer of this key, made the first time it is asked for."""
    if key not in buffers:
        buffers[key] = torch.zeros(shape, device=device)
    return buffers[key]
