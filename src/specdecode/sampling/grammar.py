"""Structured output: a grammar (JSON schema, regex, choice list or Lark grammar) constrains which tokens
may come next, through llguidance's matcher.

Under speculation the mask is applied at every draft position, to target and draft alike: the matcher
advances along the drafts to compute the verify rows' masks and rolls back, so the processed target
distribution at each position is exactly the one plain constrained decoding samples from. Only emitted
tokens advance it for good."""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Callable

import torch

from ..errors import SpecDecodeError
from ..transfers import tensor_to_device, to_device

# Whitespace between JSON tokens as the model likes to write it (pretty-printed), but at most 20
# characters at a time, so that a model cannot stall in a run of spaces until max_tokens. A schema may
# ask otherwise through its "x-guidance" options (e.g. "whitespace_flexible": false for compact JSON).
JSON_OPTIONS = {"whitespace_flexible": True, "whitespace_pattern": "[ \\t\\n\\r]{0,20}"}


def json_options(schema: dict | str, defaults: dict = JSON_OPTIONS) -> dict:
    """The JSON options a schema is compiled with: these defaults, less their whitespace pattern where the schema's
    "x-guidance" turns flexible whitespace off and sets no pattern of its own (llguidance would take the pattern over
    the switch)."""
    try:
        asked = (json.loads(schema) if isinstance(schema, str) else schema).get("x-guidance") or {}
    except (ValueError, AttributeError):
        return defaults  # not a schema object: llguidance says what is wrong
    if asked.get("whitespace_flexible") is False and "whitespace_pattern" not in asked:
        return {k: v for k, v in defaults.items() if k != "whitespace_pattern"}
    return defaults


def closed_objects(schema: dict | str) -> dict | str:
    """The schema with every object that does not say otherwise closed to properties it does not list (vLLM's
    disable_additional_properties; JSON Schema leaves them open). A string that is not JSON is left to llguidance."""
    try:
        node = json.loads(schema) if isinstance(schema, str) else copy.deepcopy(schema)
    except ValueError:
        return schema

    def close(node) -> None:
        if isinstance(node, dict) and "object" in _listed(node.get("type")):
            node.setdefault("additionalProperties", False)
        for child in node.values() if isinstance(node, dict) else node if isinstance(node, list) else ():
            close(child)

    close(node)
    return node


def _listed(kind) -> list:
    """A schema's "type": one name, or a list of them."""
    return kind if isinstance(kind, list) else [kind]


@dataclass(frozen=True)
class StructuredOutput:
    """One of: json (a schema, as a dict or string), json_object (any JSON object), regex, choice (the output is one
    of these strings), grammar (Lark syntax, llguidance's dialect, or GBNF) or structural_tag (free text in which each
    trigger string opens a structure: see structural_tag_grammar)."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    structural_tag: dict | str | None = None
    # A reasoning model's thinking left free, the grammar starting after its </think> (as vLLM's with a reasoning
    # parser): None, the grammar from the first token; True, the reply starts inside the thinking (its prompt opened
    # it); False, the reply may open it with <think> as its first token, else follows the grammar from there.
    after_thinking: bool | None = None
    # vLLM's options for JSON: the whitespace allowed between its tokens (default: JSON_OPTIONS'), or none (compact
    # JSON); a schema's objects closed to properties they do not list, where they do not say otherwise
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    def __post_init__(self):
        given = [n for n in ("json", "regex", "choice", "grammar", "structural_tag") if getattr(self, n) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise SpecDecodeError(
                f"structured output takes exactly one of json, json_object, regex, choice, grammar or "
                f"structural_tag; got {', '.join(given) or 'none'}"
            )
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise SpecDecodeError("choice must be a non-empty list of non-empty strings")
        self._check_json_options(given[0])

    def _check_json_options(self, kind: str) -> None:
        spacing = [name for name in ("whitespace_pattern", "disable_any_whitespace") if getattr(self, name)]
        if spacing and kind not in ("json", "json_object"):
            raise SpecDecodeError(f"{spacing[0]} shapes JSON output: it needs json or json_object, not {kind}")
        if len(spacing) == 2:
            raise SpecDecodeError("whitespace_pattern allows whitespace that disable_any_whitespace forbids: send one")
        if self.disable_additional_properties and kind != "json":
            raise SpecDecodeError(f"disable_additional_properties closes a schema's objects: it needs json, not {kind}")

    def json_defaults(self) -> dict:
        """llguidance's JSON options as the request asks: compact, its whitespace pattern, or ours."""
        if self.disable_any_whitespace:
            return {"whitespace_flexible": False}
        if self.whitespace_pattern is not None:
            return {"whitespace_flexible": True, "whitespace_pattern": self.whitespace_pattern}
        return JSON_OPTIONS

    def llguidance_grammar(self, is_special_token: Callable[[str], bool] = lambda text: False) -> str:
        """The grammar as llguidance compiles it; is_special_token: whether a string is one special token of the
        tokenizer (a structural tag's trigger such as <tool_call> is matched as that token, not as text)."""
        from llguidance import LLMatcher

        if self.json_object:
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=self.json_defaults())
        if self.json is not None:
            schema = closed_objects(self.json) if self.disable_additional_properties else self.json
            try:
                return LLMatcher.grammar_from_json_schema(schema, defaults=json_options(schema, self.json_defaults()))
            except ValueError as exc:
                raise SpecDecodeError(f"the JSON schema is not valid JSON: {exc}") from None
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in self.choice))
        if self.structural_tag is not None:
            return structural_tag_grammar(self.structural_tag, is_special_token)
        return lark_or_gbnf(self.grammar)


