"""From an OpenAI request to the engine: the prompt and sampling parameters read from the request, then its
submission through a Reply (server/reply.py), which builds the response from the engine's updates."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..engine.sequence import check_token_ids, truncate_prompt
from ..errors import SpecDecodeError
from ..models.infill import infill_ids
from ..sampling import SamplingParams
from .protocol import ChatRequest, CommonRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .reasoning import HARMONY, PARSERS, Thinking
from .reply import Reply, Shown, merged_stream, summed_usage
from .response_store import ResponseStore
from .responses import error_response
from .tools import template_messages


class ServingEngine(Protocol):
    """What the HTTP layer needs of an engine: one in this process (AsyncEngine) or replicas behind Ray
    Serve (server/ray_serve.py's RemoteEngines)."""

    tokenizer: Any
    max_model_len: int
    vocab_size: int
    adapters: list[str]  # the served LoRA adapters' names, which requests give as their model
    sampling_defaults: dict  # what a request's unset sampling fields take (LLM.sampling_defaults)

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        session: str | None = None,
        streamed: bool = False,
        tenant: str = "",
        adapter: str = "",
    ) -> Any: ...

    def updates(self, handle: Any, timeout: float | None = None) -> AsyncIterator: ...

    async def metrics_text(self) -> bytes: ...


