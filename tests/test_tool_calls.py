"""Tool calling on the chat endpoint: calls read out of the model's text (Hermes' <tool_call> blocks) the same
however the text is streamed, forced calls by grammar, the tools and earlier calls rendered into the prompt, and
clear 400s; through the `openai` client against tiny random models (vocabulary 100: braces and quotes are tokens)."""

import json
import random

import jsonschema
import openai
import pytest
from conftest import LocalServer, ScriptedEngine, tiny_model

from specdecode import LLM, SamplingParams
from specdecode.sampling import StructuredOutput
from specdecode.server import call_formats
from specdecode.server.api import build_app
from specdecode.server.async_engine import AsyncEngine
from specdecode.server.tools import Tools

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer", "maximum": 99}, "b": {"type": "integer", "maximum": 99}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
PARIS, ROME = ("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "Rome", "days": 2})
XML_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n"
    "</function>\n</tool_call>"
)
GLM_CALL = (
    "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n"
    "<arg_value>2</arg_value>\n</tool_call>"
)
MISTRAL_CALL = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}'
# A model's text, the content read from it (the text itself: no call) and its calls as (name, arguments).
READ = [
    (CALL, None, [PARIS]),
    ("Let me look.\n" + CALL + "\n" + CALL.replace("Paris", "Rome") + "\n", "Let me look.", [PARIS, ROME]),
    ("no call here: < tool_call> and <tool_ca", "self", []),
    ('<tool_call>{"name": "unknown", "arguments": {}}</tool_call> then text', "self", []),  # undeclared
    ('<tool_call>{"name": "get_weather", "argu', "self", []),  # cut short
    (
        'a\n\n<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>  \n more \n',
        "a\n\n  \n more",
        [("add", {"a": 1, "b": 2})],
    ),
    ("<tool_call>not json</tool_call>" + CALL, "<tool_call>not json</tool_call>", [PARIS]),
    # bare calls, as small models answer despite their templates; Llama 3's form; Mistral's (its marker kept, or
    # skipped as a special token)
    (
        '```json\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}\n```',
        None,
        [("get_weather", {"city": "Oslo", "days": 1})],
    ),
    ('  {"name": "add", "arguments": {"a": 1, "b": 2}}', None, [("add", {"a": 1, "b": 2})]),
    ('{"name": "add", "parameters": {"a": 3, "b": 4}}', None, [("add", {"a": 3, "b": 4})]),
    (
        '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 5, "b": 6}}, {"name": "add", "arguments": {"a": 7, "b": 8}}]',
        None,
        [("add", {"a": 5, "b": 6}), ("add", {"a": 7, "b": 8})],
    ),
    (' [{"name": "add", "arguments": {"a": 1, "b": 1}}]', None, [("add", {"a": 1, "b": 1})]),
    ('{"name": "nope", "arguments": {}}', "self", []),
    ('{"name": ["get_weather"], "arguments": {}}', "self", []),
    ('{"key": 1} and more', "self", []),
    ("``not a fence", "self", []),
    ("[1] a footnote", "self", []),
    # Mistral's from its tokenizer version 11 (the markers are special tokens the tokenizer keeps in the text)
    (MISTRAL_CALL, None, [PARIS]),
    ("Sure." + MISTRAL_CALL + MISTRAL_CALL.replace("Paris", "Rome"), "Sure.", [PARIS, ROME]),
    ('[TOOL_CALLS]add[CALL_ID]a1B2c3D4e[ARGS]{"a": 1, "b": 2}', None, [("add", {"a": 1, "b": 2})]),
    ('Sure. [TOOL_CALLS][{"name": "add", "arguments": {"a": 5, "b": 6}}]', "Sure.", [("add", {"a": 5, "b": 6})]),
    ('[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2} and text', " and text", [("add", {"a": 1, "b": 2})]),
    ("[TOOL_CALLS]unknown[ARGS]{}", "self", []),
    ("[TOOL_CALLS]add[ARGS]42 and more", "self", []),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Pa', "self", []),  # cut short
    ('[TOOL_CALLS][{"name": "add", "arguments": {"a": 5}}, {"name": "nope", "arguments": {}}]', "self", []),
    ("[TOOL_CALLS] what now [TOOL_CALL", "self", []),
    ("[TOOL_CALLS]add[ARGS][TOOL_CALLS]" + MISTRAL_CALL, "[TOOL_CALLS]add[ARGS][TOOL_CALLS]", [PARIS]),
    ("[TOOL_CALLS][1, 2]" + MISTRAL_CALL, "[TOOL_CALLS][1, 2]", [PARIS]),
    # Qwen3-Coder's XML inside the blocks: each value read as its schema's type
    ("Sure.\n" + XML_CALL, "Sure.", [PARIS]),
    (XML_CALL.replace("\n2\n", "\ntwo\n"), None, [("get_weather", {"city": "Paris", "days": "two"})]),
    (XML_CALL.replace("get_weather", "unknown"), "self", []),
    ("<tool_call><function=add><parameter=a>1</parameter>", "self", []),  # cut short
    # GLM-4.5's: the name, then key and value pairs, each value read as its schema's type
    ("Sure.\n" + GLM_CALL, "Sure.", [PARIS]),
    (GLM_CALL + "\n" + GLM_CALL.replace("Paris", "Rome"), None, [PARIS, ROME]),
    (
        "<tool_call>add\n<arg_key>a</arg_key><arg_value>1</arg_value><arg_key>b</arg_key><arg_value>2</arg_value></tool_call>",
        None,
        [("add", {"a": 1, "b": 2})],
    ),  # fmt: skip
    (GLM_CALL.replace("get_weather", "unknown"), "self", []),
    (GLM_CALL.replace("<arg_key>days", "stray text <arg_key>days"), "self", []),
    ("<tool_call>add\n<arg_key>a</arg_key><arg_value>1", "self", []),  # cut short
]


