"""How a draft head is made: the data and the training, each option's default written once (the CLI's
flags default to these). The defaults take about 40 minutes on two CPU cores with native bf16, and a run
never takes much over `minutes`: where the machine is slower, it records less text and trains
proportionally fewer steps (docs/decisions.md#cpu-distill-recipe-and-its-60-minute-budget). On a GPU the
default is GPU_RECIPE's."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

HELD_OUT = 0.05  # of the recorded chunks: measured after training, never trained on (heads and drafts alike)
RECORDING_SHARE = 0.55  # of a time budget, for the target's recording; training gets what is left
GENERATION_SHARE = 0.3  # of a time budget, within the recording's, for the target's completions (if any)


@dataclass
class Recipe:
    sources: list[str] = field(default_factory=lambda: ["stdlib", "sonnets"])  # see data.SOURCES
    tokens: int = 270_000  # of text the target reads and records
    completions: int = 128  # prompts the target completes, per completions:NAME source
    completion_tokens: int = 192  # new tokens per completion at most
    chunk: int = 256  # tokens per training sequence
    draft_vocab_size: int = 16384  # the target's most chosen tokens on the data
    intermediate_size: int = 2048  # the head layer's MLP width
    steps: int = 1800
    batch: int = 2  # chunks per step
    lr: float = 1e-3
    warmup: int = 30
    regression_weight: float = 1.0
    feature_noise: float = 0.05  # relative Gaussian noise on input features: drafting reads estimates
    rounds: int = 2  # drafting rounds unrolled in training (training-time test), the later ones on estimates
    round_decay: float = 0.8  # loss weight of round i: decay ** i
    seed: int = 0
    init: str | None = None  # a head to train on from (its weights and draft vocabulary), else a fresh one
    minutes: float = 60.0  # the run's time budget (0: none): text and steps shrink together to fit it
    # fine-tuning a draft model instead (`--draft-model`, the comparison for a head): its own schedule
    finetune_steps: int = 150
    finetune_lr: float = 1e-5


# A GPU records the target's features ~300 times as fast as two CPU cores and trains a step of 32 chunks in
# ~35 ms (an H200), so its default reads twenty times the text: the shipped head's recipe
# (docs/decisions.md#the-shipped-head-trained-on-a-gpu)
GPU_RECIPE = {"sources": ["python", "sonnets"], "tokens": 6_000_000, "steps": 8000, "batch": 32, "minutes": 7.5}


def recipe_for(device_type: str, **given) -> Recipe:
    """The default recipe of a device (GPU_RECIPE's on CUDA), with the options that are given (not None)."""
    defaults = asdict(Recipe()) | (GPU_RECIPE if device_type == "cuda" else {})
    return Recipe(**(defaults | {name: value for name, value in given.items() if value is not None}))
