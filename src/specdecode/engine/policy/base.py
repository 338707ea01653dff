"""What every speculation policy decides, and what the engine tells it afterwards."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ...config import DEFAULT_K


@dataclass
class DraftDecision:
    ks: list[int]  # tokens to draft per sequence
    by_lookup: list[bool]  # per sequence: drafted by the previewing proposer (prompt lookup), not the main one
    probe: bool = False  # drafting tried to measure it (the adaptive policy's thin evidence), not as predicted to pay
    score: float = 0.0  # the adaptive policy's predicted goodput over the bar drafting must clear (0: not scored)
    seconds: float = 0.0  # the adaptive policy's predicted seconds of the step, catch-ups aside (0: not priced)

    @classmethod
    def main_proposer(cls, ks: list[int]) -> "DraftDecision":
        return cls(ks, [False] * len(ks))


# What a previewing proposer offers one sequence: the length of the context match behind its draft, the
# draft, and (suffix speculation) each token's frequency estimate, or None.
Lookup = tuple[int, list[int], list[float] | None]


class Policy:
    """Decides k per sequence and step; the observe_* hooks feed policies that learn (the default: ignore)."""

    name = "policy"
    wants_draft_costs = False  # the draft's forward timed at start-up for each number of drafting sequences
    chooses_proposers = False  # may take a sequence's drafts from prompt lookup instead of the main proposer

    def __init__(self, k_max: int = DEFAULT_K):
        self.k_max = k_max
        self.decisions: Counter = Counter()  # k chosen -> sequence-steps

    def choose(
        self,
        request_ids: list[str],
        catch_up: list[int] | None = None,
        remaining: list[int] | None = None,
        lookups: list[Lookup] | None = None,
        drafter: bool = True,
        contexts: list[int] | None = None,
    ) -> DraftDecision:
        """k per sequence for this step (the engine still caps each by max_tokens and the context).
        catch_up: tokens the draft must read before it can draft for the sequence; remaining: tokens the
        sequence may still emit; lookups: per sequence, what the previewing proposer offers, where the
        engine has one; drafter: whether a model drafter exists (without one, every draft is a lookup's);
        contexts: the tokens each sequence has cached, which each of its verify rows attends to."""
        n = len(request_ids)
        decision = (
            DraftDecision.main_proposer([0] * n)
            if self.k_max == 0
            else self.decide(
                request_ids, catch_up or [0] * n, remaining or [1 << 30] * n, lookups, drafter, contexts or [0] * n
            )
        )
        self.decisions.update(decision.ks)
        return decision

    def decide(
        self,
        request_ids: list[str],
        catch_up: list[int],
        remaining: list[int],
        lookups: list[Lookup] | None,
        drafter: bool,
        contexts: list[int] | None = None,
    ) -> DraftDecision:
        raise NotImplementedError

    def expects_drafting(self, batch: int) -> bool:
        """Whether a draft model is likely to draft for some of `batch` sequences soon: worth reading a new
        prompt ahead of its first round."""
        return self.k_max > 0

    def plain_next(self) -> bool:
        """Whether the next decision is a plain step whatever this step's outcome (a re-measure of plain decoding):
        drafting queued for it would go unused."""
        return False

    def probes_next(self, contexts: list[int]) -> bool:
        """Whether the next decision, for sequences with these cached tokens, probes drafting by the drafter on one
        of them: a plain step queued for it would go unused."""
        return False

    def observe_acceptance(self, request_id: str, drafted: int, accepted: int, allowed: int | None = None) -> None:
        """The main proposer's drafts for this sequence in the step just run (drafted 0: it did not draft),
        of the `allowed` it was given (None: as many as it drafted)."""

    def observe_lookup(self, request_id: str, match: int, drafted: int, accepted: int) -> None:
        """Drafts taken from a preview with a context match of length `match`, in the step just run."""

    def observe_step(
        self,
        ks: list[int],
        target_seconds: float,
        draft_seconds_per_forward: float | None,
        step_seconds: float | None = None,
        by_lookup: list[bool] | None = None,
        contexts: list[int] | None = None,
        untimed: bool = False,
    ) -> None:
        """Measured phases of the step just run (contexts: each sequence's cached tokens before it; untimed: its time
        is not a decoding step's, its target call having also prefilled a prompt's chunk or a forward having been
        captured as a graph)."""

    def observe_draft_prefill(self, tokens: int, seconds: float) -> None:
        """A draft model read `tokens` it had missed in `seconds`."""

    def record_draft_cost(self, batch: int, seconds: float) -> None:
        """A draft forward for `batch` sequences takes `seconds` (timed at start-up, see engine/profile.py)."""

    def record_target_cost(self, batch: int, tokens: int, seconds: float, keys: int = 0, extra_keys: int = 0) -> None:
        """A target call of `batch` sequences and `tokens` tokens in all, whose sequences' first rows read `keys`
        cached keys and further rows `extra_keys`, takes `seconds` (timed at start-up)."""

    def record_attention_cost(self, per_row_key: float, per_extra_row_key: float | None = None) -> None:
        """The target's attention costs this much per cached key for a sequence's first row, and for each of its
        further rows (None: as much; timed at start-up)."""

    def forget(self, request_id: str) -> None:
        """The sequence finished."""
