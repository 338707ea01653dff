"""A reasoning model's thinking, read out of its reply: what it writes between <think> and </think> (Qwen3, QwQ,
DeepSeek-R1 and its distills) goes to the message's `reasoning`, the rest to `content`, as vLLM's reasoning parsers
split them (`serve --reasoning-parser`)."""

from __future__ import annotations

START, END = "<think>", "</think>"
# vLLM's names for the families' parsers: all of them read the same two tags
PARSERS = ("qwen3", "deepseek_r1")


def opens_thinking(prompt: str) -> bool:
    """Whether the chat template left the reply inside its thinking (DeepSeek-R1's and Qwen3-Thinking's end the prompt
    with <think>), so the reply is reasoning until it closes it."""
    return prompt.rstrip().endswith(START)


class ReasoningSplit:
    """Splits a reply given piece by piece into reasoning and content. A reply is reasoning from its start where the
    prompt opened the thinking, or where it begins with <think>; reasoning ends at </think>; a reply that begins
    otherwise is all content. Text that may be the start of a tag waits for the next piece (or the end)."""

    def __init__(self, thinking: bool):
        self.state = "reasoning" if thinking else "start"
        self.held = ""
        self.reasoned = thinking  # whether the reply has reasoning at all (None in the message where not)

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and content settled by this piece."""
        self.held += text
        reasoning = content = ""
        while self.held:
            if self.state == "start":
                begun = self.held.lstrip()
                if begun.startswith(START):
                    self.held, self.state, self.reasoned = begun[len(START) :], "reasoning", True
                elif START.startswith(begun):
                    break  # perhaps the tag, cut off
                else:
                    self.state = "content"
            elif self.state == "reasoning":
                at = self.held.find(END)
                if at >= 0:
                    reasoning += self.held[:at]
                    self.held, self.state = self.held[at + len(END) :], "content"
                    continue
                settled = len(self.held) - _tag_start_at_end(self.held, END)
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
