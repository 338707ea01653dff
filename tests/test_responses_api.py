"""OpenAI's Responses API (/v1/responses) through the `openai` client: the answer the chat endpoint gives for the same
conversation, whole and streamed as the API's events, structured output, a reasoning item where the server reads
reasoning, and a 400 for what it does not do."""

import json

import httpx
import jsonschema
import openai
import pytest
from conftest import LocalServer, ScriptedEngine, json_writing_llm
from test_tool_calls import TOOLS

from specdecode.server.api import build_app
from specdecode.server.async_engine import AsyncEngine
from specdecode.server.response_store import ResponseNotFound, ResponseStore

GREEDY = dict(model="tiny", temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def server():
    llm = json_writing_llm()
    with LocalServer(build_app(AsyncEngine(llm.engine), "tiny")) as served:
        served.client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
        yield served


def _chat_text(server, messages, max_tokens) -> str:
    reply = server.client.chat.completions.create(messages=messages, max_tokens=max_tokens, **GREEDY)
    return reply.choices[0].message.content


def test_a_response_answers_as_the_chat_endpoint_does(server):
    r = server.client.responses.create(input="hello", max_output_tokens=12, **GREEDY)
    assert r.output_text == _chat_text(server, [{"role": "user", "content": "hello"}], 12)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 12 and r.usage.total_tokens == r.usage.input_tokens + 12
    assert r.usage.model_extra["speculation"]["num_draft_tokens"] > 0
    assert [item.type for item in r.output] == ["message"]


def test_instructions_and_message_items_are_the_conversation(server):
    items = [
        {"role": "developer", "content": [{"type": "input_text", "text": "be brief"}]},
        {"type": "message", "role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "hello"}]},
        {"role": "user", "content": "again"},
    ]
    r = server.client.responses.create(input=items[1:], instructions="be brief", max_output_tokens=8, **GREEDY)
    expected = _chat_text(
        server,
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "again"},
        ],
        8,
    )
    assert r.output_text == expected
    assert server.client.responses.create(input=items, max_output_tokens=8, **GREEDY).output_text == expected


def test_a_streamed_response_sends_the_apis_events_in_order_and_the_same_text(server):
    whole = server.client.responses.create(input="abc", max_output_tokens=16, **GREEDY)
    events = list(server.client.responses.create(input="abc", max_output_tokens=16, stream=True, **GREEDY))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == 16


