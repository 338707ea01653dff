"""One request's response, built from the engine's updates: a whole JSON body, or server-sent events as they come;
each output's reasoning, content and tool calls read out of its text."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from ..errors import SpecDecodeError
from ..sampling import SamplingParams
from ..sampling.grammar import GrammarTokenizers
from .async_engine import QueueFull, ShuttingDown
from .protocol import CommonRequest
from .reasoning import Thinking, splitter
from .responses import (
    chat_logprobs,
    completion_logprobs,
    error_body,
    error_response,
    token_texts,
    usage,
    vllm_prompt_logprobs,
)
from .tools import ToolCall, Tools

if TYPE_CHECKING:
    from .handler import RequestHandler


class OutputReader:
    """One output's text as it comes, read as a message reads it: the thinking apart where the server reads reasoning
    (thinking: its tags, and whether the prompt left the reply inside it; None: no reasoning read), then the tool
    calls out of the rest where the request has tools. A whole text is one piece, fed finished."""

    def __init__(self, thinking: Thinking | None, tools: Tools | None):
        self.split = splitter(thinking) if thinking is not None else None
        self.calls = tools.stream() if tools is not None else None

    def feed(self, text: str, finished: bool) -> tuple[str, str, list[ToolCall]]:
        """The reasoning, content and calls this piece settles; with the last piece, all that was held back."""
        reasoning = ""
        if self.split is not None:
            reasoning, text = self.split.feed(text)
            if finished:
                rest = self.split.finish()
                reasoning, text = reasoning + rest[0], text + rest[1]
        calls = []
        if self.calls is not None:
            text, calls = self.calls.feed(text)
            if finished:
                rest, more = self.calls.finish()
                text, calls = text + rest, calls + more
        return reasoning, text, calls

    @property
    def reasoned(self) -> bool:
        """Whether the output has reasoning at all (a message without it has no reasoning field)."""
        return self.split is not None and self.split.reasoned


@dataclass
class Said:
    """What an output (or a streamed piece of it) says, as a message reads it: content (None: tool calls alone), tool
    calls, the finish reason (None until it finishes) and the reasoning (None: none, or not returned)."""

    content: str | None
    tool_calls: list[dict] | None = None
    finish_reason: str | None = None
    reasoning: str | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended it


@dataclass
class Shown:
    """What a response shows besides the text: vLLM's `prompt_logprobs` (each choice's for completions, the reply's
    for a chat); with `return_token_ids`, the prompt's token ids (where prompt logprobs go) and each output's (in a
    stream, each chunk's, the prompt's in the first); with `return_tokens_as_token_ids`, logprob entries named
    "token_id:ID"; a chat reply's reasoning, unless `include_reasoning` is false; a stream's usage in a chunk of its own
    (`stream_options.include_usage`), and the counts so far in every other chunk (`continuous_usage_stats`)."""

    prompt_logprobs: bool = False
    token_ids: bool = False
    tokens_as_ids: bool = False
    reasoning: bool = True
    usage_chunk: bool = False
    usage_each: bool = False

    @classmethod
    def asked_by(cls, req: CommonRequest) -> Shown:
        streamed = req.streamed_usage()
        return cls(
            prompt_logprobs=req.prompt_logprobs is not None,
            token_ids=req.return_token_ids,
            tokens_as_ids=req.return_tokens_as_token_ids,
            reasoning=getattr(req, "include_reasoning", True),
            usage_chunk=streamed.include_usage,
            usage_each=streamed.continuous_usage_stats,
        )


class Reply:
    """One request's response. echo: (text, ids) to put before each output (completions' `echo`: the prompt; a
    chat's: the assistant's last message, ids None); best: (n, whether logprobs are returned) when more outputs than
    n were generated (`best_of`); tools: a chat's tools, whose calls are read out of each output; shown: what else
    the request asks to see; thinking: None where a chat reply is all content, else whether its prompt left it inside
    its thinking (see reasoning.py)."""

    def __init__(
        self,
        handler: RequestHandler,
        ids: list[int],
        params: SamplingParams,
        chat: bool,
        echo: tuple | None = None,
        best: tuple[int, bool] | None = None,
        tools: Tools | None = None,
        shown: Shown | None = None,
        thinking: Thinking | None = None,
        model: str | None = None,
    ):
        self.handler, self.ids, self.params, self.chat, self.echo, self.best = handler, ids, params, chat, echo, best
        self.tools, self.shown, self.thinking = tools, shown or Shown(), thinking
        self.adapter, self.model = handler.served_as(model)
        self.token_text = token_texts(handler.tokenizer, self.shown.tokens_as_ids)
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.kind = "chat.completion" if chat else "text_completion"

    async def send(self, request: Request, stream: bool, timeout: float | None, session: str | None, tenant: str = ""):
        engine = self.handler.engine
        updates = await submitted(engine, self.ids, self.params, stream, timeout, session, tenant, self.adapter)
        if isinstance(updates, Response):
            return updates
        if stream:
            return StreamingResponse(self.events(updates), media_type="text/event-stream")
        return await self.whole(request, updates)

    async def whole(self, request: Request, updates):
        """The JSON body, once every output is done; a client that leaves first aborts the request."""
        collected = await collected_unless_gone(request, updates, self.params.n)
        if isinstance(collected, Response):
            return collected
        texts, finals, logprobs, prompt, outputs = collected
        best = self.best
        order = range(self.params.n) if best is None else best_outputs(logprobs, best[0])
        show_logprobs = self.params.logprobs is not None and (best is None or best[1])
        echoed = prompt if self.echo is not None and not self.chat else []  # an echoed prompt's logprobs lead
        listed = vllm_prompt_logprobs(self.handler.tokenizer, self.ids, prompt) if self.shown.prompt_logprobs else None
        choices = [
            self.choice(
                rank,
                self._called(texts[i], finals[i]),
                echoed + logprobs[i] if show_logprobs else None,
                delta=False,
                echo=self.echo,
            )
            | ({"prompt_logprobs": listed} if listed is not None and not self.chat else {})
            | self._token_ids(outputs[i], prompt_too=not self.chat)
            for rank, i in enumerate(order)
        ]
        body = {
            "id": self.id,
            "object": self.kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage(len(self.ids), finals),
        }
        body |= self._token_ids(None, prompt_too=self.chat)
        return body | ({"prompt_logprobs": listed} if listed is not None and self.chat else {})

    def _token_ids(self, output: list[int] | None, prompt_too: bool) -> dict:
        """With return_token_ids: the output's token ids (output None: none), and the prompt's where asked."""
        if not self.shown.token_ids:
            return {}
        return ({} if output is None else {"token_ids": output}) | (
            {"prompt_token_ids": self.ids} if prompt_too else {}
        )

    async def events(self, updates):
        """Server-sent events: the chunks, then [DONE]."""
        async for chunk in self.chunks(updates):
            yield sse(chunk)
        yield "data: [DONE]\n\n"

    async def chunks(self, updates):
        """The stream's chunks, one per update; the usage in a chunk of its own at the end with OpenAI's
        stream_options.include_usage (every other chunk's null, or the counts so far with vLLM's
        continuous_usage_stats), else with the last chunk; an error's body where the request fails."""
        n, kind = self.params.n, self.kind + ".chunk" if self.chat else self.kind
        started, offsets, finals, counts = [False] * n, [0] * n, {}, [0] * n
        readers = [OutputReader(self.thinking, self.tools) for _ in range(n)]
        try:
            async for update in updates:
                i = update.index
                echoed = self.echo if self.echo is not None and not started[i] else None
                body = self.choice(
                    i,
                    self._streamed(update, readers[i]),
                    self._logprobs(update),
                    delta=True,
                    text_offset=offsets[i],
                    echo=echoed,
                )
                if self.chat and started[i]:
                    del body["delta"]["role"]  # the role goes in each output's first chunk only
                body |= self._token_ids(update.token_ids, prompt_too=not self.chat and not started[i])
                first_chunk = not any(started)
                started[i] = True
                offsets[i] += len(update.text) + (len(echoed[0]) if echoed else 0)
                counts[i] = update.num_tokens
                if update.finished:
                    finals[i] = update
                head = {"id": self.id, "object": kind, "created": self.created, "model": self.model}
                chunk = head | {"choices": [body]} | self._token_ids(None, prompt_too=self.chat and first_chunk)
                if self.shown.usage_chunk:
                    chunk["usage"] = self._counted(counts) if self.shown.usage_each else None
                elif len(finals) == n:
                    chunk["usage"] = usage(len(self.ids), finals)
                yield chunk
                if self.shown.usage_chunk and len(finals) == n:
                    yield head | {"choices": [], "usage": usage(len(self.ids), finals)}
        except SpecDecodeError as exc:
            yield error_body(exc.http_status, str(exc))
        finally:
            await updates.aclose()  # a client that left mid-stream frees its sequences and KV now

    def _counted(self, counts: list[int]) -> dict:
        """The tokens so far (vLLM's continuous_usage_stats)."""
        return {
            "prompt_tokens": len(self.ids),
            "completion_tokens": sum(counts),
            "total_tokens": len(self.ids) + sum(counts),
        }

    def _called(self, text: str, final) -> Said:
        """A whole output's reasoning, content, tool calls (read out of the content) and why it ended (its final
        Update's)."""
        reader = OutputReader(self.thinking, self.tools)
        reasoning, content, calls = reader.feed(text, finished=True)
        reasoning = reasoning if reader.reasoned and self.shown.reasoning else None
        reason = final.finish_reason
        if self.tools is None:
            return Said(content, None, reason, reasoning, final.stop_reason)
        calls = [c.as_dict() for c in calls]
        return Said(
            (content or None) if calls else content,
            calls or None,
            self.tools.finish_reason(reason, bool(calls)),
            reasoning,
            final.stop_reason,
        )

    def _streamed(self, update, reader: OutputReader) -> Said:
        """An update's reasoning, content, the tool calls that closed in it and, at the end, the finish reason."""
        reason = update.finish_reason if update.finished else None
        reasoning, content, calls = reader.feed(update.text, update.finished)
        reasoning = reasoning if reasoning and self.shown.reasoning else None
        if self.tools is None:
            return Said(content, None, reason, reasoning, update.stop_reason)
        if update.finished:
            reason = self.tools.finish_reason(reason, reader.calls.called)
        before = reader.calls.calls_made - len(calls)  # the calls of the earlier pieces
        deltas = [call.as_dict(index=before + k) for k, call in enumerate(calls)]
        return Said((content or None) if deltas else content, deltas or None, reason, reasoning, update.stop_reason)

    def _logprobs(self, update):
        if self.params.logprobs is None:
            return None
        return (update.prompt_logprobs or []) + update.logprobs

    def choice(
        self, index: int, said: Said, logprobs, delta: bool, text_offset: int = 0, echo: tuple | None = None
    ) -> dict:
        """echo: (text, ids) when this piece starts with echoed text: a completion's prompt (its logprobs, if asked
        for, already at the front of logprobs), a chat's last message (ids None)."""
        out = {"index": index, "finish_reason": said.finish_reason, "stop_reason": said.stop_reason, "logprobs": None}
        text = said.content
        if echo is not None:
            text = echo[0] + (text or "")
        if logprobs is not None:
            out["logprobs"] = (
                chat_logprobs(self.token_text, logprobs)
                if self.chat
                else completion_logprobs(self.token_text, logprobs, text_offset, token_ids=echo[1] if echo else None)
            )
        if self.chat:
            message = {"role": "assistant", "content": text}
            if said.reasoning is not None:  # vLLM's name, and the one DeepSeek's API gave it
                message["reasoning"] = message["reasoning_content"] = said.reasoning
            if said.tool_calls:
                message["tool_calls"] = said.tool_calls
            out["delta" if delta else "message"] = message
        else:
            out["text"] = text
        return out


