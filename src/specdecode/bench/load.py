"""Load generator for an OpenAI-compatible server: send prompts as streaming /v1/completions requests,
either with a fixed number in flight (closed loop) or arriving as a Poisson process (open loop), or play
multi-turn chat sessions (each reply put into the next turn's history), and measure per request TTFT,
TPOT and latency, and for the run throughput and speculation statistics.

Works against any OpenAI-compatible server (vLLM, SGLang, llama.cpp, ours); the speculation fields are
read from `usage.speculation` where the server sends them."""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

import httpx
from tqdm import tqdm

from .datasets import prompts_for
from .results import command_line, write_json


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    latency_s: float | None = None
    error: str | None = None
    speculation: dict = field(default_factory=dict)
    text: str = ""  # what the server sent (a session's next turn repeats it)
    turn: int = 0  # the request's place in its session (0: the first, or a lone request)

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (the decoding speed a reader sees)."""
        if self.ttft_s is None or self.latency_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


def summarize(values: list[float]) -> dict | None:
    """mean, median, p90, p99 (nearest rank) of a list of seconds."""
    if not values:
        return None
    ordered = sorted(values)

    def rank(q: float) -> float:
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)]

    return {
        "mean": statistics.fmean(ordered),
        "median": statistics.median(ordered),
        "p90": rank(0.9),
        "p99": rank(0.99),
    }


@dataclass
class LoadResult:
    concurrency: int | None
    request_rate: float | None
    num_requests: int
    num_failed: int
    duration_s: float
    output_tokens: int
    output_throughput: float  # output tokens / s over the whole run
    request_throughput: float
    ttft_s: dict | None
    tpot_s: dict | None
    latency_s: dict | None
    acceptance_rate: float | None
    mean_accepted_length: float | None
    speculating_fraction: float | None  # share of decoding steps with drafts, over the run's requests
    errors: list[str]

    @classmethod
    def from_requests(cls, results: list[RequestResult], duration: float, concurrency, rate) -> "LoadResult":
        ok = [r for r in results if r.ok]
        tokens = sum(r.output_tokens for r in ok)
        spec = [r.speculation for r in ok if r.speculation]
        drafted = sum(s.get("num_draft_tokens", 0) for s in spec)
        accepted = sum(s.get("num_accepted_tokens", 0) for s in spec)
        spec_steps = sum(s.get("num_spec_steps", 0) for s in spec)
        steps = sum(s.get("num_steps", 0) for s in spec)
        return cls(
            concurrency,
            rate,
            len(results),
            len(results) - len(ok),
            duration,
            tokens,
            tokens / duration,
            len(ok) / duration,
            summarize([r.ttft_s for r in ok if r.ttft_s is not None]),
            summarize([r.tpot_s for r in ok if r.tpot_s is not None]),
            summarize([r.latency_s for r in ok if r.latency_s is not None]),
            accepted / drafted if drafted else None,
            (accepted + spec_steps) / spec_steps if spec_steps else None,
            spec_steps / steps if steps else (0.0 if spec else None),
            sorted({r.error for r in results if r.error})[:5],
        )

    def as_dict(self) -> dict:
        return asdict(self)


def fresh_connections(most: int) -> httpx.Limits:
    """At most `most` connections, none kept for a next request: llama-server now and then keeps a connection open
    after a streamed response and drops the next request sent on it unanswered, which would count against it
    (docs/decisions.md#llamacpp-beside-us-its-draft-model-and-a-connection-a-request)."""
    return httpx.Limits(max_connections=most, max_keepalive_connections=0)


async def send_completion(client: httpx.AsyncClient, url: str, payload: dict) -> RequestResult:
    """One streaming completion or chat completion; TTFT is the arrival of the first chunk that carries
    text."""
    start = time.perf_counter()
    result = RequestResult(ok=False)
    text_chunks = 0  # the token count of servers that stream one token per chunk and send no usage
    try:
        async with client.stream("POST", url, json={**payload, "stream": True}) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message"))
                    return result
                choice = chunk["choices"][0] if chunk.get("choices") else {}
                text = choice.get("text") or (choice.get("delta") or {}).get("content")  # completion or chat
                if text:
                    text_chunks += 1
                    result.text += text
                    if result.ttft_s is None:
                        result.ttft_s = time.perf_counter() - start
                usage = chunk.get("usage")
                if usage:
                    result.prompt_tokens = usage.get("prompt_tokens", 0)
                    result.output_tokens = usage.get("completion_tokens", 0)
                    result.speculation = usage.get("speculation") or {}
        result.latency_s = time.perf_counter() - start
        result.output_tokens = result.output_tokens or text_chunks
        result.ok = True
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_load(base_url: str, prompts: list[str], max_tokens: int, **options) -> LoadResult:
    """Closed loop with `concurrency` requests in flight, or, with `request_rate`, Poisson arrivals at that
    many requests per second (then `concurrency`, if set, still caps how many are in flight)."""
    results, duration = await send_requests(base_url, prompts, max_tokens, **options)
    return LoadResult.from_requests(results, duration, options.get("concurrency", 1), options.get("request_rate"))


async def served_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model the server lists at /v1/models (the one it serves, for ours, vLLM's and llama.cpp's)."""
    r = await client.get(base_url.rstrip("/") + "/v1/models")
    r.raise_for_status()
    return r.json()["data"][0]["id"]


async def send_requests(
    base_url: str,
    prompts: list[str],
    max_tokens: int,
    *,
    model: str | None = None,
    concurrency: int | None = 1,
    request_rate: float | None = None,
    temperature: float = 0.0,
    ignore_eos: bool = True,
    api_key: str | None = None,
    seed: int = 0,
    progress: bool = True,
) -> tuple[list[RequestResult], float]:
    """The load itself (see `run_load`): each request's result, and the run's wall time in seconds. `model`:
    the name sent in the requests (None: the one the server lists)."""
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = asyncio.Semaphore(concurrency or len(prompts))
    arrivals = random.Random(seed)
    bar = tqdm(
        total=len(prompts),
        desc=f"concurrency {concurrency}" if request_rate is None else f"{request_rate} req/s",
        disable=None if progress else True,
        leave=False,
    )  # None: off when not a TTY

    async def one(client, prompt):
        async with limit:
            payload = {
                "model": model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": temperature,
                "ignore_eos": ignore_eos,
                "stream_options": {"include_usage": True},
            }
            r = await send_completion(client, url, payload)
            bar.update(1)
            return r

    timeout = httpx.Timeout(None, connect=30)
    pool = fresh_connections((concurrency or len(prompts)) + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=pool, headers=headers) as client:
        model = model or await served_model(client, base_url)
        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(one(client, prompt)))
            if request_rate:
                await asyncio.sleep(arrivals.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return list(results), duration


async def play_sessions(
    base_url: str,
    sessions: list[list[str]],
    max_tokens: int,
    *,
    model: str | None = None,
    concurrency: int = 1,
    api_key: str | None = None,
    progress: bool = True,
    run: str = "",
) -> tuple[list[RequestResult], float]:
    """Chat sessions, `concurrency` in flight: each session's user turns one after the other, each reply
    (greedy, ending at EOS or max_tokens) put into the next turn's history, as an agent loop does. Each
    session is its own `user` (named after `run` too), so a server that scopes caches by user shares
    nothing between sessions, nor with the same sessions played in another run.
    Every turn's result (with its `turn`), and the run's wall time in seconds."""
    url = base_url.rstrip("/") + "/v1/chat/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = asyncio.Semaphore(concurrency)
    bar = tqdm(
        total=sum(map(len, sessions)),
        desc=f"sessions, concurrency {concurrency}",
        disable=None if progress else True,
        leave=False,
    )

    async def one(client, index: int, turns: list[str]) -> list[RequestResult]:
        async with limit:
            history, results = [], []
            for turn, message in enumerate(turns):
                history.append({"role": "user", "content": message})
                payload = {
                    "model": model,
                    "messages": history,
                    "max_tokens": max_tokens,
                    "temperature": 0.0,
                    "user": f"{run}session-{index}",
                    "stream_options": {"include_usage": True},
                }
                result = await send_completion(client, url, payload)
                result.turn = turn
                results.append(result)
                bar.update(1)
                if not result.ok:
                    break
                history.append({"role": "assistant", "content": result.text})
            return results

    pool = fresh_connections(concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30), limits=pool, headers=headers) as client:
        model = model or await served_model(client, base_url)
        start = time.perf_counter()
        done = await asyncio.gather(*(one(client, i, turns) for i, turns in enumerate(sessions)))
        duration = time.perf_counter() - start
    bar.close()
    return [r for results in done for r in results], duration


def run_bench_serve_cli(args) -> int:
    """`specdecode bench serve`: one load run per concurrency (or one at --request-rate) against a server."""
    prompts = prompts_for(
        args.dataset,
        args.num_prompts,
        args.tokenizer,
        seed=args.seed,
        field=args.prompt_field,
        sonnet_file=args.sonnet_file,
    )
    levels = [None] if args.request_rate else args.concurrency
    runs = []
    print(f"{args.base_url}: {len(prompts)} prompts from {args.dataset}, {args.max_tokens} new tokens", flush=True)
    for c in levels:
        result = asyncio.run(
            run_load(
                args.base_url,
                prompts,
                args.max_tokens,
                model=args.model,
                concurrency=c,
                request_rate=args.request_rate,
                temperature=args.temperature,
                ignore_eos=not args.stop_at_eos,
                api_key=args.api_key,
                seed=args.seed,
            )
        )
        runs.append(result.as_dict())
        print(describe(result), flush=True)
    report = {
        "meta": {
            "command": command_line(),
            "base_url": args.base_url,
            "dataset": args.dataset,
            "num_prompts": args.num_prompts,
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
        },
        "results": runs,
    }
    write_json(args.out, report)
    return 0


def describe(r: LoadResult) -> str:
    mode = f"concurrency {r.concurrency}" if r.request_rate is None else f"{r.request_rate} req/s"

    def ms(stats):
        return "-" if not stats else "/".join(f"{stats[key] * 1000:.1f}" for key in ("mean", "median", "p99"))

    spec = "" if r.acceptance_rate is None else f", α {r.acceptance_rate:.3f}, τ {r.mean_accepted_length:.2f}"
    failed = f", {r.num_failed} FAILED ({'; '.join(r.errors)})" if r.num_failed else ""
    return (
        f"{mode}: {r.output_throughput:.2f} tok/s, {r.request_throughput:.3f} req/s; TTFT ms mean/median/p99 "
        f"{ms(r.ttft_s)}; TPOT ms {ms(r.tpot_s)}; latency ms {ms(r.latency_s)}{spec}{failed}"
    )