def test_output_logprobs_are_the_chat_endpoint_s_whole_and_streamed(server):
    asked = dict(input="abc", max_output_tokens=10, include=["message.output_text.logprobs"], top_logprobs=2)
    whole = server.client.responses.create(**asked, **GREEDY).output[0].content[0].logprobs
    chat = (
        server.client.chat.completions.create(
            messages=[{"role": "user", "content": "abc"}], max_tokens=10, logprobs=True, top_logprobs=2, **GREEDY
        )
        .choices[0]
        .logprobs.content
    )
    assert [(e.token, e.logprob) for e in whole] == [(e.token, e.logprob) for e in chat] and len(whole) == 10
    assert all([t.token for t in w.top_logprobs] == [t.token for t in c.top_logprobs] for w, c in zip(whole, chat))
    assert all(len(e.top_logprobs) == 2 and e.bytes == list(e.token.encode()) for e in whole)
    events = list(server.client.responses.create(**asked, stream=True, **GREEDY))
    deltas = [entry for e in events if e.type == "response.output_text.delta" for entry in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done").logprobs
    final = events[-1].response.output[0].content[0].logprobs
    assert [(e.token, e.logprob) for e in whole] == [(e.token, e.logprob) for e in deltas]
    assert [e.token for e in done] == [e.token for e in final] == [e.token for e in whole]
    plain = server.client.responses.create(input="abc", max_output_tokens=10, **GREEDY)
    assert plain.output[0].content[0].logprobs == []


def test_text_format_json_schema_constrains_the_answer(server):
    schema = {
        "type": "object",
        "properties": {"b": {"enum": ["x", "y"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["b", "n"],
        "additionalProperties": False,
        "x-guidance": {"whitespace_flexible": False},  # a random model would write the most spaces allowed
    }
    r = server.client.responses.create(
        input="weather?",
        max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "place", "schema": schema, "strict": True}},
        model="tiny",
        temperature=0,
    )
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.status == "completed"


@pytest.mark.parametrize(
    "fields",
    [
        {"previous_response_id": "resp_1"},
        {"tools": [{"type": "web_search"}]},
        {"tool_choice": {"type": "function", "name": "absent"}, "tools": [{"type": "function", "name": "f"}]},
        {"input": [{"type": "file_search_call", "id": "x"}]},
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
        {"background": True},
        {"include": ["reasoning.encrypted_content"]},
        {"top_logprobs": 3},
        {"include": ["message.output_text.logprobs"], "top_logprobs": 21},
        {"include": ["message.output_text.logprobs"], "logprobs": True},
        {"n": 2},
        {"tool_choice": "required"},
        {"input": [{"role": "user"}]},
        {"messages": [{"role": "user", "content": "x"}]},
        {"text": {"format": 5}},
        {"text": {"format": {"type": "xml"}}},
        {"max_tokens": 5},
        {"input": [{"role": "user", "content": ["just a string"]}]},
        {"input": [{"role": 5, "content": "x"}]},
        {"input": [{"type": "function_call", "call_id": "c", "name": "add", "arguments": "not json"}]},
        {"max_output_tokens": 10_000},
        {"model": "other"},
    ],
)
def test_what_the_server_does_not_do_gets_a_clear_4xx(server, fields):
    r = httpx.post(server.url + "/v1/responses", json={"model": "tiny", "input": "hi", **fields}, timeout=30)
    assert r.status_code in (400, 404) and r.json()["error"]["message"], r.text


def test_a_reply_that_thinks_has_a_reasoning_item_before_its_message_whole_and_streamed():
    pieces = ["<think>add", "ing</th", "ink>It is", " 4."]
    with LocalServer(build_app(ScriptedEngine(pieces), "tiny", runs_engine=False, reasoning_parser="qwen3")) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        r = client.responses.create(model="tiny", input="2+2?")
        events = list(client.responses.create(model="tiny", input="2+2?", stream=True))
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "adding" and r.output_text == "It is 4." and r.status == "completed"
    assert r.usage.output_tokens_details.reasoning_tokens == len("adding")  # the test tokenizer: a token a character
    kinds = [e.type for e in events]
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (reasoning, text) == ("adding", "It is 4.")
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    assert added == [0, 1] and events[-1].response.output[0].type == "reasoning"


ADD = {"type": "function", **TOOLS[1]["function"]}  # the chat tests' add(a, b), in the Responses API's form


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "add"}])
def test_a_forced_function_call_comes_back_as_a_function_call_item_whole_and_streamed(server, choice):
    kwargs = dict(model="tiny", input="add", tools=[ADD], tool_choice=choice, temperature=0, max_output_tokens=600)
    r = server.client.responses.create(**kwargs)
    calls = [item for item in r.output if item.type == "function_call"]
    assert [item.type for item in r.output] == ["function_call"] and r.output_text == ""
    jsonschema.validate(json.loads(calls[0].arguments), ADD["parameters"])
    events = list(server.client.responses.create(stream=True, **kwargs))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.type, i.name, i.arguments) for i in done] == [("function_call", "add", calls[0].arguments)]
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == calls[0].arguments


def test_earlier_calls_and_their_outputs_are_the_conversation_the_chat_endpoint_reads(server):
    arguments = json.dumps({"a": 1, "b": 2})
    items = [
        {"role": "user", "content": "add 1 and 2"},
        {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": arguments},
        {"type": "function_call_output", "call_id": "call_1", "output": "3"},
    ]
    r = server.client.responses.create(input=items, tools=[ADD], max_output_tokens=10, **GREEDY)
    chat = server.client.chat.completions.create(
        messages=[
            items[0],
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": arguments}}
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "3"},
        ],
        tools=[TOOLS[1]],
        max_tokens=10,
        **GREEDY,
    )
    assert r.output_text == chat.choices[0].message.content