def _streamed(tools: Tools, pieces: list[str]):
    stream, content, calls = tools.stream(), [], []
    for piece in pieces:
        text, made = stream.feed(piece)
        content.append(text)
        calls += made
    text, made = stream.finish()
    joined = "".join(content) + text
    return (joined or None) if calls + made else joined, [(c.name, c.arguments) for c in calls + made]


def _splits(text: str, rng: random.Random, trials: int = 300):
    for _ in range(trials):
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, min(8, len(text)))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def test_a_stream_splits_content_and_calls_as_the_whole_text_does_however_it_arrives():
    tools, rng = Tools.from_request(TOOLS, None, True), random.Random(0)
    for text, _, _ in READ:
        content, calls = tools.parse(text)
        whole = (content, [(c.name, c.arguments) for c in calls])
        for pieces in _splits(text, rng):
            assert _streamed(tools, pieces) == whole, pieces


def test_a_stream_that_does_not_hold_a_tag_s_first_characters_splits_otherwise(monkeypatch):
    """The broken variant: text that may begin <tool_call> leaves at once, so a tag cut between two pieces is
    sent as content and its call is lost."""
    tools, rng = Tools.from_request(TOOLS, None, True), random.Random(0)
    monkeypatch.setattr(call_formats, "partial_tag", lambda text, tags=(): 0)
    whole = _streamed(tools, [CALL])
    assert any(_streamed(tools, pieces) != whole for pieces in _splits(CALL, rng))


def test_calls_are_read_from_hermes_blocks_and_whole_json_answers_and_the_rest_is_content():
    tools = Tools.from_request(TOOLS, None, True)
    for text, content, calls in READ:
        got, made = tools.parse(text)
        expected = text if content == "self" else content
        assert (got, [(c.name, json.loads(c.arguments)) for c in made]) == (expected, calls)
        assert len({c.id for c in made}) == len(made)
    assert tools.finish_reason("stop", True) == "tool_calls" and tools.finish_reason("length", True) == "length"


@pytest.fixture(scope="module")
def server():
    target = tiny_model(seed=0, vocab=100, max_position=2048)  # the tools' JSON is a token a character
    llm = LLM(
        target=target,
        draft=tiny_model(seed=5, vocab=100, layers=1, max_position=2048),
        num_speculative_tokens=3,
        max_model_len=2048,
        max_num_seqs=8,
        speculation_policy="fixed",
    )
    with LocalServer(build_app(AsyncEngine(llm.engine), "tiny")) as served:
        served.client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
        served.plain = LLM(target=target, num_speculative_tokens=0, max_model_len=2048)
        yield served


ASK = [{"role": "user", "content": "weather?"}]


def _chat(server, max_tokens=200, **kwargs):
    return server.client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=max_tokens, temperature=0, **kwargs
    )


def _streamed_calls(chunks) -> tuple[str, dict, str]:
    """(content, {index: [name, arguments]}, finish reason) accumulated from a stream, as clients do."""
    content, calls, reason = "", {}, None
    for chunk in chunks:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, ["", ""])
            entry[0] += call.function.name or ""
            entry[1] += call.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    return content, calls, reason


