"""Proposers by name. `LLM`, the CLI, the server and the benchmarks all build proposers here, so a new
kind (e.g. a draft head on the target's hidden states) is one file plus one `register_proposer` line."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import SpecDecodeError
from ..metrics import StepTimer

if TYPE_CHECKING:
    from ..models.loader import LoadedModel
    from .base import Proposer


@dataclass
class ProposerSetup:
    """Everything a proposer may need to build itself."""

    target: LoadedModel
    model: str | None = None  # a model to load (name, path or hub id), for proposers that run one
    loaded: LoadedModel | None = None  # or that model, already loaded
    dtype: str = "auto"
    quantization: str = "auto"
    progress: bool = True
    draft_vocab_size: int | None = None
    ngram_max: int = 3
    ngram_min: int = 1
    timer: StepTimer | None = None
    draft_confidence: float = 0.0  # a draft model stops drafting after a token it gives less probability


ProposerFactory = Callable[[ProposerSetup], "Proposer"]
_REGISTRY: dict[str, ProposerFactory] = {}
DRAFT_MODEL = "draft_model"  # the kind chosen when `speculative_model` names a model rather than a kind


def register_proposer(name: str, factory: ProposerFactory) -> None:
    """Make `name` a proposer kind: `LLM(speculative_model=name)`, `--draft name`, sweep cells."""
    _REGISTRY[name] = factory


def proposer_names() -> list[str]:
    return sorted(_REGISTRY)


def proposer_kind(speculative_model: str | None) -> str | None:
    """The registered kind a `speculative_model` value asks for: itself when it is a kind's name (vLLM's
    "[ngram]" spelling included), the part before a colon when that is one ("head:PATH"), else the
    draft-model kind (the value names a model)."""
    if speculative_model is None:
        return None
    name = speculative_model.strip("[]")
    kind = name.partition(":")[0]
    return name if name in _REGISTRY else kind if kind in _REGISTRY else DRAFT_MODEL


def build_proposer(kind: str, setup: ProposerSetup) -> Proposer:
    if kind not in _REGISTRY:
        raise SpecDecodeError(f"unknown proposer {kind!r}; registered: {', '.join(proposer_names())}")
    return _REGISTRY[kind](setup)
