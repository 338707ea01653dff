from .base import DraftBatch, Proposer
from .draft_model import DraftModelProposer
from .ngram import NgramProposer

__all__ = ["DraftBatch", "Proposer", "DraftModelProposer", "NgramProposer"]
