"""OpenAI-compatible HTTP API: the routes (/v1/completions, /v1/chat/completions with server-sent-event
streaming, /v1/responses, /v1/models, /health, /metrics, vLLM's /tokenize and /detokenize; Anthropic's /v1/messages)
and the guards in front of them (API key, body size, validation errors as 400); server/handler.py turns requests into
engine work, server/reply.py, server/responses_api.py and server/anthropic_api.py the engine's updates into
responses."""

from __future__ import annotations

import hmac
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response

from .adapters_api import LoadLoRARequest, UnloadLoRARequest, change_adapters
from .anthropic_api import MessagesRequest, anthropic_error, count_tokens, create_message
from .handler import RequestHandler, ServingEngine, api_key_sent
from .protocol import ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .responses import error_response
from .responses_api import ResponsesRequest, create_response, stored_response

MAX_REQUEST_BYTES = 8 << 20  # far above any prompt that fits a context; refused before it is read


def build_app(
    engine: ServingEngine,
    model_name: str | list[str],
    api_key: str | None = None,
    max_request_bytes: int = MAX_REQUEST_BYTES,
    runs_engine: bool = True,
    request_timeout: float | None = None,
    reasoning_parser: str | None = None,
    runtime_lora: bool = False,
    trust_request_chat_template: bool = False,
) -> FastAPI:
    """runs_engine: the app starts the engine's thread and stops it at shutdown (False: the caller runs
    the engine loop itself, as `serve` does on its main thread). request_timeout: the most seconds a
    request may run (a request may ask for less with its `timeout` field); then it is cancelled (504).
    reasoning_parser: chat replies' thinking goes to `reasoning` (see server/reasoning.py). runtime_lora: served LoRA
    adapters may be loaded and unloaded by POST /v1/load_lora_adapter and /v1/unload_lora_adapter.
    trust_request_chat_template: a chat request's chat_template renders it (else: a 400)."""

    @asynccontextmanager
    async def lifespan(app):
        if runs_engine:
            engine.start()
        yield
        if runs_engine:
            engine.stop()  # uvicorn handles SIGTERM: stop accepting, then cancel what still runs

    app = FastAPI(title="specdecode", lifespan=lifespan)
    add_guards(app, api_key, max_request_bytes)
    handler = RequestHandler(engine, model_name, request_timeout, reasoning_parser, trust_request_chat_template)
    add_routes(app, handler)
    add_lora_routes(app, handler, runtime_lora)
    return app


def add_guards(app: FastAPI, api_key: str | None, max_request_bytes: int) -> None:
    expected_key = api_key.encode() if api_key else None

    def refused(request: Request, status: int, message: str, param: str | None = None) -> Response:
        """An error in the shape of the API asked: Anthropic's for its routes, OpenAI's for the others."""
        if request.url.path.startswith("/v1/messages"):
            return anthropic_error(status, message)
        return error_response(status, message, param=param)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return refused(request, 400, f"{where or 'body'}: {first.get('msg', 'invalid request')}", where or None)

    @app.middleware("http")
    async def check_key_and_size(request: Request, call_next):
        if expected_key and request.url.path.startswith("/v1"):
            # constant time: no guessing by timing
            if not hmac.compare_digest(api_key_sent(request).encode(), expected_key):
                return refused(
                    request, 401, "missing or wrong API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')"
                )
        size = request.headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > max_request_bytes):
            return refused(request, 413, f"the request body is over {max_request_bytes} bytes; send a shorter prompt")
        return await call_next(request)


def add_routes(app: FastAPI, handler: RequestHandler) -> None:
    engine = handler.engine

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(await engine.metrics_text(), media_type="text/plain; version=0.0.4")

    served = {
        name: {
            "id": name,
            "object": "model",
            "owned_by": "specdecode",
            "created": 0,
            "max_model_len": engine.max_model_len,
        }
        for name in handler.model_names
    }

    def cards() -> dict[str, dict]:
        """As vLLM lists its LoRA modules: each adapter served now a model, the target its parent."""
        adapters = {
            name: served[handler.model_name] | {"id": name, "parent": handler.model_name} for name in engine.adapters
        }
        return served | adapters

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": list(cards().values())}

    @app.get("/v1/models/{model:path}")  # a path: served names may hold a slash ("Qwen/Qwen3-8B")
    async def model(model: str):
        card = cards().get(model)
        if card is None:
            return error_response(404, f"the model {model!r} is not served here; it serves {handler.model_name!r}")
        return card

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await handler.completion(req, request)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        return await handler.chat(req, request)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        return handler.tokenize(req)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        return handler.detokenize(req)

    add_responses_routes(app, handler)
    add_messages_routes(app, handler)


def add_responses_routes(app: FastAPI, handler: RequestHandler) -> None:
    """OpenAI's Responses API: a response made, read back and forgotten."""

    @app.post("/v1/responses")
    async def responses(req: ResponsesRequest, request: Request):
        return await create_response(handler, req, request)

    @app.get("/v1/responses/{response_id}")
    async def stored(response_id: str, request: Request):
        return stored_response(handler, response_id, request)

    @app.delete("/v1/responses/{response_id}")
    async def forget(response_id: str, request: Request):
        return stored_response(handler, response_id, request, delete=True)


def add_lora_routes(app: FastAPI, handler: RequestHandler, allowed: bool) -> None:
    """vLLM's loading and unloading of served LoRA adapters while serving, where the server allows it."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora(req: LoadLoRARequest):
        return await change_adapters(handler, allowed, req.lora_name, req.lora_path)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora(req: UnloadLoRARequest):
        return await change_adapters(handler, allowed, req.lora_name)


def add_messages_routes(app: FastAPI, handler: RequestHandler) -> None:
    """Anthropic's Messages API: a message made, a prompt's tokens counted."""

    @app.post("/v1/messages")
    async def messages(req: MessagesRequest, request: Request):
        return await create_message(handler, req, request)

    @app.post("/v1/messages/count_tokens")
    async def messages_tokens(req: MessagesRequest):
        return count_tokens(handler, req)
