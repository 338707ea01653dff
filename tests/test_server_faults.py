"""Faults and load: per-request timeouts, draining before shutdown, clients that disconnect at every phase
of a request, and a bounded soak at concurrency 16 with every feature mixed in. After each, the server
answers a good request and holds no sequence slot, no waiting request and no draft KV slot."""

import asyncio
import json
import random
import re
import socket
import threading
import time

import httpx
import pytest
from conftest import LocalServer, wait_until

from specdecode import LLM, SamplingParams
from specdecode.server.api import build_app
from specdecode.server.async_engine import AsyncEngine

STEP_DELAY = 0.02  # seconds added to each engine step, so that requests last long enough to interrupt


def _llm(target, draft, max_num_seqs=16, memory_budget=None) -> LLM:
    return LLM(
        target=target,
        draft=draft,
        num_speculative_tokens=3,
        max_model_len=256,
        max_num_seqs=max_num_seqs,
        speculation_policy="fixed",
        memory_budget=memory_budget,
    )


class Served:
    def __init__(self, target, draft, max_num_seqs=16, memory_budget=None, **app_kwargs):
        llm = _llm(target, draft, max_num_seqs, memory_budget)
        real_step = llm.engine.step
        self.steps = 0  # engine steps run: how far a request got, counted rather than timed
        self.most_waiting = 0  # requests waiting for room at once, at most
        self.fail_next_step = False

        def slow_step():
            if self.fail_next_step:
                self.fail_next_step = False
                raise RuntimeError("a bug in the step")
            self.steps += 1
            self.most_waiting = max(self.most_waiting, len(llm.engine.waiting))
            time.sleep(STEP_DELAY)
            return real_step()

        llm.engine.step = slow_step
        self.llm, self.engine = llm, AsyncEngine(llm.engine)
        self.local = LocalServer(build_app(self.engine, "tiny", **app_kwargs))

    def __enter__(self):
        self.url = self.local.__enter__().url
        return self

    def __exit__(self, *exc):
        self.local.__exit__(*exc)

    def post(self, body: dict, path="completions", **kw) -> httpx.Response:
        return httpx.post(f"{self.url}/v1/{path}", json={"model": "tiny", **body}, timeout=60, **kw)

    def assert_idle_and_serving(self):
        engine = self.llm.engine
        wait_until(lambda: not (engine.running or engine.waiting or self.engine.in_flight), "the engine is idle")
        assert engine.runner.num_free == engine.runner.num_slots
        draft_runner = engine.proposer.runner
        assert draft_runner.num_free == draft_runner.num_slots
        r = self.post({"prompt": "good", "max_tokens": 5, "ignore_eos": True, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        metrics = httpx.get(f"{self.url}/metrics").text
        assert "specdecode_num_requests_running 0.0" in metrics


@pytest.fixture
def served(target, random_draft):
    with Served(target, random_draft, request_timeout=30) as s:
        yield s


LONG = {"prompt": "abc", "max_tokens": 240, "ignore_eos": True}


# ---- timeouts -----------------------------------------------------------------------------------
def test_a_request_past_its_timeout_gets_504_and_frees_its_slot(served):
    steps = served.steps
    r = served.post({**LONG, "timeout": 0.5})
    assert r.status_code == 504 and "time limit of 0.5 s" in r.json()["error"]["message"]
    # answered when it timed out, not when its 240 tokens were done (4 a step at most with k = 3)
    assert served.steps - steps < 240 // 4
    streamed = served.post({**LONG, "timeout": 0.5, "stream": True})
    assert '"code": 504' in streamed.text and streamed.text.rstrip().endswith("data: [DONE]")
    served.assert_idle_and_serving()


def test_the_server_timeout_caps_the_requests(target, random_draft):
    with Served(target, random_draft, request_timeout=0.4) as s:
        assert s.post({**LONG, "timeout": 100}).status_code == 504
        assert s.post({"prompt": "x", "timeout": -1}).status_code == 400
        s.assert_idle_and_serving()


def test_a_step_that_raises_fails_its_requests_with_500_and_the_server_carries_on(served):
    served.fail_next_step = True
    r = served.post({"prompt": "x", "max_tokens": 5})
    assert r.status_code == 500 and "a bug in the step" in r.json()["error"]["message"]
    served.assert_idle_and_serving()


# ---- draining ---------------------------------------------------------------------------------------
def test_drain_refuses_new_requests_lets_short_ones_finish_and_cancels_the_rest(served):
    results = {}
    short = {"prompt": "a", "max_tokens": 20, "ignore_eos": True}
    started = time.time()
    assert served.post(short).status_code == 200
    # The grace period in units of this machine's speed (a busy GPU runs the tiny model's steps slower than
    # a CPU): room for the short request, a third of what the long one (12x its tokens) needs.
    grace = max(1.0, 4 * (time.time() - started))

    def run(name, body):
        results[name] = served.post(body)

    threads = [threading.Thread(target=run, args=("short", short)), threading.Thread(target=run, args=("long", LONG))]
    for t in threads:
        t.start()
    wait_until(lambda: len(served.llm.engine.running) == 2, "both requests decode")
    cancelled_box = []
    drainer = threading.Thread(target=lambda: cancelled_box.append(served.engine.drain(grace)))
    drainer.start()
    wait_until(lambda: served.engine.draining, "the engine drains")
    refused = served.post({"prompt": "late", "max_tokens": 2})
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    drainer.join(grace + 10)
    for t in threads:
        t.join(grace + 10)
    assert results["short"].status_code == 200 and results["short"].json()["usage"]["completion_tokens"] == 20
    assert results["long"].status_code == 503 and "shut down" in results["long"].json()["error"]["message"]
    assert len(cancelled_box[0]) == 1
    served.engine.draining = False
    served.assert_idle_and_serving()


# ---- disconnects at every phase ----------------------------------------------------------------------
def _raw(served, body: bytes, declared_length: int | None = None) -> socket.socket:
    host, port = served.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {declared_length or len(body)}\r\n\r\n".encode()
        + body
    )
    return sock


def test_clients_that_disconnect_at_every_phase_leave_nothing_behind(target, random_draft):
    with Served(target, random_draft, max_num_seqs=2) as served:
        body = json.dumps({"model": "tiny", **LONG}).encode()
        # 1. in the middle of sending the body
        _raw(served, body[:10], declared_length=len(body)).close()
        # 2. right after sending it, before anything is generated (non-streaming)
        _raw(served, body).close()
        # 3. right after sending a streaming request
        _raw(served, json.dumps({"model": "tiny", **LONG, "stream": True}).encode()).close()
        # 4. while waiting for a slot: two long requests hold both slots
        holders = [_raw(served, body) for _ in range(2)]
        wait_until(lambda: len(served.llm.engine.running) == 2, "two requests hold both slots")
        waiting = _raw(served, body)
        wait_until(lambda: served.llm.engine.waiting, "the third request waits for a slot")
        waiting.close()
        # 5. in the middle of a stream, after some tokens
        with httpx.stream(
            "POST", f"{served.url}/v1/completions", json={"model": "tiny", **LONG, "stream": True}, timeout=30
        ) as r:
            next(r.iter_lines())
        # 5b. in the middle of a streamed list of prompts: each prompt's sequence freed
        with httpx.stream(
            "POST",
            f"{served.url}/v1/completions",
            json={"model": "tiny", **LONG, "prompt": ["one", "two"], "stream": True},
            timeout=30,
        ) as r:
            next(r.iter_lines())
        # 6. in the middle of a non-streaming generation
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{served.url}/v1/completions", json={"model": "tiny", **LONG}, timeout=0.3)
        for sock in holders:
            sock.close()
        served.assert_idle_and_serving()
        # phases 4-6 and the two holders reached the engine for certain (1-3 may end before a request exists);
        # aborted, not finished: freed on disconnect, not after their 240 tokens
        aborted = re.search(r"specdecode_requests_aborted_total (\d+)", httpx.get(f"{served.url}/metrics").text)
        assert int(aborted.group(1)) >= 7


# ---- soak ---------------------------------------------------------------------------------------------
def _requests(rng: random.Random):
    """(body, path, check) of one request of the mix; check(response or None) raises on a wrong answer."""
    kind = rng.choice(["stream", "chat_logprobs_n", "penalties", "structured", "disconnect", "bad", "timeout"])
    tokens = rng.randint(4, 24)
    if kind == "stream":
        return (
            kind,
            {
                "prompt": "soak " * rng.randint(1, 5),
                "max_tokens": tokens,
                "ignore_eos": True,
                "stream": True,
                "temperature": 0.8,
            },
            "completions",
            tokens,
        )
    if kind == "chat_logprobs_n":
        return (
            kind,
            {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": tokens,
                "ignore_eos": True,
                "logprobs": True,
                "top_logprobs": 2,
                "n": 2,
            },
            "chat/completions",
            2 * tokens,
        )
    if kind == "penalties":
        return (
            kind,
            {
                "prompt": "abcabc",
                "max_tokens": tokens,
                "ignore_eos": True,
                "presence_penalty": 1.0,
                "frequency_penalty": 0.5,
                "min_p": 0.05,
                "logit_bias": {"3": 2},
            },
            "completions",
            tokens,
        )
    if kind == "structured":
        return kind, {"prompt": "code:", "max_tokens": 20, "guided_regex": "[A-C]{3}X"}, "completions", None
    if kind == "bad":
        return kind, {"prompt": "x", "max_tokens": -3}, "completions", None
    if kind == "timeout":
        return kind, {**LONG, "timeout": 0.2}, "completions", None
    return kind, {**LONG, "stream": True}, "completions", None


async def _one(client: httpx.AsyncClient, url: str, rng: random.Random, outcomes: list):
    kind, body, path, expected = _requests(rng)
    if kind == "disconnect":
        async with client.stream("POST", f"{url}/v1/{path}", json={"model": "tiny", **body}) as r:
            async for _ in r.aiter_lines():
                break
        outcomes.append(kind)
        return
    r = await client.post(f"{url}/v1/{path}", json={"model": "tiny", **body})
    if kind == "bad":
        assert r.status_code == 400
    elif kind == "timeout":
        assert r.status_code == 504
    elif kind == "stream":
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert r.status_code == 200 and chunks[-1]["usage"]["completion_tokens"] == expected
    elif kind == "structured":
        assert r.status_code == 200 and re.fullmatch("[A-C]{3}X", r.json()["choices"][0]["text"])
    else:
        reply = r.json()
        assert r.status_code == 200 and reply["usage"]["completion_tokens"] == expected, reply
        if kind == "chat_logprobs_n":
            assert all(len(c["logprobs"]["content"]) == expected // 2 for c in reply["choices"])
    outcomes.append(kind)


def test_soak_at_concurrency_16_loses_nothing(target, random_draft):
    """16 clients, 8 requests each of the mix (a count, not a duration: a slower machine runs it longer): every
    request gets its expected answer, every kind of request occurs, and memory does not grow."""
    with Served(target, random_draft, max_num_seqs=8, request_timeout=20) as served:

        async def worker(seed, requests, outcomes):
            rng = random.Random(seed)
            async with httpx.AsyncClient(timeout=60) as client:
                for _ in range(requests):
                    await _one(client, served.url, rng, outcomes)

        async def soak(requests):
            outcomes: list[str] = []
            await asyncio.gather(*(worker(seed, requests, outcomes) for seed in range(16)))
            return outcomes

        asyncio.run(soak(2))  # warm-up: allocator pools, grammar tokenizer
        served.assert_idle_and_serving()
        rss_before = _rss_bytes()
        outcomes = asyncio.run(soak(8))
        served.assert_idle_and_serving()
        assert len(outcomes) == 16 * 8 and len(set(outcomes)) == 7
        assert _rss_bytes() - rss_before < 100 << 20


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.parametrize("lookahead", [None, 8])
def test_under_block_pressure_requests_wait_or_are_preempted_and_none_is_lost(target, random_draft, lookahead):
    """A KV budget of 8 blocks for 16 clients whose requests take 2-4 blocks each (prompt, max_tokens and the
    drafts): requests wait for room rather than run the pool out, every one gets the greedy text computed alone,
    and the server ends idle, its blocks all returned. Admitted with room for their next 8 tokens only, requests
    outgrow the pool and are preempted, and still none is lost."""
    budget = _llm(target, random_draft).memory_plan.budget_holding(8)
    rng = random.Random(0)
    bodies = [
        {
            "prompt": "pressure " * rng.randint(4, 16),
            "max_tokens": rng.randint(40, 120),
            "ignore_eos": True,
            "temperature": 0,
        }
        for _ in range(16)
    ]
    alone = LLM(target=target, num_speculative_tokens=0, max_model_len=256)
    expected = [
        alone.generate([b["prompt"]], SamplingParams(temperature=0, max_tokens=b["max_tokens"], ignore_eos=True))[0]
        .outputs[0]
        .text
        for b in bodies
    ]
    with Served(target, random_draft, memory_budget=budget, request_timeout=120) as served:
        assert served.llm.memory_plan.num_blocks == 8
        served.llm.engine.blocks.lookahead = lookahead or served.llm.engine.blocks.lookahead

        async def send_all():
            async with httpx.AsyncClient(timeout=180) as client:
                return await asyncio.gather(
                    *(client.post(f"{served.url}/v1/completions", json={"model": "tiny", **b}) for b in bodies)
                )

        replies = asyncio.run(send_all())
        assert [r.status_code for r in replies] == [200] * 16
        assert [r.json()["choices"][0]["text"] for r in replies] == expected
        assert served.most_waiting >= 8  # 8 blocks hold 2-4 of them at once: the rest waited
        served.assert_idle_and_serving()
        assert served.llm.engine.runner.blocks_in_use() == 0
        preempted = re.search(r"^specdecode_preemptions_total (\S+)", httpx.get(f"{served.url}/metrics").text, re.M)
        assert (float(preempted.group(1)) > 0) == (lookahead is not None)