def test_a_call_the_model_writes_comes_back_as_an_item_after_the_text_before_it():
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    pieces = ["Let me add.", "\n<tool_", "call>" + call[len("<tool_call>") : 20], call[20:]]
    with LocalServer(build_app(ScriptedEngine(pieces), "tiny", runs_engine=False)) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        r = client.responses.create(model="tiny", input="add", tools=[ADD])
        events = list(client.responses.create(model="tiny", input="add", tools=[ADD], stream=True))
    assert [item.type for item in r.output] == ["message", "function_call"]
    assert r.output_text == "Let me add." and json.loads(r.output[1].arguments) == {"a": 1, "b": 2}
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [item.type for item in done] == ["message", "function_call"]
    assert done[0].content[0].text == "Let me add." and done[1].call_id.startswith("call_")
    assert json.loads(done[1].arguments) == {"a": 1, "b": 2}
    assert [e.output_index for e in events if e.type == "response.output_item.added"] == [0, 1]


# ---- stored responses -----------------------------------------------------------------------------------
def test_previous_response_id_goes_on_from_the_stored_conversation(server):
    first = server.client.responses.create(input="hi", instructions="be brief", max_output_tokens=6, **GREEDY)
    assert first.store is True
    second = server.client.responses.create(
        input="again", previous_response_id=first.id, instructions="be kind", max_output_tokens=8, **GREEDY
    )
    expected = _chat_text(
        server,
        [  # the earlier instructions are not carried over, as OpenAI's API has it
            {"role": "system", "content": "be kind"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "again"},
        ],
        8,
    )
    assert second.output_text == expected and second.previous_response_id == first.id


def test_a_stored_function_call_is_answered_by_its_output_in_the_next_response(server):
    first = server.client.responses.create(
        input="add", tools=[ADD], tool_choice="required", model="tiny", temperature=0, max_output_tokens=600
    )
    call = next(item for item in first.output if item.type == "function_call")
    answer = [{"type": "function_call_output", "call_id": call.call_id, "output": "3"}]
    r = server.client.responses.create(
        input=answer, previous_response_id=first.id, tools=[ADD], max_output_tokens=10, **GREEDY
    )
    chat = server.client.chat.completions.create(
        messages=[
            {"role": "user", "content": "add"},
            {"role": "assistant", "tool_calls": [{"id": call.call_id, "type": "function", "function": _fn(call)}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "3"},
        ],
        tools=[TOOLS[1]],
        max_tokens=10,
        **GREEDY,
    )
    assert r.output_text == chat.choices[0].message.content


def _fn(call) -> dict:
    return {"name": call.name, "arguments": call.arguments}


def test_a_stored_response_is_read_back_and_deleted_by_its_key_alone(server):
    streamed = list(server.client.responses.create(input="abc", max_output_tokens=5, stream=True, **GREEDY))
    done = streamed[-1].response
    read = server.client.responses.retrieve(done.id)
    assert read.output_text == done.output_text and read.usage.output_tokens == 5
    other = openai.OpenAI(base_url=server.url + "/v1", api_key="someone else", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(done.id)
    server.client.responses.delete(done.id)
    with pytest.raises(openai.NotFoundError, match="store=false"):
        server.client.responses.retrieve(done.id)


def test_store_false_keeps_nothing(server):
    r = server.client.responses.create(input="hi", store=False, max_output_tokens=3, **GREEDY)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        server.client.responses.create(input="more", previous_response_id=r.id, max_output_tokens=3, **GREEDY)


def test_the_store_lets_the_oldest_go_past_its_bounds():
    store = ResponseStore(max_responses=2, max_bytes=10_000)
    for n in range(3):
        store.put("me", {"id": f"r{n}"}, [{"role": "user", "content": "x"}])
    with pytest.raises(ResponseNotFound):
        store.get("me", "r0")
    assert store.get("me", "r2").body == {"id": "r2"}
    store.put("me", {"id": "big"}, [{"role": "user", "content": "x" * 20_000}])  # alone past the bytes: none kept
    with pytest.raises(ResponseNotFound):
        store.get("me", "r1")