def test_a_named_function_is_called_with_arguments_its_schema_allows(server):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = _chat(server, tools=TOOLS, tool_choice=choice).choices[0]
    assert r.message.content is None and r.finish_reason == "stop"  # OpenAI's reason when the call is forced
    (call,) = r.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    # what the engine computes for the same prompt and grammar, without the server
    plain = server.plain.chat(
        ASK,
        SamplingParams(temperature=0, max_tokens=200, structured_output=StructuredOutput(json=WEATHER)),
        tools=TOOLS,
    )[0]
    assert call.function.arguments == plain.outputs[0].text.strip()
    content, calls, reason = _streamed_calls(_chat(server, tools=TOOLS, tool_choice=choice, stream=True))
    assert (content, calls, reason) == ("", {0: ["get_weather", call.function.arguments]}, "stop")


def test_required_calls_one_declared_function_when_parallel_calls_are_off(server):
    # a random model may spend up to 20 spaces wherever JSON allows them
    r = _chat(server, 480, tools=TOOLS, tool_choice="required", parallel_tool_calls=False).choices[0]
    assert r.finish_reason == "tool_calls"
    (call,) = r.message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_tools_reach_the_prompt_and_none_leaves_them_out(server):
    """auto: the prompt holds the tools (a random model calls nothing, so its text is the content, as the engine
    decodes that prompt); none: the prompt without them."""
    asked = _chat(server, tools=TOOLS).choices[0]
    with_tools = server.plain.chat(ASK, SamplingParams(temperature=0, max_tokens=200), tools=TOOLS)[0].outputs[0]
    without = server.plain.chat(ASK, SamplingParams(temperature=0, max_tokens=200))[0].outputs[0]
    assert with_tools.text != without.text  # the check can fail
    assert asked.message.tool_calls is None and asked.message.content == with_tools.text
    assert _chat(server, tools=TOOLS, tool_choice="none").choices[0].message.content == without.text


def test_earlier_calls_and_tool_results_are_rendered(server):
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    ]
    r = server.client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=30, temperature=0)
    rendered = [history[0], {**history[1], "tool_calls": [{**history[1]["tool_calls"][0]}]}, history[2]]
    rendered[1]["tool_calls"][0]["function"] = {"name": "add", "arguments": {"a": 1, "b": 2}}  # as templates read
    rendered[1]["content"] = ""
    plain = server.plain.chat(rendered, SamplingParams(temperature=0, max_tokens=30), tools=TOOLS)[0].outputs[0]
    assert r.choices[0].message.content == plain.text


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(tool_choice="required"), "tool_choice needs tools"),
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "not among the tools"),
        (dict(tools=[{"type": "function", "function": {"description": "no name"}}]), "each tool is"),
        (dict(tools=TOOLS, tool_choice="sometimes"), 'tool_choice is "auto"'),
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": "add"}), 'tool_choice is "auto"'),
        (dict(tools=TOOLS, parallel_tool_calls=False), "parallel_tool_calls false"),
        (
            dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
            "constrains the output already",
        ),
        (dict(functions=[{"name": "f"}]), "functions is not supported"),
    ],
)
def test_tool_requests_the_server_cannot_honour_get_a_400_that_says_why(server, fields, message):
    with pytest.raises(openai.BadRequestError, match=message):
        _chat(server, **fields)


def test_a_call_in_the_history_whose_arguments_are_not_a_json_object_gets_a_400(server):
    bad = {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{a: 1"}}
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [bad]}]
    with pytest.raises(openai.BadRequestError, match="arguments are not a JSON object"):
        server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
    bad["function"]["arguments"] = "[1, 2]"
    with pytest.raises(openai.BadRequestError, match="arguments are not a JSON object"):
        server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)


@pytest.mark.parametrize(
    "text, schema, value",
    [
        ("Paris", {"type": "string"}, "Paris"),
        ("12", {"type": "string"}, "12"),
        ("12", {"type": "integer"}, 12),
        ("1.5", {"type": "number"}, 1.5),
        ("1.5", {"type": "integer"}, "1.5"),
        ("True", {"type": "boolean"}, True),
        ("false", {"type": ["boolean", "null"]}, False),
        ('{"a": [1, 2]}', {"type": "object"}, {"a": [1, 2]}),
        ("[1, 2]", {}, [1, 2]),
        ("not json", {}, "not json"),
        ("null", {"type": "null"}, None),
    ],
)
def test_qwen3_coder_parameters_are_read_as_their_schemas_types(text, schema, value):
    assert call_formats.typed(text, schema) == value


