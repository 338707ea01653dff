"""Tokenizers read from GGUF metadata encode as llama.cpp does: each vocabulary file llama.cpp ships for its own
tokenizer tests (Llama 3's byte-level BPE, Qwen's, Llama 2's and Mistral's SentencePiece) against the token ids
those tests expect, and the tokens that end a turn in each family's chat format."""

from __future__ import annotations

import pytest
from families import llama_cpp_source, vocabulary, with_metadata

from specdecode.errors import SpecDecodeError
from specdecode.models import pretokenizers
from specdecode.models import tokenizer as tokenizer_module
from specdecode.models.tokenizer import Tokenizer, template_variables

# every generative vocabulary llama.cpp's tests ship with their expected ids (but MPT's, refused: see
# test_a_pre_tokenizer_that_is_not_split_as_llama_cpp_splits_it_is_refused)
VOCABULARIES = [
    *("llama-bpe", "qwen2", "qwen35", "llama-spm", "phi-3", "refact", "starcoder", "command-r", "gpt-2", "falcon"),
    *("deepseek-coder", "deepseek-llm", "gemma-4"),
]
# those whose words transformers' own reading of the file splits otherwise than llama.cpp
SPLIT_OTHERWISE = ["refact", "starcoder", "command-r", "falcon", "deepseek-coder", "deepseek-llm"]


