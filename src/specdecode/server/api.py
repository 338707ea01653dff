"""OpenAI-compatible HTTP API over the AsyncEngine: /v1/completions, /v1/chat/completions (with
server-sent-event streaming), /v1/models, /health, /metrics."""
from __future__ import annotations

import hmac
import json
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict

from ..errors import SpecDecodeError
from ..sampling import SamplingParams
from .async_engine import AsyncEngine, QueueFull

MAX_REQUEST_BYTES = 8 << 20  # far above any prompt that fits a context; refused before it is read


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")  # clients send fields we do not need (user, stream_options, ...)
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    n: int = 1
    ignore_eos: bool = False
    logprobs: int | bool | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int]


class ContentPart(BaseModel):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    role: str
    content: str | list[ContentPart]

    def text(self) -> str:
        """The message's text; content parts (the newer OpenAI form) must all be text."""
        if isinstance(self.content, str):
            return self.content
        kinds = {part.type for part in self.content} - {"text"}
        if kinds:
            raise SpecDecodeError(f"messages: content parts of type {', '.join(sorted(kinds))} are not supported "
                                  "(text only)")
        return "".join(part.text or "" for part in self.content)


# Fields that change the output and that this server does not implement yet, with the value that means
# "off": a request that sets one otherwise gets a 400 rather than an output that silently ignores it.
UNSUPPORTED_UNLESS_DEFAULT = {
    "presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "logit_bias": None, "min_p": 0,
    "min_tokens": 0, "best_of": 1, "echo": False, "suffix": None, "top_logprobs": None, "response_format": None,
    "tools": None, "functions": None, "tool_choice": None, "guided_json": None, "guided_regex": None,
    "guided_choice": None, "guided_grammar": None, "prompt_logprobs": None,
}


class ChatRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


def refuse_unsupported_fields(req: BaseModel) -> None:
    for name, value in (req.model_extra or {}).items():
        if name in UNSUPPORTED_UNLESS_DEFAULT and value not in (UNSUPPORTED_UNLESS_DEFAULT[name], None, {}, []) \
                and not (name == "response_format" and isinstance(value, dict) and value.get("type") == "text"):
            raise SpecDecodeError(f"{name} is not supported by this server yet; leave it out (or at its default)")


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


def build_app(engine: AsyncEngine, model_name: str, api_key: str | None = None,
              max_request_bytes: int = MAX_REQUEST_BYTES, runs_engine: bool = True) -> FastAPI:
    """runs_engine: the app starts the engine's thread and stops it at shutdown (False: the caller runs
    the engine loop itself, as `serve` does on its main thread)."""
    tokenizer = engine.engine.tokenizer
    max_len = engine.engine.max_model_len

    @asynccontextmanager
    async def lifespan(app):
        if runs_engine:
            engine.start()
        yield
        if runs_engine:
            engine.stop()  # uvicorn handles SIGTERM: stop accepting, then cancel what still runs

    app = FastAPI(title="specdecode", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return error_response(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}", param=where or None)

    expected_auth = f"Bearer {api_key}".encode() if api_key else None

    @app.middleware("http")
    async def _check_api_key(request: Request, call_next):
        if expected_auth and request.url.path.startswith("/v1"):
            sent = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(sent, expected_auth):  # constant time: no guessing by timing
                return error_response(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                      "authentication_error")
        size = request.headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > max_request_bytes):
            return error_response(413, f"the request body is over {max_request_bytes} bytes; send a shorter "
                                       "prompt", "invalid_request_error")
        return await call_next(request)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "specdecode",
                                            "created": 0, "max_model_len": max_len}]}

    def prepare(req: _Common, prompt_ids: list[int], max_tokens: int | None):
        refuse_unsupported_fields(req)
        if req.n != 1:
            raise SpecDecodeError(f"only n=1 is supported, got n={req.n}")
        if req.logprobs:
            raise SpecDecodeError("logprobs are not supported")
        if not prompt_ids:
            raise SpecDecodeError("the prompt is empty")
        room = max_len - len(prompt_ids)
        if room <= 0:
            raise SpecDecodeError(f"the prompt has {len(prompt_ids)} tokens but the context holds {max_len}; "
                                  "shorten the prompt")
        max_tokens = 16 if max_tokens is None else max_tokens
        if isinstance(max_tokens, int) and max_tokens > room:
            raise SpecDecodeError(f"max_tokens={max_tokens} does not fit: the prompt has {len(prompt_ids)} "
                                  f"tokens and the context holds {max_len}; ask for at most {room}")
        return SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed,
                              stop=req.stop, max_tokens=max_tokens, ignore_eos=req.ignore_eos)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                return error_response(400, "send one prompt per request (batching happens on the server)", param="prompt")
            prompt = prompt[0]
        try:
            ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            params = prepare(req, ids, req.max_tokens)
        except SpecDecodeError as exc:
            return error_response(400, str(exc))
        return await respond(req.stream, ids, params, "text_completion", chat=False)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest):
        try:
            if not req.messages:
                raise SpecDecodeError("messages is empty; send at least one message")
            text = tokenizer.apply_chat_template([{"role": m.role, "content": m.text()} for m in req.messages])
            ids = tokenizer.encode(text)
            params = prepare(req, ids, req.max_completion_tokens or req.max_tokens)
        except SpecDecodeError as exc:
            return error_response(400, str(exc))
        return await respond(req.stream, ids, params, "chat.completion", chat=True)

    async def respond(stream: bool, ids: list[int], params: SamplingParams, kind: str, chat: bool):
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        try:
            updates = engine.updates(engine.submit(ids, params))
        except QueueFull as exc:
            response = error_response(429, str(exc), "rate_limit_error")
            response.headers["Retry-After"] = "1"
            return response
        if stream:
            return StreamingResponse(sse(updates, rid, created, kind, chat, len(ids)), media_type="text/event-stream")
        text, last = [], None
        try:
            async for update in updates:
                text.append(update.text)
                last = update
        except SpecDecodeError as exc:
            return error_response(400, str(exc))
        choice = {"index": 0, "finish_reason": last.finish_reason, "logprobs": None}
        choice.update({"message": {"role": "assistant", "content": "".join(text)}} if chat else {"text": "".join(text)})
        return {"id": rid, "object": kind, "created": created, "model": model_name, "choices": [choice],
                "usage": usage(len(ids), last.seq)}

    async def sse(updates, rid, created, kind, chat, prompt_tokens):
        kind = kind + ".chunk" if chat else kind
        first = True
        try:
            async for update in updates:
                delta = {"content": update.text} if chat else None
                if chat and first:
                    delta["role"] = "assistant"
                first = False
                choice = {"index": 0, "finish_reason": update.finish_reason if update.finished else None}
                choice.update({"delta": delta} if chat else {"text": update.text, "logprobs": None})
                chunk = {"id": rid, "object": kind, "created": created, "model": model_name, "choices": [choice]}
                if update.finished:
                    chunk["usage"] = usage(prompt_tokens, update.seq)
                yield f"data: {json.dumps(chunk)}\n\n"
        except SpecDecodeError as exc:
            yield f"data: {json.dumps({'error': {'message': str(exc), 'type': 'invalid_request_error'}})}\n\n"
        finally:
            await updates.aclose()  # a client that left mid-stream frees its sequence and KV now
        yield "data: [DONE]\n\n"

    def usage(prompt_tokens: int, seq) -> dict:
        completion = len(seq.output_ids) if seq is not None else 0
        spec = seq.metrics.as_dict() if seq is not None else {}
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion, "speculation": spec}

    return app
