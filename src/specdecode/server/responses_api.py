"""OpenAI's Responses API (`POST /v1/responses`), as vLLM serves it: a conversation in (a string, or message items,
`instructions` as the system message, earlier function calls and their outputs, after the stored conversation that
`previous_response_id` names) rendered by the chat template as /v1/chat/completions renders it; out, an assistant
message and the function calls read from it, after a reasoning item where the server reads reasoning
(`--reasoning-parser`); whole, or streamed as the API's typed events. Responses are kept in memory unless
store=false (server/response_store.py), read back by `GET /v1/responses/{id}`; conversations objects are not kept."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict

from ..errors import SpecDecodeError
from ..sampling import SamplingParams
from .handler import RequestHandler, key_owner, session_of, tenant_of
from .protocol import ChatRequest, given, validated
from .reasoning import Thinking
from .reply import OutputReader, collected_unless_gone, submitted
from .response_store import ResponseStore
from .responses import chat_logprobs, error_response, token_texts, usage
from .tools import ToolCall, Tools, assistant_message

# The API's fields that would change what is generated or answered, with the value that means "off"
UNSUPPORTED_UNLESS_OFF = {
    "conversation": None,
    "background": False,
    "prompt": None,
    "truncation": "disabled",
    "max_tool_calls": None,
    "n": 1,
}
OUTPUT_LOGPROBS = "message.output_text.logprobs"  # the one `include` taken here


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # vLLM's sampling extras (top_k, seed, ...) go on to the chat request
    model: str | None = None
    input: str | list[dict]
    instructions: str | None = None  # the system message
    max_output_tokens: int | None = None
    temperature: float | None = None  # None: the model's default (its generation config), else 1
    top_p: float | None = None
    stream: bool = False
    user: str | None = None
    metadata: dict | None = None  # returned as sent
    store: bool = True  # kept in this server's memory, for previous_response_id and GET /v1/responses/{id}
    previous_response_id: str | None = None  # the conversation goes on from that stored response's
    text: dict | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    reasoning: dict | None = None  # {"effort": ...}: given to the chat template as reasoning_effort
    tools: list[dict] | None = None  # function tools ({"type": "function", "name", "parameters", ...})
    tool_choice: str | dict | None = None  # "auto", "none", "required" or {"type": "function", "name": ...}
    parallel_tool_calls: bool = True
    include: list[str] | None = None  # [OUTPUT_LOGPROBS]: the message's text with its tokens' logprobs
    top_logprobs: int | None = None  # with them, this many likeliest tokens at each position

    def chat_request(self, earlier: list[dict] = ()) -> ChatRequest:
        """The chat request this asks for, going on from the earlier conversation (chat messages, no system's)."""
        for name, off in UNSUPPORTED_UNLESS_OFF.items():
            if (self.model_extra or {}).get(name, off) not in (off, None, [], {}):
                raise SpecDecodeError(f"{name} is not supported by this server's /v1/responses; leave it out")
        system = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        # the API's own stream_options (include_obfuscation) shape no text: the events carry the usage
        extras = {
            k: v
            for k, v in (self.model_extra or {}).items()
            if k not in UNSUPPORTED_UNLESS_OFF and k != "stream_options"
        }
        own = dict(
            model=self.model,
            messages=system + list(earlier) + input_messages(self.input),
            max_tokens=self.max_output_tokens,
            **given(temperature=self.temperature, top_p=self.top_p),
            stream=self.stream,
            user=self.user,
            response_format=chat_format((self.text or {}).get("format")),
            reasoning_effort=(self.reasoning or {}).get("effort"),
            tools=[chat_tool(tool) for tool in self.tools] if self.tools else None,
            tool_choice=chat_tool_choice(self.tool_choice),
            parallel_tool_calls=self.parallel_tool_calls,
            logprobs=self.output_logprobs(),
            top_logprobs=self.top_logprobs if self.output_logprobs() else None,
        )
        if clash := sorted(set(extras) & (set(own) | {"max_completion_tokens", "response_format"})):
            raise SpecDecodeError(f"{', '.join(clash)}: the chat endpoint's name; send the Responses API's field")
        return validated(ChatRequest, **extras, **own)

    def output_logprobs(self) -> bool:
        """Whether the message's text comes with its tokens' logprobs (`include`, the only one taken here)."""
        if other := sorted(set(self.include or []) - {OUTPUT_LOGPROBS}):
            raise SpecDecodeError(f"include: {', '.join(other)} is not supported here (only {OUTPUT_LOGPROBS!r})")
        asked = OUTPUT_LOGPROBS in (self.include or [])
        if self.top_logprobs and not asked:
            raise SpecDecodeError(f"top_logprobs needs include: [{OUTPUT_LOGPROBS!r}]")
        return asked


def chat_tool(tool: dict) -> dict:
    """A Responses function tool as chat's ({"type": "function", "function": {...}})."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise SpecDecodeError("tools: only function tools are taken here ({'type': 'function', 'name': ...})")
    return {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters") if k in tool}}


def chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def input_messages(items: str | list[dict]) -> list[dict]:
    """The Responses API's input as chat messages: a string is the user's message; items are messages, function
    calls (one assistant message of calls where they follow each other) and their outputs (tool messages)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item))
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function", "function": _called(item)}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append(assistant_message("", [call]))
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": item.get("output")})
        else:
            raise SpecDecodeError(
                f"input items of type {kind!r} are not supported (messages, function calls and their outputs)"
            )
    return messages