def _cases(name: str) -> list[tuple[str, list[int]]]:
    models = llama_cpp_source() / "models"
    inputs = (models / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    outputs = (models / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").split("\n")
    return [(text, [int(t) for t in ids.split()]) for text, ids in zip(inputs, outputs)]


@pytest.mark.parametrize("name", VOCABULARIES)
def test_every_llama_cpp_tokenizer_case_encodes_to_its_ids(name):
    """Read back from the cache as a later load reads it (the first load built and saved it)."""
    tok = vocabulary(f"ggml-vocab-{name}.gguf")
    cases = _cases(name)
    assert len(cases) > 40
    assert [_pieces(tok, text) for text, _ in cases] == [ids for _, ids in cases]


def _pieces(tok, text: str) -> list[int]:
    """The text's own tokens (llama.cpp's cases leave out the BOS a prompt begins with)."""
    ids = tok.encode(text)
    return ids[1:] if tok.bos_id is not None else ids


@pytest.mark.parametrize("name, bos", [("llama-spm", "<s>"), ("llama-bpe", "<|begin_of_text|>"), ("qwen2", None)])
def test_a_prompt_begins_with_bos_where_the_vocabulary_says_so(name, bos):
    tok = vocabulary(f"ggml-vocab-{name}.gguf")
    ids = tok.encode("Hello world")
    assert (tok.hf.convert_ids_to_tokens(ids[0]) if bos else None) == bos
    if bos:  # a chat template's text that begins with it gets no second one
        assert tok.encode(bos + "Hello world").count(ids[0]) == 1


@pytest.mark.parametrize("name", ["llama-bpe", "llama-spm", *SPLIT_OTHERWISE])
def test_transformers_own_reading_of_the_file_encodes_otherwise(name, tmp_path, monkeypatch):
    """What the check above catches: without the corrections of encode_as_llama_cpp (whole-word lookups for
    Llama 3, SentencePiece's dummy prefix, llama.cpp's splits into words) some cases encode to other ids."""
    monkeypatch.setattr(tokenizer_module, "encode_as_llama_cpp", lambda tok, meta: None)
    tok = Tokenizer.from_gguf(str(llama_cpp_source() / "models" / f"ggml-vocab-{name}.gguf"), str(tmp_path))
    assert any(_pieces(tok, text) != ids for text, ids in _cases(name))


@pytest.mark.parametrize("split", ["glm4", "gpt-2"])
def test_glms_vocabulary_splits_as_llama_3s_and_begins_with_no_bos(split, tmp_path, monkeypatch):
    """GLM-4's pre-tokenizer (glm4: no llama.cpp test vocabulary) splits words as Llama 3's and looks words up
    whole before the merges, and llama.cpp begins its prompts with no BOS whatever the file says: Llama 3's
    vocabulary so renamed encodes every case to Llama 3's ids, none with a BOS. Broken: split by GPT-2's words."""
    if split == "gpt-2":
        monkeypatch.setitem(pretokenizers.SPLITS, "glm4", (pretokenizers.GPT2_WORDS,))
    llama3 = llama_cpp_source() / "models" / "ggml-vocab-llama-bpe.gguf"
    glm = with_metadata(llama3, tmp_path / "glm.gguf", {}, {"tokenizer.ggml.pre": "glm4"})
    tok = Tokenizer.from_gguf(str(glm), str(tmp_path / "cache"))
    assert tok.bos_id is None
    matched = [tok.encode(text) == ids for text, ids in _cases("llama-bpe")]
    assert all(matched) if split == "glm4" else not all(matched)


def test_a_pre_tokenizer_that_is_not_split_as_llama_cpp_splits_it_is_refused(tmp_path):
    """MPT's vocabulary (GPT-NeoX's) holds runs of spaces as tokens of their own, which llama.cpp matches before
    its split and transformers' reading does not: refused by its pre-tokenizer's name, as is a name llama.cpp
    does not know."""
    with pytest.raises(SpecDecodeError, match="'mpt' pre-tokenizer"):
        Tokenizer.from_gguf(str(llama_cpp_source() / "models" / "ggml-vocab-mpt.gguf"), str(tmp_path / "mpt"))
    qwen = llama_cpp_source() / "models" / "ggml-vocab-qwen2.gguf"
    unknown = with_metadata(qwen, tmp_path / "unknown.gguf", {}, {"tokenizer.ggml.pre": "made-up"})
    with pytest.raises(SpecDecodeError, match="'made-up' pre-tokenizer.*refused"):
        Tokenizer.from_gguf(str(unknown), str(tmp_path / "unknown"))


@pytest.mark.parametrize(
    "name, ends",
    [
        ("llama-bpe", {"<|end_of_text|>", "<|eot_id|>"}),
        ("qwen2", {"<|endoftext|>", "<|im_end|>"}),
        ("llama-spm", {"</s>"}),
        ("phi-3", {"<|endoftext|>", "<|end|>"}),
    ],
)
def test_the_tokens_that_end_a_turn_end_generation(name, ends):
    tok = vocabulary(f"ggml-vocab-{name}.gguf")
    assert ends <= set(tok.hf.convert_ids_to_tokens(sorted(tok.eos_token_ids)))


@pytest.mark.parametrize("harmony", [True, False], ids=["gpt-oss", "phi-3-like"])
def test_gpt_oss_ends_its_answer_or_a_call_but_not_a_message(harmony):
    """gpt-oss's vocabulary (o200k_harmony: <|return|> and <|call|>) ends the reasoning's message with <|end|> and goes
    on to its answer: there <|end|> ends nothing, as in llama.cpp, and its messages' markers stay in the decoded text
    (the server reads its channels out of them); in a vocabulary without those two (Phi-3's) <|end|> ends the turn and
    special tokens are left out."""
    import copy

    hf = copy.deepcopy(vocabulary("ggml-vocab-qwen2.gguf").hf)
    added = ["<|return|>", "<|call|>", "<|end|>"] if harmony else ["<|end|>"]
    hf.add_special_tokens({"additional_special_tokens": [*added, "<|channel|>", "<|message|>"]})
    tok = Tokenizer(hf)
    ends = set(hf.convert_ids_to_tokens(sorted(tok.eos_token_ids)))
    reply = "<|channel|>analysis<|message|>Sum.<|end|>"
    assert tok.decode(hf.encode(reply, add_special_tokens=False)) == (reply if harmony else "analysisSum.")
    assert ("<|end|>" in ends) != harmony
    assert {"<|return|>", "<|call|>"} <= ends or not harmony


def test_a_chat_template_in_the_file_is_applied():
    tok = vocabulary("ggml-vocab-qwen2.gguf")
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert "<|im_start|>user\nhi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")


def test_a_chat_template_continues_the_final_message_and_reads_its_variables(monkeypatch):
    """continue_final_message leaves the assistant's message open (no end of turn, no new header); a template's own
    variables (Qwen3's enable_thinking) reach it; both switches at once are refused as the request's error."""
    from specdecode.errors import SpecDecodeError

    tok = vocabulary("ggml-vocab-qwen2.gguf")
    begun = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hello"}]
    assert tok.apply_chat_template(begun, add_generation_prompt=False, continue_final_message=True).endswith(
        "<|im_start|>assistant\nHello"
    )
    with pytest.raises(SpecDecodeError, match="template refused these messages"):
        tok.apply_chat_template(begun, continue_final_message=True)
    monkeypatch.setattr(tok.hf, "chat_template", "{{ 'think' if enable_thinking else 'answer' }}")
    assert tok.apply_chat_template(begun[:1], enable_thinking=False) == "answer"


# Mistral's template in brief: call ids of 9 letters or digits, or it raises
MISTRAL_LIKE = (
    "{%- for m in messages %}{%- if m.tool_calls is defined %}{%- for c in m.tool_calls %}"
    "{%- if c.id|length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
    "{%- endif %}{{ c.id }}|{%- endfor %}{%- elif m.role == 'tool' %}{%- if m.tool_call_id|length != 9 %}"
    "{{ raise_exception('bad id') }}{%- endif %}{{ m.tool_call_id }}|{%- endif %}{%- endfor %}"
    "[TOOL_CALLS]{{ tools | tojson }}"
)


def test_a_template_that_refuses_the_messages_says_so_and_tools_need_a_call_format(monkeypatch):
    """A template's raise_exception (Gemma's and Mistral's roles that must alternate) is the request's error, not
    the server's; tools go only to templates that ask for calls in a format read back (Hermes', Llama 3's, Mistral's),
    whose call ids Mistral's demands in a form of its own."""
    from specdecode.errors import SpecDecodeError

    tok = vocabulary("ggml-vocab-qwen2.gguf")
    assert tok.tool_call_format is None  # this file's template renders no tools
    strict = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('roles must alternate') }}{% endif %}x"
    monkeypatch.setattr(tok.hf, "chat_template", strict)
    with pytest.raises(SpecDecodeError, match="template refused these messages: roles must alternate"):
        tok.apply_chat_template([{"role": "assistant", "content": "hi"}])
    with pytest.raises(SpecDecodeError, match="no tool calls in a format"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=[{"type": "function"}])
    llama3 = '{{ tools | tojson }} Respond in the format {"name": function name, "parameters": dictionary of argument'
    monkeypatch.setattr(tok.hf, "chat_template", llama3 + " name and its value}.")
    assert tok.tool_call_format == "json"
    monkeypatch.setattr(tok.hf, "chat_template", "{{ tools | tojson }}<tool_call>")
    assert tok.tool_call_format == "hermes"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=[{"n": 1}]).startswith('[{"n": 1}]')
    monkeypatch.setattr(tok.hf, "chat_template", MISTRAL_LIKE)
    assert tok.tool_call_format == "mistral"
    long_id = "call_0123456789abcdef01234567"  # OpenAI's form, which Mistral's template refuses
    call = {"id": long_id, "type": "function", "function": {"name": "f", "arguments": {}}}
    text = tok.apply_chat_template(
        [{"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "tool_call_id": long_id}],
        tools=[{"n": 1}],
    )
    call_id, result_id = text.split("|")[:2]
    assert call_id == result_id and len(call_id) == 9 and call_id.isalnum()  # the pair still names one call


def test_a_draft_of_another_vocabulary_is_refused_naming_both_tokenizers():
    from specdecode.errors import SpecDecodeError
    from specdecode.models.loader import LoadedModel
    from specdecode.proposers.vocabulary import check_same_vocabulary

    target = LoadedModel("a-llama3", None, vocabulary("ggml-vocab-llama-bpe.gguf"), None)
    with pytest.raises(
        SpecDecodeError,
        match=r"the draft's is byte-level BPE \(qwen2\), 151,\d+ tokens, the "
        r"target's byte-level BPE \(llama-bpe\), 128,\d+ tokens",
    ):
        check_same_vocabulary(target, "a-qwen", vocabulary("ggml-vocab-qwen2.gguf"))


def test_token_strings_are_the_vocabularys_spellings_and_fragments_have_no_bos():
    qwen, spm = vocabulary("ggml-vocab-qwen2.gguf"), vocabulary("ggml-vocab-llama-spm.gguf")
    assert qwen.token_strings(qwen.encode("hello world")) == ["hello", "Ġworld"]
    assert spm.encode("hello")[0] == spm.bos_id and spm.bos_id not in spm.encode_fragment("hello")
    assert spm.token_strings(spm.encode_fragment("hello world")) == ["▁hello", "▁world"]


def test_a_chat_template_given_replaces_the_models_own_and_leaves_the_model_as_it_was(tmp_path):
    """vLLM's --chat-template: a file or the template's text; a model without one gets one; the model's tokenizer,
    shared by whoever loaded it, keeps its own."""
    from specdecode.errors import SpecDecodeError

    tok = vocabulary("ggml-vocab-qwen2.gguf")
    hi = [{"role": "user", "content": "hi"}]
    text = "{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    path = tmp_path / "template.jinja"
    path.write_text(text)
    for source in (text, str(path)):
        assert tok.with_chat_template(source).apply_chat_template(hi) == "[user] hi>"
    assert "<|im_start|>user\nhi<|im_end|>" in tok.apply_chat_template(hi)
    with pytest.raises(SpecDecodeError, match="no file here"):
        tok.with_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(SpecDecodeError, match="is no Jinja template"):  # a request's: its text, never a file
        tok.with_chat_template(str(path), files=False)
    with pytest.raises(SpecDecodeError, match="does not compile"):
        tok.with_chat_template("{% for m in messages %}")
    with pytest.raises(SpecDecodeError, match="may not set chat_template"):
        tok.apply_chat_template(hi, **template_variables({"chat_template": text}))
