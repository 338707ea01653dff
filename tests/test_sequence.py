"""A sequence's text grows by incremental detokenization: equal to decoding the whole output at every
step, for tokenizers that split characters across tokens or render a token differently at the start of a
text, and stop strings found across token boundaries; each beside a broken variant that fails."""

import random

import pytest
from families import llama_cpp_source, vocabulary

from specdecode.engine import sequence as sequence_module
from specdecode.engine.sequence import Detokenizer, Sequence
from specdecode.models.tokenizer import token_id
from specdecode.sampling import SamplingParams


class ByteLevel:
    """Each token is one UTF-8 byte (a character may take several tokens); the last id is EOS."""

    eos_token_ids = frozenset({256})

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def encode(self, text):
        return list(text.encode("utf-8"))


class LeadingSpace:
    """SentencePiece-like: words carry their leading space, and a text's first space is dropped."""

    eos_token_ids = frozenset({99})
    words = ["▁the", "▁cat", "s", "▁sat", ",", "▁on", "▁mat", "."]

    def decode(self, ids):
        return "".join(self.words[i] for i in ids if i != 99).replace("▁", " ").removeprefix(" ")


TEXT = "naïve café — 東京 ok 🙂!"


def _grow(tokenizer, ids, chunks, params=None, prompt=(1, 2)):
    """Append `ids` in chunks of the given sizes; the texts seen after each chunk."""
    seq = Sequence(list(prompt), params or SamplingParams(max_tokens=1000, ignore_eos=True), None)
    seen, i = [], 0
    for size in chunks:
        seq.append(ids[i : i + size], None, tokenizer, max_model_len=10_000)
        seen.append(seq.text)
        i += size
        if seq.finished:
            break
    return seq, seen


def _chunks(n, seed):
    rng, sizes = random.Random(seed), []
    while sum(sizes) < n:
        sizes.append(rng.randint(1, 4))
    return sizes


@pytest.mark.parametrize(
    "tokenizer, ids", [(ByteLevel(), ByteLevel().encode(TEXT)), (LeadingSpace(), [0, 1, 2, 3, 4, 5, 0, 6, 7, 1])]
)
def test_incremental_text_is_the_whole_decode_at_every_step(tokenizer, ids):
    for seed in range(5):
        seq, seen = _grow(tokenizer, ids, _chunks(len(ids), seed))
        assert seq.text == tokenizer.decode(ids)
        assert seq.token_ids == [1, 2] + ids and seq.output_ids == ids
        for text in seen:  # never a replacement character for a half-sent one, and only ever growing
            assert "\ufffd" not in text and seq.text.startswith(text)


def test_a_window_without_the_earlier_token_drops_spaces(monkeypatch):
    """Broken: decoding each new token alone renders it as a text's first token."""

    def alone(self, tokenizer, ids, flush=False):
        new = tokenizer.decode(ids[self.read :])
        self.read = len(ids)
        return new

    monkeypatch.setattr(Detokenizer, "new_text", alone)
    seq, _ = _grow(LeadingSpace(), [0, 1, 3], [1, 1, 1])
    assert seq.text != LeadingSpace().decode([0, 1, 3])


def test_a_character_cut_off_at_the_end_comes_out_as_a_replacement():
    seq, _ = _grow(ByteLevel(), ByteLevel().encode("ok 🙂")[:-1], [10], SamplingParams(max_tokens=5))
    assert seq.finish_reason == "length" and seq.text == "ok \ufffd"


@pytest.mark.parametrize(
    "stop, expected", [(["—"], "naïve café "), (["東京 o", "zzz"], "naïve café — "), (["é"], "naïve caf")]
)
def test_stop_strings_spanning_token_boundaries_cut_the_text(stop, expected):
    ids = ByteLevel().encode(TEXT)
    for seed in range(5):
        seq, _ = _grow(ByteLevel(), ids, _chunks(len(ids), seed), SamplingParams(max_tokens=1000, stop=stop))
        assert seq.finish_reason == "stop" and seq.text == expected
        assert seq.stop_reason == next(s for s in stop if s in TEXT)  # vLLM's: which stop string ended it


def test_stop_search_that_misses_strings_across_chunks_fails(monkeypatch):
    """Broken: searching only the newest characters misses a stop string that began earlier."""

    def newest_only(self, tokenizer):
        added = self._extend_text(tokenizer)
        return any(s in self.text[len(self.text) - added :] for s in self.params.stop_strings)

    monkeypatch.setattr(sequence_module.Sequence, "_hit_stop_string", newest_only)
    seq, _ = _grow(
        ByteLevel(), ByteLevel().encode(TEXT), [1] * len(TEXT.encode()), SamplingParams(max_tokens=1000, stop=["café"])
    )
    assert seq.finish_reason != "stop"


def _llama_cpp_cases(name: str) -> list[str]:
    """The texts of llama.cpp's tokenizer tests: scripts, emoji, runs of spaces and newlines, code."""
    path = llama_cpp_source() / "models" / f"ggml-vocab-{name}.gguf.inp"
    return path.read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")


