"""The OpenAI-compatible server over real HTTP on 127.0.0.1, driven by the official `openai` client,
with tiny random models (the engine is the same one the real models use)."""

import asyncio
import concurrent.futures
import json
import threading

import httpx
import openai
import pytest
from conftest import LocalServer, wait_until

from specdecode import LLM, SamplingParams, SpecDecodeError
from specdecode.server.api import build_app
from specdecode.server.async_engine import AsyncEngine

API_KEY = "test-key"


@pytest.fixture(scope="module")
def served(target, random_draft):
    llm = LLM(
        target=target,
        draft=random_draft,
        num_speculative_tokens=3,
        max_model_len=256,
        max_num_seqs=16,
        speculation_policy="fixed",
    )
    engine = AsyncEngine(llm.engine)
    with LocalServer(build_app(engine, "tiny", API_KEY)) as server:
        server.engine = engine
        server.client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
        yield server


def _solo(target, prompt, max_tokens):
    llm = LLM(target=target, num_speculative_tokens=0, max_model_len=256)
    return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0]


def test_completion_and_usage(served, target):
    r = served.client.completions.create(
        model="tiny", prompt="hello world", max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].text == _solo(target, "hello world", 12).outputs[0].text
    assert r.usage.completion_tokens == 12
    assert r.usage.model_extra["speculation"]["num_draft_tokens"] > 0


def test_streaming_completion_equals_non_streaming(served):
    kwargs = dict(model="tiny", prompt="abcabcabc", max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    whole = served.client.completions.create(**kwargs).choices[0].text
    chunks = list(served.client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_streaming_and_not(served):
    msgs = [{"role": "user", "content": "hi"}]
    whole = served.client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    parts = served.client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=10, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    assert "".join(c.choices[0].delta.content or "" for c in parts) == whole.choices[0].message.content


def test_without_max_tokens_a_chat_runs_to_the_context_end_and_a_completion_gives_16(served):
    """OpenAI's defaults: a chat answer is not cut at some small length; a legacy completion gives 16 tokens."""
    msgs = [{"role": "user", "content": "hi"}]
    chat = served.client.chat.completions.create(
        model="tiny", messages=msgs, temperature=0, extra_body={"ignore_eos": True}
    )
    assert chat.usage.prompt_tokens + chat.usage.completion_tokens == 256
    assert chat.choices[0].finish_reason == "length"
    completion = served.client.completions.create(model="tiny", prompt="x", extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 16


def test_models_health_metrics(served):
    assert [m.id for m in served.client.models.list()] == ["tiny"]
    assert served.client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        served.client.models.retrieve("other/model")
    assert httpx.get(served.url + "/health").json() == {"status": "ok"}
    text = httpx.get(served.url + "/metrics").text
    assert "specdecode_spec_decode_num_draft_tokens_total" in text and "specdecode_num_requests_running" in text


def test_concurrent_requests_batched_equal_solo_and_all_complete(served, target):
    prompts = [f"prompt number {i} " * (1 + i % 3) for i in range(100)]
    lengths = [5 + i % 11 for i in range(100)]

    def one(i):
        r = served.client.completions.create(
            model="tiny", prompt=prompts[i], max_tokens=lengths[i], temperature=0, extra_body={"ignore_eos": True}
        )
        return r.choices[0].text, r.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(100)))
    assert [n for _, n in results] == lengths
    for i in range(0, 100, 9):  # batched greedy equals the same request alone
        assert results[i][0] == _solo(target, prompts[i], lengths[i]).outputs[0].text


@pytest.mark.parametrize(
    "body, message",
    [
        ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 10**9}, "max_tokens"),
        ({"prompt": "x", "temperature": -0.5}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "top_p": 1.5}, "top_p"),
        ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ({"prompt": "x" * 300}, "context"),
        ({"prompt": "x", "n": 17}, "n must be an integer from 1 to 16"),
        ({"max_tokens": 3}, "prompt"),
    ],
)
def test_bad_requests_get_400_and_server_keeps_serving(served, body, message):
    r = httpx.post(
        served.url + "/v1/completions", json={"model": "tiny", **body}, headers={"Authorization": f"Bearer {API_KEY}"}
    )
    assert r.status_code == 400
    assert message in r.json()["error"]["message"]
    ok = served.client.completions.create(model="tiny", prompt="still", max_tokens=3, temperature=0)
    assert ok.choices[0].text is not None


