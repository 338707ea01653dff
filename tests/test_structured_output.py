"""Structured output under speculation (llguidance masks at every draft position, to target and draft):
every output follows its grammar, greedy output equals plain constrained greedy output, sampled output
follows the masked target distribution; each fails on a deliberately broken variant."""

import functools
import json
import re
from dataclasses import replace

import jsonschema
import pytest
from conftest import tiny_model
from families import vocabulary
from stats import PASS_P, chi2_pvalue, exact_joint, sampled_joint

from specdecode import LLM, SamplingParams, SpecDecodeError
from specdecode.engine import overlap
from specdecode.sampling import GrammarMatcher, StructuredOutput
from specdecode.sampling import grammar as grammar_module
from specdecode.verify import together, verifier

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["a", "b"],
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"enum": ["x", "y"]},
        "c": {"type": "string", "maxLength": 4},
    },
}
# a structural tag's two structures, whose JSON holds no string (a '<' or '!' in the text is a trigger or an end)
TAGGED = {
    "a": {"type": "object", "additionalProperties": False, "required": ["n"], "properties": {"n": {"type": "integer"}}},
    "b": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 2},
}
TAG = {"structures": [{"begin": f"<{k}>", "schema": v, "end": "!"} for k, v in TAGGED.items()], "triggers": ["<"]}
LARK = 'start: "(" item ("," item)+ ")"\nitem: /[a-c]/ | "x"'
GBNF = 'root ::= "(" item ("," item)+ ")"\nitem ::= [a-c] | "x"'  # the same in GBNF (llama.cpp's, vLLM docs')
SPECS = {
    "regex": (StructuredOutput(regex="[a-c]{3}x"), lambda text: re.fullmatch("[a-c]{3}x", text)),
    "choice": (StructuredOutput(choice=("yes", "no", "maybe")), lambda text: text in ("yes", "no", "maybe")),
    "json_schema": (StructuredOutput(json=SCHEMA), lambda text: jsonschema.validate(json.loads(text), SCHEMA) or True),
    "json_object": (StructuredOutput(json_object=True), lambda text: isinstance(json.loads(text), dict)),
    "lark": (StructuredOutput(grammar=LARK), lambda text: re.fullmatch(r"\(([a-c]|x)(,([a-c]|x))+\)", text)),
    "gbnf": (StructuredOutput(grammar=GBNF), lambda text: re.fullmatch(r"\(([a-c]|x)(,([a-c]|x))+\)", text)),
}


@pytest.fixture(scope="module")
def models():
    """Vocabulary 100: characters ' ' to '\\x82', so braces and quotes exist; id 99 is EOS."""
    return tiny_model(seed=0, vocab=100), tiny_model(seed=5, vocab=100, layers=1)


def _generate(target, draft=None, k=3, params=None, prompts=("hello", "the json:"), **kw):
    llm = LLM(target=target, draft=draft, num_speculative_tokens=k, max_model_len=256, speculation_policy="fixed", **kw)
    return llm.generate(list(prompts), params)


@pytest.mark.parametrize("name", SPECS)
def test_greedy_structured_output_is_valid_and_equals_plain(models, name):
    target, draft = models
    spec, valid = SPECS[name]
    params = SamplingParams(temperature=0, max_tokens=200, structured_output=spec)
    plain = [o.outputs[0] for o in _generate(target, k=0, params=params)]
    finished = [o for o in plain if o.finish_reason == "stop"]  # a random model may fill any free string
    assert all(valid(o.text) for o in finished)
    assert finished or name == "json_object"  # (the real Qwen test checks json_object's output parses)
    assert all(o.text.startswith("{") for o in plain) or name not in ("json_schema", "json_object")
    for proposer in (dict(draft=draft), dict(draft=target), dict(speculative_model="ngram")):
        outs = _generate(target, params=params, **proposer)
        assert [o.outputs[0].token_ids for o in outs] == [o.token_ids for o in plain]
        assert "draft" not in proposer or sum(o.spec["num_draft_tokens"] for o in outs) > 0


@pytest.mark.parametrize("name", ["json_schema", "lark"])
def test_sampled_structured_outputs_all_validate(models, name):
    target, draft = models
    spec, valid = SPECS[name]
    outs = _generate(
        target, draft, params=SamplingParams(n=8, temperature=1.0, max_tokens=120, seed=1, structured_output=spec)
    )
    texts = [o.text for out in outs for o in out.outputs if o.finish_reason == "stop"]
    assert len(texts) >= 12 and all(valid(t) for t in texts)
    assert len(set(texts)) > 4


