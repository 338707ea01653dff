"""The whole sampling API through the official `openai` client with speculation on (a draft model and
prompt lookup): penalties, logit_bias, min_p, min_tokens, logprobs (chat and completions, streamed and
not), n and structured output (response_format, guided_*). Greedy answers equal plain decoding's with the
same processors, token for token, and the logprobs equal plain decoding's."""

import json
import re

import httpx
import jsonschema
import openai
import pytest
from conftest import SHAPE_ATOL, LocalServer, tiny_model

from specdecode import LLM, SamplingParams
from specdecode.sampling import StructuredOutput
from specdecode.server.api import build_app
from specdecode.server.async_engine import AsyncEngine

PROCESSORS = dict(presence_penalty=0.6, frequency_penalty=0.4, logit_bias={"5": 3.0, "9": -100})
EXTRA = dict(repetition_penalty=1.2, min_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module", params=["draft", "ngram"])
def server(request, target, random_draft):
    draft = dict(draft=target) if request.param == "draft" else dict(speculative_model="ngram")
    llm = LLM(
        target=target, num_speculative_tokens=3, max_model_len=256, max_num_seqs=8, speculation_policy="fixed", **draft
    )
    with LocalServer(build_app(AsyncEngine(llm.engine), "tiny")) as server:
        server.client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        yield server


@pytest.fixture(scope="module")
def plain(target):
    """Plain decoding with the same processors: the reference every answer must equal."""
    llm = LLM(target=target, num_speculative_tokens=0, max_model_len=256)

    def run(prompt_ids, max_tokens, logprobs=None):
        params = SamplingParams(
            temperature=0,
            max_tokens=max_tokens,
            logprobs=logprobs,
            logit_bias={int(k): v for k, v in PROCESSORS["logit_bias"].items()},
            **{k: v for k, v in PROCESSORS.items() if k != "logit_bias"},
            **EXTRA,
        )
        return llm.generate([prompt_ids], params)[0].outputs[0]

    return run


def _completion(server, stream=False, **kw):
    return server.client.completions.create(
        model="tiny",
        prompt="hello hello hello world",
        max_tokens=16,
        temperature=0,
        stream=stream,
        **PROCESSORS,
        extra_body=EXTRA,
        **kw,
    )


def test_processed_greedy_completion_equals_plain(server, plain, target):
    r = _completion(server)
    reference = plain(target.tokenizer.encode("hello hello hello world"), 16)
    assert r.choices[0].text == reference.text
    assert r.usage.model_extra["speculation"]["num_draft_tokens"] > 0


def test_completion_logprobs_equal_plain_streamed_and_not(server, plain, target):
    reference = plain(target.tokenizer.encode("hello hello hello world"), 16, logprobs=2)
    whole = _completion(server, logprobs=2).choices[0].logprobs
    assert len(whole.token_logprobs) == 16
    assert whole.tokens == [target.tokenizer.decode([lp.token_id]) for lp in reference.logprobs]
    assert max(abs(a - b.logprob) for a, b in zip(whole.token_logprobs, reference.logprobs)) < 1e-4
    assert all(len(top) == 2 for top in whole.top_logprobs)
    chunks = list(_completion(server, stream=True, logprobs=2))
    streamed = [lp for c in chunks if c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(whole.token_logprobs, abs=SHAPE_ATOL)  # the streamed prompt is cached


def test_chat_logprobs_and_top_logprobs(server):
    msgs = [{"role": "user", "content": "abcabc"}]
    kw = dict(
        model="tiny",
        messages=msgs,
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        **PROCESSORS,
        extra_body=EXTRA,
    )
    whole = server.client.chat.completions.create(**kw).choices[0]
    content = whole.logprobs.content
    assert len(content) == 12 and "".join(t.token for t in content) == whole.message.content
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob >= t.logprob for t in content)
    # another user: the prompt is computed whole again, not from the first request's cached rows (whose
    # last token, computed apart, rounds differently in the 7th digit)
    streamed = [
        t
        for c in server.client.chat.completions.create(stream=True, user="another", **kw)
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert [t.token for t in streamed] == [t.token for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-6)


def test_a_users_next_turn_reports_its_cached_prompt_tokens(server):
    """The second turn starts from the first's kept context: OpenAI's cached_tokens counts it; another
    user's identical request computes its prompt whole."""
    kw = dict(model="tiny", max_tokens=6, temperature=0)
    turn = [{"role": "user", "content": "count: 1 2 3 4 5 6 7 8 9"}]
    first = server.client.chat.completions.create(messages=turn, user="carol", **kw)
    turn += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "again"}]
    second = server.client.chat.completions.create(messages=turn, user="carol", **kw)
    stranger = server.client.chat.completions.create(messages=turn, user="dave", **kw)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert first.usage.prompt_tokens < second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens
    assert stranger.usage.prompt_tokens_details.cached_tokens == 0
    assert stranger.choices[0].message.content == second.choices[0].message.content
    metrics = httpx.get(server.url + "/metrics").text
    cached = float(re.search(r"^specdecode_prompt_tokens_cached_total (\S+)$", metrics, re.M).group(1))
    assert cached >= second.usage.prompt_tokens_details.cached_tokens


