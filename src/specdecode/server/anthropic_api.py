"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`), as vLLM and llama.cpp's server
serve it for clients that speak Anthropic's protocol (the `anthropic` SDK, coding agents): the conversation (system
text, messages of text, tool_use and tool_result blocks, earlier thinking) rendered by the chat template as
/v1/chat/completions renders it; out, a message of content blocks (thinking where the server reads reasoning, text,
the tool calls read from the text), whole or streamed as the API's events; errors in the API's own shape."""

from __future__ import annotations

import json
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict

from ..errors import SpecDecodeError
from .handler import RequestHandler, session_of, tenant_of
from .protocol import ChatRequest, given, validated
from .reasoning import Thinking
from .reply import OutputReader, collected_unless_gone, submitted
from .tools import ToolCall, Tools, assistant_message

# Anthropic's error types by HTTP status
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}
# The API's fields that would change what is generated and that this server does not do, with the value meaning "off"
UNSUPPORTED_UNLESS_OFF = {"container": None, "mcp_servers": None, "context_management": None}
# Fields that change how a request is billed, routed or cached, not what it answers (prompt caching is automatic here)
IGNORED = {"cache_control", "diagnostics", "inference_geo", "speed", "user_profile_id", "workspace_id", "service_tier"}


def anthropic_error(status: int, message: str) -> JSONResponse:
    return JSONResponse(error_body(status, message), status)


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def as_anthropic_error(response: Response) -> Response:
    """An OpenAI-shaped error response (a queue's 429, a drain's 503) in Anthropic's shape, its headers kept."""
    if not isinstance(response, JSONResponse):
        return response
    message = json.loads(response.body).get("error", {}).get("message", "")
    shaped = anthropic_error(response.status_code, message)
    shaped.headers.update({k: v for k, v in response.headers.items() if k.lower() == "retry-after"})
    return shaped


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # vLLM's sampling extras (seed, ignore_eos, ...) go on to the chat request
    model: str | None = None
    max_tokens: int | None = None  # required by /v1/messages, not by count_tokens
    messages: list[dict]
    system: str | list[dict] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None  # None: the model's default (its generation config), else 1
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict | None = None  # user_id: whose conversation (a scaled-out deployment keeps it on one replica)
    tools: list[dict] | None = None
    tool_choice: dict | None = None  # {"type": "auto" | "any" | "tool" | "none", "name", "disable_parallel_tool_use"}
    # {"type": "enabled", "budget_tokens": N}, {"type": "adaptive"} (no budget) or {"type": "disabled"}; "display":
    # "omitted" leaves the thinking's text out of the reply
    thinking: dict | None = None
    output_config: dict | None = None  # {"format": {"type": "json_schema", "schema": ...}, "effort": ...}
    output_format: dict | None = None  # the structured-outputs beta's name for output_config.format

    def chat_request(self, reads_reasoning: bool) -> ChatRequest:
        """The chat request this asks for (reads_reasoning: whether the server reads thinking out of replies)."""
        for name, off in UNSUPPORTED_UNLESS_OFF.items():
            if (self.model_extra or {}).get(name, off) not in (off, [], {}):
                raise SpecDecodeError(f"{name} is not supported by this server's /v1/messages; leave it out")
        system = system_text(self.system)
        extras = {k: v for k, v in (self.model_extra or {}).items() if k not in UNSUPPORTED_UNLESS_OFF.keys() | IGNORED}
        choice = self.tool_choice or {}
        own = dict(
            model=self.model,
            messages=([{"role": "system", "content": system}] if system is not None else [])
            + chat_messages(self.messages),
            max_tokens=self.max_tokens,
            **given(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k),
            stop=self.stop_sequences,
            stream=self.stream,
            user=(self.metadata or {}).get("user_id"),
            tools=[chat_tool(tool) for tool in self.tools] if self.tools else None,
            tool_choice=chat_tool_choice(choice) if self.tool_choice else None,
            parallel_tool_calls=not choice.get("disable_parallel_tool_use", False),
            response_format=self.response_format(),
            **self.thinking_fields(reads_reasoning, extras.pop("chat_template_kwargs", None)),
        )
        effort = (self.output_config or {}).get("effort")
        if effort is not None:
            own["reasoning_effort"] = effort
        if clash := sorted(set(extras) & (set(own) | {"max_completion_tokens"})):
            raise SpecDecodeError(f"{', '.join(clash)}: the chat endpoint's name; send the Messages API's field")
        return validated(ChatRequest, **extras, **own)

    def response_format(self) -> dict | None:
        """output_config.format (or the beta's output_format) as chat's response_format."""
        format_ = (self.output_config or {}).get("format") or self.output_format
        if format_ is None:
            return None
        if not isinstance(format_, dict) or format_.get("type") != "json_schema" or "schema" not in format_:
            raise SpecDecodeError('output_config.format must be {"type": "json_schema", "schema": {...}}')
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": format_["schema"]}}

    def thinking_fields(self, reads_reasoning: bool, template_kwargs: dict | None) -> dict:
        """thinking as the chat template's enable_thinking (Qwen3's switch) and the thinking's token budget. Thinking
        asked for needs the server to read it out of the reply."""
        kind = (self.thinking or {}).get("type")
        if kind is None:
            return {"chat_template_kwargs": template_kwargs}
        if kind not in ("enabled", "adaptive", "disabled"):
            raise SpecDecodeError('thinking.type must be "enabled", "adaptive" or "disabled" here')
        if kind != "disabled" and not reads_reasoning:
            raise SpecDecodeError(
                "thinking needs the reasoning read out of the reply: start the server with --reasoning-parser"
            )
        budget = self.thinking.get("budget_tokens") if kind == "enabled" else None
        return {
            "chat_template_kwargs": dict(template_kwargs or {}) | {"enable_thinking": kind != "disabled"},
            "thinking_token_budget": budget,
        }

    @property
    def shows_thinking(self) -> bool:
        return (self.thinking or {}).get("display") != "omitted"