def test_masks_not_advanced_along_the_drafts_are_caught(models, monkeypatch):
    """The broken variant masks every verify row as if no draft came before it."""
    target, _ = models
    spec, _ = SPECS["json_schema"]
    params = SamplingParams(temperature=0, max_tokens=80, structured_output=spec)
    plain = [o.outputs[0].token_ids for o in _generate(target, k=0, params=params)]
    real = GrammarMatcher.mask_rows
    monkeypatch.setattr(GrammarMatcher, "mask_rows", lambda self, logits, drafts: real(self, logits, []))
    try:
        broken = [o.outputs[0].token_ids for o in _generate(target, target, params=params)]
    except SpecDecodeError as exc:  # the emitted text left the grammar
        assert "outside the grammar" in str(exc)
    else:
        assert broken != plain


@pytest.mark.parametrize("broken", [False, True])
def test_grammars_verified_in_one_pass_give_what_one_by_one_gives(models, monkeypatch, broken):
    """Greedy and seeded sampled requests under grammars, beside a penalised one, verified in one pass (a GPU's way,
    the masks of every row applied at once): the outputs of verification one by one. Broken: no mask in the pass."""
    target, draft = models
    params = [
        SamplingParams(temperature=0, max_tokens=60, structured_output=SPECS["json_schema"][0]),
        SamplingParams(temperature=1.0, seed=3, max_tokens=60, structured_output=SPECS["lark"][0]),
        SamplingParams(temperature=0.8, seed=4, max_tokens=40, presence_penalty=0.3),
    ]
    prompts = ("hello", "the json:", "abc")
    one_by_one = [o.outputs[0].token_ids for o in _generate(target, draft, params=params, prompts=prompts)]
    monkeypatch.setattr(overlap, "verify_batch", functools.partial(verifier.verify_batch, together=True))
    if broken:
        monkeypatch.setattr(together, "mask_grammars", lambda rows, grammars, drafts: rows)
    try:
        one_pass = [o.outputs[0].token_ids for o in _generate(target, draft, params=params, prompts=prompts)]
    except SpecDecodeError as exc:  # the emitted text left the grammar
        assert broken and "outside the grammar" in str(exc)
    else:
        assert (one_pass == one_by_one) is not broken


SMALL_VOCAB = 8  # characters ' ' to '&'; id 7 is EOS


def test_sampling_under_a_grammar_follows_the_masked_target():
    target = tiny_model(seed=7, vocab=SMALL_VOCAB, hidden=32)
    draft = tiny_model(seed=8, vocab=SMALL_VOCAB, hidden=32, layers=1)
    params = SamplingParams(
        n=16,
        temperature=1.0,
        max_tokens=4,
        presence_penalty=0.5,
        structured_output=StructuredOutput(regex='[!"#]{1,2}[$%&]'),
    )
    prompt = [1, 2, 3]
    joint = exact_joint(target, prompt, params)
    assert abs(sum(joint.values()) - 1) < 1e-5 and all(t[-1] == 7 for t in joint)  # each ends with EOS
    counts, accepted = sampled_joint(target, draft, prompt, params, samples=6000)
    assert 0.1 < accepted < 0.95
    assert chi2_pvalue(counts, joint) > PASS_P


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(regex="(unclosed"), "grammar is not valid"),
        (dict(grammar="start: ???"), "grammar is not valid"),
        (dict(grammar="root ::= ( "), "neither Lark nor GBNF"),
        (dict(json="{not json"), "not valid JSON"),
        (dict(choice=()), "non-empty list"),
        (dict(regex="a", choice=("a",)), "exactly one of"),
        (dict(structural_tag={"structures": TAG["structures"]}), "structural_tag takes"),
        (dict(structural_tag={**TAG, "triggers": ["["]}), "starts with none of the triggers"),
        (dict(structural_tag={"type": "structural_tag", "format": {}}), "form with a 'format'"),
        (dict(structural_tag="{not json"), "not valid JSON"),
        (
            dict(structural_tag={**TAG, "structures": [{"begin": "<a>", "schema": "[1]", "end": "!"}]}),
            "not a JSON schema",
        ),
    ],
)
def test_bad_grammars_get_clear_errors(models, kwargs, message):
    with pytest.raises(SpecDecodeError, match=message):
        _generate(models[0], k=0, params=SamplingParams(structured_output=StructuredOutput(**kwargs)))


def test_structured_output_refuses_ignore_eos():
    with pytest.raises(SpecDecodeError, match="cannot be combined with ignore_eos or min_tokens"):
        SamplingParams(ignore_eos=True, structured_output=StructuredOutput(regex="a"))