def lark_or_gbnf(grammar: str) -> str:
    """A grammar in llguidance's Lark, or in GBNF (llama.cpp's, the EBNF of vLLM's examples: `root ::= ...`), which
    llguidance converts to Lark, as vLLM's guidance backend takes its grammar field."""
    from llguidance import grammar_from

    try:
        return grammar_from("grammar", grammar)
    except ValueError as exc:
        raise SpecDecodeError(f"the grammar is neither Lark nor GBNF that converts: {exc}") from None


def structural_tag_grammar(tag: dict | str, is_special_token: Callable[[str], bool]) -> str:
    """vLLM's structural tag, {"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}: free text in which a
    trigger opens the structure whose begin starts with it, its JSON following the schema, then its end; compiled as
    vLLM's guidance backend compiles it (llguidance's StructTag). Triggers of the form <...> are matched as special
    tokens where each is one."""
    from llguidance import StructTag

    tag = _structural_tag_fields(tag)
    tags = []
    for structure in tag["structures"]:
        begin = structure["begin"]
        trigger = next((t for t in tag["triggers"] if begin.startswith(t)), None)
        if trigger is None:
            raise SpecDecodeError(f"structural_tag: the begin {begin!r} starts with none of the triggers")
        tags.append(
            StructTag(trigger=trigger, begin=begin, grammar=_with_json_options(structure), end=structure["end"])
        )
    bracketed = [t for t in tag["triggers"] if t.startswith("<") and t.endswith(">")]
    return StructTag.to_grammar(tags, assume_special=all(map(is_special_token, bracketed)))


def _structural_tag_fields(tag: dict | str) -> dict:
    """The tag as a dict, checked to have the fields vLLM's first form has (its later "format" form is not read)."""
    usage = 'structural_tag takes {"structures": [{"begin": str, "schema": {...}, "end": str}, ...], "triggers": [str]}'
    try:
        tag = json.loads(tag) if isinstance(tag, str) else tag
    except ValueError as exc:
        raise SpecDecodeError(f"structural_tag is not valid JSON ({exc}); {usage}") from None
    if not isinstance(tag, dict) or "format" in tag:
        raise SpecDecodeError(f"{usage} (the form with a 'format' is not supported here)")
    structures, triggers = tag.get("structures"), tag.get("triggers")
    fields_ok = (
        isinstance(structures, list)
        and structures
        and all(
            isinstance(s, dict)
            and isinstance(s.get("begin"), str)
            and isinstance(s.get("end"), str)
            and isinstance(s.get("schema"), (dict, str))
            for s in structures
        )
    )
    triggers_ok = isinstance(triggers, list) and triggers and all(isinstance(t, str) and t for t in triggers)
    if not (fields_ok and triggers_ok):
        raise SpecDecodeError(usage)
    return tag


def _with_json_options(structure: dict) -> dict:
    """A structure's schema with our JSON options where it states none (a %json in Lark takes no defaults)."""
    schema = structure["schema"]
    try:
        schema = json.loads(schema) if isinstance(schema, str) else schema
    except ValueError as exc:
        raise SpecDecodeError(
            f"structural_tag: the schema of {structure['begin']!r} is not valid JSON: {exc}"
        ) from None
    if not isinstance(schema, dict):
        raise SpecDecodeError(f"structural_tag: the schema of {structure['begin']!r} is not a JSON schema object")
    return schema if "x-guidance" in schema else {**schema, "x-guidance": JSON_OPTIONS}


def is_special_token(tokenizer, text: str) -> bool:
    ids = tokenizer.encode_fragment(text)
    return len(ids) == 1 and ids[0] in tokenizer.special_ids