def system_text(system: str | list[dict] | None) -> str | None:
    """The system prompt: a string, or text blocks (joined by newlines)."""
    if system is None or isinstance(system, str):
        return system
    return "\n".join(_text_of(block, "system") for block in system)


def _text_of(block: dict, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text":
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        raise SpecDecodeError(f"{where}: blocks of type {kind!r} are not supported here (text only)")
    return str(block.get("text") or "")


def chat_messages(messages: list[dict]) -> list[dict]:
    """The API's messages as chat messages: a user's tool_result blocks become tool messages (before its text), an
    assistant's tool_use blocks its tool calls and its thinking blocks its reasoning; text blocks joined by newlines,
    as chat's content parts are."""
    out = []
    for message in messages:
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant"):
            raise SpecDecodeError(f"messages: role {role!r} is not user or assistant (the system prompt is `system`)")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif isinstance(content, list):
            out += _user_messages(content) if role == "user" else [_assistant_message(content)]
        else:
            raise SpecDecodeError("messages: each message's content is a string or a list of content blocks")
    return out


def _user_messages(blocks: list[dict]) -> list[dict]:
    results = [
        _tool_message(block) for block in blocks if isinstance(block, dict) and block.get("type") == "tool_result"
    ]
    texts = [
        _text_of(block, "messages")
        for block in blocks
        if not (isinstance(block, dict) and block.get("type") == "tool_result")
    ]
    return results + ([{"role": "user", "content": "\n".join(texts)}] if texts else [])


def _tool_message(block: dict) -> dict:
    content = block.get("content", "")
    if isinstance(content, list):
        content = "\n".join(_text_of(part, "tool_result content") for part in content)
    return {"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": str(content)}


def _assistant_message(blocks: list[dict]) -> dict:
    text, calls, thinking = [], [], []
    for block in blocks:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_use":
            arguments = json.dumps(block.get("input") or {})
            calls.append(
                {
                    "id": block.get("id"),
                    "type": "function",
                    "function": {"name": block.get("name"), "arguments": arguments},
                }
            )
        elif kind == "thinking":
            thinking.append(str(block.get("thinking") or ""))
        else:
            text.append(_text_of(block, "messages"))
    return assistant_message("\n".join(text), calls, "".join(thinking))


def chat_tool(tool: dict) -> dict:
    """A client tool ({"name", "description", "input_schema"}) as chat's function tool; Anthropic's own server tools
    (web search, code execution, ...) run on Anthropic's side and are not served here."""
    if not isinstance(tool, dict) or tool.get("type", "custom") != "custom" or "name" not in tool:
        kind = tool.get("type") if isinstance(tool, dict) else tool
        raise SpecDecodeError(f"tools: {kind!r} is not taken here; send client tools ({{'name', 'input_schema'}})")
    function = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
    if "description" in tool:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def chat_tool_choice(choice: dict) -> str | dict:
    if not isinstance(choice.get("disable_parallel_tool_use", False), bool):
        raise SpecDecodeError("tool_choice.disable_parallel_tool_use must be true or false")
    kind = choice.get("type")
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    named = {"auto": "auto", "any": "required", "none": "none"}
    if kind not in named:
        raise SpecDecodeError('tool_choice.type must be "auto", "any", "tool" or "none"')
    return named[kind]


def served_chat(handler: RequestHandler, req: MessagesRequest) -> tuple[ChatRequest, str] | JSONResponse:
    """The chat request a message asks for and its prompt, or the error response: a 404 for another model's name."""
    if wrong := handler.other_model(req):
        return as_anthropic_error(wrong)
    try:
        chat = req.chat_request(handler.reasoning_parser is not None)
        return chat, handler.chat_prompt(chat)
    except SpecDecodeError as exc:
        return anthropic_error(400, str(exc))


async def create_message(handler: RequestHandler, req: MessagesRequest, request: Request):
    served = served_chat(handler, req)
    if isinstance(served, JSONResponse):
        return served
    if req.max_tokens is None:
        return anthropic_error(400, "max_tokens: Field required (the most tokens the reply may have)")
    chat, prompt = served
    try:
        ids, params = handler.chat_sampling(chat, prompt)
    except SpecDecodeError as exc:
        return anthropic_error(400, str(exc))
    reply = MessageReply(handler, req, ids, handler.thinking(prompt), chat.tool_use)
    limit, session, tenant = handler.time_limit(chat.timeout), session_of(chat, request), tenant_of(chat, request)
    updates = await submitted(handler.engine, ids, params, req.stream, limit, session, tenant, reply.adapter)
    if isinstance(updates, Response):
        return as_anthropic_error(updates)
    if req.stream:
        return StreamingResponse(reply.events(updates), media_type="text/event-stream")
    collected = await collected_unless_gone(request, updates, 1)
    if isinstance(collected, Response):
        return as_anthropic_error(collected)
    texts, finals, *_ = collected
    reader = OutputReader(reply.thinking, reply.tools)
    reasoning, content, calls = reader.feed(texts[0], finished=True)
    blocks = [thinking_block(reasoning if req.shows_thinking else "")] if reader.reasoned else []
    blocks += [text_block(content)] if content or not calls else []
    return reply.body(blocks + [call_block(call) for call in calls], finals[0])


def count_tokens(handler: RequestHandler, req: MessagesRequest) -> dict | JSONResponse:
    """The prompt's tokens as /v1/messages would serve it."""
    served = served_chat(handler, req)
    return served if isinstance(served, JSONResponse) else {"input_tokens": len(handler.tokenizer.encode(served[1]))}


def thinking_block(text: str) -> dict:
    return {"type": "thinking", "thinking": text, "signature": ""}  # nothing is signed here


def text_block(text: str) -> dict:
    return {"type": "text", "text": text}


def call_block(call: ToolCall) -> dict:
    """A call as its tool_use block; one whose arguments are no JSON object (a string the model wrote that does not
    parse) can be no tool_use, and is given as the call's text."""
    try:
        arguments = json.loads(call.arguments)
    except json.JSONDecodeError:
        arguments = None
    if not isinstance(arguments, dict):
        return text_block(json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False))
    return {"type": "tool_use", "id": f"toolu_{call.id.removeprefix('call_')}", "name": call.name, "input": arguments}


