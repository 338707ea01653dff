"""A reasoning model's thinking read out of its chat replies (`serve --reasoning-parser`): the split of a whole reply,
the same split however a stream cuts it (a version that does not hold back a tag's first characters fails), and the
server's messages and deltas, from an engine whose replies are scripted."""

import json
import random

import httpx
import openai
import pytest
from conftest import LocalServer, ScriptedEngine

from specdecode.server import reasoning
from specdecode.server.api import build_app
from specdecode.server.reasoning import ReasoningSplit, Thinking
from specdecode.server.reply import OutputReader

# (reply, whether its prompt opened the thinking, reasoning, content)
SPLITS = [
    ("<think>\nLet me add.\n</think>\n\nIt is 4.", False, "\nLet me add.\n", "\n\nIt is 4."),
    ("  <think>a</think>b", False, "a", "b"),
    ("It is 4.", False, None, "It is 4."),
    ("It is <think> 4.", False, None, "It is <think> 4."),
    ("<think>cut off mid-thought", False, "cut off mid-thought", ""),
    ("<thin", False, None, "<thin"),
    ("Adding: 2 + 2 = 4.</think>4", True, "Adding: 2 + 2 = 4.", "4"),
    ("still thinking </thi", True, "still thinking </thi", ""),
    ("", True, "", ""),
    ("</think></think>x", True, "", "</think>x"),
]


def _tagged(start: str, end: str) -> list[tuple]:
    """The same replies with another model's tags, which split the same."""
    return [
        tuple(_.replace("<think>", start).replace("</think>", end) if isinstance(_, str) else _ for _ in case)
        for case in SPLITS
    ]


MAGISTRAL_SPLITS, SEED_SPLITS = _tagged("[THINK]", "[/THINK]"), _tagged("<seed:think>", "</seed:think>")
CASES = [
    *(("qwen3", *case) for case in SPLITS),
    *(("mistral", *case) for case in MAGISTRAL_SPLITS),
    *(("seed_oss", *case) for case in SEED_SPLITS),
]


def _thinking(parser: str, opened: bool) -> Thinking:
    return Thinking(*reasoning.PARSERS[parser], opened)


@pytest.mark.parametrize("parser, reply, thinking, reasoning_text, content", CASES)
def test_a_whole_reply_splits_into_reasoning_and_content(parser, reply, thinking, reasoning_text, content):
    reader = OutputReader(_thinking(parser, thinking), None)
    reasoning, text, calls = reader.feed(reply, finished=True)
    assert (reasoning if reader.reasoned else None, text, calls) == (reasoning_text, content, [])


def test_a_prompt_ending_in_a_start_tag_opens_the_thinking():
    assert Thinking.of("deepseek_r1", "<|Assistant|><think>\n").opened
    assert not Thinking.of("mistral", "<|Assistant|><think>\n").opened
    assert Thinking.of("mistral", "[INST]2+2?[/INST][THINK]") == Thinking("[THINK]", "[/THINK]", True)


def _streamed(pieces: list[str], thinking: Thinking) -> tuple[str, str]:
    split, said = ReasoningSplit(thinking), []
    said += [split.feed(piece) for piece in pieces]
    said.append(split.finish())
    return "".join(r for r, _ in said), "".join(c for _, c in said)


def _cuts(text: str, rng: random.Random, trials: int = 200):
    for _ in range(trials):
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, min(6, len(text)))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def test_a_stream_splits_as_the_whole_reply_does_however_it_is_cut():
    rng = random.Random(0)
    for parser, reply, thinking, reasoning_text, content in CASES:
        for pieces in _cuts(reply, rng):
            assert _streamed(pieces, _thinking(parser, thinking)) == (reasoning_text or "", content), pieces


def test_a_stream_that_sends_a_tags_first_characters_at_once_splits_otherwise(monkeypatch):
    """The broken variant: '</th' at a piece's end goes out as reasoning before the next piece shows it closes it."""
    monkeypatch.setattr(reasoning, "_tag_start_at_end", lambda text, tag: 0)
    assert _streamed(["<think>a</th", "ink>b"], _thinking("qwen3", False)) != ("a", "b")


def _served(pieces, parser="qwen3", opens_thinking=False):
    app = build_app(ScriptedEngine(pieces, opens_thinking), "tiny", runs_engine=False, reasoning_parser=parser)
    return LocalServer(app)


