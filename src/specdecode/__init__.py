"""specdecode: lossless speculative decoding on PyTorch."""

from .engine.llm import LLM, CompletionOutput, RequestOutput
from .errors import SpecDecodeError
from .metrics import expected_speedup
from .sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "SpecDecodeError", "expected_speedup"]
__version__ = "0.1.0"