class MessageReply:
    """One message's body and events: its id, its content blocks, why it stopped and its usage."""

    def __init__(
        self,
        handler: RequestHandler,
        req: MessagesRequest,
        ids: list[int],
        thinking: Thinking | None,
        tools: Tools | None,
    ):
        self.handler, self.ids, self.thinking, self.tools = handler, ids, thinking, tools
        self.stops, self.shows_thinking = req.stop_sequences or [], req.shows_thinking
        self.id = f"msg_{uuid.uuid4().hex}"
        self.adapter, self.model = handler.served_as(req.model)

    def body(self, content: list[dict], final) -> dict:
        return (
            self.head(content)
            | self.stopped(final, any(b["type"] == "tool_use" for b in content))
            | {"usage": self.usage(final)}
        )

    def head(self, content: list[dict]) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
        }

    def stopped(self, final, called: bool) -> dict:
        """stop_reason: the model called a tool, reached max_tokens, wrote a stop sequence or ended its turn."""
        if called and final.finish_reason == "stop":
            return {"stop_reason": "tool_use", "stop_sequence": None}
        if final.finish_reason == "length":
            return {"stop_reason": "max_tokens", "stop_sequence": None}
        if final.stop_reason in self.stops:
            return {"stop_reason": "stop_sequence", "stop_sequence": final.stop_reason}
        return {"stop_reason": "end_turn", "stop_sequence": None}

    def usage(self, final) -> dict:
        """Anthropic counts the prompt's tokens read from the cache apart from the rest."""
        spec = (final.spec if final is not None else None) or {}
        cached = spec.get("num_cached_prompt_tokens", 0)
        return {
            "input_tokens": len(self.ids) - cached,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
            "output_tokens": final.num_tokens if final is not None else 0,
            "speculation": spec,
        }

    async def events(self, updates):
        """message_start, each content block opened, its deltas and closed, message_delta (why it stopped, the
        usage), message_stop; an error event where the request fails."""
        blocks = _BlockStream(self)
        start = self.head([]) | {"stop_reason": None, "stop_sequence": None, "usage": self.usage(None)}
        yield event("message_start", message=start)
        try:
            async for update in updates:
                for out in blocks.feed(update):
                    yield out
                if update.finished:
                    usage = self.usage(update)
                    yield event("message_delta", delta=self.stopped(update, blocks.called), usage=usage)
                    yield event("message_stop")
        except SpecDecodeError as exc:
            yield event("error", error=error_body(exc.http_status, str(exc))["error"])
        finally:
            await updates.aclose()  # a client that left mid-stream frees its sequence and KV now