def _both(server, **kwargs) -> tuple[dict, dict]:
    """The message of a whole reply, and the streamed deltas' fields joined."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "2+2?"}], max_tokens=50) | kwargs
    message = client.chat.completions.create(**kwargs).choices[0].message.model_dump(exclude_none=True)
    joined: dict = {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for key, value in chunk.choices[0].delta.model_dump(exclude_none=True).items():
            if isinstance(value, str) and key != "role":
                joined[key] = joined.get(key, "") + value
    return message, joined


def test_the_server_returns_the_thinking_apart_streamed_or_not():
    with _served(["<thi", "nk>\nLet me", " add.</th", "ink>\n\nIt is", " 4."]) as server:
        message, joined = _both(server)
    assert message["reasoning"] == message["reasoning_content"] == "\nLet me add."
    assert message["content"] == "\n\nIt is 4."
    assert joined == {"reasoning": "\nLet me add.", "reasoning_content": "\nLet me add.", "content": "\n\nIt is 4."}


def test_magistral_s_thinking_and_its_calls_after_it_are_read_apart():
    pieces = ["[THINK]", "Let me", " call add.[/TH", "INK]", "[TOOL_CALLS]", "add", "[ARGS]", '{"a": 1, "b": 2}']
    add = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    with _served(pieces, "mistral") as server:
        message, joined = _both(server, tools=[add])
        plain, _ = _both(server)
    assert message["reasoning"] == joined["reasoning"] == "Let me call add." and "content" not in message
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("add", {"a": 1, "b": 2})
    ]
    assert plain["content"] == '[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}'  # no tools asked for: the text as written


def test_an_unknown_reasoning_parser_is_refused_naming_the_known_ones():
    from specdecode.errors import SpecDecodeError

    parsers = "qwen3, deepseek_r1, mistral, seed_oss, glm45, openai_gptoss"
    with pytest.raises(SpecDecodeError, match=f"{parsers}, not 'granite'"):
        build_app(ScriptedEngine([]), "tiny", runs_engine=False, reasoning_parser="granite")


def test_a_prompt_that_opens_the_thinking_makes_the_reply_reasoning_until_it_closes_it():
    with _served(["Adding: 2", " + 2 = 4.</think>", "4"], "deepseek_r1", opens_thinking=True) as server:
        message, joined = _both(server)
    assert (message["reasoning"], message["content"]) == ("Adding: 2 + 2 = 4.", "4")
    assert (joined["reasoning"], joined["content"]) == ("Adding: 2 + 2 = 4.", "4")


def test_a_reply_without_thinking_is_all_content_and_include_reasoning_false_drops_the_thinking():
    with _served(["It is", " 4."]) as server:
        message, joined = _both(server)
        assert "reasoning" not in message and message["content"] == "It is 4." and "reasoning" not in joined
    with _served(["<think>a</think>", "It is 4."]) as server:
        message, joined = _both(server, extra_body={"include_reasoning": False})
    assert "reasoning" not in message and message["content"] == "It is 4." and joined == {"content": "It is 4."}


def test_without_a_parser_the_thinking_stays_in_the_content_and_include_reasoning_false_is_refused():
    with _served(["<think>a</think>", "It is 4."], parser=None) as server:
        message, _ = _both(server)
        assert message["content"] == "<think>a</think>It is 4." and "reasoning" not in message
        r = httpx.post(
            server.url + "/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "include_reasoning": False},
        )
    assert r.status_code == 400 and "--reasoning-parser" in r.json()["error"]["message"]


def test_tool_calls_are_read_from_the_content_after_the_thinking():
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    add = {
        "type": "function",
        "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {}, "b": {}}}},
    }
    with _served(["<think>I will call add", ".</think>", call]) as server:
        message, _ = _both(server, tools=[add])
    assert message["reasoning"] == "I will call add." and "content" not in message
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("add", {"a": 1, "b": 2})
    ]


def test_an_earlier_replys_thinking_reaches_the_template_as_reasoning_content():
    """Qwen3's and DeepSeek-R1's templates read an assistant message's `reasoning_content`, gpt-oss's its `thinking`;
    either name is taken."""
    from specdecode.server.protocol import ChatMessage
    from specdecode.server.tools import template_messages

    sent = [
        ChatMessage(role="user", content="2+2?"),
        ChatMessage(role="assistant", content="4", reasoning="adding"),
        ChatMessage(role="assistant", content="4", reasoning_content="summing"),
    ]
    rendered = template_messages(sent)
    assert [m.get("reasoning_content") for m in rendered] == [None, "adding", "summing"]
    assert [m.get("thinking") for m in rendered] == [None, "adding", "summing"]


def test_with_a_parser_a_chats_grammar_starts_after_the_thinking():
    from specdecode.server.handler import RequestHandler
    from specdecode.server.protocol import ChatRequest

    chat = ChatRequest(messages=[{"role": "user", "content": "hi"}], response_format={"type": "json_object"})
    engine = ScriptedEngine([])
    for parser, prompt, expected in [
        (None, "<user>hi<assistant>", None),
        ("qwen3", "<user>hi<assistant>", False),  # the reply may open its thinking
        ("deepseek_r1", "<user>hi<assistant><think>\n", True),  # it starts inside it
    ]:
        _, params = RequestHandler(engine, "tiny", reasoning_parser=parser).chat_sampling(chat, prompt)
        assert params.structured_output.after_thinking is expected


# ---- gpt-oss's harmony channels ----------------------------------------------------------------------------

ANALYSIS, FINAL = "<|channel|>analysis<|message|>", "<|start|>assistant<|channel|>final<|message|>"
# (reply, reasoning, content): analysis then the answer; the answer alone; a call after analysis (its recipient in the
# channel's part, or in the role's), which becomes a Hermes block; a preamble on commentary then a call; no header
HARMONY_SPLITS = [
    (f"{ANALYSIS}User asks 2+2.<|end|>{FINAL}It is 4.", "User asks 2+2.", "It is 4."),
    ("<|channel|>final<|message|>It is 4.", None, "It is 4."),
    (
        f"{ANALYSIS}Call add.<|end|><|start|>assistant<|channel|>commentary to=functions.add <|constrain|>json"
        '<|message|>{"a": 1, "b": 2}',
        "Call add.",
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>',
    ),
    (
        "<|channel|>commentary<|message|>Adding now.<|end|>"
        '<|start|>assistant to=functions.add<|channel|>commentary json<|message|>{"a": 1}',
        None,
        'Adding now.<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>',
    ),
    ("It is 4.", None, "It is 4."),
    (f"{ANALYSIS}cut off mid-thought <|en", "cut off mid-thought <|en", ""),
]


@pytest.mark.parametrize("reply, reasoning_text, content", HARMONY_SPLITS)
def test_gpt_oss_channels_split_into_reasoning_and_content_however_the_stream_is_cut(reply, reasoning_text, content):
    thinking = Thinking.of(reasoning.HARMONY, "<|start|>user<|message|>2+2?<|end|><|start|>assistant")
    reader = OutputReader(thinking, None)
    got, text, _ = reader.feed(reply, finished=True)
    assert (got if reader.reasoned else None, text) == (reasoning_text, content)
    for pieces in _cuts(reply, random.Random(1), trials=100):
        split, said = reasoning.splitter(thinking), []
        said += [split.feed(piece) for piece in pieces] + [split.finish()]
        assert ("".join(r for r, _ in said), "".join(c for _, c in said)) == (reasoning_text or "", content), pieces


def test_a_gpt_oss_splitter_that_took_every_channel_for_content_fails():
    """The broken variant: the analysis channel's message read as the answer's."""
    split = reasoning.HarmonySplit()
    split._said = lambda body, reasoning_text, content: (reasoning_text, content + body)
    assert split.feed(HARMONY_SPLITS[0][0]) != ("User asks 2+2.", "It is 4.")


def test_gpt_oss_calls_are_read_as_tool_calls_by_the_server():
    """gpt-oss's reply through the server, whose parser for it needs no flag: its analysis as the reasoning, its call
    to a function as a tool call."""
    add = {
        "type": "function",
        "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {}, "b": {}}}},
    }
    pieces = [
        ANALYSIS[:9],
        ANALYSIS[9:],
        "Call ",
        "add.<|e",
        "nd|><|start|>assistant<|channel|>commentary to=fun",
        "ctions.add <|constrain|>json<|message|>",
        '{"a": 1,',
        ' "b": 2}',
    ]
    engine = ScriptedEngine(pieces)
    engine.tokenizer.harmony = True  # as models.tokenizer tells gpt-oss's vocabulary
    with LocalServer(build_app(engine, "tiny", runs_engine=False)) as server:
        message, _ = _both(server, tools=[add])
    assert message["reasoning"] == "Call add." and "content" not in message
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("add", {"a": 1, "b": 2})
    ]