COMPACT = {**SCHEMA, "required": ["a", "b", "c"], "x-guidance": {"whitespace_flexible": False}}


def test_a_schema_that_turns_flexible_whitespace_off_gets_compact_json(models, monkeypatch):
    """Our default whitespace pattern would otherwise win over the schema's switch (llguidance takes the pattern):
    the random model, free to, writes the most whitespace allowed."""
    target, _ = models
    params = SamplingParams(temperature=0, max_tokens=80, structured_output=StructuredOutput(json=COMPACT))
    texts = [o.outputs[0].text for o in _generate(target, k=0, params=params)]
    assert all(jsonschema.validate(json.loads(t), COMPACT) is None for t in texts)
    assert all(json.dumps(json.loads(t), separators=(",", ":")) == t for t in texts)
    monkeypatch.setattr(grammar_module, "json_options", lambda schema, defaults: defaults)
    loose = [o.outputs[0].text for o in _generate(target, k=0, params=params)]
    assert loose != texts and any(ch in t for t in loose for ch in " \n")


def _greedy_texts(target, spec: StructuredOutput) -> list[str]:
    """The outputs the grammar ended (a random model may go on with a free string past any limit)."""
    params = SamplingParams(temperature=0, max_tokens=150, structured_output=spec)
    outs = [o.outputs[0] for o in _generate(target, k=0, params=params, prompts=("hello", "the json:", "{", "x"))]
    return [o.text for o in outs if o.finish_reason == "stop"]


def test_vllms_json_whitespace_options_shape_the_output(models, monkeypatch):
    """disable_any_whitespace gives compact JSON, a whitespace_pattern the whitespace it allows, where the random model
    left free writes newlines and runs of spaces. Broken: the options not passed to llguidance."""
    target, _ = models
    closed = {**SCHEMA, "required": ["a", "b", "c"]}
    compact = _greedy_texts(target, StructuredOutput(json=closed, disable_any_whitespace=True))
    assert all(json.dumps(json.loads(t), separators=(",", ":")) == t for t in compact)
    spaced = _greedy_texts(target, StructuredOutput(json=SCHEMA, whitespace_pattern="[ ]?"))
    assert compact and spaced and all(jsonschema.validate(json.loads(t), SCHEMA) is None for t in spaced)
    assert all("\n" not in t and "  " not in t for t in spaced) and any(" " in t for t in spaced)
    monkeypatch.setattr(StructuredOutput, "json_defaults", lambda self: grammar_module.JSON_OPTIONS)
    loose = _greedy_texts(target, StructuredOutput(json=SCHEMA, whitespace_pattern="[ ]?"))
    assert any("\n" in t or "  " in t for t in loose)
    assert _greedy_texts(target, StructuredOutput(json=closed, disable_any_whitespace=True)) != compact


def _first_key_allowed(target, spec: StructuredOutput, text: str) -> str:
    """The characters the grammar allows after the text (the vocabulary-100 model's tokens are characters)."""
    grammar = GrammarMatcher.compile(spec, target.tokenizer, 100)
    grammar.advance(_ids(text))
    mask = grammar.allowed_rows([], 1, 100)[0]
    return "".join(chr(32 + i) for i in mask.nonzero()[:, 0].tolist() if i < 95)


def test_disable_additional_properties_closes_objects_the_schema_leaves_open(models, monkeypatch):
    """After a schema's only property, an open object allows another key (','), a closed one only its end; nested
    objects and objects that say otherwise keep to what they say. Broken: the schema passed as it came."""
    target, _ = models
    schema = {
        "type": "object",
        "required": ["a", "n"],
        "properties": {
            "a": {"type": "integer", "maximum": 5},
            "n": {"type": "object", "required": ["b"], "properties": {"b": {"type": "integer", "maximum": 5}}},
            "o": {"type": "object", "additionalProperties": True},
        },
    }

    def after(text: str, **options) -> str:
        return _first_key_allowed(target, StructuredOutput(json=schema, disable_any_whitespace=True, **options), text)

    assert "," in after('{"a":1,"n":{"b":2')  # open: more keys may follow
    assert after('{"a":1,"n":{"b":2', disable_additional_properties=True) == "}"
    assert "," in after('{"a":1,"n":{"b":2},"o":{"x":1', disable_additional_properties=True)  # it says open
    assert schema["properties"]["n"].get("additionalProperties") is None  # the caller's schema is left as it is
    monkeypatch.setattr(grammar_module, "closed_objects", lambda schema: schema)
    assert "," in after('{"a":1,"n":{"b":2', disable_additional_properties=True)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(regex="a+", whitespace_pattern=" "), "needs json or json_object, not regex"),
        (dict(choice=("a",), disable_any_whitespace=True), "needs json or json_object, not choice"),
        (dict(json_object=True, disable_additional_properties=True), "needs json, not json_object"),
        (dict(json=SCHEMA, whitespace_pattern=" ", disable_any_whitespace=True), "send one"),
    ],
)
def test_json_options_elsewhere_are_refused(kwargs, message):
    with pytest.raises(SpecDecodeError, match=message):
        StructuredOutput(**kwargs)


