"""Proposers, registered by name: each built-in kind is one line here."""

from .base import DraftBatch, Preview, Proposer, TargetFeedback
from .draft_head import DraftHeadProposer
from .draft_model import DraftModelProposer
from .ngram import NgramProposer
from .registry import (
    DRAFT_MODEL,
    ProposerSetup,
    build_proposer,
    proposer_kind,
    proposer_names,
    register_proposer,
    unregister_proposer,
)
from .suffix import SuffixCache, SuffixProposer

register_proposer(DRAFT_MODEL, DraftModelProposer.from_setup)
register_proposer("ngram", NgramProposer.from_setup)
register_proposer("head", DraftHeadProposer.from_setup)
register_proposer("suffix", SuffixProposer.from_setup)

__all__ = [
    "DraftBatch",
    "Preview",
    "Proposer",
    "TargetFeedback",
    "DraftHeadProposer",
    "DraftModelProposer",
    "NgramProposer",
    "SuffixCache",
    "SuffixProposer",
    "ProposerSetup",
    "build_proposer",
    "proposer_kind",
    "proposer_names",
    "register_proposer",
    "unregister_proposer",
]
