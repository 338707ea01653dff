"""OpenAI-compatible HTTP API over the AsyncEngine: /v1/completions, /v1/chat/completions (with
server-sent-event streaming), /v1/models, /health, /metrics."""
from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ..errors import SpecDecodeError
from ..sampling import SamplingParams
from ..sampling.grammar import GrammarTokenizers
from .async_engine import AsyncEngine, QueueFull, ShuttingDown
from .protocol import ChatRequest, CompletionRequest, _Common
from .responses import chat_logprobs, completion_logprobs, usage

MAX_REQUEST_BYTES = 8 << 20  # far above any prompt that fits a context; refused before it is read


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 413: "invalid_request_error",
               429: "rate_limit_error", 503: "service_unavailable", 504: "timeout"}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": status}}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status)


def build_app(engine: AsyncEngine, model_name: str, api_key: str | None = None,
              max_request_bytes: int = MAX_REQUEST_BYTES, runs_engine: bool = True,
              request_timeout: float | None = None) -> FastAPI:
    """runs_engine: the app starts the engine's thread and stops it at shutdown (False: the caller runs
    the engine loop itself, as `serve` does on its main thread). request_timeout: the most seconds a
    request may run (a request may ask for less with its `timeout` field); then it is cancelled (504)."""
    tokenizer = engine.tokenizer
    max_len = engine.max_model_len

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
                return error_response(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")
        size = request.headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > max_request_bytes):
            return error_response(413, f"the request body is over {max_request_bytes} bytes; send a shorter "
                                       "prompt")
        return await call_next(request)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(await engine.metrics_text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "specdecode",
                                            "created": 0, "max_model_len": max_len}]}

    def time_limit(requested: float | None) -> float | None:
        """The request's own timeout, never past the server's --request-timeout."""
        limits = [t for t in (requested, request_timeout) if t is not None]
        return min(limits) if limits else None

    def prepare(req: _Common, prompt_ids: list[int], max_tokens: int | None) -> SamplingParams:
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
        return req.sampling_params(max_tokens, req.requested_logprobs())

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
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
        echo = (prompt if isinstance(prompt, str) else tokenizer.decode(ids), ids) if req.echo else None
        return await respond(request, req.stream, ids, params, "text_completion", chat=False,
                             timeout=time_limit(req.timeout), session=req.user or request.headers.get("x-session-id"),
                             echo=echo, best=(req.n, req.logprobs is not None) if params.n > req.n else None)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        try:
            if not req.messages:
                raise SpecDecodeError("messages is empty; send at least one message")
            text = tokenizer.apply_chat_template([{"role": m.role, "content": m.text()} for m in req.messages])
            ids = tokenizer.encode(text)
            params = prepare(req, ids, req.max_completion_tokens or req.max_tokens)
        except SpecDecodeError as exc:
            return error_response(400, str(exc))
        return await respond(request, req.stream, ids, params, "chat.completion", chat=True,
                             timeout=time_limit(req.timeout), session=req.user or request.headers.get("x-session-id"))

    async def respond(request: Request, stream: bool, ids: list[int], params: SamplingParams, kind: str,
                      chat: bool, timeout: float | None, session: str | None, echo: tuple | None = None,
                      best: tuple[int, bool] | None = None):
        """session: the conversation a scaled-out deployment keeps on one replica (ignored by one engine).
        echo: (prompt text, prompt ids) to put before each completion (completions' `echo`).
        best: (n, whether logprobs are returned) when more outputs than n were generated (`best_of`)."""
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        if params.structured_output is not None:  # built once, in seconds: not on the engine's thread
            await asyncio.to_thread(GrammarTokenizers.get, tokenizer, engine.vocab_size)
        try:
            handle = engine.submit(ids, params, session=session, streamed=stream)
        except (QueueFull, ShuttingDown) as exc:
            response = error_response(exc.http_status, str(exc))
            response.headers["Retry-After"] = "1"
            return response
        updates = engine.updates(handle, timeout)
        if stream:
            return StreamingResponse(sse(updates, params, rid, created, kind, chat, len(ids), echo),
                                     media_type="text/event-stream")
        collecting = asyncio.ensure_future(collect(updates, params.n))
        gone = asyncio.ensure_future(client_gone(request))
        await asyncio.wait({collecting, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not collecting.done():  # the client left: cancelling the collection aborts the request (its slots, KV)
            collecting.cancel()
            return Response(status_code=499)
        try:
            texts, finals, logprobs = collecting.result()
        except SpecDecodeError as exc:
            return error_response(exc.http_status, str(exc))
        prompt_scored = len(ids) if params.prompt_logprobs is not None else 0  # echoed prompt logprobs lead
        order = range(params.n) if best is None else best_outputs(logprobs, best[0], prompt_scored)
        show_logprobs = params.logprobs is not None and (best is None or best[1])
        choices = [choice(rank, texts[i], logprobs[i] if show_logprobs else None, finals[i].finish_reason, chat,
                          delta=False, echo=echo) for rank, i in enumerate(order)]
        return {"id": rid, "object": kind, "created": created, "model": model_name, "choices": choices,
                "usage": usage(len(ids), finals)}

    def best_outputs(logprobs: list[list], n: int, skip: int) -> list[int]:
        """The n outputs with the highest total logprob of their generated tokens (after the first `skip`
        entries), best first."""
        totals = [sum(lp.logprob for lp in lps[skip:]) for lps in logprobs]
        return sorted(range(len(totals)), key=lambda i: -totals[i])[:n]

    async def collect(updates, n: int):
        """Each output's whole text, final Update and logprobs."""
        texts, finals, logprobs = [[] for _ in range(n)], {}, [[] for _ in range(n)]
        async for update in updates:
            texts[update.index].append(update.text)
            logprobs[update.index].extend((update.prompt_logprobs or []) + update.logprobs)
            if update.finished:
                finals[update.index] = update
        return ["".join(t) for t in texts], finals, logprobs

    async def client_gone(request: Request) -> None:
        """Returns when the client closes the connection (its body has been read, so the next message
        can only be the disconnect)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass

    def choice(index: int, text: str, logprobs, finish_reason, chat: bool, delta: bool,
               text_offset: int = 0, echo: tuple | None = None) -> dict:
        """echo: (prompt text, prompt ids) when this piece starts with the echoed prompt (its logprobs, if
        asked for, are already at the front of logprobs)."""
        out = {"index": index, "finish_reason": finish_reason, "logprobs": None}
        if echo is not None:
            text = echo[0] + text
        if logprobs is not None:
            out["logprobs"] = chat_logprobs(tokenizer, logprobs) if chat else \
                completion_logprobs(tokenizer, logprobs, text_offset, token_ids=echo[1] if echo else None)
        if chat:
            out["delta" if delta else "message"] = {"role": "assistant", "content": text}
        else:
            out["text"] = text
        return out

    async def sse(updates, params, rid, created, kind, chat, prompt_tokens, echo=None):
        kind = kind + ".chunk" if chat else kind
        n = params.n
        started, offsets, finals = [False] * n, [0] * n, {}
        try:
            async for update in updates:
                i = update.index
                logprobs = None
                if params.logprobs is not None:
                    logprobs = (update.prompt_logprobs or []) + update.logprobs
                echoed = echo if echo is not None and not started[i] else None
                body = choice(i, update.text, logprobs, update.finish_reason if update.finished else None, chat,
                              delta=True, text_offset=offsets[i], echo=echoed)
                if chat and started[i]:
                    del body["delta"]["role"]  # the role goes in each output's first chunk only
                started[i] = True
                offsets[i] += len(update.text) + (len(echoed[0]) if echoed else 0)
                if update.finished:
                    finals[i] = update
                chunk = {"id": rid, "object": kind, "created": created, "model": model_name, "choices": [body]}
                if len(finals) == n:
                    chunk["usage"] = usage(prompt_tokens, finals)
                yield f"data: {json.dumps(chunk)}\n\n"
        except SpecDecodeError as exc:
            yield f"data: {json.dumps(error_body(exc.http_status, str(exc)))}\n\n"
        finally:
            await updates.aclose()  # a client that left mid-stream frees its sequences and KV now
        yield "data: [DONE]\n\n"

    return app
