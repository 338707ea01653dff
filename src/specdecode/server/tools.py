"""OpenAI tool calling on chat requests. The tools reach the model through its chat template, and its calls come
back out of its text in the formats templates ask for (call_formats.py): Hermes' `<tool_call>{"name": ...,
"arguments": {...}}</tool_call>` blocks (Qwen2.5, Qwen3, Hermes) or the same blocks around Qwen3-Coder's XML
(`<function=NAME><parameter=ARG>value</parameter></function>`) or GLM-4.5's pairs (`NAME <arg_key>ARG</arg_key>
<arg_value>value</arg_value>`); Mistral's `[TOOL_CALLS]` and a list of calls, or
`[TOOL_CALLS]NAME[ARGS]{...}` from its tokenizer version 11 (Mistral Small 3.2, Devstral, Magistral); and a whole
answer that is a call's JSON or a list of them (Llama 3's `{"name": ..., "parameters": {...}}`). tool_choice
"required" or a named function constrains the output by grammar, as vLLM does: to a JSON list of calls, or to the
named function's arguments (docs/decisions.md#tool-calls-read-out-of-the-text)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from ..errors import SpecDecodeError
from ..sampling import StructuredOutput
from . import call_formats as formats


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_dict(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


@dataclass(frozen=True)
class Tools:
    """A request's tools (name -> JSON schema of the arguments) and how it lets the model use them: choice is
    "auto", "required", "none" or "named" (the function `named`, which it must call)."""

    declared: tuple[dict, ...]
    schemas: dict[str, dict]
    choice: str
    named: str | None = None
    parallel: bool = True

    @classmethod
    def from_request(cls, tools: list | None, tool_choice, parallel: bool) -> Tools | None:
        if not tools:
            if tool_choice not in (None, "none"):
                raise SpecDecodeError("tool_choice needs tools; send the functions the model may call")
            return None
        schemas = dict(_function(tool) for tool in tools)
        named = _named(tool_choice, schemas)
        choice = "named" if named else tool_choice if tool_choice is not None else "auto"
        if not parallel and choice == "auto":
            raise SpecDecodeError(
                "parallel_tool_calls false is supported with tool_choice required or a named function; "
                "with auto the model may call several"
            )
        return cls(tuple(tools), schemas, choice, named, parallel)

    @property
    def rendered(self) -> list[dict] | None:
        """The tools the chat template shows the model: none where it may not call them."""
        return None if self.choice == "none" else list(self.declared)

    def constraint(self) -> StructuredOutput | None:
        """The grammar of a forced call: a named function's arguments, or a list of calls (one at most when
        parallel calls are off)."""
        if self.choice in ("auto", "none"):
            return None
        if self.named:
            return StructuredOutput(json=self.schemas[self.named])
        calls = {
            "type": "array",
            "minItems": 1,
            "items": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {"name": {"const": name}, "arguments": schema},
                        "required": ["name", "arguments"],
                        "additionalProperties": False,
                    }
                    for name, schema in self.schemas.items()
                ]
            },
        }
        return StructuredOutput(json=calls | ({} if self.parallel else {"maxItems": 1}))

    def stream(self) -> CallStream:
        return CallStream(self)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole output as (content, calls): what streaming it gives, joined."""
        stream = self.stream()
        content, calls = stream.feed(text)
        rest, more = stream.finish()
        content += rest
        return (content or None) if calls + more else content, calls + more

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """OpenAI's: "tool_calls" where the model chose to call (a named function forced: "stop")."""
        return "tool_calls" if called and reason == "stop" and not self.named else reason


