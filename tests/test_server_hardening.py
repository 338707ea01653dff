"""The server under bad input and overload: a bad request gets a clear error and never costs the
others theirs; a full queue answers 429 at once; the API key and body size are checked before work."""

import threading
import time

import httpx
import pytest
from conftest import VOCAB, LocalServer, wait_until

from specdecode import LLM, SamplingParams
from specdecode.server.api import build_app
from specdecode.server.async_engine import AsyncEngine

KEY = "hardening-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _solo(target, prompt, max_tokens):
    llm = LLM(target=target, num_speculative_tokens=0, max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate(prompt, params)[0].outputs[0].text


def _slowed(llm, seconds):
    """Each engine step takes at least `seconds`, so that requests overlap for long enough to test."""
    step = llm.engine.step

    def slow_step():
        time.sleep(seconds)
        return step()

    llm.engine.step = slow_step


@pytest.fixture
def server(target, random_draft):
    llm = LLM(
        target=target,
        draft=random_draft,
        num_speculative_tokens=3,
        max_model_len=256,
        max_num_seqs=2,
        speculation_policy="fixed",
    )
    _slowed(llm, 0.01)
    engine = AsyncEngine(llm.engine, max_waiting=1)
    with LocalServer(build_app(engine, "tiny", KEY, max_request_bytes=4096)) as s:
        s.engine = engine
        yield s


def _complete(server, body, **kw):
    return httpx.post(
        server.url + "/v1/completions", json={"model": "tiny", "temperature": 0, **body}, headers=AUTH, timeout=60, **kw
    )


@pytest.mark.parametrize("bad", [[5, VOCAB], [-1, 3], [7, 10**12]])
def test_token_ids_outside_the_vocabulary_get_a_400_while_other_requests_carry_on(server, target, bad):
    good = {}
    body = {"prompt": "hello world", "max_tokens": 40, "ignore_eos": True}
    worker = threading.Thread(target=lambda: good.update(r=_complete(server, body)))
    worker.start()
    wait_until(lambda: server.engine.engine.running, "the good request is running")
    r = _complete(server, {"prompt": bad, "max_tokens": 4})
    worker.join()
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
    assert good["r"].status_code == 200
    assert good["r"].json()["choices"][0]["text"] == _solo(target, "hello world", 40)


def test_a_full_waiting_queue_answers_429_with_retry_after_and_recovers(server):
    body = {"prompt": "abcabc", "max_tokens": 60, "ignore_eos": True}
    results = []
    workers = [threading.Thread(target=lambda: results.append(_complete(server, body))) for _ in range(3)]
    for w in workers:  # two slots and one waiting place
        w.start()
    wait_until(lambda: server.engine.in_flight == 3, "the three requests arrived")
    refused = _complete(server, body)
    for w in workers:
        w.join()
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert "capacity" in refused.json()["error"]["message"]
    assert [r.status_code for r in results] == [200] * 3
    assert all(r.json()["usage"]["completion_tokens"] == 60 for r in results)
    assert server.engine.in_flight == 0  # nothing leaked: the next request is served
    assert _complete(server, {"prompt": "x", "max_tokens": 2}).status_code == 200
    assert "specdecode_requests_rejected_total 1.0" in httpx.get(server.url + "/metrics").text


@pytest.mark.parametrize(
    "auth", [None, "Bearer hardening-kez", "Bearer hardening-key-and-more", "bearer hardening-key", "hardening-key"]
)
def test_wrong_api_keys_are_refused(server, auth):
    headers = {} if auth is None else {"Authorization": auth}
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=headers)
    assert r.status_code == 401
    assert _complete(server, {"prompt": "x", "max_tokens": 2}).status_code == 200


def test_oversized_bodies_are_refused_before_they_are_read(server):
    r = _complete(server, {"prompt": "x" * 5000, "max_tokens": 2})
    assert r.status_code == 413 and "bytes" in r.json()["error"]["message"]
    assert _complete(server, {"prompt": "x" * 100, "max_tokens": 2}).status_code == 200


def test_the_library_refuses_out_of_vocabulary_ids_too(target):
    llm = LLM(target=target, num_speculative_tokens=0, max_model_len=256)
    with pytest.raises(Exception, match="not in this model's vocabulary"):
        llm.generate([[3, VOCAB + 5]], SamplingParams(max_tokens=2))


