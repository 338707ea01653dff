"""OpenAI tool calling on chat requests. The tools reach the model through its chat template, and its calls come
back out of its text in the formats templates ask for: Hermes' `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>` blocks (Qwen2.5, Qwen3, Hermes) or the same blocks around Qwen3-Coder's XML (`<function=NAME>
<parameter=ARG>value</parameter></function>`), and a whole answer that is a call's JSON or a list of them (Llama 3's
`{"name": ..., "parameters": {...}}`, Mistral's `[TOOL_CALLS] [...]`). tool_choice "required" or a named function
constrains the output by grammar, as vLLM does: to a JSON list of calls, or to the named function's arguments
(docs/decisions.md#tool-calls-read-out-of-the-text)."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from ..errors import SpecDecodeError
from ..sampling import StructuredOutput

OPEN, CLOSE = "<tool_call>", "</tool_call>"


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

    In auto mode a call is a <tool_call> block naming a declared function: text that might begin one is held
    until it does or cannot, and the call leaves when its block closes (a block that is no such call goes out as
    content). An output that is nothing but a call's JSON (bare, or fenced as ```json, as small models answer
    despite their templates) is a call too: an output that begins like one is held to its end. Whitespace at the
    end of the content so far waits for text to follow it, and is dropped at the end where the model called.
    Where a call was forced, the JSON is read at the end."""

    def __init__(self, tools: Tools):
        self.tools, self.pending, self.inside, self.blank = tools, "", False, ""
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
            self.bare = _may_be_bare(self.head)
            if self.bare is not False:
                return "", []
            text, self.head = self.head, ""
        return self._blocks(text)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left at the end: an unclosed block as content; a forced or bare call's JSON read."""
        if self.tools.choice == "none":
            return "", []
        if self.tools.choice != "auto":
            calls = self._json_calls(self.pending, forced=True)
            self.calls_made += len(calls)
            return ("", calls) if calls else (self.pending, [])
        content, calls = "", []
        if self.head:  # held to the end: a bare call, or text after all
            head, self.head = self.head, ""
            if calls := self._json_calls(_unfenced(head)):
                self.calls_made += len(calls)
                return "", calls
            content, calls = self._blocks(head)
        rest = self.blank + (OPEN if self.inside else "") + self.pending
        self.blank = self.pending = ""
        return content + ("" if self.called and not rest.strip() else rest), calls

    def _blocks(self, text: str) -> tuple[str, list[ToolCall]]:
        """Content and the <tool_call> blocks that close in text (after what came before)."""
        self.pending += text
        content, calls = [], []
        while True:
            if self.inside:
                end = self.pending.find(CLOSE)
                if end < 0:
                    break
                block, self.pending, self.inside = self.pending[:end], self.pending[end + len(CLOSE) :], False
                call = self._call(block)
                content.append(OPEN + block + CLOSE if call is None else "")
                calls += [call] if call is not None else []
                continue
            start = self.pending.find(OPEN)
            cut = start if start >= 0 else len(self.pending) - _partial_tag(self.pending)
            content.append(self.pending[:cut])
            if start < 0:
                self.pending = self.pending[cut:]
                break
            self.pending, self.inside = self.pending[start + len(OPEN) :], True
        self.calls_made += len(calls)
        return self._hold_blank("".join(content)), calls

    def _hold_blank(self, content: str) -> str:
        text = self.blank + content
        body = text.rstrip()
        self.blank = text[len(body) :]
        return body

    def _call(self, block: str) -> ToolCall | None:
        try:
            return self._as_call(json.loads(block))
        except json.JSONDecodeError:
            return self._xml_call(block)

    def _xml_call(self, block: str) -> ToolCall | None:
        """Qwen3-Coder's call: <function=NAME> and its <parameter=ARG> elements, each value read as its schema's
        type says (text as written, numbers, booleans, JSON for objects and arrays), as vLLM's qwen3_coder parser
        reads them."""
        function = XML_FUNCTION.fullmatch(block)
        name = function[1].strip() if function else None
        if name not in self.tools.schemas:
            return None
        properties = self.tools.schemas[name].get("properties") or {}
        arguments = {}
        for key, value in XML_PARAMETER.findall(function[2]):
            arguments[key.strip()] = _typed(_one_newline_off(value), properties.get(key.strip()) or {})
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False))

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


FENCE, MISTRAL = "```json", "[TOOL_CALLS]"
XML_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.S)
XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


def _one_newline_off(value: str) -> str:
    """A parameter's value as written between its tags, which templates put on lines of their own."""
    return value.removeprefix("\n").removesuffix("\n")


def _typed(value: str, schema: dict):
    """A parameter's text as the value its JSON schema's type names; text that does not parse stays text."""
    kinds = schema.get("type") if isinstance(schema, dict) else None
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if "string" in kinds or value.strip() == "":
        return value
    if "boolean" in kinds and value.strip().lower() in ("true", "false"):  # Python's True, as models write it too
        return value.strip().lower() == "true"
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        return value
    if kinds == [None]:
        return parsed
    return parsed if any(kind in SCHEMA_TYPES and SCHEMA_TYPES[kind](parsed) for kind in kinds) else value


# What a JSON schema's "type" admits, by name
SCHEMA_TYPES = {
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "null": lambda v: v is None,
}


def _may_be_bare(head: str) -> bool | None:
    """Whether an output beginning so may be a call's JSON alone; None while its start cannot tell."""
    start = head.lstrip()
    if start.startswith(("{", "[", FENCE)):  # a list of calls: Mistral's after its [TOOL_CALLS]
        return True
    return None if FENCE.startswith(start) else False


def _unfenced(text: str) -> str:
    text = text.strip().removeprefix(MISTRAL).lstrip()  # its marker where decoding keeps special tokens
    if text.startswith(FENCE) and text.endswith("```"):
        return text[len(FENCE) : -3]
    return text


def _partial_tag(text: str) -> int:
    """How many characters at the end of text could begin <tool_call>."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


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
    if thinking is not None:  # the name Qwen3's and DeepSeek-R1's templates read
        out["reasoning_content"] = thinking
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
