"""Anthropic's Messages API (/v1/messages) through the `anthropic` client: the answer the chat endpoint gives for the
same conversation, whole and streamed as the API's events; stop sequences, tool use, thinking blocks, structured
output, token counting; the API's own errors and its x-api-key header."""

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
from conftest import LocalServer, ScriptedEngine, json_writing_llm
from test_tool_calls import TOOLS

from specdecode.errors import SpecDecodeError
from specdecode.server.anthropic_api import MessagesRequest, chat_messages
from specdecode.server.api import build_app
from specdecode.server.async_engine import AsyncEngine

# the SDK no longer sends sampling settings (Claude's newer models take none); the API still reads them
GREEDY = dict(model="tiny", extra_body={"temperature": 0, "ignore_eos": True})
CHAT_GREEDY = dict(model="tiny", temperature=0, extra_body={"ignore_eos": True})
ADD = {"name": "add", "input_schema": TOOLS[1]["function"]["parameters"]}  # the chat tests' add(a, b), Anthropic's form


@pytest.fixture(scope="module")
def server():
    llm = json_writing_llm()
    with LocalServer(build_app(AsyncEngine(llm.engine), "tiny", api_key="sk-test")) as served:
        served.client = anthropic.Anthropic(base_url=served.url, api_key="sk-test", max_retries=0)
        served.chat = openai.OpenAI(base_url=served.url + "/v1", api_key="sk-test", max_retries=0)
        yield served


def _chat(server, messages, max_tokens, **kwargs):
    return server.chat.chat.completions.create(messages=messages, max_tokens=max_tokens, **CHAT_GREEDY, **kwargs)