def test_n_outputs_streamed_and_not(server):
    kw = dict(
        model="tiny",
        prompt="the cat",
        max_tokens=10,
        temperature=1.0,
        n=3,
        seed=5,
        extra_body={"ignore_eos": True, "min_p": 0.05},
    )
    whole = server.client.completions.create(**kw)
    assert sorted(c.index for c in whole.choices) == [0, 1, 2]
    assert whole.usage.completion_tokens == 30
    chunks = list(server.client.completions.create(stream=True, **kw))
    texts = {i: "".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in range(3)}
    assert texts == {c.index: c.text for c in whole.choices}  # seeded: the same three texts
    assert len(set(texts.values())) > 1


def test_min_tokens_and_logit_bias_reach_the_engine(server):
    eos = 63  # the tiny tokenizer's EOS
    r = server.client.completions.create(
        model="tiny", prompt="x", max_tokens=8, temperature=0, logit_bias={str(eos): 100}, extra_body={"min_tokens": 3}
    )
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "stop"


# ---- structured output ----------------------------------------------------------------------------
SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["a", "b"],
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"enum": ["x", "y"]}},
}


@pytest.fixture(scope="module", params=["draft", "ngram"])
def json_server(request):
    """Vocabulary 100, so that braces and quotes are tokens."""
    target = tiny_model(seed=0, vocab=100)
    proposer = (
        dict(draft=tiny_model(seed=5, vocab=100, layers=1))
        if request.param == "draft"
        else dict(speculative_model="ngram")
    )
    llm = LLM(
        target=target,
        num_speculative_tokens=3,
        max_model_len=256,
        max_num_seqs=8,
        speculation_policy="fixed",
        **proposer,
    )
    with LocalServer(build_app(AsyncEngine(llm.engine), "tiny")) as server:
        server.client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        server.target = target
        yield server


def test_response_format_json_schema_validates_and_equals_plain(json_server):
    fmt = {"type": "json_schema", "json_schema": {"name": "pair", "schema": SCHEMA, "strict": True}}
    msgs = [{"role": "user", "content": "a pair"}]
    r = json_server.client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=180, temperature=0, response_format=fmt
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    assert r.choices[0].finish_reason == "stop"
    plain = LLM(target=json_server.target, num_speculative_tokens=0, max_model_len=256).chat(
        msgs, SamplingParams(temperature=0, max_tokens=180, structured_output=StructuredOutput(json=SCHEMA))
    )
    assert r.choices[0].message.content == plain[0].outputs[0].text
    streamed = json_server.client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=180, temperature=0, response_format=fmt, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == r.choices[0].message.content


def test_sampled_json_schema_with_n_and_guided_fields(json_server):
    r = json_server.client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "json"}],
        max_tokens=230,  # a random model may spend up to 20 spaces wherever JSON allows them
        temperature=1.0,
        n=4,
        seed=2,
        response_format={"type": "json_schema", "json_schema": {"name": "pair", "schema": SCHEMA}},
    )
    for choice in r.choices:
        assert choice.finish_reason == "stop"  # the grammar ended the text, not the token limit
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    choice = json_server.client.completions.create(
        model="tiny",
        prompt="pick",
        max_tokens=10,
        temperature=1.0,
        extra_body={"guided_choice": ["red", "green", "blue"]},
    )
    assert choice.choices[0].text in ("red", "green", "blue")
    regex = json_server.client.completions.create(
        model="tiny", prompt="code", max_tokens=10, temperature=1.0, extra_body={"guided_regex": "[A-Z]{2}-[0-9]{3}"}
    )
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", regex.choices[0].text)


def test_vllms_structured_outputs_equal_the_librarys_constraints(json_server):
    """vLLM's structured_outputs (its API since 0.12) and guided_whitespace_pattern: each greedy answer under
    speculation is plain decoding's under the same StructuredOutput."""
    plain = LLM(target=json_server.target, num_speculative_tokens=0, max_model_len=256)
    cases = [
        (
            {"choice": ["red", "green", "blue"], "disable_fallback": True},
            StructuredOutput(choice=("red", "green", "blue")),
        ),
        ({"regex": "[A-Z]{2}-[0-9]{3}"}, StructuredOutput(regex="[A-Z]{2}-[0-9]{3}")),
        (
            {"json": json.dumps(SCHEMA), "disable_any_whitespace": True},
            StructuredOutput(json=SCHEMA, disable_any_whitespace=True),
        ),
        ({"json": SCHEMA, "whitespace_pattern": "[ ]?"}, StructuredOutput(json=SCHEMA, whitespace_pattern="[ ]?")),
    ]
    texts = []
    for fields, spec in cases:
        r = json_server.client.completions.create(
            model="tiny", prompt="pick", max_tokens=60, temperature=0, extra_body={"structured_outputs": fields}
        )
        expected = plain.generate(["pick"], SamplingParams(temperature=0, max_tokens=60, structured_output=spec))
        assert r.choices[0].text == expected[0].outputs[0].text, fields
        texts.append(r.choices[0].text)
    assert texts[0] in ("red", "green", "blue") and re.fullmatch("[A-Z]{2}-[0-9]{3}", texts[1])
    assert json.dumps(json.loads(texts[2]), separators=(",", ":")) == texts[2]
    guided = json_server.client.completions.create(
        model="tiny",
        prompt="pick",
        max_tokens=60,
        temperature=0,
        extra_body={"guided_json": SCHEMA, "guided_whitespace_pattern": "[ ]?"},
    )
    assert guided.choices[0].text == r.choices[0].text


