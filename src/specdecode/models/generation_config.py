"""The sampling settings a model's makers recommend, taken as vLLM takes them (`--generation-config`: a checkpoint's
generation_config.json) and llama.cpp (a GGUF's general.sampling.* keys, which its converter writes from that file):
a request that leaves one of these fields unset gets the model's value; one that sets it keeps its own."""

from __future__ import annotations

import json
import os

from ..errors import SpecDecodeError

# generation_config.json's names, and the GGUF keys, of the fields vLLM takes, as SamplingParams names them
FROM_CHECKPOINT = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
FROM_GGUF = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
CHOICES = ("auto", "vllm")  # or a folder that holds a generation_config.json


def recommended_sampling(source) -> dict:
    """What a model's files recommend (a models.sources.ModelSource): its GGUF keys, or its folder's file."""
    if source.format == "gguf":
        return _from_gguf(source.path)
    path = os.path.join(source.path, "generation_config.json")
    return _from_file(path) if os.path.isfile(path) else {}


def sampling_defaults(choice: str, recommended: dict) -> dict:
    """What requests that leave a field unset take: "auto", the model's recommendation; "vllm", none (this engine's
    own defaults, as vLLM's option says); a folder, its generation_config.json's."""
    if choice == "vllm":
        return {}
    if choice == "auto":
        return dict(recommended)
    path = os.path.join(os.path.expanduser(choice), "generation_config.json")
    if not os.path.isfile(path):
        raise SpecDecodeError(
            f"generation_config: {choice!r} is no folder holding a generation_config.json; pass auto (the model's "
            "own), vllm (none) or such a folder"
        )
    return _from_file(path)


def _from_file(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            fields = json.load(f)
    except (OSError, ValueError) as exc:
        raise SpecDecodeError(
            f"{path} is not readable JSON ({exc}); pass --generation-config vllm to leave it"
        ) from None
    found = {ours: fields[theirs] for theirs, ours in FROM_CHECKPOINT.items() if fields.get(theirs) is not None}
    return _checked(found, path)


def _from_gguf(path: str) -> dict:
    from .gguf_loader import MappedReader

    fields = MappedReader(path).fields
    found = {ours: _as_written(fields[key].contents()) for key, ours in FROM_GGUF.items() if key in fields}
    return _checked(found, path)


def _as_written(value):
    """A float32 value as its writer gave it (0.7, not 0.699999988): the shortest decimal that rounds to it."""
    return float(f"{value:.7g}") if isinstance(value, float) else value


def _checked(values: dict, where: str) -> dict:
    """The values as SamplingParams takes them (a top_k of 0 is "off", as in transformers), checked to be valid."""
    from ..sampling import SamplingParams

    if values.get("top_k") == 0:
        values["top_k"] = -1
    try:
        SamplingParams(**values)
    except (SpecDecodeError, TypeError) as exc:
        raise SpecDecodeError(
            f"{where} recommends sampling settings this engine cannot take ({exc}); pass --generation-config vllm to "
            "leave them"
        ) from None
    return values