def _message(item: dict) -> dict:
    """A message item: its content a string or text parts; a developer's message is a system message to templates."""
    content = item.get("content")
    if isinstance(content, list):
        if not all(isinstance(part, dict) and part.get("type") in ("input_text", "output_text") for part in content):
            raise SpecDecodeError("input content parts must be input_text or output_text parts (text only here)")
        content = "\n".join(str(part.get("text") or "") for part in content)  # as chat's content parts
    role = item.get("role")
    return {"role": "system" if role == "developer" else role, "content": content}


def _called(item: dict) -> dict:
    return {"name": item.get("name"), "arguments": item.get("arguments", "{}")}


def chat_format(format_: dict | None) -> dict | None:
    """text.format as chat's response_format (json_schema's schema one level down there)."""
    if format_ is not None and not isinstance(format_, dict):
        raise SpecDecodeError('text.format must be an object: {"type": "text" | "json_object" | "json_schema", ...}')
    if format_ is None or format_.get("type") != "json_schema":
        return format_
    return {"type": "json_schema", "json_schema": {"name": format_.get("name"), "schema": format_.get("schema")}}


async def create_response(handler: RequestHandler, req: ResponsesRequest, request: Request):
    if wrong := handler.other_model(req):
        return wrong
    owner = key_owner(request)
    try:
        earlier = (
            handler.responses.get(owner, req.previous_response_id).conversation if req.previous_response_id else []
        )
        chat = req.chat_request(earlier)
        prompt = handler.chat_prompt(chat)
        ids, params = handler.chat_sampling(chat, prompt)
    except SpecDecodeError as exc:
        return error_response(
            exc.http_status, str(exc), param="previous_response_id" if exc.http_status == 404 else None
        )
    thinking = handler.thinking(prompt)
    kept = Kept(handler.responses, owner, earlier + input_messages(req.input)) if req.store else None
    reply = ResponseReply(handler, req, ids, params, thinking, chat.tool_use, kept)
    limit, session, tenant = handler.time_limit(chat.timeout), session_of(chat, request), tenant_of(chat, request)
    updates = await submitted(handler.engine, ids, params, req.stream, limit, session, tenant, reply.adapter)
    if isinstance(updates, Response):
        return updates
    if req.stream:
        return StreamingResponse(reply.events(updates), media_type="text/event-stream")
    collected = await collected_unless_gone(request, updates, 1)
    if isinstance(collected, Response):
        return collected
    texts, finals, logprobs, *_ = collected
    reader = OutputReader(thinking, reply.tools)
    reasoning, content, calls = reader.feed(texts[0], finished=True)
    output = [reply.reasoning_item(reasoning)] if reader.reasoned else []
    output += [reply.message_item(content, logprobs=reply.entries(logprobs[0]))] if content or not calls else []
    return reply.body(output + [reply.call_item(call) for call in calls], finals)


@dataclass
class Kept:
    """Where a finished response is stored, and the conversation it ends (without its reply)."""

    store: ResponseStore
    owner: str
    conversation: list[dict]

    def put(self, body: dict) -> None:
        self.store.put(self.owner, body, self.conversation + [reply_message(body["output"])])


