"""vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter: served LoRA adapters loaded and unloaded while the
server serves, between the engine's steps (engine/adapters.py). Off unless `serve --allow-runtime-lora-updating`
(vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING): a request could have the server read any adapter file it can reach."""

from __future__ import annotations

from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from ..engine.adapters import load_adapter, unload_adapter
from ..errors import SpecDecodeError
from .handler import RequestHandler
from .responses import error_response


class LoadLoRARequest(BaseModel):
    lora_name: str
    lora_path: str  # a PEFT adapter's folder or llama.cpp's .gguf of one; PATH:SCALE scales it


class UnloadLoRARequest(BaseModel):
    lora_name: str


async def change_adapters(handler: RequestHandler, allowed: bool, name: str, path: str | None = None):
    """Load `path` as `name` (path given) or unload `name`; vLLM's plain-text answer, or an error that says why."""
    if not allowed:
        return error_response(
            400, "loading LoRA adapters while serving is off; start the server with --allow-runtime-lora-updating"
        )
    if not hasattr(handler.engine, "change_adapters"):
        return error_response(400, "LoRA adapters are loaded while serving by one engine, not by Ray replicas")
    if path is not None and (not name or name in handler.model_names):
        return error_response(400, f"lora_name {name!r} would hide the served model; name the adapter otherwise")
    try:
        if path is None:
            await handler.engine.change_adapters(lambda engine: unload_adapter(engine, name))
        else:
            await handler.engine.change_adapters(lambda engine: load_adapter(engine, name, path))
    except SpecDecodeError as exc:
        status = 404 if path is None and name not in handler.engine.adapters else exc.http_status
        return error_response(status, str(exc), param="lora_name" if status == 404 else None)
    except Exception as exc:  # an unreadable file: the request's error, the server serves on
        return error_response(400, f"the LoRA adapter at {path!r} could not be read: {exc}", param="lora_path")
    done = "removed" if path is None else "added"
    return PlainTextResponse(f"Success: LoRA adapter '{name}' {done} successfully.")