def test_structural_tags_as_response_format_and_structured_outputs(json_server):
    """vLLM's structural tag, in response_format (its structures and triggers beside the type) and in
    structured_outputs (a JSON string): the library's output under the same tag, with a structure opened."""
    tag = {
        "structures": [{"begin": "<a>", "schema": {"type": "array", "items": {"type": "integer"}}, "end": "!"}],
        "triggers": ["<"],
    }
    bias = {str(ord("<") - 32): 8.0}
    plain = LLM(target=json_server.target, num_speculative_tokens=0, max_model_len=256)
    msgs = [{"role": "user", "content": "tag"}]
    spec = StructuredOutput(structural_tag=tag)
    params = SamplingParams(temperature=0, max_tokens=60, logit_bias={ord("<") - 32: 8.0}, structured_output=spec)
    expected = plain.chat(msgs, params)
    chat = json_server.client.chat.completions.create(
        model="tiny",
        messages=msgs,
        max_tokens=60,
        temperature=0,
        logit_bias=bias,
        response_format={"type": "structural_tag", **tag},
    )
    assert chat.choices[0].message.content == expected[0].outputs[0].text and "<a>[" in expected[0].outputs[0].text
    completion = json_server.client.completions.create(
        model="tiny",
        prompt="tag",
        max_tokens=60,
        temperature=0,
        logit_bias=bias,
        extra_body={"structured_outputs": {"structural_tag": json.dumps(tag)}},
    )
    expected = plain.generate(["tag"], params)
    assert completion.choices[0].text == expected[0].outputs[0].text


def test_echo_returns_the_prompt_and_its_logprobs_streamed_and_not(server, target):
    kw = dict(
        model="tiny",
        prompt="HELLO HELLO",
        max_tokens=6,
        temperature=0,
        echo=True,
        logprobs=1,
        extra_body={"ignore_eos": True},
    )
    whole = server.client.completions.create(**kw).choices[0]
    completion = server.client.completions.create(**{**kw, "echo": False, "logprobs": None}).choices[0].text
    assert whole.text == "HELLO HELLO" + completion
    prompt_ids = target.tokenizer.encode("HELLO HELLO")
    lp = whole.logprobs
    assert len(lp.tokens) == len(prompt_ids) + 6 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens) == whole.text and lp.text_offset[len(prompt_ids)] == len("HELLO HELLO")
    chunks = list(server.client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    streamed = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-6)


def test_prompt_logprobs_are_vllms_each_token_given_those_before_with_its_rank(server, target):
    """vLLM's field: per prompt token (None first) its logprob and rank, and the N most likely tokens' (ranks 1..N):
    the library's numbers, a choice's for completions, the reply's for a chat; never streamed."""
    prompt = "HELLO HELLO world"
    ids = target.tokenizer.encode(prompt)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "prompt_logprobs": 2}
    listed = httpx.post(f"{server.url}/v1/completions", json=body).json()["choices"][0]["prompt_logprobs"]
    scored = (
        LLM(target=target, num_speculative_tokens=0, max_model_len=256)
        .generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
        .prompt_logprobs
    )
    assert listed[0] is None and len(listed) == len(ids)
    for token, entries, lp in zip(ids[1:], listed[1:], scored[1:]):
        assert entries[str(token)]["logprob"] == pytest.approx(lp.logprob, abs=1e-6)
        assert entries[str(token)]["rank"] == lp.rank and [entries[str(i)]["rank"] for i, _ in lp.top] == [1, 2]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "prompt_logprobs": 0}
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=chat).json()
    assert len(reply["prompt_logprobs"]) == reply["usage"]["prompt_tokens"]
    assert "prompt_logprobs" not in reply["choices"][0]
    streamed = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": True})
    assert streamed.status_code == 400 and "cannot be streamed" in streamed.json()["error"]["message"]


def test_best_of_returns_the_outputs_with_the_highest_total_logprob(server):
    kw = dict(model="tiny", prompt="pick", max_tokens=8, temperature=1.0, seed=9, extra_body={"ignore_eos": True})
    all_four = server.client.completions.create(n=4, logprobs=0, **kw)
    totals = {c.text: sum(c.logprobs.token_logprobs) for c in all_four.choices}
    best = server.client.completions.create(n=2, best_of=4, **kw)
    assert [c.text for c in best.choices] == sorted(totals, key=totals.get, reverse=True)[:2]
    assert [c.index for c in best.choices] == [0, 1] and best.choices[0].logprobs is None
    assert best.usage.completion_tokens == 32  # all four were generated
    refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "best_of": 2, "stream": True})
    assert refused.status_code == 400 and "cannot be streamed" in refused.json()["error"]["message"]