def reply_message(output: list[dict]) -> dict:
    """A response's output items as the assistant's chat message that a later response's conversation holds."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    reasoning = "".join(part["text"] for item in output if item["type"] == "reasoning" for part in item["content"])
    calls = [
        {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
        for item in output
        if item["type"] == "function_call"
    ]
    return assistant_message(text, calls, reasoning)


def stored_response(handler: RequestHandler, response_id: str, request: Request, delete: bool = False):
    """GET /v1/responses/{id} (the stored body), DELETE (it is forgotten)."""
    try:
        if delete:
            handler.responses.delete(key_owner(request), response_id)
            return {"id": response_id, "object": "response.deleted", "deleted": True}
        return handler.responses.get(key_owner(request), response_id).body
    except SpecDecodeError as exc:
        return error_response(exc.http_status, str(exc))


ITEM_PREFIXES = {"reasoning": "rs", "message": "msg"}  # as OpenAI's item ids begin


def new_item_id(kind: str) -> str:
    return f"{ITEM_PREFIXES[kind]}_{uuid.uuid4().hex}"


class ResponseReply:
    """One response's body and events: its items (a reasoning item, the message, the function calls), their ids."""

    def __init__(
        self,
        handler: RequestHandler,
        req: ResponsesRequest,
        ids: list[int],
        params: SamplingParams,
        thinking: Thinking | None,
        tools: Tools | None,
        kept: Kept | None = None,
    ):
        self.handler, self.req, self.ids, self.thinking, self.tools = handler, req, ids, thinking, tools
        self.params = params  # as served: the body gives its temperature and top_p
        self.kept = kept  # None: store=false
        self.id = f"resp_{uuid.uuid4().hex}"
        self.adapter, self.model = handler.served_as(req.model)
        self.item_ids = {kind: new_item_id(kind) for kind in ITEM_PREFIXES}
        # the output's tokens' logprobs go with the message's text, as vLLM gives them (reasoning's and calls' too)
        self.token_text = token_texts(handler.tokenizer, as_ids=False) if req.output_logprobs() else None
        self.created = int(time.time())
        self.sequence = 0

    def body(self, output: list[dict], finals: dict | None = None) -> dict:
        """The Response object (finals None: still in progress); a finished one is stored unless store=false."""
        final = (finals or {}).get(0)
        incomplete = final is not None and final.finish_reason == "length"
        status = "in_progress" if final is None else "incomplete" if incomplete else "completed"
        req = self.req
        body = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "error": None,
            "model": self.model,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "temperature": self.params.temperature,
            "top_p": self.params.top_p,
            "metadata": req.metadata or {},
            "text": req.text or {"format": {"type": "text"}},
            "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [],
            "parallel_tool_calls": req.parallel_tool_calls,
            "store": req.store,
            "previous_response_id": req.previous_response_id,
            "output": output,
            "usage": None if final is None else self.usage(finals, output),
        }
        if final is not None and self.kept is not None:
            self.kept.put(body)
        return body

    def usage(self, finals: dict, output: list[dict]) -> dict:
        counted = usage(len(self.ids), finals)
        reasoning = "".join(part["text"] for item in output if item["type"] == "reasoning" for part in item["content"])
        return {
            "input_tokens": counted["prompt_tokens"],
            "input_tokens_details": counted["prompt_tokens_details"],
            "output_tokens": counted["completion_tokens"],
            # the reasoning's tokens as its text tokenizes again (the engine does not count them apart)
            "output_tokens_details": {"reasoning_tokens": len(self.handler.tokenizer.encode_fragment(reasoning))},
            "total_tokens": counted["total_tokens"],
            "speculation": counted["speculation"],
        }

    def reasoning_item(self, text: str, status: str = "completed") -> dict:
        content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
        return {
            "id": self.item_ids["reasoning"],
            "type": "reasoning",
            "summary": [],
            "content": content,
            "status": status,
        }

    def message_item(self, text: str, status: str = "completed", logprobs: list[dict] = ()) -> dict:
        content = [self.part("message", text, logprobs)] if status == "completed" else []
        return {
            "id": self.item_ids["message"],
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": content,
        }

    @staticmethod
    def call_item(call: ToolCall) -> dict:
        return {
            "id": f"fc_{call.id.removeprefix('call_')}",
            "type": "function_call",
            "call_id": call.id,
            "name": call.name,
            "arguments": call.arguments,
            "status": "completed",
        }

    @staticmethod
    def part(kind: str, text: str, logprobs: list[dict] = ()) -> dict:
        if kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": list(logprobs)}

    def entries(self, logprobs: list) -> list[dict]:
        """Tokens' logprobs as the API lists them (token, logprob, bytes, top_logprobs), where asked for."""
        return chat_logprobs(self.token_text, logprobs)["content"] if self.token_text else []

    def event(self, kind: str, **fields) -> str:
        self.sequence += 1
        data = {"type": kind, "sequence_number": self.sequence - 1, **fields}
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    async def events(self, updates):
        """The API's events: the response created, each item opened, its text in deltas and closed, the response
        completed (or incomplete, at max_output_tokens); an error event where the request fails."""
        stream = _ItemStream(self)
        yield self.event("response.created", response=self.body([]))
        yield self.event("response.in_progress", response=self.body([]))
        try:
            async for update in updates:
                for event in stream.feed(update):
                    yield event
                if update.finished:
                    yield self.event(
                        "response.incomplete" if update.finish_reason == "length" else "response.completed",
                        response=self.body(stream.done, {0: update}),
                    )
        except SpecDecodeError as exc:
            yield self.event("error", code=str(exc.http_status), message=str(exc), param=None)
        finally:
            await updates.aclose()  # a client that left mid-stream frees its sequence and KV now