# ---- vLLM's structural tags: free text, each trigger opening a structure -------------------------------------------
def _structures(text: str, cut: bool) -> list[str]:
    """The structures a text opened, each checked against its schema (the last may be cut by max_tokens)."""
    opened = text.split("<")[1:]
    for piece in opened[:-1] if cut else opened:
        kind, body = re.fullmatch(r"([ab])>([^!]*)!.*", piece, re.S).groups()
        jsonschema.validate(json.loads(body), TAGGED[kind])
    return opened


def test_a_structural_tag_holds_each_structure_to_its_schema_and_equals_plain(models, monkeypatch):
    """The random model, pushed to write '<' (the trigger), must then write one of the begins, its JSON and its end,
    and is free between; speculative greedy output is plain's. Broken: the structures not compiled (free text)."""
    target, draft = models
    spec = StructuredOutput(structural_tag=json.dumps(TAG))
    params = SamplingParams(temperature=0, max_tokens=120, structured_output=spec, logit_bias={_ids("<")[0]: 8.0})
    plain = [o.outputs[0] for o in _generate(target, k=0, params=params, prompts=("hello", "the json:", "?"))]
    opened = [_structures(o.text, cut=o.finish_reason == "length") for o in plain]
    assert sum(map(len, opened)) >= 6 and {p[0] for ps in opened for p in ps} == {"a", "b"}
    for proposer in (dict(draft=draft), dict(draft=target), dict(speculative_model="ngram")):
        outs = _generate(target, params=params, prompts=("hello", "the json:", "?"), **proposer)
        assert [o.outputs[0].token_ids for o in outs] == [o.token_ids for o in plain]
    from llguidance import LLMatcher

    monkeypatch.setattr(
        grammar_module, "structural_tag_grammar", lambda tag, special: LLMatcher.grammar_from_regex("(?s:.*)")
    )
    free = [o.outputs[0] for o in _generate(target, k=0, params=params, prompts=("hello", "the json:", "?"))]
    with pytest.raises((AttributeError, ValueError, jsonschema.ValidationError)):
        [_structures(o.text, cut=o.finish_reason == "length") for o in free]


def test_a_bracketed_trigger_that_is_one_special_token_is_matched_as_that_token(monkeypatch):
    """Qwen's <|im_start|> is one special token: the trigger is that token (as vLLM's guidance backend takes it), which
    the model can emit; matched as text, it could not. Broken: every trigger taken as text. A bracketed trigger that
    is no token of the vocabulary is text."""
    tok = vocabulary("ggml-vocab-qwen2.gguf")
    start = tok.encode_fragment("<|im_start|>")
    tag = {"structures": [{"begin": "<|im_start|>", "schema": {"type": "object"}, "end": "<|im_end|>"}]}
    spec = StructuredOutput(structural_tag={**tag, "triggers": ["<|im_start|>"]})
    vocab = len(tok.get_vocab())
    assert len(start) == 1 and GrammarMatcher.compile(spec, tok, vocab).allowed_rows([], 1, vocab)[0, start[0]]
    monkeypatch.setattr(grammar_module, "is_special_token", lambda tokenizer, text: False)
    assert not GrammarMatcher.compile(spec, tok, vocab).allowed_rows([], 1, vocab)[0, start[0]]
    monkeypatch.undo()
    as_text = {"structures": [{"begin": "<x>", "schema": {}, "end": "!"}], "triggers": ["<x>"]}  # no such token
    small = tiny_model(seed=0, vocab=100).tokenizer
    grammar = GrammarMatcher.compile(StructuredOutput(structural_tag=as_text), small, 100)
    assert grammar.allowed_rows([], 1, 100)[0, _ids("<")[0]]


# ---- a grammar after a reasoning model's thinking ------------------------------------------------------------------
def _ids(text: str) -> list[int]:
    return [ord(ch) - 32 for ch in text]