class CallStream:
    """One output's text as it comes, split into content and calls, the same split however the text arrives.

    In auto mode a call is a block naming a declared function: a <tool_call> block, which ends at its closing tag,
    or what follows [TOOL_CALLS] (Mistral's), which ends with its JSON. Text that might begin a block is held until it
    does or cannot, and a call leaves when its block ends (a block that is no such call goes out as content). An
    output that is nothing but a call's JSON (bare, or fenced as ```json, as small models answer despite their
    templates) is a call too: an output that begins like one is held to its end. Whitespace at the end of the
    content so far waits for text to follow it, and is dropped at the end where the model called. Where a call was
    forced, the JSON is read at the end."""

    def __init__(self, tools: Tools):
        self.tools, self.pending, self.inside, self.blank = tools, "", "", ""  # inside: the open block's marker
        self.head, self.bare = "", None  # the output's start, and whether it may be a bare call (None: unknown)
        self.calls_made = 0

    @property
    def called(self) -> bool:
        return self.calls_made > 0

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        if self.tools.choice == "none":
            return text, []
        if self.tools.choice != "auto":
            self.pending += text
            return "", []
        if self.bare is not False:
            self.head += text
            self.bare = formats.may_be_bare(self.head)
            if self.bare is not False:
                return "", []
            text, self.head = self.head, ""
        return self._blocks(text)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left at the end: an unended block as content; a forced or bare call's JSON read."""
        if self.tools.choice == "none":
            return "", []
        if self.tools.choice != "auto":
            calls = self._json_calls(self.pending, forced=True)
            self.calls_made += len(calls)
            return ("", calls) if calls else (self.pending, [])
        content, calls = "", []
        if self.head:  # held to the end: a bare call, or text after all
            head, self.head = self.head, ""
            if calls := self._json_calls(formats.unfenced(head)):
                self.calls_made += len(calls)
                return "", calls
            content, calls = self._blocks(head)
        rest = self.blank + self.inside + self.pending
        self.blank = self.pending = ""
        return content + ("" if self.called and not rest.strip() else rest), calls

    def _blocks(self, text: str) -> tuple[str, list[ToolCall]]:
        """Content and the blocks that end in text (after what came before)."""
        self.pending += text
        content, calls = [], []
        while True:
            if self.inside:
                ended = self._block_end()
                if ended is None:
                    break
                end, made = ended
                content.append("" if made else self.inside + self.pending[:end])
                calls += made
                self.pending, self.inside = self.pending[end:], ""
                continue
            start, opener = formats.first_opener(self.pending)
            cut = start if opener else len(self.pending) - formats.partial_tag(self.pending)
            content.append(self.pending[:cut])
            if not opener:
                self.pending = self.pending[cut:]
                break
            self.pending, self.inside = self.pending[start + len(opener) :], opener
        self.calls_made += len(calls)
        return self._hold_blank("".join(content)), calls

    def _block_end(self) -> tuple[int, list[ToolCall]] | None:
        """Where the open block ends in the pending text and its calls (none: the block is content); None while it
        has not ended."""
        if self.inside != formats.OPEN:
            return self._mistral_end()
        end = self.pending.find(formats.CLOSE)
        if end < 0:
            return None
        call = self._call(self.pending[:end])
        return end + len(formats.CLOSE), [call] if call else []

    def _mistral_end(self) -> tuple[int, list[ToolCall]] | None:
        """What follows [TOOL_CALLS]: a JSON list of calls (Mistral's tokenizers before version 11), or one call as
        name[ARGS]{arguments} (from version 11; [CALL_ID]id may come before [ARGS]), ending where its JSON does.
        Text that can be neither leaves the marker alone as content."""
        body = self.pending.lstrip()
        if body.startswith("["):
            listed = body[1:].lstrip()
            if listed.startswith("{"):
                return self._ended_json(len(self.pending) - len(body), lambda value: value)
            return None if not listed else (0, [])
        head = formats.mistral_call(self.pending)
        if head is True:
            return None
        if head is False or self.pending[head[1]] != "{":
            return 0, []
        return self._ended_json(head[1], lambda arguments: [{"name": head[0], "arguments": arguments}])

    def _ended_json(self, start: int, as_calls) -> tuple[int, list[ToolCall]] | None:
        """Where the JSON value at start ends and the calls as_calls makes of it (none unless each is a declared
        function's); None while it has not ended."""
        found = formats.json_value(self.pending, start)
        if found is None:
            return None
        listed = as_calls(found[0])
        calls = [self._as_call(value) for value in listed] if isinstance(listed, list) else []
        return found[1], calls if calls and all(calls) else []

    def _hold_blank(self, content: str) -> str:
        text = self.blank + content
        body = text.rstrip()
        self.blank = text[len(body) :]
        return body

    def _call(self, block: str) -> ToolCall | None:
        try:
            return self._as_call(json.loads(block))
        except json.JSONDecodeError:
            return self._xml_call(block) or self._glm_call(block)

    def _xml_call(self, block: str) -> ToolCall | None:
        """Qwen3-Coder's call: <function=NAME> and its <parameter=ARG> elements."""
        function = formats.XML_FUNCTION.fullmatch(block)
        name = function[1].strip() if function else None
        if name not in self.tools.schemas:
            return None
        arguments = formats.xml_arguments(function[2], self.tools.schemas[name].get("properties") or {})
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False))

    def _glm_call(self, block: str) -> ToolCall | None:
        """GLM-4.5's call: the function's name, then its <arg_key>/<arg_value> pairs."""
        function = formats.GLM_CALL.fullmatch(block)
        name = function[1] if function else None
        if name not in self.tools.schemas:
            return None
        arguments = formats.glm_arguments(function[2], self.tools.schemas[name].get("properties") or {})
        return None if arguments is None else ToolCall(name, json.dumps(arguments, ensure_ascii=False))

    def _as_call(self, value) -> ToolCall | None:
        """A call of a declared function, or None."""
        name = value.get("name") if isinstance(value, dict) else None
        if not isinstance(name, str) or name not in self.tools.schemas:
            return None
        arguments = value.get("arguments", value.get("parameters", {}))  # Llama 3's name for them
        if isinstance(arguments, str):
            return ToolCall(name, arguments)
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False)) if isinstance(arguments, dict) else None

    def _json_calls(self, text: str, forced: bool = False) -> list[ToolCall]:
        """The calls a whole output's JSON holds: the named function's arguments, or a call or a list of them."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return []  # cut short (max_tokens), or not JSON
        if forced and self.tools.named:
            return [ToolCall(self.tools.named, text.strip())]
        calls = [self._as_call(v) for v in (value if isinstance(value, list) else [value])]
        return calls if calls and all(calls) else []


def _function(tool) -> tuple[str, dict]:
    function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise SpecDecodeError('tools: each tool is {"type": "function", "function": {"name": ..., "parameters": ...}}')
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise SpecDecodeError(f"tools: {function['name']}'s parameters must be a JSON schema object")
    return function["name"], parameters


def _named(tool_choice, schemas: dict[str, dict]) -> str | None:
    """The function tool_choice names, or None for "auto", "required" and "none"."""
    if tool_choice in (None, "auto", "required", "none"):
        return None
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if name is None:
        raise SpecDecodeError(
            'tool_choice is "auto", "required", "none" or {"type": "function", "function": {"name": ...}}'
        )
    if name not in schemas:
        raise SpecDecodeError(f"tool_choice names {name!r}, which is not among the tools ({', '.join(schemas)})")
    return name


def assistant_message(content: str, calls: list[dict], reasoning: str = "") -> dict:
    """An assistant's chat message as another API's reply or input gives it: its text (None where it only calls), its
    calls (chat's {"id", "type": "function", "function": {...}}) and its thinking (Qwen3's and DeepSeek-R1's
    templates read reasoning_content)."""
    message = {"role": "assistant", "content": content if content or not calls else None}
    return message | ({"tool_calls": calls} if calls else {}) | ({"reasoning_content": reasoning} if reasoning else {})


def template_messages(messages) -> list[dict]:
    """The conversation as chat templates read it: assistant calls with their arguments as objects."""
    return [_template_message(i, m) for i, m in enumerate(messages)]


def _template_message(i: int, message) -> dict:
    out = {"role": message.role, "content": message.text()}
    if message.tool_calls:
        out["tool_calls"] = [_template_call(i, call) for call in message.tool_calls]
    for key in ("tool_call_id", "name"):
        if getattr(message, key) is not None:
            out[key] = getattr(message, key)
    thinking = message.reasoning_content if message.reasoning_content is not None else message.reasoning
    if thinking is not None:  # the names Qwen3's and DeepSeek-R1's templates read, and gpt-oss's
        out["reasoning_content"] = out["thinking"] = thinking
    return out


def _template_call(i: int, call) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise SpecDecodeError(f'messages[{i}].tool_calls: each is {{"function": {{"name": ..., "arguments": ...}}}}')
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except json.JSONDecodeError:
            arguments = None
    if not isinstance(arguments, dict):
        raise SpecDecodeError(f"messages[{i}].tool_calls: {function['name']}'s arguments are not a JSON object")
    return {**call, "function": {"name": function["name"], "arguments": arguments}}