@pytest.mark.parametrize(
    "path, body",
    [("completions", {"prompt": "x"}), ("chat/completions", {"messages": [{"role": "user", "content": "x"}]})],
)
def test_a_model_not_served_here_is_404_and_one_left_out_is_this_one(served, path, body):
    """Another model's name would get this model's output: the client is told which name to send."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(f"{served.url}/v1/{path}", json={"model": "gpt-4o", "max_tokens": 2, **body}, headers=headers)
    assert r.status_code == 404
    assert r.json()["error"]["param"] == "model" and "send model='tiny'" in r.json()["error"]["message"]
    r = httpx.post(f"{served.url}/v1/{path}", json={"max_tokens": 2, **body}, headers=headers)
    assert r.status_code == 200 and r.json()["model"] == "tiny"


def test_malformed_json_is_400(served):
    r = httpx.post(
        served.url + "/v1/completions",
        content=b"{not json",
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
    )
    assert r.status_code == 400 and "error" in r.json()


def test_api_key_required(served):
    r = httpx.post(served.url + "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 401
    bad = openai.OpenAI(base_url=served.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny", prompt="x", max_tokens=2)


def test_client_disconnect_frees_the_slot(served):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {
        "model": "tiny",
        "prompt": "long one",
        "max_tokens": 200,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", served.url + "/v1/completions", json=body, headers=headers) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                break  # one chunk, then hang up
    # the gauge too: an abort while nothing else runs must not leave it counting the aborted request
    wait_until(
        lambda: (
            "specdecode_num_requests_running 0.0" in httpx.get(served.url + "/metrics").text
            and served.engine.engine.runner.num_free == 16
        ),
        "the slot is free again",
        timeout=10,
    )
    assert "specdecode_requests_aborted_total 1.0" in httpx.get(served.url + "/metrics").text


def test_first_token_is_streamed_before_the_first_decode_step(target):
    """TTFT is the prefill's time: the first token reaches the client while the first decode step is held
    back (here, until that token has arrived; published only after the step, it never would)."""
    llm = LLM(target=target, num_speculative_tokens=0, max_model_len=256)
    prompt = target.tokenizer.encode("hello")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    solo = llm.generate([prompt], params)[0].outputs[0].text
    engine, first_token_out = AsyncEngine(llm.engine), threading.Event()
    decode_step = llm.engine._decode_step

    def held_decode_step(seqs, out, chunk=None):
        if not first_token_out.wait(3):
            raise RuntimeError("the first token was not published before the first decode step")
        decode_step(seqs, out, chunk)

    llm.engine._decode_step = held_decode_step

    async def stream():
        updates = engine.generate(prompt, params)
        first = await asyncio.wait_for(updates.__anext__(), 10)
        first_token_out.set()
        return [first] + [u async for u in updates]

    engine.start()
    try:
        updates = asyncio.run(stream())
    finally:
        engine.stop()
    assert updates[0].text == solo[0]
    assert "".join(u.text for u in updates) == solo and updates[-1].finished


@pytest.mark.parametrize(
    "text, stops, finished, sent, expected",
    [
        ("hello wor", ["world!"], False, 0, "hell"),  # "o wor" may begin "world!": held back
        ("abcd", ["abcdefg"], False, 0, ""),  # a stop string longer than the text holds all of it back
        ("abc\ufffd\ufffd", [], False, 1, "bc"),  # half a character waits for the rest
        ("ab\ufffd", [], False, 2, ""),
        ("abc\ufffd", ["xyz"], True, 1, "bc\ufffd"),  # a finished text goes out whole
    ],
)
def test_a_stream_sends_the_tail_a_stop_string_or_half_a_character_cannot_claim(text, stops, finished, sent, expected):
    class Seq:
        params = SamplingParams(stop=stops)

    seq = Seq()
    seq.text, seq.finished = text, finished
    assert AsyncEngine._streamable_text(seq, sent) == expected


def _chat_text(served, target, stream=False, **fields):
    """A greedy chat's content (streamed: its deltas joined) and what plain decoding gives after `fields`' prompt."""
    body = dict(model="tiny", max_tokens=8, temperature=0, extra_body={"ignore_eos": True, **fields.pop("extra", {})})
    reply = served.client.chat.completions.create(stream=stream, **body, **fields)
    if stream:
        return "".join(c.choices[0].delta.content or "" for c in reply)
    return reply.choices[0].message.content


def test_the_chat_template_takes_vllms_options(served, target):
    """chat_template_kwargs reach the template; continue_final_message leaves the assistant's message open, and echo
    puts it before the reply, streamed or not."""
    hi = [{"role": "user", "content": "hi"}]
    thinking = _chat_text(served, target, messages=hi, extra={"chat_template_kwargs": {"enable_thinking": False}})
    prompt = target.tokenizer.apply_chat_template(hi, enable_thinking=False)
    assert prompt == "<enable_thinking=False><user>hi<assistant>"
    assert thinking == _solo(target, prompt, 8).outputs[0].text
    begun = [*hi, {"role": "assistant", "content": "Hel"}]
    options = {"add_generation_prompt": False, "continue_final_message": True, "echo": True}
    whole = _chat_text(served, target, messages=begun, extra=options)
    assert whole == "Hel" + _solo(target, "<user>hi<assistant>Hel", 8).outputs[0].text
    assert _chat_text(served, target, stream=True, messages=begun, extra=options) == whole
    assert _chat_text(served, target, messages=hi, extra={"echo": True}) == _chat_text(served, target, messages=hi)


def test_the_library_chat_takes_the_same_options(target):
    llm = LLM(target=target, num_speculative_tokens=0, max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    begun = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    out = llm.chat(begun, params, add_generation_prompt=False, continue_final_message=True)[0].outputs[0].text
    assert out == llm.generate("<user>hi<assistant>Hel", params)[0].outputs[0].text
    thinking = llm.chat(begun[:1], params, chat_template_kwargs={"enable_thinking": False})[0].outputs[0].text
    assert thinking == llm.generate("<enable_thinking=False><user>hi<assistant>", params)[0].outputs[0].text
    for reserved in ({"tools": []}, {"add_generation_prompt": False}):  # arguments of their own, as on the server
        with pytest.raises(SpecDecodeError, match="may not set"):
            llm.chat(begun[:1], params, chat_template_kwargs=reserved)


OWN_TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{% if add_generation_prompt %}[bot]{% endif %}"
)


def test_a_requests_chat_template_renders_it_where_the_server_trusts_requests(served, target, tmp_path):
    """vLLM's --trust-request-chat-template: a chat's chat_template (its text, never a file on the server) renders
    that request alone, /tokenize's too; without the switch, a 400 naming it."""
    hi = [{"role": "user", "content": "hi"}]
    refused = httpx.post(
        served.url + "/v1/chat/completions",
        json={"model": "tiny", "messages": hi, "chat_template": OWN_TEMPLATE},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=30,
    )
    assert refused.status_code == 400 and "--trust-request-chat-template" in refused.json()["error"]["message"]
    llm = LLM(target=target, num_speculative_tokens=3, max_model_len=256, speculative_model="ngram")
    with LocalServer(build_app(AsyncEngine(llm.engine), "tiny", trust_request_chat_template=True)) as trusting:
        trusting.client = openai.OpenAI(base_url=trusting.url + "/v1", api_key="unused", max_retries=0)
        own = _chat_text(trusting, target, messages=hi, extra={"chat_template": OWN_TEMPLATE})
        assert own == _solo(target, "[user]hi[bot]", 8).outputs[0].text
        assert _chat_text(trusting, target, messages=hi) == _solo(target, "<user>hi<assistant>", 8).outputs[0].text
        tokens = httpx.post(
            trusting.url + "/tokenize", json={"messages": hi, "chat_template": OWN_TEMPLATE}, timeout=30
        ).json()["tokens"]
        assert tokens == target.tokenizer.encode("[user]hi[bot]")
        on_disk = tmp_path / "template.jinja"
        on_disk.write_text(OWN_TEMPLATE)
        for template, message in [(str(on_disk), "is no Jinja template"), ("{% for %}", "does not compile")]:
            r = httpx.post(
                trusting.url + "/v1/chat/completions",
                json={"model": "tiny", "messages": hi, "chat_template": template},
                timeout=30,
            )
            assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


