"""How models write tool calls in their text, read piece by piece: the markers that open a call, Qwen3-Coder's XML
parameters, GLM-4.5's argument pairs, and Mistral's `[TOOL_CALLS]` forms. `tools.CallStream` decides with these
what is a call and what is content; each function answers the same however much of the text has arrived, or says it
must wait for more."""

from __future__ import annotations

import json
import re

OPEN, CLOSE = "<tool_call>", "</tool_call>"  # Hermes' blocks (Qwen2.5, Qwen3, Hermes)
MISTRAL, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"  # special tokens, kept in the text (tokenizer.py)
OPENERS = (OPEN, MISTRAL)
FENCE = "```json"

XML_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.S)
XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)
# GLM-4.5's call: the function's name on the block's first line, then <arg_key>/<arg_value> pairs
GLM_CALL = re.compile(r"\s*([\w.-]+)\s*((?:<arg_key>.*)?)", re.S)
GLM_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.S)
# Mistral's call from tokenizer version 11: name[ARGS]{...}, or name[CALL_ID]id[ARGS]{...}
MISTRAL_HEAD = re.compile(r"\s*([\w.-]+)(?:\[CALL_ID\]\w*)?\[ARGS\]\s*")
MISTRAL_HEAD_SO_FAR = re.compile(r"\s*[\w.-]*(?:\[CALL_ID\]\w*)?")


def first_opener(text: str) -> tuple[int, str]:
    """Where the first marker that opens a call is, and which; (-1, "") where there is none."""
    found = [(at, opener) for opener in OPENERS if (at := text.find(opener)) >= 0]
    return min(found) if found else (-1, "")


def partial_tag(text: str, tags: tuple[str, ...] = OPENERS) -> int:
    """How many characters at the end of text could begin one of tags."""
    for n in range(min(max(map(len, tags)) - 1, len(text)), 0, -1):
        if any(tag.startswith(text[-n:]) for tag in tags):
            return n
    return 0


def json_value(text: str, start: int) -> tuple[object, int] | None:
    """The JSON value that begins at start and where it ends; None while it has not ended (or never will)."""
    try:
        return json.JSONDecoder().raw_decode(text, start)
    except json.JSONDecodeError:
        return None


def mistral_call(text: str) -> tuple[str, int] | bool:
    """What follows [TOOL_CALLS] as version 11's head of one call: (the function's name, where its arguments
    begin); True while it may still become one, False where it cannot."""
    head = MISTRAL_HEAD.match(text)
    if head and head.end() < len(text):
        return head[1], head.end()
    if head:
        return True  # the arguments' first character is still to come
    so_far = text[: len(text) - partial_tag(text, (CALL_ID, ARGS))]
    return MISTRAL_HEAD_SO_FAR.fullmatch(so_far) is not None


def may_be_bare(head: str) -> bool | None:
    """Whether an output beginning so may be a call's JSON alone; None while its start cannot tell."""
    start = head.lstrip()
    if start.startswith(MISTRAL):
        return False  # its calls are read as they end
    if MISTRAL.startswith(start):
        return None
    if start.startswith(("{", "[", FENCE)):  # a list of calls: Mistral's before version 11 without its marker
        return True
    return None if FENCE.startswith(start) else False


def unfenced(text: str) -> str:
    text = text.strip()
    if text.startswith(FENCE) and text.endswith("```"):
        return text[len(FENCE) : -3]
    return text


def xml_arguments(body: str, properties: dict) -> dict:
    """Qwen3-Coder's <parameter=ARG> elements, each value read as its schema's type says (text as written, numbers,
    booleans, JSON for objects and arrays), as vLLM's qwen3_coder parser reads them."""
    return {
        key.strip(): typed(_one_newline_off(value), properties.get(key.strip()) or {})
        for key, value in XML_PARAMETER.findall(body)
    }


def glm_arguments(pairs: str, properties: dict) -> dict | None:
    """GLM-4.5's <arg_key>/<arg_value> pairs, each value read as its schema's type says (as vLLM's glm45 parser reads
    them); None where the text between the pairs is not theirs."""
    if GLM_ARGUMENT.sub("", pairs).strip():
        return None
    return {key.strip(): typed(value, properties.get(key.strip()) or {}) for key, value in GLM_ARGUMENT.findall(pairs)}


def _one_newline_off(value: str) -> str:
    """A parameter's value as written between its tags, which templates put on lines of their own."""
    return value.removeprefix("\n").removesuffix("\n")


def typed(value: str, schema: dict):
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