class GrammarTokenizers:
    """llguidance's view of a tokenizer (each token's bytes) takes seconds to build: one per tokenizer."""

    _cache: dict[int, Any] = {}

    @classmethod
    def get(cls, tokenizer, vocab_size: int):
        key = id(tokenizer)
        if key not in cls._cache:
            cls._cache[key] = (tokenizer, _build_ll_tokenizer(tokenizer, vocab_size))
        return cls._cache[key][1]


def _build_ll_tokenizer(tokenizer, vocab_size: int):
    import llguidance
    import llguidance.hf

    eos = sorted(tokenizer.eos_token_ids)
    hf = getattr(tokenizer, "hf", None)
    if hf is not None:
        try:
            return llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=eos)
        except ValueError:  # not a fast (Rust) tokenizer
            pass
    # any other tokenizer whose tokens decode one by one (character- or byte-level)
    return llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(_TokenBytes(tokenizer, vocab_size, eos)), n_vocab=vocab_size, eos_token=eos
    )


class _TokenBytes:
    def __init__(self, tokenizer, vocab_size: int, eos: list[int]):
        self.eos_token_id, self.bos_token_id = eos[0], None
        self.special_token_ids = eos
        self.tokens = [b"" if i in eos else tokenizer.decode([i]).encode() for i in range(vocab_size)]
        self._encode = tokenizer.encode

    def __call__(self, text: str) -> list[int]:
        return self._encode(text)


class GrammarMatcher:
    """One sequence's position in its grammar, over the output tokens emitted so far.

    Masks are kept per speculative prefix (the tokens past the emitted text) until the text advances:
    the draft computes the masks of draft positions 0..k-1 and verification needs the same ones, plus
    one after the last draft, so a step computes k + 1 masks rather than 2k + 1."""

    def __init__(self, matcher, vocab_size: int, eos_ids: frozenset[int]):
        self._matcher = matcher
        self._vocab = vocab_size
        # never consumed along drafts: the text ends there, and llguidance's rollback does not count them
        self._eos = eos_ids
        self._drafted: list[int] = []  # tokens consumed by draft(), undone by undo_drafts()
        self._masks: dict[tuple, torch.Tensor] = {}  # (speculative prefix, vocab) -> allowed tokens

    @classmethod
    def compile(cls, spec: StructuredOutput, tokenizer, vocab_size: int) -> "GrammarMatcher":
        from llguidance import LLMatcher

        grammar = spec.llguidance_grammar(lambda text: is_special_token(tokenizer, text))
        matcher = LLMatcher(GrammarTokenizers.get(tokenizer, vocab_size), grammar, log_level=0)
        if matcher.is_error():
            raise SpecDecodeError(f"the structured output grammar is not valid: {matcher.get_error()}")
        grammar = cls(matcher, vocab_size, frozenset(tokenizer.eos_token_ids))
        tags = getattr(tokenizer, "think_ids", None)  # the thinking tags' ids where each is one token
        if spec.after_thinking is None or tags is None:
            return grammar
        return AfterThinking(grammar, *tags, thinking=spec.after_thinking)

    def copy(self) -> "GrammarMatcher":
        return GrammarMatcher(self._matcher.deep_copy(), self._vocab, self._eos)

    def _allowed_now(self, vocab: int) -> torch.Tensor:
        """[vocab] bool: the tokens the grammar allows in the matcher's current state."""
        allowed = torch.frombuffer(bytearray(self._matcher.compute_logit_bias()), dtype=torch.uint8) > 0
        if len(allowed) >= vocab:
            return allowed[:vocab]
        return torch.cat([allowed, torch.zeros(vocab - len(allowed), dtype=torch.bool)])

    def mask_rows(self, logits: torch.Tensor, drafts: list[int]) -> torch.Tensor:
        """logits [P, V], row j after drafts[:j]: disallowed tokens get -inf (see allowed_rows)."""
        allowed = self.allowed_rows(drafts, *logits.shape)
        return logits.masked_fill(~tensor_to_device(allowed, logits.device), float("-inf"))

    def allowed_rows(self, drafts: list[int], rows: int, vocab: int) -> torch.Tensor:
        """[rows, vocab] bool on the host: the tokens allowed at row j, after drafts[:j]. Rows past the first draft
        the grammar refuses, or past an end-of-sequence draft, repeat that row's mask (the draft is rejected
        there, or the text ends, so they go unused)."""
        drafts = list(drafts[: rows - 1])
        before_eos = next((i for i, t in enumerate(drafts) if t in self._eos), len(drafts))
        valid = self._matcher.validate_tokens(drafts[:before_eos])
        masks, consumed = [], 0
        for j in range(min(rows, valid + 1)):
            key = (tuple(self._drafted) + tuple(drafts[:j]), vocab)
            if key not in self._masks:  # bring the matcher to drafts[:j] (rolled back below), then ask it
                for token in drafts[consumed:j]:
                    self._matcher.consume_token(token)
                consumed = j
                self._masks[key] = self._allowed_now(vocab)
            masks.append(self._masks[key])
        if consumed:
            self._matcher.rollback(consumed)
        masks += [masks[-1]] * (rows - len(masks))
        return torch.stack(masks)

    def advance(self, tokens: list[int]) -> None:
        """The tokens are emitted: final."""
        self._masks.clear()
        for token in tokens:
            if self._matcher.is_stopped():  # complete: what follows is the end-of-sequence token
                return
            if not self._matcher.consume_token(token):
                raise SpecDecodeError(f"a token outside the grammar was emitted: {self._matcher.get_error()}")

    def draft(self, token: int) -> None:
        """A proposer drafted the token: the next draft position's mask follows it, until undo_drafts()."""
        if token not in self._eos and self._matcher.try_consume_tokens([token]):
            self._drafted.append(token)

    def undo_drafts(self) -> None:
        if self._drafted:
            self._matcher.rollback(len(self._drafted))
        self._drafted = []