def test_stop_token_ids_end_the_text_through_the_server(served, target):
    ids = _solo(target, "hello world", 12).outputs[0].token_ids
    stop = next(t for i, t in enumerate(ids) if i >= 3 and t not in ids[:i])
    r = served.client.completions.create(
        model="tiny", prompt="hello world", max_tokens=12, temperature=0, extra_body={"stop_token_ids": [stop]}
    )
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == ids.index(stop) + 1


def _solo_with(target, prompt, max_tokens, **params):
    llm = LLM(target=target, num_speculative_tokens=0, max_model_len=256)
    return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, **params))[0]


@pytest.mark.parametrize("stream", [False, True])
def test_return_token_ids_gives_the_prompts_and_the_outputs_ids(served, target, stream):
    """vLLM's return_token_ids: completions carry both in each choice (the prompt's in a stream's first chunk); a
    chat, the prompt's beside the choices; a stream's chunks each carry their own output tokens."""
    expected = _solo(target, "hello world", 12).outputs[0].token_ids
    kwargs = dict(model="tiny", max_tokens=12, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    completion = served.client.completions.create(prompt="hello world", stream=stream, **kwargs)
    chunks = [c.model_dump() for c in (completion if stream else [completion])]
    choices = [c["choices"][0] for c in chunks]
    assert [t for c in choices for t in c["token_ids"]] == expected
    assert choices[0]["prompt_token_ids"] == target.tokenizer.encode("hello world")
    assert all("prompt_token_ids" not in c for c in choices[1:])

    messages = [{"role": "user", "content": "hi"}]
    chat = served.client.chat.completions.create(messages=messages, stream=stream, **kwargs)
    chunks = [c.model_dump() for c in (chat if stream else [chat])]
    prompt = target.tokenizer.encode(target.tokenizer.apply_chat_template(messages))
    assert chunks[0]["prompt_token_ids"] == prompt and all("prompt_token_ids" not in c for c in chunks[1:])
    ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert ids == _solo(target, [prompt], 12).outputs[0].token_ids


def test_without_return_token_ids_no_ids_come_back(served):
    r = served.client.completions.create(model="tiny", prompt="hello", max_tokens=3).model_dump()
    assert "token_ids" not in r["choices"][0] and "prompt_token_ids" not in r["choices"][0]


def test_vocabulary_limits_and_special_tokens_through_the_server(served, target):
    """allowed_token_ids and bad_words give the library's output; skip_special_tokens=false shows the end token
    (here made the only token, and ignored as an end)."""
    limits = dict(allowed_token_ids=list(range(20, 50)), bad_words=["F", "OO"], ignore_eos=True)
    r = served.client.completions.create(model="tiny", prompt="hello", max_tokens=12, temperature=0, extra_body=limits)
    assert r.choices[0].text == _solo_with(target, "hello", 12, **limits).outputs[0].text
    eos = max(target.tokenizer.eos_token_ids)
    only_eos = dict(logit_bias={str(eos): 100}, ignore_eos=True)
    for skip in (True, False):
        r = served.client.completions.create(
            model="tiny",
            prompt="hello",
            max_tokens=4,
            temperature=0,
            extra_body=only_eos | {"skip_special_tokens": skip},
        )
        assert r.choices[0].text == ("" if skip else target.tokenizer.decode([eos] * 4, skip_special_tokens=False))


def test_truncate_prompt_tokens_through_the_server_echoes_what_was_read(served, target):
    prompt = "the quick brown fox jumps over the lazy dog"
    kept = target.tokenizer.encode(prompt)[-7:]
    r = served.client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=6,
        temperature=0,
        echo=True,
        extra_body={"truncate_prompt_tokens": 7, "ignore_eos": True},
    )
    expected = _solo(target, [kept], 6).outputs[0].text
    assert r.choices[0].text == target.tokenizer.decode(kept) + expected and r.usage.prompt_tokens == 7


