"""A reasoning model's thinking, read out of its reply: what it writes between its two tags (<think> and </think>:
Qwen3, QwQ, DeepSeek-R1 and its distills; [THINK] and [/THINK]: Magistral) goes to the message's `reasoning`, the rest
to `content`, as vLLM's reasoning parsers split them (`serve --reasoning-parser`)."""

from __future__ import annotations

from dataclasses import dataclass

# vLLM's names for the families' parsers, and the tags each reads
PARSERS = {
    "qwen3": ("<think>", "</think>"),
    "deepseek_r1": ("<think>", "</think>"),
    "mistral": ("[THINK]", "[/THINK]"),  # special tokens, kept in the text (tokenizer.KEPT_MARKERS)
}


@dataclass(frozen=True)
class Thinking:
    """How a chat reply's thinking is marked, and whether the prompt left the reply inside it (DeepSeek-R1's and
    Qwen3-Thinking's templates end the prompt with <think>), so the reply is reasoning until it closes it."""

    start: str
    end: str
    opened: bool

    @classmethod
    def of(cls, parser: str, prompt: str) -> Thinking:
        start, end = PARSERS[parser]
        return cls(start, end, prompt.rstrip().endswith(start))


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


def _tag_start_at_end(text: str, tag: str) -> int:
    """The length of the longest start of `tag` (not all of it) that `text` ends with."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:n])), 0)
