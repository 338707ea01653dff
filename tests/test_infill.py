"""Fill in the middle (OpenAI's `suffix`): the FIM tokens found by their spellings, the prompt laid out prefix-suffix-
middle, a code model filling the gap (greedy speculation as plain decoding), and the server and CLI taking it."""

import dataclasses

import httpx
import openai
import pytest
from conftest import ByteTokenizer, LocalServer

from specdecode import LLM, SamplingParams
from specdecode.errors import SpecDecodeError
from specdecode.models import infill
from specdecode.models.infill import fim_ids, infill_ids
from specdecode.models.loader import load_tokenizer
from specdecode.server.api import build_app
from specdecode.server.async_engine import AsyncEngine

API_KEY = "test-key"
FIM = {"prefix": 1, "suffix": 2, "middle": 3}


@pytest.mark.parametrize("family, triple", list(infill.TRIPLES.items()))
def test_each_familys_fim_tokens_are_found_together(family, triple):
    vocab = {"a": 0, **{spelling: 10 + i for i, spelling in enumerate(triple)}}
    assert fim_ids(vocab.get) == {"prefix": 10, "suffix": 11, "middle": 12}
    assert fim_ids({"a": 0, triple[0]: 10, triple[1]: 11}.get) is None  # no middle: no gap to fill


class BosTokenizer(ByteTokenizer):
    """Bytes, a BOS (id 0) put first by encode(), and FIM tokens."""

    bos_id, fim_ids = 0, FIM

    def encode(self, text: str) -> list[int]:
        return [0, *super().encode(text)]


def test_the_prompt_is_bos_then_prefix_suffix_middle_each_after_its_token():
    tok = BosTokenizer()
    before, after = tok.encode("ab")[1:], tok.encode("yz")[1:]
    assert infill_ids(tok, "ab", "yz") == [0, 1, *before, 2, *after, 3]
    assert infill_ids(tok, [0, 50, 51], "yz") == [0, 1, 50, 51, 2, *after, 3]  # ids as given, BOS once
    with pytest.raises(SpecDecodeError, match="no fill-in-the-middle tokens"):
        infill_ids(ByteTokenizer(), "ab", "yz")


def test_the_bundled_coder_fills_in_and_stops_where_llama_cpp_would():
    tok = load_tokenizer("qwen2.5-coder-0.5b")
    vocab = tok.get_vocab()
    assert tok.fim_ids == {role: vocab[f"<|fim_{role}|>"] for role in ("prefix", "suffix", "middle")}
    assert {vocab["<|fim_pad|>"], vocab["<|repo_name|>"], vocab["<|file_sep|>"]} <= tok.eos_token_ids
    assert load_tokenizer("smollm2-135m").fim_ids is None and load_tokenizer("gemma3-270m").fim_ids is None


GAPS = [
    ('import math\n\ndef circle_area(r):\n    """Area of a circle of radius r."""\n', "\n\nprint(circle_area(2.0))\n"),
    ("def fib(n):\n    if n < 2:\n        return n\n", "\n"),
    ("def add(a, b):\n    return ", "\n\nassert add(1, 2) == 3\n"),
    ('def greet(name):\n    return f"Hello, {', '}!"\n'),
]
FILLS = ["    return math.pi * r ** 2\n", "    return fib(n-1) + fib(n-2)\n", "a + b\n", 'name}!"\n']


@pytest.fixture(scope="module")
def coder():
    return LLM("qwen2.5-coder-0.5b", speculative_model="suffix", num_speculative_tokens=4, progress=False)


def _fills(llm, layout, k=None) -> list[str]:
    saved, llm.engine.k = llm.engine.k, llm.engine.k if k is None else k
    try:
        outs = llm.generate([layout(llm.tokenizer, pre, post) for pre, post in GAPS], SamplingParams(temperature=0))
    finally:
        llm.engine.k = saved
    return [o.outputs[0].text for o in outs]


def test_a_code_model_fills_the_gap_and_speculation_changes_no_token(coder):
    fills = _fills(coder, infill_ids)
    assert all(text.startswith(fill) for text, fill in zip(fills, FILLS)), fills
    assert fills == _fills(coder, infill_ids, k=0)


def test_the_gaps_are_not_filled_with_suffix_and_prefix_swapped(coder):
    """The check above holds the layout to account: the model's FIM order taken the other way round fails it."""

    def swapped(tok, prefix, suffix):
        return infill_ids(tok, suffix, prefix)

    fills = _fills(coder, swapped)
    assert not any(text.startswith(fill) for text, fill in zip(fills, FILLS)), fills


@pytest.fixture(scope="module")
def fim_server(target):
    """The tiny target with FIM tokens in its tokenizer, served."""
    tok = ByteTokenizer()
    tok.fim_ids = FIM
    llm = LLM(target=dataclasses.replace(target, tokenizer=tok), num_speculative_tokens=3, max_model_len=256)
    with LocalServer(build_app(AsyncEngine(llm.engine), "tiny", API_KEY)) as server:
        server.llm = llm
        server.client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
        yield server


def test_the_server_fills_the_gap_its_suffix_leaves_streamed_and_not(fim_server):
    kw = dict(model="tiny", prompt="def f(x):", suffix="return y", max_tokens=12, temperature=0)
    kw["extra_body"] = {"ignore_eos": True}
    whole = fim_server.client.completions.create(**kw)
    streamed = "".join(c.choices[0].text for c in fim_server.client.completions.create(stream=True, **kw))
    alone = LLM(target=fim_server.llm.target, num_speculative_tokens=0, max_model_len=256).generate(
        [infill_ids(fim_server.llm.tokenizer, "def f(x):", "return y")],
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    )[0]
    assert whole.choices[0].text == streamed == alone.outputs[0].text
    assert whole.usage.prompt_tokens == len("def f(x):") + len("return y") + 3


@pytest.mark.parametrize(
    "fields, message",
    [({"echo": True}, "echo and suffix together"), ({"suffix": 5}, "suffix")],
)
def test_the_server_refuses_what_it_cannot_fill_in(fim_server, fields, message):
    body = {"model": "tiny", "prompt": "x", "suffix": "y", **fields}
    r = httpx.post(f"{fim_server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 400 and message in r.json()["error"]["message"]