async def merged_stream(replies: list[Reply], n: int, timeout: float | None, session: str | None, tenant: str):
    """Several prompts' replies streamed as one (OpenAI's list of prompts): their chunks as they come, under the first
    reply's id, prompt i's choices at indices from i * n; the usage summed at the end (where each reply's would go:
    the last chunk's, or a chunk of its own with stream_options.include_usage)."""
    streams = []
    for reply in replies:
        engine = reply.handler.engine
        updates = await submitted(engine, reply.ids, reply.params, True, timeout, session, tenant, reply.adapter)
        if isinstance(updates, Response):  # turned away: the ones submitted before it are let go
            for earlier in streams:
                await earlier.aclose()
            return updates
        streams.append(updates)
    return StreamingResponse(_merged(replies, streams, n), media_type="text/event-stream")


async def _merged(replies: list[Reply], streams: list, n: int):
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async for chunk in replies[i].chunks(streams[i]):
                await queue.put((i, chunk))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i)) for i in range(len(replies))]
    usages, held, running = {}, None, len(tasks)
    try:
        while running:
            i, chunk = await queue.get()
            if chunk is None:  # a reply's end
                running -= 1
                continue
            if "error" in chunk:
                yield sse(chunk)
                continue
            if chunk.get("usage"):
                usages[i] = chunk["usage"]
            if not chunk["choices"]:
                continue
            chunk.pop("usage", None)
            if replies[0].shown.usage_chunk:
                chunk["usage"] = None  # as include_usage has every chunk but the last
            chunk["id"] = replies[0].id
            for choice in chunk["choices"]:
                choice["index"] += i * n
            if held is not None:
                yield sse(held)
            held = chunk
        for chunk in last_chunks(held, usages, replies[0]):
            yield sse(chunk)
    finally:
        for task in tasks:
            task.cancel()  # a client that left: each reply's stream closes, its sequences freed
    yield "data: [DONE]\n\n"