# Hostile input: each case gets a 4xx with an OpenAI-style error body (never a 500 or a hang), and the
# server still serves afterwards with no sequence slot left behind.
HOSTILE = [
    ("completions", {"prompt": None}),
    ("completions", {"prompt": 123}),
    ("completions", {"prompt": []}),
    ("completions", {"prompt": [[1, 2], "a"]}),
    ("completions", {"prompt": ["a", ""], "stream": True}),
    ("completions", {"prompt": ["a", "b"], "stream": True, "best_of": 3}),
    ("completions", {"prompt": ["a", ""]}),
    ("completions", {"prompt": [[1, 2], [99999]]}),
    ("completions", {"prompt": [1.5, 2]}),
    ("completions", {"prompt": {"text": "hi"}}),
    ("completions", {"prompt": ""}),
    ("completions", {"prompt": "x", "max_tokens": -1}),
    ("completions", {"prompt": "x", "max_tokens": 0}),
    ("completions", {"prompt": "x", "max_tokens": 1e30}),
    ("completions", {"prompt": "x", "max_tokens": 10**9}),
    ("completions", {"prompt": "x", "temperature": "hot"}),
    ("completions", {"prompt": "x", "top_k": -5}),
    ("completions", {"prompt": "x", "top_k": 1.5}),
    ("completions", {"prompt": "x", "seed": "abc"}),
    ("completions", {"prompt": "x", "seed": 2**70}),
    ("completions", {"prompt": "x", "stop": 5}),
    ("completions", {"prompt": "x", "stop": [""]}),
    ("completions", {"prompt": "x", "logprobs": 50}),
    ("completions", {"prompt": "x", "n": 0}),
    ("completions", {"prompt": "x", "stream": "sometimes"}),
    ("completions", {"prompt": "x", "presence_penalty": 5}),
    ("completions", {"prompt": "x", "frequency_penalty": "lots"}),
    ("completions", {"prompt": "x", "logit_bias": {"5": 1000}}),
    ("completions", {"prompt": "x", "logit_bias": {"abc": 1}}),
    ("completions", {"prompt": "x", "logit_bias": {"99999": 1}}),
    ("completions", {"prompt": "x", "repetition_penalty": 0}),
    ("completions", {"prompt": "x", "min_tokens": -1}),
    ("completions", {"prompt": "x", "min_tokens": 9, "max_tokens": 3}),
    ("completions", {"prompt": "x", "n": 100}),
    ("completions", {"prompt": "x", "min_p": 1.5}),
    ("completions", {"prompt": "x", "best_of": 0}),
    ("completions", {"prompt": "x", "echo": "yes please"}),
    ("completions", {"prompt": "x", "suffix": "a model without fill-in-the-middle tokens"}),
    *(
        ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], **fields})
        for fields in [
            {"echo": "sometimes"},
            {"continue_final_message": True, "add_generation_prompt": False},  # the last message is the user's
            {"continue_final_message": True},
            {"chat_template_kwargs": {"tools": []}},
            {"chat_template_kwargs": "enable_thinking"},
            {"add_special_tokens": True},
        ]
    ),
    *(  # vLLM's fields that would change the output and are not implemented here
        ("completions", {"prompt": "x", **fields})
        for fields in [
            {"use_beam_search": True},
            {"stop_token_ids": [99999]},
            {"stop_token_ids": ["x"]},
            {"include_stop_str_in_output": "maybe"},
            # vLLM's vocabulary limits and prompt truncation: values that cannot be served
            {"allowed_token_ids": []},
            {"allowed_token_ids": [99999]},
            {"allowed_token_ids": [5], "bad_words": ["%"]},  # its only token banned
            {"allowed_token_ids": [5], "guided_regex": "a+"},
            {"bad_words": [""]},
            {"bad_words": "x"},
            {"bad_words": ["x"], "guided_choice": ["x", "y"]},
            {"truncate_prompt_tokens": 0},
            {"truncate_prompt_tokens": -2},
            {"return_token_ids": "sometimes"},
            {"skip_special_tokens": "perhaps"},
            {"spaces_between_special_tokens": "sometimes"},
            # vLLM's structured_outputs: refused where it is misspelt, asks two things or what is not built
            {"structured_outputs": {"regex": "a+", "choice": ["a"]}},
            {"structured_outputs": {"regx": "a+"}},
            {"structured_outputs": {"structural_tag": '{"type": "structural_tag"}'}},
            {"structured_outputs": {"structural_tag": {"structures": [], "triggers": ["<"]}}},
            {"response_format": {"type": "structural_tag", "format": {"type": "triggered_tags"}}},
            {"structured_outputs": {"whitespace_pattern": " "}},
            {"structured_outputs": {"regex": "a+", "disable_any_whitespace": True}},
            {"structured_outputs": {"choice": "a"}},
            {"structured_outputs": {"regex": "a+"}, "guided_choice": ["a"]},
            {"structured_outputs": {"json_object": True}, "response_format": {"type": "json_object"}},
            {"guided_whitespace_pattern": " "},
            {"guided_whitespace_pattern": " ", "guided_regex": "a+"},
            {"chat_template": "{{ messages }}"},
            {"add_special_tokens": False},
        ]
    ),
    ("chat/completions", {"messages": []}),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 99}),
    ("chat/completions", {"messages": "hello"}),
    ("chat/completions", {"messages": [{"role": "user"}]}),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}}),
    (
        "chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x"}},
        },
    ),
    ("completions", {"prompt": "x", "guided_regex": "(unclosed"}),
    ("completions", {"prompt": "x", "guided_regex": "a+", "guided_choice": ["a", "b"]}),
    ("completions", {"prompt": "x", "guided_choice": []}),
    ("completions", {"prompt": "x", "guided_grammar": "start: ???"}),
    ("completions", {"prompt": "x", "guided_json": "{not json"}),
    ("completions", {"prompt": "x", "guided_regex": "a+", "ignore_eos": True}),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}),
    *(
        ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], **fields})
        for fields in [
            {"tools": "string"},
            {"tools": [1]},
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
                "tool_choice": "required",
            },
            {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": 5},
            {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function"}},
            {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"function": "f"}},
            {"tools": [{"type": "function", "function": {"name": "f"}}], "parallel_tool_calls": "maybe"},
            {"tool_choice": "required"},
        ]
    ),
    *(
        ("chat/completions", {"messages": [{"role": "assistant", **fields}]})
        for fields in [
            {"tool_calls": [1]},
            {"tool_calls": [{"function": {"name": 1}}]},
            {"tool_calls": [{"function": {"name": "f", "arguments": 5}}]},
            {"content": None},
        ]
    ),
]