def event(kind: str, **fields) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"


class _BlockStream:
    """The content blocks of a streamed message as its text comes: thinking (where read) opened at its first text,
    text at the content's, each tool call as a block of its own once it closes; at the end a text block (empty)
    where nothing else was said."""

    def __init__(self, reply: MessageReply):
        self.reader = OutputReader(reply.thinking, reply.tools)
        self.shows_thinking = reply.shows_thinking
        self.open, self.index, self.said, self.called = None, -1, False, False

    def feed(self, update) -> list[str]:
        reasoning, content, calls = self.reader.feed(update.text, update.finished)
        events = self._delta("thinking", reasoning if self.shows_thinking else "") if reasoning else []
        if content:
            events += self._delta("text", content)
        for block in map(call_block, calls):
            if block["type"] == "text":
                events += self._delta("text", block["text"])
                continue
            events += self._start(block | {"input": {}})
            events.append(self._event_delta({"type": "input_json_delta", "partial_json": json.dumps(block["input"])}))
            events += self._close()
            self.called = True
        if update.finished:
            events += ([] if self.said or self.called else self._start(text_block(""))) + self._close()
        return events

    def _delta(self, kind: str, text: str) -> list[str]:
        events = [] if self.open == kind else self._start(thinking_block("") if kind == "thinking" else text_block(""))
        self.said = self.said or kind == "text"
        field = "thinking" if kind == "thinking" else "text"
        return events + ([self._event_delta({"type": f"{kind}_delta", field: text})] if text else [])

    def _start(self, block: dict) -> list[str]:
        events = self._close()
        self.index += 1
        self.open = block["type"]
        return events + [event("content_block_start", index=self.index, content_block=block)]

    def _event_delta(self, delta: dict) -> str:
        return event("content_block_delta", index=self.index, delta=delta)

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", index=self.index)]
