"""`specdecode distill`: record the target's features on text, then train a draft head on them."""
from .command import distill

__all__ = ["distill"]
