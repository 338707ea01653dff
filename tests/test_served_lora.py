"""Served LoRA adapters (vLLM's --lora-modules): each request computes with the adapter it names, beside requests of
other adapters and of none in the same forwards, and gets what the target loaded with that adapter alone computes
(greedy outputs token for token, in the one-call decoder and layer by layer, with speculation too); a route that
gives every row the same adapter, or a decoder that ignores it, computes otherwise; a prompt never starts from KV
blocks computed with another adapter; the server lists the adapters as models and answers in their name; names are
checked. Adapters loaded while serving compute as adapters loaded at start, and one loaded again under a name never
finds the blocks of the one before (a prefix index keyed by name does); unloading is refused while a request
computes with the adapter, and a bad adapter changes nothing."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from conftest import LocalServer, fixed_k_llm, make_head
from families import convert, make_checkpoint, make_lora, reference_model
from test_families import _prompt
from test_lora import _loaded

from specdecode import LLM, SamplingParams
from specdecode.cli import build_parser
from specdecode.config import EngineConfig
from specdecode.errors import SpecDecodeError
from specdecode.models.lora import Adapter, LowRankAdded
from specdecode.server.api import build_app
from specdecode.server.async_engine import AsyncEngine
from specdecode.server.serve_cmd import llm_options

NAMES = ["first", "", "second", "first"]  # each prompt's adapter ("": none), two prompts of one adapter apart
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """The model's GGUF and two adapters (PEFT folders) of other layers and ranks, by name, at half strength."""
    root = tmp_path_factory.mktemp("served-lora")
    folder = make_checkpoint("qwen2_yarn", root / "checkpoint")
    reference = reference_model(folder)
    make_lora(reference, root / "first", ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    make_lora(reference, root / "second", ("k_proj", "o_proj", "down_proj"), rank=8, seed=1)
    served = {name: Adapter(str(root / name), 0.5) for name in ("first", "second")}
    return convert(folder, root / "model.gguf"), served


def _prompts(vocab: int) -> list[list[int]]:
    first = _prompt(vocab, 20, seed=2)
    return [first * 2, _prompt(vocab, 9, seed=3), first * 2, _prompt(vocab, 33, seed=4)]  # repeats: lookups hit


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _each_alone(gguf, served, quantization: str) -> list[list[int]]:
    """Each prompt's output from the target loaded with its adapter alone (as --lora), one LLM each."""
    alone = {}
    for name in dict.fromkeys(NAMES):
        target = _loaded(gguf, *([served[name]] if name else []), quantization=quantization)
        llm = LLM(target=target, num_speculative_tokens=0, max_model_len=256)
        alone[name] = _tokens(llm.generate(_prompts(target.config.vocab_size), PARAMS))
    return [alone[name][i] for i, name in enumerate(NAMES)]


def _mixed(gguf, served, quantization: str, proposer: str | None = None, folder=None) -> list[list[int]]:
    target = _loaded(gguf, quantization=quantization, served=served)
    if proposer == "head":  # its features the target's, each row's as its adapter computes them
        proposer = make_head(target, folder / "head", intermediate=64)
    llm = fixed_k_llm(target, speculative_model=proposer, k=3 if proposer else 0)
    outputs = llm.generate(_prompts(target.config.vocab_size), PARAMS, adapter=NAMES)
    assert proposer is None or sum(o.spec["num_draft_tokens"] for o in outputs) > 0
    return _tokens(outputs)


@pytest.fixture(scope="module")
def expected(made):
    """By weights: w8a8 (the one-call decoder) and float32 (layer by layer)."""
    gguf, served = made
    return {quantization: _each_alone(gguf, served, quantization) for quantization in ("w8a8", "none")}


@pytest.mark.parametrize("proposer", [None, "ngram", "head"])
@pytest.mark.parametrize("quantization", ["w8a8", "none"])
def test_each_request_computes_with_the_adapter_it_names_beside_the_others(
    made, expected, quantization, proposer, tmp_path
):
    gguf, served = made
    want = expected[quantization]
    assert len({tuple(tokens) for tokens in want[:3]}) == 3  # the adapters change the output: the test can fail
    assert _mixed(gguf, served, quantization, proposer, tmp_path) == want


def test_a_forward_s_rows_run_by_adapter_packed_or_padded():
    from specdecode.models.runtime import ForwardBatch

    def runs(sets, new, width):
        return ForwardBatch.build([0, 1, 2], [0, 5, 9], new, 64, "cpu", "last", width, sets).adapter_runs

    assert runs([1, 1, 0], [3, 2, 4], 16) == [(0, 5, 1), (5, 4, 0)]  # packed: each sequence's rows, neighbours joined
    assert runs([2, 0, 2], [3, 2, 4], 0) == [(0, 4, 2), (4, 4, 0), (8, 4, 2)]  # padded: 4 rows a sequence
    assert runs([0, 0, 0], [3, 2, 4], 16) is None  # the model's own set: no route


def test_a_route_that_gives_every_row_one_adapter_computes_otherwise(made, expected, monkeypatch):
    """The broken variant: every row of a forward computed with the set of its first sequence."""
    import specdecode.models.runtime as runtime

    monkeypatch.setattr(runtime, "adapter_runs", lambda sets, rows: [(0, sum(rows), sets[0])])
    gguf, served = made
    assert _mixed(gguf, served, "none") != expected["none"]


def test_a_one_call_decoder_that_ignores_the_route_computes_otherwise(made, expected, monkeypatch):
    """The broken variant: the decoder's call without the adapter runs (every row the model's own set)."""
    from specdecode.executor.decoder import DecoderKernel

    called = DecoderKernel.__call__

    def blind(self, model, x, rope, batch, cache):
        batch.adapter_runs = None
        return called(self, model, x, rope, batch, cache)

    monkeypatch.setattr(DecoderKernel, "__call__", blind)
    gguf, served = made
    assert _mixed(gguf, served, "w8a8") != expected["w8a8"]


def _twice(made, monkeypatch=None) -> tuple[list, list, int]:
    """A prompt with the first adapter, then without (prefix caching on): the second's output and the cached
    prompt tokens it started from, and the output of the prompt without adapter on a fresh engine."""
    gguf, served = made
    target = _loaded(gguf, quantization="w8a8", served=served)
    prompt = _prompts(target.config.vocab_size)[3]
    llm = LLM(target=target, num_speculative_tokens=0, max_model_len=256, prefix_caching=True)
    llm.generate([prompt], PARAMS, adapter="first")
    again = llm.generate([prompt], PARAMS, adapter="first")[0]
    assert again.metrics.num_cached_prompt_tokens >= 16  # the same adapter finds its blocks
    after = llm.generate([prompt], PARAMS)[0]
    fresh = LLM(target=target, num_speculative_tokens=0, max_model_len=256).generate([prompt], PARAMS)[0]
    return after.outputs[0].token_ids, fresh.outputs[0].token_ids, after.metrics.num_cached_prompt_tokens


def test_a_prompt_never_starts_from_blocks_computed_with_another_adapter(made):
    after, fresh, cached = _twice(made)
    assert cached == 0 and after == fresh


def test_a_prefix_index_blind_to_adapters_gives_another_answer(made, monkeypatch):
    """The broken variant: blocks found by tenant and tokens alone."""
    import specdecode.executor.runner as runner

    monkeypatch.setattr(runner, "_scoped", lambda scope, adapter: scope)
    after, fresh, cached = _twice(made)
    assert cached > 0 and after != fresh


def test_the_server_lists_the_adapters_and_answers_in_the_name_asked(made):
    gguf, served = made
    target = _loaded(gguf, quantization="w8a8", served=served)
    llm = LLM(target=target, num_speculative_tokens=0, max_model_len=256)
    prompt = _prompts(target.config.vocab_size)[1]
    want = {name: llm.generate([prompt], PARAMS, adapter=name)[0].outputs[0].token_ids for name in ("", "first")}
    with LocalServer(build_app(AsyncEngine(llm.engine), "tiny")) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        cards = {card.id: card for card in client.models.list().data}
        got = {
            name: client.completions.create(
                model=name or "tiny", prompt=prompt, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
            )
            for name in ("", "first")
        }
        with pytest.raises(openai.NotFoundError, match="not served"):
            client.completions.create(model="third", prompt=prompt, max_tokens=4)
        metrics = httpx.get(server.url + "/metrics").text
    assert set(cards) == {"tiny", "first", "second"} and cards["first"].model_extra["parent"] == "tiny"
    assert got["first"].model == "first" and got[""].model == "tiny"
    for name, completion in got.items():
        assert completion.choices[0].text == target.tokenizer.decode(want[name])
    assert want["first"] != want[""]
    assert 'specdecode_lora_requests_finished_total{adapter="first"} 1.0' in metrics
    assert 'specdecode_lora_output_tokens_total{adapter="first"} 24.0' in metrics and 'adapter=""' not in metrics


def test_every_chat_api_answers_with_the_adapter_named_and_in_its_name(made):
    """Chat completions, the Responses API and the Messages API: the same adapted answer, each giving its name."""
    gguf, served = made
    llm = LLM(
        target=_loaded(gguf, quantization="w8a8", served=served),
        num_speculative_tokens=0,
        max_model_len=256,
        chat_template="{% for m in messages %}{{ m.content }}{% endfor %}",
    )
    message, greedy = [{"role": "user", "content": "def add(a, b):"}], {"temperature": 0, "max_tokens": 12}
    with LocalServer(build_app(AsyncEngine(llm.engine), "tiny")) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        texts, names = {}, {}
        for name in ("first", "tiny"):
            chat = client.chat.completions.create(model=name, messages=message, **greedy)
            response = client.responses.create(model=name, input=message, temperature=0, max_output_tokens=12)
            anthropic = httpx.post(
                server.url + "/v1/messages", json={"model": name, "messages": message, **greedy}
            ).json()  # fmt: skip
            texts[name] = [chat.choices[0].message.content, response.output_text, anthropic["content"][0]["text"]]
            names[name] = [chat.model, response.model, anthropic["model"]]
    assert names == {"first": ["first"] * 3, "tiny": ["tiny"] * 3}
    assert len(set(texts["first"])) == 1 and len(set(texts["tiny"])) == 1 and texts["first"] != texts["tiny"]


def test_adapter_names_are_checked(made):
    gguf, served = made
    llm = LLM(target=_loaded(gguf, quantization="w8a8", served=served), num_speculative_tokens=0, max_model_len=256)
    with pytest.raises(SpecDecodeError, match="no LoRA adapter 'third' is served \\(served: 'first', 'second'\\)"):
        llm.generate([[1, 2, 3]], PARAMS, adapter="third")
    plain = LLM(target=_loaded(gguf, quantization="w8a8"), num_speculative_tokens=0, max_model_len=256)
    with pytest.raises(SpecDecodeError, match="this model has no served adapters"):
        plain.generate([[1, 2, 3]], PARAMS, adapter="first")
    assert not plain.engine.has_unfinished() and not llm.engine.has_unfinished()


def test_adapters_for_a_target_loaded_apart_are_refused_not_left_out(made):
    gguf, served = made
    target = _loaded(gguf, quantization="w8a8")
    named = {"lora_modules": [f"first={served['first'].path}"]}
    for options in ({"lora": [str(served["first"].path)]}, named, {"lora_dtype": "bfloat16"}):
        with pytest.raises(SpecDecodeError, match="adapt a target the LLM loads"):
            LLM(target=target, num_speculative_tokens=0, **options)


def test_lora_modules_are_parsed_and_checked():
    args = build_parser().parse_args(["serve", "--lora-modules", "sql=/a", "--lora-modules", "chat=/b.gguf:0.5"])
    assert llm_options(args)["lora_modules"] == ("sql=/a", "chat=/b.gguf:0.5")
    config = EngineConfig(model="m", lora_modules=("sql=/a", "chat=/b.gguf:0.5"))
    assert Adapter.served(config.lora_modules) == {"sql": Adapter("/a"), "chat": Adapter("/b.gguf", 0.5)}
    for wrong, message in [(("/a",), "NAME=PATH"), (("=/a",), "NAME=PATH"), (("a=/x", "a=/y"), "twice")]:
        with pytest.raises(SpecDecodeError, match=message):
            EngineConfig(model="m", lora_modules=wrong)


# ---- adapters loaded and unloaded while serving (engine/adapters.py; vLLM's /v1/load_lora_adapter) --------------


def _spec(adapter: Adapter) -> str:
    return f"{adapter.path}:{adapter.scale}"


def test_adapters_loaded_while_serving_compute_as_adapters_loaded_at_start(made, expected):
    """Into a target loaded without any (the one-call decoder described anew), served beside requests of none."""
    from specdecode.engine.adapters import load_adapter

    gguf, served = made
    llm = fixed_k_llm(_loaded(gguf, quantization="w8a8"), k=0)
    for name, adapter in served.items():
        load_adapter(llm.engine, name, _spec(adapter))
    assert llm.engine.runner.adapters == ["first", "second"] and llm.target.model.layers_kernel is not None
    outputs = llm.generate(_prompts(llm.target.config.vocab_size), PARAMS, adapter=NAMES)
    assert _tokens(outputs) == expected["w8a8"]
    rounded = _loaded(gguf, quantization="w8a8", lora_dtype="bfloat16")
    load_adapter(fixed_k_llm(rounded, k=0).engine, "first", _spec(served["first"]))
    assert {s.lora_a.dtype for m in rounded.model.modules() if isinstance(m, LowRankAdded) for s in m.sets[1:]} == {
        torch.bfloat16
    }


def _reloaded(made, prompt_of: int = 3) -> tuple[list[int], list[int], int]:
    """A prompt with "first", which is then unloaded and loaded again from the second adapter's files (prefix
    caching on): the prompt's output under the new "first", the cached prompt tokens it started from, and its
    output with "second"."""
    from specdecode.engine.adapters import load_adapter, unload_adapter

    gguf, served = made
    target = _loaded(gguf, quantization="w8a8", served=served)
    prompt = _prompts(target.config.vocab_size)[prompt_of]
    llm = LLM(target=target, num_speculative_tokens=0, max_model_len=256, prefix_caching=True)
    llm.generate([prompt], PARAMS, adapter="first")
    unload_adapter(llm.engine, "first")
    with pytest.raises(SpecDecodeError, match="no LoRA adapter 'first' is served"):
        llm.generate([prompt], PARAMS, adapter="first")
    load_adapter(llm.engine, "first", _spec(served["second"]))
    again = llm.generate([prompt], PARAMS, adapter="first")[0]
    second = llm.generate([prompt], PARAMS, adapter="second")[0]
    return again.outputs[0].token_ids, second.outputs[0].token_ids, again.metrics.num_cached_prompt_tokens


def test_an_adapter_loaded_again_under_its_name_never_finds_the_blocks_of_the_one_before(made):
    again, second, cached = _reloaded(made)
    assert cached == 0 and again == second


def test_a_prefix_index_that_scopes_blocks_by_adapter_name_gives_the_old_adapter_s_answer(made, monkeypatch):
    """The broken variant: blocks kept by the adapter's name, which a later adapter takes again."""
    import specdecode.executor.runner as runner

    def by_name(scope, adapter_set):
        route = runner_of["runner"]._route
        name = next(name for name, index in route.sets.items() if index == adapter_set) if adapter_set else ""
        return (scope, "lora", name) if name else scope

    runner_of = {}
    built = runner.ModelRunner.__init__

    def keeping(self, *args, **kwargs):
        built(self, *args, **kwargs)
        runner_of["runner"] = self

    monkeypatch.setattr(runner.ModelRunner, "__init__", keeping)
    monkeypatch.setattr(runner, "_scoped", by_name)
    again, second, cached = _reloaded(made)
    assert cached > 0 and again != second


def test_unloading_is_refused_while_requests_use_the_adapter_and_a_bad_adapter_changes_nothing(made, tmp_path):
    from specdecode.engine.adapters import load_adapter, unload_adapter

    gguf, served = made
    llm = fixed_k_llm(_loaded(gguf, quantization="w8a8", served=served), k=0)
    prompt = _prompts(llm.target.config.vocab_size)[1]
    before = llm.generate([prompt], PARAMS, adapter="second")[0].outputs[0].token_ids
    llm.engine.add_group(prompt, PARAMS, adapter="second")
    with pytest.raises(SpecDecodeError, match="1 sequences are computing with the LoRA adapter 'second'"):
        unload_adapter(llm.engine, "second")
    while llm.engine.has_unfinished():
        llm.engine.step()
    (tmp_path / "empty").mkdir()
    for name, path, message in [
        ("first", _spec(served["second"]), "served already"),
        ("third", str(tmp_path / "empty"), "no adapter_config.json"),
        ("third", str(tmp_path / "absent"), "give a PEFT adapter's folder"),
    ]:
        with pytest.raises(SpecDecodeError, match=message):
            load_adapter(llm.engine, name, path)
    assert llm.engine.runner.adapters == ["first", "second"]
    assert llm.generate([prompt], PARAMS, adapter="second")[0].outputs[0].token_ids == before
    unload_adapter(llm.engine, "second")
    assert llm.engine.runner.adapters == ["first"]


def test_the_server_loads_and_unloads_adapters_where_it_allows_it(made, tmp_path):
    gguf, served = made
    target = _loaded(gguf, quantization="w8a8")
    prompt = _prompts(target.config.vocab_size)[1]
    alone = LLM(target=_loaded(gguf, served["first"], quantization="w8a8"), num_speculative_tokens=0, max_model_len=256)
    want = alone.generate([prompt], PARAMS)[0].outputs[0].text
    llm = LLM(target=target, num_speculative_tokens=0, max_model_len=256)
    greedy = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    with LocalServer(build_app(AsyncEngine(llm.engine), "tiny", runtime_lora=True)) as server:

        def post(path: str, **body) -> httpx.Response:
            return httpx.post(server.url + path, json=body, timeout=60)

        loaded = post("/v1/load_lora_adapter", lora_name="first", lora_path=_spec(served["first"]))
        assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'first' added successfully."
        models = {card["id"] for card in httpx.get(server.url + "/v1/models").json()["data"]}
        answer = post("/v1/completions", model="first", **greedy).json()
        refusals = [
            post("/v1/load_lora_adapter", lora_name="first", lora_path=_spec(served["second"])),
            post("/v1/load_lora_adapter", lora_name="third", lora_path=str(tmp_path / "absent")),
            post("/v1/load_lora_adapter", lora_name="tiny", lora_path=_spec(served["second"])),
        ]
        unloaded = post("/v1/unload_lora_adapter", lora_name="first")
        gone = [post("/v1/completions", model="first", **greedy), post("/v1/unload_lora_adapter", lora_name="first")]
        still = post("/v1/completions", model="tiny", **greedy)
    assert models == {"tiny", "first"} and answer["model"] == "first" and answer["choices"][0]["text"] == want
    assert [r.status_code for r in refusals] == [400, 400, 400] and all(r.json()["error"]["message"] for r in refusals)
    assert unloaded.status_code == 200 and [r.status_code for r in gone] == [404, 404] and still.status_code == 200
    with LocalServer(build_app(AsyncEngine(llm.engine), "tiny")) as server:
        off = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"})
    assert off.status_code == 400 and "--allow-runtime-lora-updating" in off.json()["error"]["message"]