def last_chunks(held: dict | None, usages: dict, first: Reply) -> list[dict]:
    """The last chunk with the summed usage on it, or, with include_usage, then a chunk of the usage alone."""
    total = summed_usage([usages[i] for i in sorted(usages)])
    if not first.shown.usage_chunk:
        return [] if held is None else [held | {"usage": total}]
    head = {"id": first.id, "object": first.kind, "created": first.created, "model": first.model}
    return ([] if held is None else [held]) + [head | {"choices": [], "usage": total}]


def sse(chunk: dict) -> str:
    """A chunk as a server-sent event."""
    return f"data: {json.dumps(chunk)}\n\n"


def summed_usage(usages: list[dict]) -> dict:
    """Several requests' usage as one: the counts summed, the speculation figures the first's."""
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    total = dict(usages[0]) if usages else {}
    total |= {key: sum(u.get(key, 0) for u in usages) for key in counts}
    if "prompt_tokens_details" in total:
        cached = sum(u.get("prompt_tokens_details", {}).get("cached_tokens", 0) for u in usages)
        total["prompt_tokens_details"] = {"cached_tokens": cached}
    return total


def best_outputs(logprobs: list[list], n: int) -> list[int]:
    """The n outputs with the highest total logprob of their generated tokens, best first."""
    totals = [sum(lp.logprob for lp in lps) for lps in logprobs]
    return sorted(range(len(totals)), key=lambda i: -totals[i])[:n]