@pytest.fixture
def thinker():
    """The vocabulary-100 model whose tokenizer reads '[' and ']' as <think> and </think>."""
    model = tiny_model(seed=0, vocab=100)
    model.tokenizer.think_ids = (_ids("[")[0], _ids("]")[0])
    return model


def _allowed(grammar, drafts: str, rows: int) -> list[str]:
    masks = grammar.allowed_rows(_ids(drafts), rows, 100)
    return ["all" if bool(m.all()) else "".join(chr(32 + i) for i in m.nonzero()[:, 0].tolist()) for m in masks]


def test_a_grammar_after_thinking_lets_the_thinking_be_and_masks_from_the_token_after_its_end(thinker):
    spec = StructuredOutput(regex="[a-c]{2}x", after_thinking=True)
    inside = GrammarMatcher.compile(spec, thinker.tokenizer, 100)
    assert _allowed(inside, "hi]ab", 6) == ["all", "all", "all", "abc", "abc", "x"]
    inside.advance(_ids("h]"))
    assert _allowed(inside, "a", 2) == ["abc", "abc"]
    maybe = GrammarMatcher.compile(replace(spec, after_thinking=False), thinker.tokenizer, 100)
    assert _allowed(maybe, "[z]a", 5) == ["[abc", "all", "all", "abc", "abc"]  # opened by its first token
    assert _allowed(maybe, "ab", 3) == ["[abc", "abc", "x"]  # not opened: the grammar from the first token
    drafted = maybe.copy()
    for token in _ids("[q]"):
        drafted.draft(token)
    assert _allowed(drafted, "c", 2) == ["abc", "abc"]
    drafted.undo_drafts()
    assert _allowed(drafted, "", 1) == ["[abc"]


@pytest.mark.parametrize("proposer", ["draft", "self", "ngram"])
def test_greedy_with_a_grammar_after_thinking_is_valid_and_equals_plain(thinker, proposer):
    """The thinking's end drafted, accepted or not, inside verify windows: the text plain decoding gives."""
    draft = tiny_model(seed=5, vocab=100, layers=1)
    draft.tokenizer.think_ids = thinker.tokenizer.think_ids
    spec = StructuredOutput(regex="[a-c]{3}x", after_thinking=True)
    params = SamplingParams(temperature=0, max_tokens=120, structured_output=spec, logit_bias={_ids("]")[0]: 6.0})
    plain = [o.outputs[0] for o in _generate(thinker, k=0, params=params)]
    assert all(o.finish_reason == "stop" and re.fullmatch(r"[^\]]*\][a-c]{3}x", o.text) for o in plain), plain
    with_proposer = {"draft": dict(draft=draft), "self": dict(draft=thinker), "ngram": dict(speculative_model="ngram")}
    outs = [o.outputs[0] for o in _generate(thinker, params=params, **with_proposer[proposer])]
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]


def test_sampling_under_a_grammar_after_thinking_follows_the_masked_target(monkeypatch):
    """'!' and '%' are <think> and </think>: a reply may open its thinking at once, then the grammar follows its end.
    Broken: every verify row masked as the first (the state not moved along the drafts)."""
    target = tiny_model(seed=7, vocab=SMALL_VOCAB, hidden=32)
    draft = tiny_model(seed=8, vocab=SMALL_VOCAB, hidden=32, layers=1)
    for model in (target, draft):
        model.tokenizer.think_ids = (1, 5)
    spec = StructuredOutput(regex='[#$]"', after_thinking=False)
    params = SamplingParams(n=16, temperature=1.0, max_tokens=4, structured_output=spec)
    prompt = [1, 2, 3]
    joint = exact_joint(target, prompt, params)
    assert abs(sum(joint.values()) - 1) < 1e-5
    assert any(t[0] == 1 for t in joint) and any(t[0] in (3, 4) for t in joint)  # both beginnings
    counts, accepted = sampled_joint(target, draft, prompt, params, samples=6000)
    assert 0.1 < accepted < 0.99  # past the thinking the grammar leaves few choices: most drafts are right
    assert chi2_pvalue(counts, joint) > PASS_P
    from specdecode.sampling.grammar import AfterThinking

    real = AfterThinking.allowed_rows
    monkeypatch.setattr(
        AfterThinking, "allowed_rows", lambda self, drafts, rows, vocab: real(self, [], 1, vocab).expand(rows, vocab)
    )
    try:
        counts, _ = sampled_joint(target, draft, prompt, params, samples=6000)
    except SpecDecodeError as exc:  # a token the grammar refuses was accepted
        assert "outside the grammar" in str(exc)
    else:
        assert chi2_pvalue(counts, joint) < 1e-6
