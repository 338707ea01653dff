"""Benchmark pieces: datasets are deterministic, the load generator's arithmetic is right, and it measures
a real local server."""

import asyncio
import json
import types

import pytest

from specdecode import SpecDecodeError
from specdecode.bench.datasets import (
    SONNET_INSTRUCTION,
    humaneval_prompts,
    jsonl_prompts,
    load_prompts,
    poem_lines,
    sonnet_prompts,
    stdlib_prompts,
)
from specdecode.bench.load import LoadResult, RequestResult, run_load, summarize
from specdecode.bench.server_process import serve_argv
from specdecode.models.lora import Adapter


def _count_words(text: str) -> int:
    return len(text.split())


def test_humaneval_prompts():
    prompts = humaneval_prompts()
    assert len(prompts) == 164 and prompts[0].startswith("from typing import List")


def test_poem_lines_are_verse_only():
    lines = poem_lines()
    assert "From fairest creatures we desire increase," in lines
    assert all(line.strip() == line and len(line) > 20 for line in lines)
    assert not any(line in ("I", "II", "THE SONNETS") for line in lines)
    assert len(lines) > 2000


def test_sonnet_prompts_are_deterministic_and_sized():
    a = sonnet_prompts(3, 200, _count_words, seed=1)
    assert a == sonnet_prompts(3, 200, _count_words, seed=1)
    assert a != sonnet_prompts(3, 200, _count_words, seed=2)
    assert len(set(a)) == 3
    for p in a:
        assert p.startswith(SONNET_INSTRUCTION)
        assert 180 <= _count_words(p) <= 200  # filled up to the target, never past it
    longer = sonnet_prompts(1, 800, _count_words, seed=1)[0]
    assert 780 <= _count_words(longer) <= 800


def test_stdlib_prompts_are_real_source_of_the_asked_length():
    prompts = stdlib_prompts(3, 2000, _count_words)
    assert len(set(prompts)) == 3  # each from another module
    for prompt in prompts:
        assert 1800 <= _count_words(prompt) <= 2000 and prompt.endswith("\n")
        assert "def " in prompt or "class " in prompt


def test_sonnet_prompts_from_a_user_file(tmp_path):
    poem = tmp_path / "poem.txt"
    poem.write_text("TITLE\n\nShall I compare thee to a summer's day?\nThou art more lovely and more temperate:\n")
    (p,) = sonnet_prompts(1, 40, _count_words, path=poem)
    assert "summer's day" in p or "temperate" in p
    with pytest.raises(SpecDecodeError, match="shorter than the instruction"):
        sonnet_prompts(1, 5, _count_words, path=poem)