class _ItemStream:
    """The items of a streamed response as its text comes: reasoning (where read) opened at its first text and closed
    at the content's, the message opened at its first text, each function call as it closes; at the end a message
    (empty) where nothing else was said."""

    def __init__(self, reply: ResponseReply):
        self.reply, self.open, self.done = reply, None, []
        self.texts = {"reasoning": "", "message": ""}
        self.reader = OutputReader(reply.thinking, reply.tools)
        self.pending, self.logprobs = [], []  # tokens' since the last text delta; the open message's entries

    def feed(self, update) -> list[str]:
        self.pending += update.logprobs
        reasoning, content, calls = self.reader.feed(update.text, update.finished)
        events = self._text("reasoning", reasoning) if reasoning else []
        if content:
            events += self._text("message", content)
        for call in calls:
            events += self._call(call)
        if update.finished:
            said = self.texts["message"] or any(item["type"] == "function_call" for item in self.done)
            events += ([] if said else self._text("message", "")) + self._close()
        return events

    def _call(self, call: ToolCall) -> list[str]:
        item, events = self.reply.call_item(call), self._close()
        where = {"item_id": item["id"], "output_index": len(self.done)}
        events += [
            self.reply.event(
                "response.output_item.added",
                output_index=where["output_index"],
                item=item | {"arguments": "", "status": "in_progress"},
            ),
            self.reply.event("response.function_call_arguments.delta", **where, delta=call.arguments),
            self.reply.event(
                "response.function_call_arguments.done", **where, name=call.name, arguments=call.arguments
            ),
            self.reply.event("response.output_item.done", output_index=where["output_index"], item=item),
        ]
        self.done.append(item)
        return events

    def _text(self, kind: str, delta: str) -> list[str]:
        events = [] if self.open == kind else self._close() + self._open(kind)
        if delta:
            self.texts[kind] += delta
            fields = {"logprobs": self._taken()} if kind == "message" else {}
            name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
            events.append(self.reply.event(name, **self._where(kind), delta=delta, **fields))
        return events

    def _where(self, kind: str) -> dict:
        return {"item_id": self.reply.item_ids[kind], "output_index": len(self.done), "content_index": 0}

    def _taken(self) -> list[dict]:
        """The pending tokens' logprob entries, now the open message's."""
        entries, self.pending = self.reply.entries(self.pending), []
        self.logprobs += entries
        return entries

    def _item(self, kind: str, status: str) -> dict:
        if kind == "reasoning":
            return self.reply.reasoning_item(self.texts[kind], status)
        return self.reply.message_item(self.texts[kind], status, self.logprobs)

    def _open(self, kind: str) -> list[str]:
        """An item of its own each time (a message after a function call is another message)."""
        if self.texts[kind] or any(item["type"] == kind for item in self.done):
            self.reply.item_ids[kind] = new_item_id(kind)
            self.texts[kind] = ""
        self.logprobs = [] if kind == "message" else self.logprobs
        self.open = kind
        where = self._where(kind)
        return [
            self.reply.event(
                "response.output_item.added", output_index=where["output_index"], item=self._item(kind, "in_progress")
            ),
            self.reply.event("response.content_part.added", **where, part=self.reply.part(kind, "")),
        ]

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        kind, text = self.open, self.texts[self.open]
        where = self._where(kind)
        done = "response.output_text.done" if kind == "message" else "response.reasoning_text.done"
        if kind == "message":
            self._taken()  # the tokens since its last delta are its too
        logprobs = {"logprobs": self.logprobs} if kind == "message" else {}
        events = [
            self.reply.event(done, **where, text=text, **logprobs),
            self.reply.event("response.content_part.done", **where, part=self.reply.part(kind, text, self.logprobs)),
            self.reply.event(
                "response.output_item.done", output_index=where["output_index"], item=self._item(kind, "completed")
            ),
        ]
        self.done.append(self._item(kind, "completed"))
        self.open = None
        return events