def _streamed_cases(tok, name: str, seed: int = 0):
    """Each case's tokens (an end-of-turn token inside: decoding skips it) grown in chunks of 1-4: (the texts seen
    after each chunk, the whole decode) per case."""
    eos = min(tok.eos_token_ids)
    for text in _llama_cpp_cases(name):
        ids = tok.encode(text)
        ids = ids[: len(ids) // 2] + [eos] + ids[len(ids) // 2 :]
        seq, seen = _grow(tok, ids, _chunks(len(ids), seed))
        assert seq.detokenizer.stream  # the tokenizer's own incremental decoder, not the window
        yield seen, tok.decode(ids)


@pytest.mark.parametrize("name", ["qwen2", "llama-bpe", "llama-spm"])
def test_a_real_tokenizers_incremental_decoder_gives_the_whole_decode(name):
    """Byte-level BPE (Qwen's, Llama 3's) and SentencePiece with byte fallback (Llama 2's)."""
    tok = vocabulary(f"ggml-vocab-{name}.gguf")
    for seen, whole in _streamed_cases(tok, name):
        assert seen[-1] == whole
        assert all(whole.startswith(text) for text in seen)


def test_a_real_tokenizers_cut_off_character_comes_out_as_the_whole_decode_does():
    tok = vocabulary("ggml-vocab-llama-spm.gguf")  # byte fallback: 🙂 is four byte tokens
    ids = tok.encode("ok 🙂 ok 🙂")[:-1]
    seq, _ = _grow(tok, ids, [1] * len(ids), SamplingParams(max_tokens=len(ids)))
    assert seq.finish_reason == "length" and seq.text == tok.decode(ids) and seq.text.endswith("\ufffd")


def test_an_incremental_decoder_started_afresh_each_step_fails(monkeypatch):
    """Broken: a decoder that forgets the tokens before drops a word's leading space and splits characters."""
    from tokenizers.decoders import DecodeStream

    tok = vocabulary("ggml-vocab-llama-spm.gguf")
    backend = tok.hf.backend_tokenizer
    monkeypatch.setattr(
        type(tok), "decode_stream", lambda self: lambda t: DecodeStream(skip_special_tokens=True).step(backend, t)
    )
    assert any(seen[-1] != whole for seen, whole in _streamed_cases(tok, "llama-spm"))


@pytest.mark.parametrize("incremental", [True, False])
def test_special_tokens_stay_in_the_text_when_asked(monkeypatch, incremental):
    """skip_special_tokens=False: the end-of-turn token inside the text is rendered, by the tokenizer's incremental
    decoder and by the window alike."""
    tok = vocabulary("ggml-vocab-qwen2.gguf")
    if not incremental:
        monkeypatch.setattr(type(tok), "decode_stream", lambda self, **options: None)
    end = token_id(tok.hf, "<|im_end|>")
    ids = tok.encode("def f(x):") + [end] + tok.encode(" return x")
    for skip in (True, False):
        params = SamplingParams(max_tokens=100, ignore_eos=True, skip_special_tokens=skip)
        seq, _ = _grow(tok, ids, _chunks(len(ids), 1), params)
        assert seq.text == tok.decode(ids, skip_special_tokens=skip)
        assert ("<|im_end|>" in seq.text) != skip


@pytest.mark.parametrize("kept", [False, True])
def test_the_stop_token_that_ends_the_text_is_left_out_of_it(kept):
    """As vLLM's: EOS or a stop token ends the text without its own text (include_stop_str_in_output keeps it)."""
    ids = ByteLevel().encode("ab,cd,ef")
    params = SamplingParams(max_tokens=100, stop_token_ids=[ord(",")], include_stop_str_in_output=kept)
    seq, _ = _grow(ByteLevel(), ids, [2, 3, 3], params)
    assert seq.output_ids == ids[:3] and seq.text == ("ab," if kept else "ab")
    assert seq.stop_reason == ord(",")  # the stop token's id, as vLLM's stop_reason


@pytest.mark.parametrize("min_tokens, expected", [(0, "ab"), (2, "ab"), (3, "ab,cd"), (6, "ab,cd,ef")])
def test_a_stop_string_counts_only_where_it_ends_after_min_tokens(min_tokens, expected):
    ids = ByteLevel().encode("ab,cd,ef,gh")
    params = SamplingParams(max_tokens=100, stop=[","], min_tokens=min_tokens, ignore_eos=True)
    seq, _ = _grow(ByteLevel(), ids, [1] * len(ids), params)
    assert seq.text == expected and seq.finish_reason == "stop"


class SpacedSpecials:
    """A Python tokenizer's way: special tokens (id 9, "<s>") with spaces around them unless asked otherwise."""

    eos_token_ids = frozenset({99})

    def decode(self, ids, skip_special_tokens=True, spaces_between_special_tokens=True):
        pad = " " if spaces_between_special_tokens else ""
        return "".join(
            pad + "<s>" + pad if i == 9 else "ab"[i % 2] for i in ids if not (i == 9 and skip_special_tokens)
        )


@pytest.mark.parametrize("spaced", [True, False])
def test_spaces_between_special_tokens_reach_the_tokenizers_decoding(spaced):
    ids, tok = [0, 1, 9, 0, 9, 1], SpacedSpecials()
    params = SamplingParams(
        max_tokens=100, ignore_eos=True, skip_special_tokens=False, spaces_between_special_tokens=spaced
    )
    seq, _ = _grow(tok, ids, [1] * len(ids), params)
    assert seq.text == tok.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=spaced)
