"""A reasoning model's thinking, read out of its reply: what it writes between its two tags (<think> and </think>:
Qwen3, QwQ, DeepSeek-R1 and its distills, GLM-Z1; [THINK] and [/THINK]: Magistral; <seed:think> and </seed:think>:
Seed-OSS) goes to the message's `reasoning`, the rest to `content`, as vLLM's reasoning parsers split them (`serve
--reasoning-parser`). gpt-oss writes messages on channels instead (OpenAI's harmony format): its analysis channel is
the reasoning, the others the content, its calls to functions rewritten as Hermes' blocks for the tool-call reader."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

HARMONY = "openai_gptoss"  # vLLM's name for gpt-oss's parser
# vLLM's names for the families' parsers, and the tags each reads
PARSERS = {
    "qwen3": ("<think>", "</think>"),
    "deepseek_r1": ("<think>", "</think>"),
    "mistral": ("[THINK]", "[/THINK]"),  # special tokens, kept in the text (tokenizer.KEPT_MARKERS)
    "seed_oss": ("<seed:think>", "</seed:think>"),
    "glm45": ("<think>", "</think>"),  # GLM-4.5's and GLM-Z1's
    HARMONY: ("<|channel|>analysis<|message|>", "<|end|>"),  # its markers kept in the text (tokenizer.HARMONY_MARKERS)
}


@dataclass(frozen=True)
class Thinking:
    """How a chat reply's thinking is marked, and whether the prompt left the reply inside it (DeepSeek-R1's and
    Qwen3-Thinking's templates end the prompt with <think>), so the reply is reasoning until it closes it."""

    start: str
    end: str
    opened: bool
    harmony: bool = False  # gpt-oss's channels (HarmonySplit), not a pair of tags

    @classmethod
    def of(cls, parser: str, prompt: str) -> Thinking:
        start, end = PARSERS[parser]
        return cls(start, end, prompt.rstrip().endswith(start), parser == HARMONY)


class ReasoningSplit:
    """Splits a reply given piece by piece into reasoning and content. A reply is reasoning from its start where the
    prompt opened the thinking, or where it begins with the start tag; reasoning ends at the end tag; a reply that
    begins otherwise is all content. Text that may be the start of a tag waits for the next piece (or the end)."""

    def __init__(self, thinking: Thinking):
        self.start, self.end = thinking.start, thinking.end
        self.state = "reasoning" if thinking.opened else "start"
        self.held = ""
        self.reasoned = thinking.opened  # whether the reply has reasoning at all (None in the message where not)

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and content settled by this piece."""
        self.held += text
        reasoning = content = ""
        while self.held:
            if self.state == "start":
                begun = self.held.lstrip()
                if begun.startswith(self.start):
                    self.held, self.state, self.reasoned = begun[len(self.start) :], "reasoning", True
                elif self.start.startswith(begun):
                    break  # perhaps the tag, cut off
                else:
                    self.state = "content"
            elif self.state == "reasoning":
                at = self.held.find(self.end)
                if at >= 0:
                    reasoning += self.held[:at]
                    self.held, self.state = self.held[at + len(self.end) :], "content"
                    continue
                settled = len(self.held) - _tag_start_at_end(self.held, self.end)
                reasoning, self.held = reasoning + self.held[:settled], self.held[settled:]
                break
            else:
                content, self.held = content + self.held, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back, at the reply's end: reasoning if the thinking was never closed, else content."""
        held, self.held = self.held, ""
        return (held, "") if self.state == "reasoning" else ("", held)


# harmony's markers: a message is [<|start|>ROLE]<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>FORMAT]<|message|>BODY,
# ended by <|end|> (or by <|return|> or <|call|>, which end generation and are not in the text)
MESSAGE, MESSAGE_END = "<|message|>", "<|end|>"
TO = r"(?:\s*to=functions\.([\w.-]+))?"  # a message's recipient, written in its role's part or its channel's
HEADER = re.compile(rf"(?:<\|start\|>\w*)?{TO}\s*<\|channel\|>(\w+){TO}.*", re.S)
HEADER_STARTS = ("<|start|>", "<|channel|>")


class HarmonySplit:
    """Splits gpt-oss's reply, given piece by piece, into reasoning (the analysis channel's messages) and content (the
    final and commentary channels'); a message to a function becomes a Hermes block, <tool_call>{"name": ..,
    "arguments": ..}</tool_call>, in the content. A reply that does not begin with a header is all content."""

    def __init__(self):
        self.state, self.held = "header", ""
        self.channel, self.function = "", None
        self.reasoned = False

    def feed(self, text: str) -> tuple[str, str]:
        self.held += text
        reasoning = content = ""
        while self.held:
            if self.state == "header":
                settled = self._header()
                if settled is None:
                    break
                content += settled
            elif self.state == "body":
                at = self.held.find(MESSAGE_END)
                end = at if at >= 0 else len(self.held) - _tag_start_at_end(self.held, MESSAGE_END)
                body, self.held = self.held[:end], self.held[end:]
                reasoning, content = self._said(body, reasoning, content)
                if at < 0:
                    break
                self.held, self.state = self.held[len(MESSAGE_END) :], "header"
                content += self._closed()
            else:
                content, self.held = content + self.held, ""
        return reasoning, content

    def _header(self) -> str | None:
        """Reads a message's header from what is held: "" once read (the body follows), None while it may still be one,
        or what was held where it is no header (the rest of the reply is content)."""
        head = self.held.lstrip()
        at = head.find(MESSAGE)
        header = HEADER.fullmatch(head[:at]) if at >= 0 else None
        if header:
            self.channel, self.function = header[2], header[1] or header[3]
            self.held, self.state = head[at + len(MESSAGE) :], "body"
            self.reasoned |= self.channel == "analysis"
            return f'<tool_call>{{"name": {json.dumps(self.function)}, "arguments": ' if self.function else ""
        if at < 0 and any(s.startswith(head[: len(s)]) for s in HEADER_STARTS) and len(head) < 200:
            return None
        held, self.held, self.state = self.held, "", "content"
        return held

    def _said(self, body: str, reasoning: str, content: str) -> tuple[str, str]:
        if self.channel == "analysis":
            return reasoning + body, content
        return reasoning, content + body

    def _closed(self) -> str:
        """What ends the message's text in the content: a call's block closed."""
        closing = "}</tool_call>" if self.function else ""
        self.function = None
        return closing

    def finish(self) -> tuple[str, str]:
        """What was held at the reply's end: the last message's body (a call's block closed: a call ends generation,
        at <|call|>), or text that began as a header and never became one."""
        held, self.held = self.held, ""
        if self.state != "body":
            return "", held
        reasoning, content = self._said(held, "", "")
        return reasoning, content + self._closed()


def splitter(thinking: Thinking) -> ReasoningSplit | HarmonySplit:
    """The reader of a reply's reasoning for the parser the thinking is of."""
    return HarmonySplit() if thinking.harmony else ReasoningSplit(thinking)


def _tag_start_at_end(text: str, tag: str) -> int:
    """The length of the longest start of `tag` (not all of it) that `text` ends with."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:n])), 0)