class AfterThinking:
    """A grammar that starts after a reasoning model's thinking: every token is allowed inside it, the grammar's
    mask applies from the token after </think>. A reply not inside it yet may open it with <think> as its first token
    (the only token allowed there besides the grammar's). Drafts move the state as emitted tokens do, so a verify
    row after a drafted </think> gets the grammar's mask; the grammar itself sees only the tokens after it."""

    def __init__(self, grammar: GrammarMatcher, start: int, end: int, thinking: bool):
        self.grammar, self.start, self.end = grammar, start, end
        self.state = "thinking" if thinking else "start"  # then "grammar", for good
        self._drafted_state = self.state

    def copy(self) -> AfterThinking:
        twin = AfterThinking(self.grammar.copy(), self.start, self.end, thinking=False)
        twin.state = twin._drafted_state = self.state
        return twin

    def _after(self, state: str, token: int) -> tuple[str, bool]:
        """The state after the token, and whether the grammar reads it."""
        if state == "thinking":
            return ("grammar" if token == self.end else "thinking"), False
        if state == "start" and token == self.start:
            return "thinking", False
        return "grammar", True

    def mask_rows(self, logits: torch.Tensor, drafts: list[int]) -> torch.Tensor:
        allowed = self.allowed_rows(drafts, *logits.shape)
        return logits.masked_fill(~tensor_to_device(allowed, logits.device), float("-inf"))

    def allowed_rows(self, drafts: list[int], rows: int, vocab: int) -> torch.Tensor:
        """[rows, vocab] bool: row j's tokens after drafts[:j], the grammar's rows asked of it along the drafts it
        reads."""
        state, read, masks = self._drafted_state, [], []
        for j in range(rows):
            if state == "thinking":
                masks.append(torch.ones(vocab, dtype=torch.bool))
            else:
                mask = self.grammar.allowed_rows(read, len(read) + 1, vocab)[-1]
                if state == "start" and self.start < vocab:
                    mask = mask.clone()
                    mask[self.start] = True
                masks.append(mask)
            if j < len(drafts):
                state, reads = self._after(state, drafts[j])
                read += [drafts[j]] if reads else []
        return torch.stack(masks)

    def advance(self, tokens: list[int]) -> None:
        read = []
        for token in tokens:
            self.state, reads = self._after(self.state, token)
            read += [token] if reads else []
        self._drafted_state = self.state
        self.grammar.advance(read)

    def draft(self, token: int) -> None:
        self._drafted_state, reads = self._after(self._drafted_state, token)
        if reads:
            self.grammar.draft(token)

    def undo_drafts(self) -> None:
        self.grammar.undo_drafts()
        self._drafted_state = self.state


def mask_grammars(rows: torch.Tensor, grammars: list[GrammarMatcher | None], drafts: list[list[int]]) -> torch.Tensor:
    """Logits rows of several sequences (sequence i's len(drafts[i]) + 1 after those before it, row j after
    drafts[:j]) with each grammar's mask applied, every sequence's masks copied to the device at once; in place."""
    masked = [i for i, g in enumerate(grammars) if g is not None]
    if not masked:
        return rows
    starts = list(accumulate((len(d) + 1 for d in drafts), initial=0))
    allowed = torch.cat([grammars[i].allowed_rows(drafts[i], len(drafts[i]) + 1, rows.shape[-1]) for i in masked])
    where = to_device([starts[i] + j for i in masked for j in range(len(drafts[i]) + 1)], rows.device)
    rows[where] = rows[where].masked_fill(~tensor_to_device(allowed, rows.device), float("-inf"))
    return rows