MARKED_REPLY = 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}'


@pytest.fixture(scope="module")
def mistral_tokenizers(tmp_path_factory):
    """A Mistral checkpoint's tokenizer whose [TOOL_CALLS] and [ARGS] are special tokens, as in Mistral's own
    vocabularies: read from the checkpoint folder and from llama.cpp's conversion of it."""
    from families import convert, make_checkpoint, save_spm_tokenizer

    from specdecode.models.tokenizer import Tokenizer

    folder = make_checkpoint("mistral", tmp_path_factory.mktemp("mistral-tools"))
    markers = ("[INST]", "[/INST]", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[THINK]", "[/THINK]")
    save_spm_tokenizer(folder, markers, (MARKED_REPLY,) * 20)
    gguf = convert(folder, folder / "model.gguf")
    return {"hf": Tokenizer.from_pretrained(str(folder)), "gguf": Tokenizer.from_gguf(str(gguf), str(folder / "gguf"))}


def _detokenized(tok, ids: list[int]) -> str:
    """The text the engine gives a reply token by token, as the server reads calls from it."""
    from specdecode.engine.sequence import Detokenizer

    detokenizer, text = Detokenizer(0), []
    for n in range(1, len(ids) + 1):
        text.append(detokenizer.new_text(tok, ids[:n], flush=n == len(ids)))
    return "".join(text)


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_mistral_s_call_markers_stay_in_a_reply_s_text_and_its_calls_are_read(mistral_tokenizers, source):
    """The other special tokens are still left out (the end of turn), and kept where a request asks; Magistral's
    thinking tags are kept too."""
    tok = mistral_tokenizers[source]
    reply = tok.encode_fragment(MARKED_REPLY) + [tok.hf.eos_token_id]
    assert tok.token_strings(reply).count("[TOOL_CALLS]") == 1 and "[ARGS]" in tok.token_strings(reply)
    text = tok.decode(reply)  # SentencePiece puts a space after a special token
    assert text == _detokenized(tok, reply) and text.replace(" ", "") == MARKED_REPLY.replace(" ", "")
    assert tok.decode(reply, skip_special_tokens=False).endswith("</s>")
    content, (call,) = Tools.from_request(TOOLS, None, True).parse(text)
    assert (content, call.name, json.loads(call.arguments)) == ("Sure.", *PARIS)
    thought = tok.encode_fragment("[THINK]Paris[/THINK]")  # Magistral's thinking, its tags the budget's ids
    assert tok.think_ids == (thought[0], thought[-1]) and tok.decode(thought).replace(" ", "") == "[THINK]Paris[/THINK]"


def test_a_tokenizer_that_skips_the_markers_loses_the_call(mistral_tokenizers, monkeypatch):
    """The broken variant: the markers left out as the other special tokens are, the call reads as content."""
    tok = mistral_tokenizers["gguf"]
    monkeypatch.setattr(tok, "hidden_ids", None)
    reply = tok.encode_fragment(MARKED_REPLY)
    content, calls = Tools.from_request(TOOLS, None, True).parse(_detokenized(tok, reply))
    assert calls == [] and "get_weather" in content and "[TOOL_CALLS]" not in content


def test_a_vocabulary_without_markers_decodes_as_transformers_does():
    from families import vocabulary

    tok = vocabulary("ggml-vocab-qwen2.gguf")
    ids = tok.encode("<|im_start|>assistant\nHi<|im_end|>")
    assert tok.hidden_ids is None and tok.decode(ids) == tok.hf.decode(ids, skip_special_tokens=True) == "assistant\nHi"


def test_mistral_s_calls_reach_the_openai_client_whole_and_streamed():
    pieces = ["Sure.", "[TOOL_CALLS]", "get", "_weather", "[ARGS]", '{"city": "Par', 'is", "days": 2}']
    pieces += ["[TOOL_CALLS]", "add", "[CALL_ID]", "a1B2c3D4e", "[ARGS]", '{"a": 1, "b": 2}']
    with LocalServer(build_app(ScriptedEngine(pieces), "tiny", runs_engine=False)) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Paris?"}], tools=TOOLS, max_tokens=50)
        whole = client.chat.completions.create(**kwargs).choices[0]
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
    made = [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
    assert (whole.message.content, made, whole.finish_reason) == (
        "Sure.",
        [PARIS, ("add", {"a": 1, "b": 2})],
        "tool_calls",
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    streamed = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert text == "Sure." and [(d.index, d.function.name) for d in streamed] == [(0, "get_weather"), (1, "add")]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