@pytest.mark.parametrize("endpoint, body", HOSTILE)
def test_hostile_input_gets_a_clear_4xx(server, endpoint, body):
    r = httpx.post(f"{server.url}/v1/{endpoint}", json={"model": "tiny", **body}, headers=AUTH, timeout=30)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert r.json()["error"]["message"]


@pytest.mark.parametrize(
    "content, headers",
    [
        (b"[1, 2, 3]", {}),
        (b"\xff\xfe not utf-8", {}),
        (b'{"prompt": "x"', {}),
        (b'{"prompt": "x", "max_tokens": NaN}', {}),
        (b'{"prompt": "x", "temperature": 1e400}', {}),
        (b"", {}),
    ],
)
def test_broken_bodies_get_400(server, content, headers):
    r = httpx.post(
        f"{server.url}/v1/completions",
        content=content,
        headers={**AUTH, "Content-Type": "application/json", **headers},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["message"]


def test_after_the_hostile_suite_the_server_serves_and_holds_no_slot(server, target):
    for endpoint, body in HOSTILE[:10]:
        httpx.post(f"{server.url}/v1/{endpoint}", json={"model": "tiny", **body}, headers=AUTH, timeout=30)
    with httpx.stream(
        "POST",
        f"{server.url}/v1/completions",
        headers=AUTH,
        timeout=30,
        json={"model": "tiny", "prompt": "abc", "max_tokens": 50, "stream": True, "ignore_eos": True},
    ) as r:
        next(r.iter_lines())  # a client that leaves after the first chunk
    r = _complete(server, {"prompt": "hello world", "max_tokens": 12, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == _solo(target, "hello world", 12)
    wait_until(lambda: not server.engine.in_flight, "no request is left in flight")
    metrics = httpx.get(server.url + "/metrics").text
    assert "specdecode_num_requests_running 0.0" in metrics


def test_text_content_parts_are_accepted(server, target):
    parts = [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        headers=AUTH,
        timeout=30,
        json={"model": "tiny", "messages": [{"role": "user", "content": parts}], "max_tokens": 5, "temperature": 0},
    )
    plain = httpx.post(
        f"{server.url}/v1/chat/completions",
        headers=AUTH,
        timeout=30,
        json={"model": "tiny", "messages": [{"role": "user", "content": "hel\nlo"}], "max_tokens": 5, "temperature": 0},
    )
    assert r.status_code == 200 and r.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
