"""Proposers by name. `LLM`, the CLI, the server and the benchmarks all build proposers here, so a new
kind (e.g. a draft head on the target's hidden states) is one file plus one `register_proposer` line."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..config import EngineConfig
from ..errors import SpecDecodeError
from ..timing import StepTimer

if TYPE_CHECKING:
    from ..models.loader import LoadedModel
    from .base import Proposer


@dataclass
class ProposerSetup:
    """Everything a proposer may need to build itself: the target, the engine's options (the draft's name
    is `config.speculative_model`) and, where the caller has it, the draft model already loaded."""

    target: LoadedModel
    config: EngineConfig = field(default_factory=EngineConfig)
    loaded: LoadedModel | None = None
    progress: bool = True
    timer: StepTimer | None = None


ProposerFactory = Callable[[ProposerSetup], "Proposer"]
_REGISTRY: dict[str, ProposerFactory] = {}
DRAFT_MODEL = "draft_model"  # the kind chosen when `speculative_model` names a model rather than a kind


def register_proposer(name: str, factory: ProposerFactory) -> None:
    """Make `name` a proposer kind: `LLM(speculative_model=name)`, `--draft name`, sweep cells."""
    _REGISTRY[name] = factory


def unregister_proposer(name: str) -> None:
    """Remove a kind added by register_proposer (a plug-in's test, say, cleaning up after itself)."""
    if name not in _REGISTRY:
        raise KeyError(f"no proposer kind {name!r} is registered; registered: {', '.join(proposer_names())}")
    del _REGISTRY[name]


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
