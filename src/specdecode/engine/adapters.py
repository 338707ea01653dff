"""Served LoRA adapters loaded and unloaded while the engine serves (vLLM's /v1/load_lora_adapter and
/v1/unload_lora_adapter): called between steps, on the engine's thread (server/async_engine.py)."""

from __future__ import annotations

from ..errors import SpecDecodeError
from ..models.loader import load_served_adapter, unload_served_adapter
from ..models.lora import Adapter


def load_adapter(engine, name: str, path: str) -> None:
    """Serve the adapter at `path` (PATH or PATH:SCALE, as --lora-modules takes it) as `name` from the next step."""
    engine.runner.adapters_may_change()
    load_served_adapter(engine.runner.model, name, Adapter.parse(path))
    engine.runner.adapters_changed()


def unload_adapter(engine, name: str) -> None:
    """Stop serving `name`; refused while a request computes with it (its rows would lose their adapter)."""
    engine.runner.check_adapter(name)
    unfinished = [*engine.waiting, *engine.running, *(chunked.seq for chunked in engine.prefilling)]
    users = sum(seq.adapter == name for seq in unfinished)
    if users:
        raise SpecDecodeError(
            f"{users} sequences are computing with the LoRA adapter {name!r}; unload it once they finish"
        )
    unload_served_adapter(engine.runner.model, name)
    engine.runner.adapters_changed()
