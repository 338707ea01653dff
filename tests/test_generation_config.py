"""The sampling defaults a model's makers recommend (vLLM's --generation-config; llama.cpp's GGUF general.sampling.*):
read from a checkpoint's generation_config.json or a GGUF's keys, taken by the library's generate() without sampling
params and by every server API for the fields a request leaves unset, never over what a request sets."""

import json
from dataclasses import replace

import httpx
import numpy as np
import openai
import pytest
from conftest import LocalServer
from gguf import GGUFWriter

from specdecode import LLM, SamplingParams, SpecDecodeError
from specdecode.models.generation_config import recommended_sampling, sampling_defaults
from specdecode.models.sources import ModelSource
from specdecode.server.api import build_app
from specdecode.server.async_engine import AsyncEngine

QWEN_LIKE = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}


def _checkpoint(folder, fields: dict) -> ModelSource:
    folder.mkdir(exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, **fields}))
    return ModelSource("x", "hf", str(folder))


def test_a_checkpoints_generation_config_gives_vllms_fields(tmp_path):
    """do_sample and ids are not sampling settings; max_new_tokens is max_tokens; a top_k of 0 is off."""
    source = _checkpoint(tmp_path / "qwen", {**QWEN_LIKE, "max_new_tokens": 64})
    expected = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 64}
    assert recommended_sampling(source) == expected
    assert recommended_sampling(_checkpoint(tmp_path / "off", {"top_k": 0, "min_p": 0.1})) == {
        "top_k": -1,
        "min_p": 0.1,
    }
    (tmp_path / "none").mkdir()
    assert recommended_sampling(ModelSource("x", "hf", str(tmp_path / "none"))) == {}


def test_a_ggufs_sampling_keys_give_the_same_fields(tmp_path):
    path = tmp_path / "m.gguf"
    writer = GGUFWriter(str(path), "qwen2")
    writer.add_float32("general.sampling.temp", 0.6)
    writer.add_float32("general.sampling.top_p", 0.95)
    writer.add_int32("general.sampling.top_k", 40)
    writer.add_float32("general.sampling.penalty_repeat", 1.1)
    writer.add_int32("general.sampling.penalty_last_n", 64)  # llama.cpp's window: no field of ours
    writer.add_tensor("x", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    found = recommended_sampling(ModelSource("m", "gguf", str(path)))
    assert found == {"temperature": 0.6, "top_p": 0.95, "top_k": 40, "repetition_penalty": 1.1}


def test_the_choice_of_defaults_and_bad_ones(tmp_path):
    recommended = {"temperature": 0.7}
    assert sampling_defaults("auto", recommended) == recommended and sampling_defaults("vllm", recommended) == {}
    _checkpoint(tmp_path / "other", {"temperature": 0.2})
    assert sampling_defaults(str(tmp_path / "other"), recommended) == {"temperature": 0.2}
    with pytest.raises(SpecDecodeError, match="no folder holding a generation_config.json"):
        sampling_defaults(str(tmp_path / "missing"), recommended)
    with pytest.raises(SpecDecodeError, match="--generation-config vllm"):
        recommended_sampling(_checkpoint(tmp_path / "bad", {"top_p": 1.5}))


# greedy and short, so that taking them or not shows in the output
DEFAULTS = {"temperature": 0.0, "max_tokens": 6, "repetition_penalty": 1.3}
GREEDY = SamplingParams(**DEFAULTS)


@pytest.fixture(scope="module")
def recommending(target):
    return replace(target, recommended_sampling=DEFAULTS)


def test_generate_without_params_takes_the_models_defaults(recommending):
    llm = LLM(target=recommending, num_speculative_tokens=3, speculative_model="ngram", max_model_len=256)
    assert llm.get_default_sampling_params() == GREEDY
    taken, given = (llm.generate(["hello world"], *params)[0].outputs[0].token_ids for params in ((), (GREEDY,)))
    assert taken == given and len(taken) <= 6
    none = LLM(target=recommending, num_speculative_tokens=0, max_model_len=256, generation_config="vllm")
    assert none.sampling_defaults == {} and none.get_default_sampling_params() == SamplingParams()


def test_every_api_takes_the_models_defaults_where_a_request_leaves_them_unset(recommending):
    """Completions, chat, the Responses and Messages APIs: a request that sets none gets the greedy 6 tokens under
    the penalty; one that sets them gets its own. Broken: the server's engine not given the defaults."""
    llm = LLM(target=recommending, num_speculative_tokens=3, speculative_model="ngram", max_model_len=256)
    greedy_text = llm.generate(["hello world"], GREEDY)[0].outputs[0].text
    chat_text = llm.chat([{"role": "user", "content": "hi"}], GREEDY)[0].outputs[0].text
    engine = AsyncEngine(llm.engine, sampling_defaults=llm.sampling_defaults)
    with LocalServer(build_app(engine, "tiny")) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        completion = client.completions.create(model="tiny", prompt="hello world", max_tokens=None)
        assert completion.choices[0].text == greedy_text
        own = client.completions.create(model="tiny", prompt="hello world", max_tokens=3, temperature=0)
        assert own.usage.completion_tokens <= 3 and greedy_text.startswith(own.choices[0].text)
        unpenalised = llm.generate(["hello world"], replace(GREEDY, repetition_penalty=1.0))[0].outputs[0].text
        assert unpenalised != greedy_text  # the model's penalty shows; a request's own value wins over it
        sent = {"repetition_penalty": 1.0}
        assert (
            client.completions.create(model="tiny", prompt="hello world", temperature=0, extra_body=sent)
            .choices[0]
            .text
            == unpenalised
        )
        hi = [{"role": "user", "content": "hi"}]
        assert client.chat.completions.create(model="tiny", messages=hi).choices[0].message.content == chat_text
        response = client.responses.create(model="tiny", input=hi)
        assert response.output_text == chat_text and response.temperature == 0.0
        message = httpx.post(
            server.url + "/v1/messages", json={"model": "tiny", "max_tokens": 6, "messages": hi}, timeout=30
        ).json()
        assert message["content"][0]["text"] == chat_text
    with LocalServer(build_app(AsyncEngine(llm.engine), "tiny")) as broken:
        client = openai.OpenAI(base_url=broken.url + "/v1", api_key="unused", max_retries=0)
        assert client.completions.create(model="tiny", prompt="hello world", seed=1).choices[0].text != greedy_text


def test_a_checkpoint_and_its_llama_cpp_conversion_recommend_the_same(tmp_path):
    """llama.cpp's converter writes generation_config.json's settings as the GGUF's general.sampling.* keys: loaded
    from either, the model recommends the same (the GGUF's read once, then kept)."""
    from families import convert, make_checkpoint

    from specdecode.models.loader import load_model

    folder = make_checkpoint("qwen3", tmp_path / "qwen3")
    written = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**written, **QWEN_LIKE}))
    gguf = convert(folder, tmp_path / "qwen3.gguf")
    expected = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    for source in (folder, gguf, gguf):
        loaded = load_model(str(source), quantization="none", dtype="float32", progress=False)
        assert loaded.recommended_sampling == expected, source
