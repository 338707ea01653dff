"""The executor: a ModelRunner per loaded model (weights, KV cache, forward) and the backends behind it."""

from .runner import ModelRunner

__all__ = ["ModelRunner"]