def test_jsonl_and_dataset_specs(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n\n{"prompt": "b", "x": 1}\n')
    assert jsonl_prompts(f) == ["a", "b"]
    assert load_prompts(f"jsonl:{f}", 5) == ["a", "b", "a", "b", "a"]
    f.write_text('{"text": "a"}\n')
    with pytest.raises(SpecDecodeError, match="no string field 'prompt'"):
        jsonl_prompts(f)
    with pytest.raises(SpecDecodeError, match="unknown dataset"):
        load_prompts("poems", 2)


def test_request_and_run_arithmetic():
    """TTFT 0.5 s, latency 2.5 s, 11 tokens: TPOT = (2.5 - 0.5) / 10 = 0.2 s."""
    r = RequestResult(
        ok=True,
        output_tokens=11,
        ttft_s=0.5,
        latency_s=2.5,
        speculation={"num_draft_tokens": 8, "num_accepted_tokens": 6, "num_spec_steps": 2, "num_steps": 4},
    )
    assert r.tpot_s == pytest.approx(0.2)
    assert RequestResult(ok=True, output_tokens=1, ttft_s=0.5, latency_s=0.5).tpot_s is None
    other = RequestResult(ok=True, output_tokens=5, ttft_s=1.5, latency_s=3.5)
    failed = RequestResult(ok=False, error="HTTP 400: bad")
    run = LoadResult.from_requests([r, other, failed], duration=4.0, concurrency=2, rate=None)
    assert run.output_tokens == 16 and run.output_throughput == pytest.approx(4.0)
    assert run.num_failed == 1 and run.errors == ["HTTP 400: bad"]
    assert run.request_throughput == pytest.approx(0.5)
    assert run.ttft_s["mean"] == pytest.approx(1.0) and run.tpot_s["mean"] == pytest.approx((0.2 + 0.5) / 2)
    assert run.acceptance_rate == pytest.approx(0.75)
    assert run.mean_accepted_length == pytest.approx((6 + 2) / 2)
    assert run.speculating_fraction == pytest.approx(0.5)


def test_summarize_percentiles():
    s = summarize([float(i) for i in range(1, 101)])
    assert s["mean"] == pytest.approx(50.5) and s["median"] == pytest.approx(50.5)
    assert s["p90"] == 90 and s["p99"] == 99
    assert summarize([]) is None


@pytest.fixture(scope="module")
def server(target, random_draft):
    from conftest import LocalServer

    from specdecode import LLM
    from specdecode.server.api import build_app
    from specdecode.server.async_engine import AsyncEngine

    llm = LLM(
        target=target,
        draft=random_draft,
        num_speculative_tokens=3,
        max_model_len=256,
        max_num_seqs=4,
        speculation_policy="fixed",
    )
    with LocalServer(build_app(AsyncEngine(llm.engine), "tiny", None)) as s:
        yield s


def test_load_generator_against_a_local_server(server):
    prompts = [f"prompt number {i}" for i in range(10)] + ["x" * 300]  # the last one exceeds the context
    run = asyncio.run(run_load(server.url, prompts, 8, model="tiny", concurrency=4, progress=False))
    assert run.num_requests == 11 and run.num_failed == 1
    assert "HTTP 400" in run.errors[0] and "context" in run.errors[0]
    assert run.output_tokens == 10 * 8
    assert run.output_throughput == pytest.approx(80 / run.duration_s)
    assert 0 < run.ttft_s["mean"] <= run.latency_s["mean"]
    assert run.tpot_s["mean"] > 0
    assert 0 <= run.acceptance_rate <= 1 and run.speculating_fraction > 0


async def _read_request(reader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    await reader.readexactly(int(length))


async def _answers_once_a_connection(reader, writer) -> None:
    """A server that, as llama-server now and then, keeps a connection open after a streamed response and then
    drops the request sent on it unanswered."""
    body = b'data: {"choices": [{"text": "hi"}], "usage": {"completion_tokens": 1}}\n\ndata: [DONE]\n\n'
    try:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        await _read_request(reader)  # the next request on this connection: never answered
    except asyncio.IncompleteReadError:  # the client closed it: no next request
        pass
    writer.close()


def test_load_sends_each_request_on_a_connection_of_its_own():
    """Every request its own connection: one sent on a connection the server has done with fails unanswered
    (as llama-server's now and then), which would count against the server."""

    async def load():
        server = await asyncio.start_server(_answers_once_a_connection, "127.0.0.1", 0)
        async with server:
            url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
            return await run_load(url, ["a", "b", "c", "d"], 1, model="m", concurrency=1, progress=False)

    run = asyncio.run(load())
    assert run.num_failed == 0 and run.output_tokens == 4, run.errors


def test_poisson_arrivals_are_spread_out(server):
    prompts = ["hello"] * 6
    run = asyncio.run(
        run_load(server.url, prompts, 4, model="tiny", concurrency=None, request_rate=20.0, progress=False, seed=3)
    )
    assert run.num_failed == 0 and run.output_tokens == 24
    assert run.duration_s > 0.05  # 5 gaps at 20 req/s: about 0.25 s on average


def test_bench_serve_cli_writes_json(server, tmp_path):
    from specdecode.cli import main

    out = tmp_path / "serve.json"
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": f"p{i}"}) for i in range(4)))
    assert (
        main(
            [
                "bench",
                "serve",
                "--base-url",
                server.url,
                "--model",
                "tiny",
                "--dataset",
                f"jsonl:{f}",
                "--num-prompts",
                "4",
                "--max-tokens",
                "5",
                "--concurrency",
                "1",
                "2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert [r["concurrency"] for r in report["results"]] == [1, 2]
    assert all(r["output_tokens"] == 20 and r["num_failed"] == 0 for r in report["results"])


def test_sessions_put_each_reply_into_the_next_turn(server):
    """Agent-loop sessions: turn t's prompt is the chat of every earlier turn with the replies the server
    sent (the byte tokenizer makes the prompt's token count exact), and every turn is kept."""
    from specdecode.bench.load import play_sessions

    sessions = [["ab", "cde", "f"], ["xyz", "w"], ["q"]]
    results, duration = asyncio.run(play_sessions(server.url, sessions, 6, model="tiny", concurrency=2, progress=False))
    assert [r.turn for r in results] == [0, 1, 2, 0, 1, 0] and all(r.ok for r in results) and duration > 0
    by_session = [results[0:3], results[3:5], results[5:6]]
    for turns, played in zip(sessions, by_session):
        history = ""
        for message, result in zip(turns, played):
            history += f"<user>{message}<assistant>"
            assert result.prompt_tokens == len(history)
            assert 0 < result.output_tokens <= 6 and len(result.text) <= result.output_tokens
            history += result.text


@pytest.fixture
def local_servers(monkeypatch, server):
    """`bench concurrency` without server processes: every configuration is the local test server."""
    from specdecode.bench import concurrency

    class Local:
        base_url = server.url

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(concurrency, "start_server", lambda name, serve_args, args: Local())
    return concurrency


def test_bench_concurrency_plays_sessions_on_every_server(local_servers, monkeypatch, tmp_path, capsys):
    """`bench concurrency --dataset agent-loop`: each configuration gets the same sessions, every turn
    counted, and the rows carry the later turns' TPOT."""
    from specdecode.cli import build_parser

    concurrency = local_servers
    scripted = []  # the real scripts are longer than the tiny model's context
    monkeypatch.setattr(
        concurrency,
        "agent_loop_scripts",
        lambda count, turns: scripted.append((count, turns)) or [["ab", "cd"]] * count,
    )
    args = build_parser().parse_args(
        [
            "bench",
            "concurrency",
            "--dataset",
            "agent-loop",
            "--turns",
            "2",
            "--policies",
            "plain",
            "adaptive-suffix",
            "--concurrency",
            "2",
            "--max-tokens",
            "4",
            "--min-requests",
            "3",
            "--requests-per-client",
            "1",
            "--out",
            str(tmp_path / "c.json"),
        ]
    )
    assert concurrency.run_concurrency_cli(args) == 0
    assert capsys.readouterr().out.startswith("agent-loop sessions of 2 turns through the server")
    report = json.loads((tmp_path / "c.json").read_text())
    assert [r["config"] for r in report["results"]] == ["plain", "adaptive-suffix"]
    for row in report["results"]:
        assert row["num_requests"] == 3 * 2 and row["num_failed"] == 0
        assert row["later_turns_tpot_s"] is not None
    assert report["meta"]["dataset"] == "agent-loop" and scripted == [(3, 2)]


def test_benchmarks_take_any_prompt_dataset(tmp_path, monkeypatch, capsys):
    """bench latency / concurrency --dataset: chats, or any dataset load_prompts reads (the user's own
    prompts among them); a wrong one fails before any model loads, naming what is accepted."""
    from specdecode.bench import concurrency, datasets, latency
    from specdecode.cli import build_parser

    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    assert latency.load_requests(f"jsonl:{f}", 3, 2, "tiny") == ["a", "b", "a"]
    assert concurrency.workload(build_parser().parse_args(["bench", "concurrency", "--dataset", f"jsonl:{f}"]), 3) == [
        "a",
        "b",
        "a",
    ]
    monkeypatch.setattr(datasets, "token_counter", lambda name: _count_words)  # sized by the model's tokenizer
    (sonnet,) = latency.load_requests("sonnet:60", 1, 2, "tiny")
    assert sonnet.startswith(SONNET_INSTRUCTION) and 50 <= _count_words(sonnet) <= 60
    assert latency.load_requests("code-edit", 1, 2, "tiny")[0][-1]["role"] == "user"
    for bad in ("poems", "sonnet:long", "jsonl:"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["bench", "latency", "--dataset", bad])
        assert f"unknown dataset '{bad}'; use humaneval, code-edit, agent-loop" in capsys.readouterr().err


def test_bench_concurrency_sends_a_prompt_file_as_completions(local_servers, tmp_path, capsys):
    """`bench concurrency --dataset jsonl:PATH`: the file's prompts, as completions that run to max tokens."""
    from specdecode.cli import build_parser

    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": p}) for p in ("ab", "cde")))
    args = build_parser().parse_args(
        [
            "bench",
            "concurrency",
            "--dataset",
            f"jsonl:{f}",
            "--policies",
            "plain",
            "--concurrency",
            "2",
            "--max-tokens",
            "4",
            "--min-requests",
            "3",
            "--requests-per-client",
            "1",
            "--out",
            str(tmp_path / "c.json"),
        ]
    )
    assert local_servers.run_concurrency_cli(args) == 0
    assert capsys.readouterr().out.startswith(f"prompts from jsonl:{f} through the server")
    (row,) = json.loads((tmp_path / "c.json").read_text())["results"]
    assert row["num_requests"] == 3 and row["num_failed"] == 0 and row["output_tokens"] == 3 * 4


def test_tpot_windows_cover_the_whole_output(target):
    """`bench tpot` times every window of one long plain output, in order, and the output runs to the end
    (a stop string is checked every token but never matches)."""
    from specdecode import LLM
    from specdecode.bench.tpot import tpot_by_window

    llm = LLM(target=target, num_speculative_tokens=0, max_model_len=512, max_num_seqs=1)
    rows = tpot_by_window(llm, "abc", max_tokens=300, window=50)
    assert [r.tokens for r in rows] == list(range(51, 300, 50))  # the first step: the prefill, 1 token
    # the forward is timed inside the same steps: part of each token's time, never more
    assert all(0 < r.forward_s < r.tpot_s for r in rows)


def test_tpot_pairs_each_long_window_with_a_short_requests_window(target, monkeypatch):
    """Between windows of the long output, a short request on a second engine (same weights) decodes its
    stretch of tokens SHORT_FROM..SHORT_TO, starting over past it; neither engine's output is disturbed."""
    from specdecode import LLM, SamplingParams
    from specdecode.bench import tpot

    monkeypatch.setattr(tpot, "SHORT_FROM", 20)
    monkeypatch.setattr(tpot, "SHORT_TO", 60)
    long, short = (LLM(target=target, num_speculative_tokens=0, max_model_len=512, max_num_seqs=1) for _ in "ab")
    seen = []
    original_run = tpot.TimedRequest.run

    def run(request, window):
        row = original_run(request, window)
        seen.append((request.llm is short, request.seq, row))
        return row

    monkeypatch.setattr(tpot.TimedRequest, "run", run)
    pairs = tpot.tpot_interleaved(long, short, long.tokenizer.encode("abc"), max_tokens=200, window=20)
    assert [row.tokens for row, _ in pairs] == list(range(21, 200, 20))
    # timed short windows run from token 20 to 60, then a fresh request: untimed warm-ups to token 20 between
    assert [ref.tokens for _, ref in pairs] == [40, 60, 40, 60, 40, 60, 40, 60, 40]
    assert sum(1 for is_short, _, row in seen if is_short and row.tokens == 20) == 5
    assert all(0 < ref.forward_s < ref.tpot_s for _, ref in pairs)
    alone = LLM(target=target, num_speculative_tokens=0, max_model_len=512, max_num_seqs=1)
    expected = alone.generate(["abc"], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))[0]
    long_seq = next(seq for is_short, seq, _ in seen if not is_short)
    assert long_seq.output_ids == expected.outputs[0].token_ids
    assert all(
        seq.output_ids == expected.outputs[0].token_ids[: len(seq.output_ids)] for is_short, seq, _ in seen if is_short
    )


class _Loaded(Exception):
    """Raised by a stand-in load_model once it has recorded what it was asked for."""


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "latency", "--quantization", "w8a8", "--draft-quantization", "w8a16", "--kv-cache-dtype", "float32"],
        ["bench", "latency", "--quantization", "w8a8", "--draft-quantization", "w8a16", "--kv-cache-dtype", "float32"]
        + ["--lora", "adapter", "--lora", "other.gguf:0.5", "--lora-dtype", "bfloat16"],
        ["plan", "--quantization", "w8a8", "--draft-quantization", "w8a16", "--kv-cache-dtype", "float32"],
    ],
)
def test_benchmarks_load_models_with_the_backend_flags_they_show(monkeypatch, argv):
    """A flag a benchmark accepts reaches the models it loads (the target's and the draft's)."""
    import specdecode.models.loader as loader
    from specdecode.bench import advisor, latency
    from specdecode.cli import build_parser

    asked = []

    def recording_load_model(name, *args, **kw):
        asked.append((name, kw))
        if len(asked) == 2:
            raise _Loaded
        return types.SimpleNamespace(model=types.SimpleNamespace(device="cpu"))

    monkeypatch.setattr(loader, "load_model", recording_load_model)
    monkeypatch.setattr(latency, "load_model", recording_load_model)
    args = build_parser().parse_args(argv)
    with pytest.raises(_Loaded):
        if argv[0] == "plan":
            advisor.run_advisor_cli(args)
        else:
            latency.run_backend(args, args.quantization[0], [], None)
    (_, target), (_, draft) = asked
    assert target["quantization"] == "w8a8" and draft["quantization"] == "w8a16" and draft["draft"]
    assert target["kv_cache_dtype"] == draft["kv_cache_dtype"] == "float32"
    if "--lora" in argv:
        assert target["lora"] == [Adapter("adapter"), Adapter("other.gguf", 0.5)] and "lora" not in draft
        assert target["lora_dtype"] == "bfloat16"


def test_bench_concurrency_starts_every_server_with_the_backend_flags():
    from specdecode.bench.concurrency import server_configs
    from specdecode.cli import build_parser

    args = build_parser().parse_args(
        [
            "bench",
            "concurrency",
            "--policies",
            "plain",
            "adaptive-suffix",
            "--quantization",
            "w8a8",
            "--kv-cache-dtype",
            "float32",
        ]
    )
    for _, argv in server_configs(args):
        assert argv[argv.index("--quantization") + 1] == "w8a8"
        assert argv[argv.index("--kv-cache-dtype") + 1] == "float32"


def test_llama_cpp_speculates_with_our_draft_model_or_else_the_bundled_one(capsys):
    """llama.cpp's draft rows (llama-speculative-simple, llama-server): our draft where --draft names a model; the
    target's bundled draft model where it names a head or a lookup (llama.cpp reads neither: bench concurrency
    resolved one as a file and failed the whole sweep); none where the target has none. The sweep says which."""
    from specdecode.bench.concurrency import llama_server_configs
    from specdecode.bench.llama_cpp import llama_cpp_draft
    from specdecode.cli import build_parser
    from specdecode.config import DEFAULT_DRAFT, DEFAULT_TARGET

    assert llama_cpp_draft(DEFAULT_TARGET, None) == DEFAULT_DRAFT
    assert llama_cpp_draft(DEFAULT_TARGET, "smollm2-135m") == "smollm2-135m"
    assert llama_cpp_draft("smollm2-135m", "ngram") is None

    def args(*flags):
        return build_parser().parse_args(["bench", "concurrency", "--vs-llama-server", "bin", *flags])

    for proposer in ("head:qwen2.5-coder-1.5b", "ngram", "suffix"):
        assert llama_cpp_draft(DEFAULT_TARGET, proposer) == DEFAULT_DRAFT
        assert [name for name, _ in llama_server_configs(args("--draft", proposer))] == ["llama.cpp", "llama.cpp-draft"]
        assert f"speculates with {DEFAULT_DRAFT}" in capsys.readouterr().out
    other = args("--model", "smollm2-135m", "--draft", "ngram")
    assert [name for name, _ in llama_server_configs(other)] == ["llama.cpp"]
    assert "llama.cpp-draft left out" in capsys.readouterr().out


def test_bench_latency_gives_llama_cpp_draft_rows_beside_a_head(monkeypatch, capsys):
    """`bench latency --draft head:... --vs-llama-cpp`: llama.cpp's draft rows speculate with the bundled draft
    model at each k (they were left out), and the output says so."""
    from specdecode.bench import latency
    from specdecode.bench.llama_cpp import LlamaSpeculative
    from specdecode.cli import build_parser
    from specdecode.config import DEFAULT_DRAFT

    drafts = []

    def speculative(bin_dir, target, draft, prompts, k, max_tokens, threads):
        drafts.append((draft, k))
        return LlamaSpeculative(k, 64, 2.0, 30, 20)

    monkeypatch.setattr(latency, "resolve", lambda name: types.SimpleNamespace(path=f"{name}.gguf"))
    monkeypatch.setattr(latency, "run_llama_speculative", speculative)
    args = build_parser().parse_args(
        ["bench", "latency", "--draft", "head:qwen2.5-coder-1.5b", "-k", "2", "3", "--vs-llama-cpp", "bin"]
    )
    plain = types.SimpleNamespace(tokens_per_s=16.0)
    bench = types.SimpleNamespace(verify_cost_ratio=lambda k: 1.0)
    rows = latency.run_llama_cpp_speculative(args, ["p"], 2, plain, bench)
    assert drafts == [(f"{DEFAULT_DRAFT}.gguf", 2), (f"{DEFAULT_DRAFT}.gguf", 3)]
    assert [r.config for r in rows] == ["llama.cpp: draft k=2", "llama.cpp: draft k=3"] and rows[0].speedup == 2.0
    assert f"speculate with {DEFAULT_DRAFT}" in capsys.readouterr().out


def test_chunked_perplexity_scores_each_whole_chunks_second_half(target):
    """llama-perplexity's measure: whole chunks only, each scored from its middle on (position p predicts
    token p + 1)."""
    import math

    import torch

    from specdecode.bench.quality import chunked_perplexity
    from specdecode.executor.runner import ModelRunner

    ids = [(7 * i + 3) % 60 for i in range(2 * 16 + 5)]  # two chunks of 16, and 5 tokens left over
    nll = 0.0
    for chunk in (ids[:16], ids[16:32]):
        runner = ModelRunner(target.model, 1, 17)
        logp = torch.log_softmax(runner.forward([runner.allocate()], [chunk], "all"), -1)
        nll -= sum(logp[p, chunk[p + 1]].item() for p in range(8, 15))
    assert chunked_perplexity(target.model, ids, 16) == pytest.approx(math.exp(nll / 14), rel=1e-6)


def test_llama_cpp_perplexity_and_tokens_are_read_from_its_output(tmp_path):
    from specdecode.bench.llama_cpp import run_llama_perplexity, run_llama_tokenize

    for name, output in (
        ("llama-tokenize", "load: 151643 tokens\n[1, 22, 333]"),
        ("llama-perplexity", "[1]59.5859,[2]63.7833,\nFinal estimate: PPL = 17.8779 +/- 1.46745"),
    ):
        tool = tmp_path / name
        tool.write_text(f"#!/bin/sh\nprintf '{output}\\n' >&2\n")
        tool.chmod(0o755)
    assert run_llama_tokenize(str(tmp_path), "m.gguf", "t.txt") == [1, 22, 333]
    assert run_llama_perplexity(str(tmp_path), "m.gguf", "t.txt", 256, 2) == 17.8779
    (tmp_path / "llama-perplexity").write_text("#!/bin/sh\necho 'error: you need at least 512 tokens' >&2\n")
    with pytest.raises(SpecDecodeError, match="could not read llama-perplexity's estimate"):
        run_llama_perplexity(str(tmp_path), "m.gguf", "t.txt", 256, 2)


def test_a_missing_perplexity_tool_says_how_to_build_it(tmp_path):
    from specdecode.bench.llama_cpp import run_llama_tokenize

    _tool(tmp_path, "llama-bench", "exit 0\n")  # build-llama-cpp.sh's folder, without the extra targets
    with pytest.raises(SpecDecodeError, match="--target llama-perplexity llama-tokenize"):
        run_llama_tokenize(str(tmp_path), "m.gguf", "t.txt")
    with pytest.raises(SpecDecodeError, match="pass the folder that build-llama-cpp.sh printed"):
        run_llama_tokenize(str(tmp_path / "elsewhere"), "m.gguf", "t.txt")


def _tool(folder, name: str, script: str) -> None:
    tool = folder / name
    tool.write_text("#!/bin/sh\n" + script)
    tool.chmod(0o755)


def test_llama_cpp_batches_run_unrepacked_where_its_repacked_kernels_crash(tmp_path):
    """A llama-bench that dies of SIGSEGV on forwards over several tokens unless repacking is off (as its
    AMX kernels do on some Intel hosts): decoding keeps the default run, the forwards come from the rerun."""
    from specdecode.bench.llama_cpp import run_llama_bench, run_llama_speculative

    tg = '{"n_prompt": 0, "n_gen": 96, "avg_ts": 14.0}'
    pp = '{"n_prompt": 1, "n_gen": 0, "avg_ts": 20.0}, {"n_prompt": 3, "n_gen": 0, "avg_ts": 45.0}'
    _tool(
        tmp_path,
        "llama-bench",
        f"""case "$*" in
  *"--repack 0"*) echo '[{pp}]' ;;
  *"-p 0 "*) echo '[{tg}]' ;;
  *) kill -SEGV $$ ;;
esac
""",
    )
    bench = run_llama_bench(str(tmp_path), "m.gguf", 2, 96, forward_sizes=(1, 3))
    assert (bench.decode_tokens_per_s, bench.batches_repacked) == (14.0, False)
    assert bench.verify_cost_ratio(2) == pytest.approx((3000 / 45) / 50)
    assert (bench.prefill_tokens_per_s(3), bench.prefill_tokens_per_s(512)) == (45.0, None)
    _tool(
        tmp_path,
        "llama-speculative-simple",
        """case "$*" in
  *--no-repack*) printf 'decoded 96 tokens in 4.0 seconds\\nn_drafted = 60\\nn_accept = 45\\n' >&2 ;;
  *) kill -SEGV $$ ;;
esac
""",
    )
    spec = run_llama_speculative(str(tmp_path), "m.gguf", "d.gguf", ["a", "b"], 3, 96, 2)
    assert (spec.output_tokens, spec.drafted, spec.accepted, spec.repacked) == (192, 120, 90, False)
    _tool(
        tmp_path,
        "llama-bench",
        f"""case "$*" in
  *"-fa off"*"--repack 0"*) echo '[{pp}]' ;;
  *"-fa off -p 0 "*) echo '[{tg}]' ;;
  *) kill -ABRT $$ ;;
esac
""",
    )  # its flash attention crashing over repacked weights even decoding (DeepSeek's latent attention), its batches too
    bench = run_llama_bench(str(tmp_path), "m.gguf", 2, 96, forward_sizes=(1, 3))
    assert (bench.decode_tokens_per_s, bench.batches_repacked, bench.flash_attention) == (14.0, False, False)
    assert bench.prefill_tokens_per_s(3) == 45.0
    _tool(tmp_path, "llama-bench", "kill -SEGV $$\n")  # crashing either way: the error says so
    with pytest.raises(SpecDecodeError, match="died of signal 11"):
        run_llama_bench(str(tmp_path), "m.gguf", 2, 96)


def test_llama_cpp_decoding_after_a_filled_cache_reads_each_depth(tmp_path):
    """`bench tpot --vs-llama-cpp` asks llama-bench for decoding after each depth and reads the rate by depth,
    rerunning unrepacked where filling the cache crashes its repacked kernels."""
    from specdecode.bench.llama_cpp import run_llama_decode_at_depths

    rows = (
        '[{"n_prompt": 0, "n_gen": 500, "n_depth": 230, "avg_ts": 42.0},'
        ' {"n_prompt": 0, "n_gen": 500, "n_depth": 3630, "avg_ts": 21.0}]'
    )
    _tool(
        tmp_path,
        "llama-bench",
        f"""case "$*" in
  *"-n 500 -d 230,3630"*) echo '{rows}' ;;
  *) echo "unexpected arguments: $*" >&2; exit 1 ;;
esac
""",
    )
    assert run_llama_decode_at_depths(str(tmp_path), "m.gguf", 2, 500, (230, 3630)) == ({230: 42.0, 3630: 21.0}, True)
    _tool(
        tmp_path,
        "llama-bench",
        f"""case "$*" in
  *"--repack 0"*) echo '{rows}' ;;
  *) kill -SEGV $$ ;;
esac
""",
    )
    assert run_llama_decode_at_depths(str(tmp_path), "m.gguf", 2, 500, (230, 3630))[1] is False


@pytest.mark.parametrize(
    "draft, rows",
    [
        (None, ["ngram"]),  # no bundled draft for a tiny target: the n-gram rows only
        ("ngram", ["ngram"]),
        ("suffix", ["suffix", "ngram"]),
        ("head:H", ["head", "ngram"]),
    ],
)
def test_bench_latency_draft_takes_a_proposer_kind_as_its_own_rows(target, monkeypatch, draft, rows):
    """`bench latency --draft ngram|suffix|head:PATH` (as --help says) measures that proposer under the fixed
    policy instead of loading a draft model named like it."""
    from specdecode.bench import latency
    from specdecode.cli import build_parser

    made = []
    monkeypatch.setattr(latency, "LLM", lambda **kw: made.append(kw) or kw)
    args = build_parser().parse_args(
        ["bench", "latency", "--model", "tiny", "-k", "2", "3"] + (["--draft", draft] if draft else [])
    )
    assert latency.draft_model_name(args) is None
    runs = latency.make_runs(args, target, None, None)
    assert [r.kind for r in runs] == rows
    assert all(kw["speculation_policy"] == "fixed" for kw in made)
    assert [kw["speculative_model"] for kw in made][:1] == [draft or "ngram"]


@pytest.mark.parametrize("flags", [["--draft", "head:H"], ["--head", "H"]])
def test_bench_latency_suffix_measures_a_head_alone_and_beside_suffix_drafts(target, monkeypatch, flags):
    """With --suffix, a head (from --draft or --head) gets the adaptive rows a draft model gets: alone and
    with suffix drafts beside it, each with the last confidence asked for."""
    from specdecode.bench import latency
    from specdecode.cli import build_parser

    made = []
    monkeypatch.setattr(latency, "LLM", lambda **kw: made.append(kw) or kw)
    args = build_parser().parse_args(
        [
            "bench",
            "latency",
            "--model",
            "tiny",
            "-k",
            "2",
            "3",
            "--suffix",
            "--no-ngram",
            "--draft-confidence",
            "0.5",
            "0.8",
            *flags,
        ]
    )
    runs = latency.make_runs(args, target, None, None)
    assert [r.kind for r in runs] == ["head", "suffix adaptive", "head adaptive", "head+suffix adaptive"]
    adaptive = made[-2:]
    assert [kw["speculative_model"] for kw in adaptive] == ["head:H", "head:H"]
    assert [kw["prompt_lookup"] for kw in adaptive] == [None, "suffix"]
    assert all(kw["draft_confidence"] == 0.8 and kw["num_speculative_tokens"] == 3 for kw in adaptive)
    assert "speculation_policy" not in adaptive[0]  # the engine's default, adaptive


def test_llama_server_starts_unrepacked_where_its_repacked_kernels_crash_it(tmp_path):
    """A llama-server that dies of SIGSEGV at start-up unless repacking is off (as its AMX kernels do on
    some Intel hosts) is started again with --no-repack, and says so; one that crashes either way is an
    error that shows its output."""
    import sys

    from specdecode.bench.server_process import ServerCrashed, llama_server

    health = (
        "import http.server, sys; port = int(sys.argv[sys.argv.index('--port') + 1])\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self): self.send_response(200); self.end_headers()\n"
        "http.server.HTTPServer(('127.0.0.1', port), H).serve_forever()\n"
    )
    (tmp_path / "health.py").write_text(health)
    _tool(
        tmp_path,
        "llama-server",
        f"""case "$*" in
  *--no-repack*) exec {sys.executable} {tmp_path / "health.py"} "$@" ;;
  *) echo 'repacked kernels'; kill -SEGV $$ ;;
esac
""",
    )
    with llama_server(str(tmp_path), "m.gguf", 2, 256, 2) as server:
        assert not server.repacked and "--no-repack" in server.args and server.proc.poll() is None
    _tool(tmp_path, "llama-server", "echo 'crashed'; kill -SEGV $$\n")
    with pytest.raises(ServerCrashed, match="crashed"):
        with llama_server(str(tmp_path), "m.gguf", 2, 256, 2):
            pass


def test_a_server_interrupted_while_it_starts_is_stopped(monkeypatch):
    """SIGTERM (the bench turns it into SystemExit) or Ctrl-C while a server loads: its context manager's
    __exit__ never runs, so __enter__ itself must stop the child rather than leave it holding memory and a port."""
    import sys

    from specdecode.bench import server_process

    def interrupted(_self):
        raise KeyboardInterrupt

    # (not time.sleep: stopping the child waits on it through time.sleep too, and would be interrupted as well)
    monkeypatch.setattr(server_process.ServerProcess, "_wait_until_it_answers", interrupted)
    server = server_process.ServerProcess([], command=[sys.executable, "-c", "import time; time.sleep(60)"])
    with pytest.raises(KeyboardInterrupt):
        with server:
            pass
    assert server.proc.poll() is not None


def test_a_server_without_a_context_length_gets_the_models_own():
    """max_model_len None (the model's context, the engine's default) leaves the flag out rather than passing
    "None", which the server's parser refuses."""
    assert "--max-model-len" not in serve_argv("m", 4, None, "auto")
    argv = serve_argv("m", 4, 512, "auto")
    assert argv[argv.index("--max-model-len") + 1] == "512"