def test_a_message_answers_as_the_chat_endpoint_does(server):
    m = server.client.messages.create(messages=[{"role": "user", "content": "hello"}], max_tokens=12, **GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [block.type for block in m.content] == ["text"]
    assert m.content[0].text == _chat(server, [{"role": "user", "content": "hello"}], 12).choices[0].message.content
    assert (m.stop_reason, m.stop_sequence) == ("max_tokens", None)
    assert m.usage.output_tokens == 12 and m.usage.input_tokens + m.usage.cache_read_input_tokens > 0


def test_the_system_prompt_and_content_blocks_are_the_conversation(server):
    blocks = [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]
    m = server.client.messages.create(
        system=[{"type": "text", "text": "rules"}, {"type": "text", "text": "more"}],
        messages=[
            {"role": "user", "content": blocks},
            {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
            {"role": "user", "content": "again"},
        ],
        max_tokens=8,
        **GREEDY,
    )
    expected = _chat(
        server,
        [
            {"role": "system", "content": "rules\nmore"},
            {"role": "user", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "again"},
        ],
        8,
    )
    assert m.content[0].text == expected.choices[0].message.content


def test_a_streamed_message_sends_the_apis_events_in_order_and_the_same_text(server):
    kwargs = dict(messages=[{"role": "user", "content": "abc"}], max_tokens=16, **GREEDY)
    whole = server.client.messages.create(**kwargs)
    events = list(server.client.messages.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == whole.content[0].text
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 16
    with server.client.messages.stream(**kwargs) as stream:  # the SDK's own accumulation of the events
        assert stream.get_final_message().content[0].text == whole.content[0].text


def test_a_stop_sequence_ends_the_message_and_is_named(server):
    free = server.client.messages.create(messages=[{"role": "user", "content": "hi"}], max_tokens=30, **GREEDY)
    stop = free.content[0].text[10:12]
    m = server.client.messages.create(
        messages=[{"role": "user", "content": "hi"}], max_tokens=30, stop_sequences=["\x7f", stop], **GREEDY
    )
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
    assert m.content[0].text == free.content[0].text[: free.content[0].text.index(stop)]
    chat = _chat(server, [{"role": "user", "content": "hi"}], 30, stop=[stop])
    assert chat.choices[0].model_extra["stop_reason"] == stop  # vLLM's field names the stop string on chats too


def test_a_forced_tool_call_is_a_tool_use_block_whole_and_streamed(server):
    kwargs = dict(
        model="tiny",
        messages=[{"role": "user", "content": "add"}],
        tools=[ADD],
        tool_choice={"type": "tool", "name": "add"},
        extra_body={"temperature": 0},
        max_tokens=600,
    )
    m = server.client.messages.create(**kwargs)
    assert [b.type for b in m.content] == ["tool_use"] and m.content[0].name == "add"
    jsonschema.validate(m.content[0].input, ADD["input_schema"])
    assert m.content[0].id.startswith("toolu_")
    with server.client.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in streamed.content] == [("tool_use", "add", m.content[0].input)]


def test_a_call_the_model_chose_stops_with_tool_use():
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    with LocalServer(build_app(ScriptedEngine(["Sure.", call]), "tiny", runs_engine=False)) as s:
        client = anthropic.Anthropic(base_url=s.url, api_key="unused", max_retries=0)
        kwargs = dict(model="tiny", messages=[{"role": "user", "content": "1+2"}], tools=[ADD], max_tokens=50)
        m = client.messages.create(**kwargs)
        events = list(client.messages.create(stream=True, **kwargs))
    assert [(b.type, getattr(b, "text", None)) for b in m.content] == [("text", "Sure."), ("tool_use", None)]
    assert m.content[1].input == {"a": 1, "b": 2} and m.stop_reason == "tool_use"
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["text", "tool_use"] and events[-2].delta.stop_reason == "tool_use"
    partial = [e.delta.partial_json for e in events if e.type == "content_block_delta" and e.index == 1]
    assert json.loads("".join(partial)) == {"a": 1, "b": 2}


def test_a_call_whose_arguments_are_no_object_is_given_as_text_whole_and_streamed():
    """A model's string of arguments that does not parse can be no tool_use block (its input is an object)."""
    call = '<tool_call>{"name": "add", "arguments": "not json"}</tool_call>'
    with LocalServer(build_app(ScriptedEngine([call]), "tiny", runs_engine=False)) as s:
        client = anthropic.Anthropic(base_url=s.url, api_key="unused", max_retries=0)
        kwargs = dict(model="tiny", messages=[{"role": "user", "content": "1+2"}], tools=[ADD], max_tokens=50)
        m = client.messages.create(**kwargs)
        with client.messages.stream(**kwargs) as stream:
            streamed = stream.get_final_message()
    text = '{"name": "add", "arguments": "not json"}'
    assert [(b.type, b.text) for b in m.content] == [("text", text)] and m.stop_reason == "end_turn"
    assert [(b.type, b.text) for b in streamed.content] == [("text", text)] and streamed.stop_reason == "end_turn"


def test_tool_use_and_tool_result_blocks_become_the_chats_calls_and_tool_messages():
    assert chat_messages(
        [
            {"role": "user", "content": "add 1 and 2"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "easy", "signature": ""},
                    {"type": "text", "text": "Adding."},
                    {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 1, "b": 2}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "3"}]},
                    {"type": "text", "text": "thanks"},
                ],
            },
        ]
    ) == [
        {"role": "user", "content": "add 1 and 2"},
        {
            "role": "assistant",
            "content": "Adding.",
            "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
            ],
            "reasoning_content": "easy",
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "3"},
        {"role": "user", "content": "thanks"},
    ]


def test_count_tokens_counts_the_prompt_a_message_is_served_with(server):
    conversation = [{"role": "user", "content": "count me"}]
    counted = server.client.messages.count_tokens(model="tiny", system="sys", messages=conversation, tools=[ADD])
    m = server.client.messages.create(system="sys", messages=conversation, tools=[ADD], max_tokens=1, **GREEDY)
    assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens > 20