def test_return_tokens_as_token_ids_names_logprob_entries_by_id(served):
    asked = {"ignore_eos": True, "return_token_ids": True, "return_tokens_as_token_ids": True}
    r = served.client.completions.create(
        model="tiny", prompt="hello", max_tokens=6, temperature=0, logprobs=2, extra_body=asked
    ).model_dump()["choices"][0]
    assert r["logprobs"]["tokens"] == [f"token_id:{t}" for t in r["token_ids"]]
    assert all(key.startswith("token_id:") for top in r["logprobs"]["top_logprobs"] for key in top)
    chat = served.client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body=asked,
    ).model_dump()["choices"][0]
    entries = chat["logprobs"]["content"]
    assert [e["token"] for e in entries] == [f"token_id:{t}" for t in chat["token_ids"]]
    assert all(t["token"].startswith("token_id:") for e in entries for t in e["top_logprobs"])


def test_tokenize_and_detokenize_give_the_ids_a_request_is_served_with(served, target):
    """vLLM's /tokenize: a prompt as completions read it (its BOS optional), a chat as its template renders it; and
    /detokenize back."""
    tok = target.tokenizer

    def post(path, body):
        return httpx.post(served.url + path, json={"model": "tiny", **body}, timeout=30)

    r = post("/tokenize", {"prompt": "hello world", "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode("hello world") and r["count"] == len(r["tokens"]) and r["max_model_len"] == 256
    assert r["token_strs"] == tok.token_strings(r["tokens"])
    messages = [{"role": "user", "content": "hi"}]
    r = post("/tokenize", {"messages": messages, "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert r["tokens"] == tok.encode(tok.apply_chat_template(messages, enable_thinking=False))
    assert r["token_strs"] is None
    assert post("/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": tok.decode(r["tokens"])}
    ends = post("/detokenize", {"tokens": [5, max(tok.eos_token_ids)]}).json()["prompt"]
    assert ends == tok.decode([5, max(tok.eos_token_ids)], skip_special_tokens=False) != tok.decode([5])


@pytest.mark.parametrize(
    "path, body, status",
    [
        ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400),
        ("/tokenize", {}, 400),
        ("/tokenize", {"prompt": "x", "add_eos": True}, 400),
        ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "add_special_tokens": True}, 400),
        ("/tokenize", {"messages": []}, 400),
        ("/tokenize", {"prompt": "x", "model": "other"}, 404),
        ("/detokenize", {"tokens": [99999]}, 400),
        ("/detokenize", {"tokens": "abc"}, 400),
    ],
)
def test_tokenize_refuses_what_it_cannot_do_and_says_why(served, path, body, status):
    r = httpx.post(served.url + path, json={"model": "tiny", **body}, timeout=30)
    assert r.status_code == status and r.json()["error"]["message"]


def test_a_list_of_prompts_is_answered_prompt_by_prompt_in_one_body(served, target):
    """OpenAI's list of prompts (texts or token ids): prompt i's n choices at indices i * n onwards, each what the
    prompt alone gets; usage summed."""
    prompts = ["hello world", "abcabc", "the fox"]
    alone = [_solo(target, p, 8).outputs[0] for p in prompts]
    kwargs = dict(model="tiny", max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    r = served.client.completions.create(prompt=prompts, **kwargs)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [o.text for o in alone]
    assert r.usage.completion_tokens == 24
    assert r.usage.prompt_tokens == sum(len(target.tokenizer.encode(p)) for p in prompts)
    ids = [target.tokenizer.encode(p) for p in prompts[:2]]
    twice = served.client.completions.create(prompt=ids, n=2, **kwargs)
    assert [c.index for c in twice.choices] == [0, 1, 2, 3]
    assert [c.text for c in twice.choices] == [alone[0].text] * 2 + [alone[1].text] * 2


@pytest.mark.parametrize("include_usage", [False, True])
def test_a_streamed_list_of_prompts_sends_each_prompts_chunks_under_one_id(served, target, include_usage):
    """Prompt i's n choices at indices from i * n, each what the prompt alone streams; the usage summed at the end, on
    the last chunk or, with include_usage, in a chunk of its own."""
    prompts = ["hello world", "abcabc"]
    alone = [_solo(target, p, 8).outputs[0].text for p in prompts]
    options = {"stream_options": {"include_usage": True}} if include_usage else {}
    chunks = _chunks(served, {"prompt": prompts, "max_tokens": 8, "n": 2, "stream": True, **options})
    texts = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: alone[0], 1: alone[0], 2: alone[1], 3: alone[1]}
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert [chunk for chunk in chunks if chunk.get("usage")] == [chunks[-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 32 and bool(chunks[-1]["choices"]) != include_usage


def _chunks(served, body: dict) -> list[dict]:
    r = httpx.post(
        served.url + "/v1/completions",
        json={"model": "tiny", "prompt": "hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True, **body},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=30,
    )
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def test_stream_options_include_usage_sends_the_usage_in_a_last_chunk_of_its_own(served):
    """OpenAI's include_usage: every other chunk's usage null, then one chunk without choices; vLLM's
    continuous_usage_stats: the counts so far in every chunk. Without them, the usage rides on the last chunk."""
    plain = _chunks(served, {"stream": True})
    assert "usage" not in plain[0] and plain[-1]["usage"]["completion_tokens"] == 6 and plain[-1]["choices"]
    asked = _chunks(served, {"stream": True, "stream_options": {"include_usage": True}})
    assert all(c["usage"] is None for c in asked[:-1]) and asked[-1]["choices"] == []
    assert asked[-1]["usage"]["completion_tokens"] == 6 and asked[-1]["usage"]["speculation"]["num_output_tokens"] == 6
    each = _chunks(served, {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    so_far = [c["usage"]["completion_tokens"] for c in each[:-1]]
    assert so_far == sorted(so_far) and so_far[-1] == 6 and each[-1]["choices"] == []
    text = "".join(c["choices"][0]["text"] for c in asked[:-1])
    assert text == "".join(c["choices"][0]["text"] for c in plain)


def test_stream_options_without_a_stream_get_a_400(served):
    r = httpx.post(
        served.url + "/v1/completions",
        json={"model": "tiny", "prompt": "hi", "stream_options": {"include_usage": True}},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=30,
    )
    assert r.status_code == 400 and "stream" in r.json()["error"]["message"]