class RequestHandler:
    """model_name: the served model's name, or its names (the first is the one responses give). request_timeout: the
    most seconds a request may run (a request may ask for less with its `timeout` field); then it is cancelled
    (504). reasoning_parser: a chat reply's thinking goes to `reasoning` (one of reasoning.PARSERS; None: the reply is
    all content)."""

    def __init__(
        self,
        engine: ServingEngine,
        model_name: str | list[str],
        request_timeout: float | None = None,
        reasoning_parser: str | None = None,
        trusts_request_templates: bool = False,
    ):
        # the names a request may give the model (vLLM's --served-model-name); responses give the first
        self.model_names = [model_name] if isinstance(model_name, str) else list(model_name)
        self.engine, self.model_name, self.request_timeout = engine, self.model_names[0], request_timeout
        self.tokenizer = engine.tokenizer
        if reasoning_parser not in (None, *PARSERS):
            raise SpecDecodeError(f"reasoning_parser is one of {', '.join(PARSERS)}, not {reasoning_parser!r}")
        # gpt-oss's channels are always read, as vLLM reads them: its raw reply is markers and channel names
        harmony = getattr(self.tokenizer, "harmony", False)
        self.reasoning_parser = reasoning_parser or (HARMONY if harmony else None)
        self.trusts_request_templates = trusts_request_templates  # vLLM's --trust-request-chat-template
        self.responses = ResponseStore()  # the Responses API's, for previous_response_id

    def other_model(self, req: CommonRequest | TokenizeRequest | DetokenizeRequest) -> JSONResponse | None:
        """A 404 for a request that names a model this server does not serve (its output would be another
        model's); a request that names none gets this one."""
        if req.model is None or req.model in self.model_names or req.model in self.engine.adapters:
            return None
        return error_response(
            404,
            f"the model {req.model!r} is not served here; send model={self.model_name!r} (listed at /v1/models)",
            param="model",
        )

    def served_as(self, model: str | None) -> tuple[str, str]:
        """For a request naming `model`: the served LoRA adapter it computes with ("": none, the model as loaded), and
        the name its reply gives (the adapter's, else the served model's)."""
        adapter = model if model in self.engine.adapters else ""
        return adapter, adapter or self.model_name

    async def completion(self, req: CompletionRequest, request: Request):
        """One prompt, or several (OpenAI's list of prompts: each answered as a request of its own, their choices
        together in one body or stream, prompt i's n choices at indices i * n to i * n + n - 1)."""
        if wrong := self.other_model(req):
            return wrong
        prompts = listed_prompts(req.prompt)
        replies = [self.completion_reply(req, prompt) for prompt in prompts]
        if refused := next((r for r in replies if isinstance(r, JSONResponse)), None):
            return refused
        limit, session, tenant = self.time_limit(req.timeout), session_of(req, request), tenant_of(req, request)
        if len(replies) == 1:
            return await replies[0].send(request, req.stream, limit, session, tenant)
        if req.stream:
            return await merged_stream(replies, req.n, limit, session, tenant)
        bodies = await asyncio.gather(*(reply.send(request, False, limit, session, tenant) for reply in replies))
        return next((b for b in bodies if isinstance(b, Response)), None) or merged_choices(bodies, req.n)

    def completion_reply(self, req: CompletionRequest, prompt: str | list[int]) -> Reply | JSONResponse:
        try:
            whole = self.prompt_ids(prompt, req.suffix, req.echo)
            ids, params = self.sampling_params(req, whole, req.max_tokens)
        except SpecDecodeError as exc:
            return error_response(400, str(exc))
        echo = None
        if req.echo:  # the prompt as read: the text sent, unless it was truncated or sent as ids
            echo = (prompt if isinstance(prompt, str) and ids is whole else self.tokenizer.decode(ids), ids)
        return Reply(
            self,
            ids,
            params,
            chat=False,
            echo=echo,
            best=(req.n, req.logprobs is not None) if params.n > req.n else None,
            shown=Shown.asked_by(req),
            model=req.model,
        )

    async def chat(self, req: ChatRequest, request: Request):
        if wrong := self.other_model(req):
            return wrong
        try:
            text = self.chat_prompt(req)
            ids, params = self.chat_sampling(req, text)
        except SpecDecodeError as exc:
            return error_response(400, str(exc))
        echo = None if (echoed := req.echoed()) is None else (echoed, None)
        reply = Reply(
            self,
            ids,
            params,
            chat=True,
            echo=echo,
            tools=req.tool_use,
            shown=Shown.asked_by(req),
            thinking=self.thinking(text),
            model=req.model,
        )
        return await reply.send(
            request, req.stream, self.time_limit(req.timeout), session_of(req, request), tenant_of(req, request)
        )

    def chat_prompt(self, req: ChatRequest) -> str:
        """The conversation as the model's chat template renders it, with the request's tools and options."""
        if not req.messages:
            raise SpecDecodeError("messages is empty; send at least one message")
        tools = req.tool_use
        messages = template_messages(req.messages)
        return self.chat_tokenizer(req).apply_chat_template(
            messages, tools=tools.rendered if tools else None, **req.template_options()
        )

    def chat_tokenizer(self, req: ChatRequest):
        """The tokenizer that renders this chat: with the request's own template where the server trusts them (a
        template runs in Jinja's sandbox, but may loop long or render what the model was not trained on)."""
        if req.chat_template is None:
            return self.tokenizer
        if not self.trusts_request_templates:
            raise SpecDecodeError(
                "chat_template: this server renders chats with the model's template; a request's own is used where "
                "the server is started with --trust-request-chat-template"
            )
        return self.tokenizer.with_chat_template(req.chat_template, files=False)

    def chat_sampling(self, req: ChatRequest, prompt: str) -> tuple[list[int], SamplingParams]:
        """A chat's prompt ids and sampling parameters; with a reasoning parser, a grammar starts after the thinking."""
        ids, params = self.sampling_params(
            req, self.tokenizer.encode(prompt), req.max_completion_tokens or req.max_tokens, default=None
        )
        if self.reasoning_parser is not None and params.structured_output is not None:
            params.structured_output = replace(params.structured_output, after_thinking=self.thinking(prompt).opened)
        if not req.include_reasoning and self.reasoning_parser is None:
            raise SpecDecodeError(
                "include_reasoning=false needs the reasoning read out of the reply: start the server with "
                "--reasoning-parser"
            )
        return ids, params

    def thinking(self, prompt: str) -> Thinking | None:
        """How a chat reply's thinking is read: None, not at all (the reply is all content)."""
        return None if self.reasoning_parser is None else Thinking.of(self.reasoning_parser, prompt)

    def tokenize(self, req: TokenizeRequest) -> dict | JSONResponse:
        """vLLM's /tokenize: the token ids a prompt or a chat is served with, with the context's length."""
        if wrong := self.other_model(req):
            return wrong
        try:
            if (req.prompt is None) == (req.messages is None):
                raise SpecDecodeError("send a prompt or messages (one of the two)")
            if req.messages is not None:
                ids = self.tokenizer.encode(self.chat_prompt(req.chat()))
            elif req.add_special_tokens is False:
                ids = self.tokenizer.encode_fragment(req.prompt)
            else:
                ids = self.tokenizer.encode(req.prompt)
        except SpecDecodeError as exc:
            return error_response(400, str(exc))
        strings = self.tokenizer.token_strings(ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids, "token_strs": strings}

    def detokenize(self, req: DetokenizeRequest) -> dict | JSONResponse:
        """vLLM's /detokenize: the text of token ids, special tokens included."""
        if wrong := self.other_model(req):
            return wrong
        try:
            check_token_ids(req.tokens, self.engine.vocab_size, "tokens")
        except SpecDecodeError as exc:
            return error_response(400, str(exc))
        return {"prompt": self.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    def prompt_ids(self, prompt: str | list[int], suffix: str | None, echo: bool) -> list[int]:
        """A completion's prompt; with a suffix, the gap between the two for the model to fill in."""
        if suffix is None:
            return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if echo:
            raise SpecDecodeError("echo and suffix together: the prompt is not what the completion continues; drop one")
        return infill_ids(self.tokenizer, prompt, suffix)

    def time_limit(self, requested: float | None) -> float | None:
        """The request's own timeout, never past the server's."""
        limits = [t for t in (requested, self.request_timeout) if t is not None]
        return min(limits) if limits else None

    def sampling_params(
        self, req: CommonRequest, prompt_ids: list[int], max_tokens: int | None, default: int | None = 16
    ) -> tuple[list[int], SamplingParams]:
        """The prompt as served (truncated where the request asks) and its sampling parameters, the model's defaults in
        the fields it leaves unset. default: max_tokens where neither the request nor the model's defaults set it, as
        OpenAI's API has it: 16 for completions, for chat the rest of the context (None)."""
        max_len = self.engine.max_model_len
        prompt_ids = truncate_prompt(prompt_ids, req.truncate_prompt_tokens, max_len, max_tokens or default)
        if not prompt_ids:
            raise SpecDecodeError("the prompt is empty")
        room = max_len - len(prompt_ids)
        if room <= 0:
            raise SpecDecodeError(
                f"the prompt has {len(prompt_ids)} tokens but the context holds {max_len}; shorten the prompt"
            )
        defaults = self.engine.sampling_defaults
        if max_tokens is None:
            default = defaults.get("max_tokens", default)
            max_tokens = room if default is None else min(default, room)
        if isinstance(max_tokens, int) and max_tokens > room:
            raise SpecDecodeError(
                f"max_tokens={max_tokens} does not fit: the prompt has {len(prompt_ids)} "
                f"tokens and the context holds {max_len}; ask for at most {room}"
            )
        return prompt_ids, req.sampling_params(max_tokens, req.requested_logprobs(), defaults)


def listed_prompts(prompt: str | list) -> list[str | list[int]]:
    """A completion request's prompts: a text, token ids, or a list of either (an empty list: one empty prompt)."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def merged_choices(bodies: list[dict], n: int) -> dict:
    """One completion body for several prompts' (prompt i's choices at indices from i * n), their usage summed (the
    speculation figures are the first prompt's, as a body's are its first output's)."""
    body = dict(bodies[0])
    body["choices"] = [
        choice | {"index": i * n + choice["index"]} for i, b in enumerate(bodies) for choice in b["choices"]
    ]
    body["usage"] = summed_usage([b["usage"] for b in bodies])
    return body


def session_of(req: CommonRequest, request: Request) -> str | None:
    """The conversation a scaled-out deployment keeps on one replica (one engine ignores it)."""
    return req.user or request.headers.get("x-session-id")


def api_key_sent(request: Request) -> str:
    """The API key a request carries: OpenAI's clients send it as a bearer token, Anthropic's as x-api-key."""
    bearer = request.headers.get("authorization", "")
    return bearer.removeprefix("Bearer ") if bearer.startswith("Bearer ") else request.headers.get("x-api-key", "")


def tenant_of(req: CommonRequest, request: Request) -> str:
    """Who asks: the API key the request carries (hashed: the key itself is kept nowhere) and its `user`.
    Suffix speculation drafts from this tenant's earlier outputs only."""
    return f"{key_owner(request)}/{req.user or ''}"


def key_owner(request: Request) -> str:
    """Whose API key a request carries, hashed: the key itself is kept nowhere."""
    return hashlib.blake2b(api_key_sent(request).encode(), digest_size=8).hexdigest()