def test_output_config_format_constrains_the_answer(server):
    schema = {
        "type": "object",
        "properties": {"b": {"enum": ["x", "y"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["b", "n"],
        "additionalProperties": False,
        "x-guidance": {"whitespace_flexible": False},
    }
    m = server.client.messages.create(
        model="tiny",
        messages=[{"role": "user", "content": "weather?"}],
        max_tokens=60,
        output_config={"format": {"type": "json_schema", "schema": schema}},
        extra_body={"temperature": 0},
    )
    jsonschema.validate(json.loads(m.content[0].text), schema)
    assert m.stop_reason == "end_turn"


def test_thinking_comes_back_as_a_thinking_block_before_the_text_whole_and_streamed():
    pieces = ["<think>add", "ing</th", "ink>It is", " 4."]
    with LocalServer(build_app(ScriptedEngine(pieces), "tiny", runs_engine=False, reasoning_parser="qwen3")) as s:
        client = anthropic.Anthropic(base_url=s.url, api_key="unused", max_retries=0)
        kwargs = dict(model="tiny", messages=[{"role": "user", "content": "2+2?"}], max_tokens=1024)
        m = client.messages.create(thinking={"type": "enabled", "budget_tokens": 512}, **kwargs)
        events = list(client.messages.create(stream=True, **kwargs))
    assert [(b.type, getattr(b, "thinking", None) or b.text) for b in m.content] == [
        ("thinking", "adding"),
        ("text", "It is 4."),
    ]
    deltas = [(e.index, e.delta.type) for e in events if e.type == "content_block_delta"]
    assert deltas[0] == (0, "thinking_delta") and deltas[-1] == (1, "text_delta")
    thought = "".join(e.delta.thinking for e in events if e.type == "content_block_delta" and e.index == 0)
    assert thought == "adding" and m.stop_reason == "end_turn"


def test_thinking_without_a_reasoning_parser_is_refused_in_the_apis_error_shape():
    with LocalServer(build_app(ScriptedEngine(["x"]), "tiny", runs_engine=False)) as s:
        client = anthropic.Anthropic(base_url=s.url, api_key="unused", max_retries=0)
        with pytest.raises(anthropic.BadRequestError, match="--reasoning-parser"):
            client.messages.create(
                model="tiny",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=2048,
                thinking={"type": "enabled", "budget_tokens": 1024},
            )


def test_the_api_key_goes_in_x_api_key_or_as_a_bearer_token(server):
    wrong = anthropic.Anthropic(base_url=server.url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        wrong.messages.create(messages=[{"role": "user", "content": "hi"}], max_tokens=2, **GREEDY)
    assert refused.value.body["error"]["type"] == "authentication_error"
    bearer = httpx.post(
        server.url + "/v1/messages",
        headers={"authorization": "Bearer sk-test"},
        json={"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )
    assert bearer.status_code == 200 and bearer.json()["type"] == "message"


@pytest.mark.parametrize(
    "fields",
    [
        {"max_tokens": None},
        {"messages": [{"role": "system", "content": "x"}]},
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        {"messages": [{"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]}]},
        {"messages": [{"role": "user", "content": 5}]},
        {"system": [{"type": "image"}]},
        {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
        {"tool_choice": {"type": "tool", "name": "absent"}, "tools": [ADD]},
        {"tool_choice": {"type": "sometimes"}, "tools": [ADD]},
        {"tool_choice": {"type": "any"}},
        {"tool_choice": {"type": "any", "disable_parallel_tool_use": "yes"}, "tools": [ADD]},
        {"thinking": {"type": "sometimes"}},
        {"output_config": {"format": {"type": "xml"}}},
        {"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]},
        {"container": "c1"},
        {"stop": ["x"]},
        {"top_k": -5},
        {"thinking_token_budget": 5},
        {"max_tokens": 10_000},
        {"model": "other"},
    ],
)
def test_what_the_server_does_not_do_gets_the_apis_4xx(server, fields):
    body = {"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]} | fields
    body = {k: v for k, v in body.items() if v is not None}
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": "sk-test"}, json=body, timeout=30)
    assert r.status_code in (400, 404), r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["message"]
    assert error["error"]["type"] == ("not_found_error" if r.status_code == 404 else "invalid_request_error")


def test_a_bad_body_is_refused_in_the_apis_shape_and_the_server_carries_on(server):
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": "sk-test"}, json={"max_tokens": 5}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "messages" in r.json()["error"]["message"]
    m = server.client.messages.create(messages=[{"role": "user", "content": "hi"}], max_tokens=3, **GREEDY)
    assert m.usage.output_tokens == 3


def test_chat_messages_refuses_what_it_cannot_render():
    with pytest.raises(SpecDecodeError, match="text only"):
        chat_messages([{"role": "user", "content": [{"type": "document", "source": {}}]}])


@pytest.mark.parametrize(
    "thinking, enabled, budget",
    [
        ({"type": "enabled", "budget_tokens": 1024}, True, 1024),
        ({"type": "adaptive"}, True, None),
        ({"type": "disabled"}, False, None),
    ],
)
def test_thinking_reaches_the_template_and_its_budget_the_sampling_parameters(thinking, enabled, budget):
    req = MessagesRequest(
        model="tiny", max_tokens=2048, messages=[{"role": "user", "content": "hi"}], thinking=thinking
    )
    chat = req.chat_request(reads_reasoning=True)
    assert chat.template_options()["enable_thinking"] is enabled
    assert chat.sampling_params(2048, None).thinking_token_budget == budget