async def submitted(
    engine,
    ids: list[int],
    params: SamplingParams,
    stream: bool,
    timeout: float | None,
    session: str | None,
    tenant: str,
    adapter: str = "",
):
    """The request's updates from the engine, or the response that turns it away (429 or 503, with Retry-After)."""
    if params.structured_output is not None:  # built once, in seconds: not on the engine's thread
        await asyncio.to_thread(GrammarTokenizers.get, engine.tokenizer, engine.vocab_size)
    try:
        handle = engine.submit(ids, params, session=session, streamed=stream, tenant=tenant, adapter=adapter)
    except (QueueFull, ShuttingDown) as exc:
        response = error_response(exc.http_status, str(exc))
        response.headers["Retry-After"] = "1"
        return response
    return engine.updates(handle, timeout)


async def collected_unless_gone(request: Request, updates, n: int):
    """collect()'s result once every output is done, or the response to send instead: 499 where the client left
    first (the request is aborted, its slots and KV freed), the error that ended the request."""
    collecting = asyncio.ensure_future(collect(updates, n))
    gone = asyncio.ensure_future(client_gone(request))
    await asyncio.wait({collecting, gone}, return_when=asyncio.FIRST_COMPLETED)
    gone.cancel()
    if not collecting.done():  # cancelling the collection aborts the request
        collecting.cancel()
        return Response(status_code=499)
    try:
        return collecting.result()
    except SpecDecodeError as exc:
        return error_response(exc.http_status, str(exc))


async def collect(updates, n: int):
    """Each output's whole text, final Update and logprobs, the prompt's logprobs (empty where not asked), and each
    output's token ids."""
    texts, finals, logprobs, prompt = [[] for _ in range(n)], {}, [[] for _ in range(n)], []
    token_ids = [[] for _ in range(n)]
    async for update in updates:
        texts[update.index].append(update.text)
        logprobs[update.index].extend(update.logprobs)
        token_ids[update.index].extend(update.token_ids)
        prompt = update.prompt_logprobs or prompt
        if update.finished:
            finals[update.index] = update
    return ["".join(t) for t in texts], finals, logprobs, prompt, token_ids


async def client_gone(request: Request) -> None:
    """Returns when the client closes the connection (its body has been read, so the next message can only
    be the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
