"""The OpenAI request bodies we accept, and their translation to SamplingParams."""

from __future__ import annotations

import math
from functools import cached_property

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..errors import SpecDecodeError
from ..models.tokenizer import template_variables
from ..sampling import SamplingParams, StructuredOutput
from .tools import Tools

# Fields that change the output and that this server does not implement (OpenAI's and vLLM's), with the value that
# means "off": a request that sets one otherwise gets a 400 rather than an output that silently ignores it.
UNSUPPORTED_UNLESS_DEFAULT = {
    "suffix": None,
    "functions": None,
    "function_call": None,
    "guided_decoding_backend": None,
    "use_beam_search": False,
    "length_penalty": 1.0,
    "logits_processors": None,
    "chat_template": None,  # a chat's (ChatRequest.chat_template): a completion has no template to replace
    "mm_processor_kwargs": None,
    "prompt_embeds": None,
    "vllm_xargs": None,
    "max_repetition_pattern_size": 0,
    "min_repetition_pattern_size": 0,
    "repetition_min_count": 0,
}


# the sampling fields whose default a model's generation config may give (vLLM's list; max_tokens apart)
MODEL_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False  # OpenAI's: the usage in a last chunk of its own (null in the others)
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, the counts so far in every chunk


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs object (its StructuredOutputsParams): one constraint and the JSON options."""

    model_config = ConfigDict(extra="forbid")  # a misspelt option would shape the output otherwise than asked
    schema_: dict | str | None = Field(None, alias="json")  # (BaseModel has a json attribute)
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    disable_fallback: bool = False  # vLLM's fallback from one grammar backend to another: this server has one
    structural_tag: str | dict | None = None  # {"structures": [{"begin", "schema", "end"}], "triggers": [...]}

    def spec(self) -> StructuredOutput:
        return StructuredOutput(
            json=self.schema_,
            json_object=bool(self.json_object),
            regex=self.regex,
            choice=tuple(self.choice) if self.choice is not None else None,
            grammar=self.grammar,
            structural_tag=self.structural_tag,
            whitespace_pattern=self.whitespace_pattern,
            disable_any_whitespace=self.disable_any_whitespace,
            disable_additional_properties=self.disable_additional_properties,
        )


class CommonRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # clients send fields we do not need (user, stream_options, ...)
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    min_tokens: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM's: tokens that end the text as EOS does
    include_stop_str_in_output: bool = False  # vLLM's: the stop string that ended the text kept at its end
    stream: bool = False
    n: int = 1
    ignore_eos: bool = False
    # structured output: OpenAI's response_format, vLLM's structured_outputs, or its older guided_* fields
    response_format: dict | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    timeout: float | None = None  # seconds; the request is cancelled (504) when it runs longer
    user: str | None = None  # OpenAI's end-user id: a scaled-out deployment keeps its requests on one replica
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob given the tokens before, and N others'
    # vLLM's too
    skip_special_tokens: bool = True  # special tokens (end of turn) left out of the text
    spaces_between_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None  # only these may be generated
    bad_words: list[str] | None = None  # words that may not be generated
    truncate_prompt_tokens: int | None = None  # only the prompt's last N tokens read (-1: what fits beside max_tokens)
    thinking_token_budget: int | None = None  # the most tokens a reasoning model's thinking may take
    return_token_ids: bool = False  # the prompt's and each output's token ids in the response
    return_tokens_as_token_ids: bool = False  # logprob entries name their tokens "token_id:ID"
    stream_options: StreamOptions | None = None

    @field_validator("timeout")
    @classmethod
    def _positive_timeout(cls, value: float | None) -> float | None:
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError("timeout must be a positive number of seconds")
        return value

    def streamed_usage(self) -> StreamOptions:
        if self.stream_options is not None and not self.stream:
            raise SpecDecodeError("stream_options apply to a stream: send stream=true or leave them out")
        return self.stream_options or StreamOptions()

    def sampling_params(self, max_tokens: int, logprobs: int | None, defaults: dict | None = None) -> SamplingParams:
        """defaults: what the fields of MODEL_DEFAULTED left unset take (the model's generation config)."""
        refuse_unsupported_fields(self)
        self.streamed_usage()  # checked with the rest of the request
        n = self.candidates() if isinstance(self, CompletionRequest) else self.n
        if n > self.n and logprobs is None:
            logprobs = 0  # ranking reads each token's logprob; they are not returned
        if self.prompt_logprobs is not None and self.stream:
            raise SpecDecodeError("prompt_logprobs cannot be streamed (as in vLLM); ask without stream")
        echoed = logprobs if isinstance(self, CompletionRequest) and self.echo else None
        return SamplingParams(
            prompt_logprobs=echoed if self.prompt_logprobs is None else self.prompt_logprobs,
            structured_output=self.structured_output(),
            n=n,
            **self.defaulted(defaults or {}),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=self.logit_bias,
            min_tokens=self.min_tokens,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            max_tokens=max_tokens,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            thinking_token_budget=self.thinking_token_budget,
            logprobs=logprobs,
        )

    def defaulted(self, defaults: dict) -> dict:
        """The fields a model's generation config may set, each as the request sets it, else the model's value."""
        return {
            name: getattr(self, name) if name in self.model_fields_set else defaults.get(name, getattr(self, name))
            for name in MODEL_DEFAULTED
        }

    def structured_output(self) -> StructuredOutput | None:
        asked = {
            "response_format": response_format_grammar(self.response_format),
            "structured_outputs": self.structured_outputs and self.structured_outputs.spec(),
            "guided_*": self.guided_fields(),
        }
        asked = {name: spec for name, spec in asked.items() if spec is not None}
        if len(asked) > 1:
            raise SpecDecodeError(
                f"send one of response_format, structured_outputs or guided_* fields, not {' and '.join(asked)}"
            )
        return next(iter(asked.values()), None)

    def guided_fields(self) -> StructuredOutput | None:
        """vLLM's guided_* fields (before structured_outputs took their place in its 0.12)."""
        guided = {
            "json": self.guided_json,
            "regex": self.guided_regex,
            "grammar": self.guided_grammar,
            "choice": tuple(self.guided_choice) if self.guided_choice is not None else None,
        }
        guided = {k: v for k, v in guided.items() if v is not None}
        if len(guided) > 1:
            raise SpecDecodeError(f"send one guided_* field at a time, got {', '.join('guided_' + k for k in guided)}")
        if self.guided_whitespace_pattern is not None:
            if not guided:
                raise SpecDecodeError("guided_whitespace_pattern shapes guided_json's output: send guided_json with it")
            guided["whitespace_pattern"] = self.guided_whitespace_pattern
        return StructuredOutput(**guided) if guided else None


def response_format_grammar(response_format: dict | None) -> StructuredOutput | None:
    """OpenAI's response_format: text (no constraint), json_object, or json_schema with its schema; or vLLM's
    structural_tag, its structures and triggers beside the type."""
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise SpecDecodeError("response_format json_schema needs json_schema.schema, a JSON schema object")
        return StructuredOutput(json=schema)
    if kind == "structural_tag":
        return StructuredOutput(structural_tag={k: v for k, v in response_format.items() if k != "type"})
    raise SpecDecodeError(f"response_format type {kind!r} is not one of text, json_object, json_schema, structural_tag")


class CompletionRequest(CommonRequest):
    prompt: str | list[str] | list[int] | list[list[int]]  # one prompt, or several (each answered apart)
    logprobs: int | None = None  # the chosen token's logprob and this many alternatives
    echo: bool = False  # the prompt comes back before the completion (with its logprobs, if asked)
    best_of: int | None = None  # generate this many and return the n with the highest total logprob
    add_special_tokens: bool = True  # vLLM's: the BOS the model's prompts begin with (off: not supported)
    suffix: str | None = None  # the text after the gap the completion fills (a code model's fill-in-the-middle)

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def candidates(self) -> int:
        """How many outputs to generate: best_of when it asks for more than n."""
        if self.best_of is None or self.best_of == self.n:
            return self.n
        if not isinstance(self.best_of, int) or self.best_of < self.n:
            raise SpecDecodeError(f"best_of must be an integer >= n={self.n}, got {self.best_of!r}")
        if self.stream:
            raise SpecDecodeError("best_of cannot be streamed: the best outputs are known only at the end")
        return self.best_of


class ContentPart(BaseModel):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    role: str
    content: str | list[ContentPart] | None = None  # None: an assistant's message of tool calls alone
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None  # a tool's answer: to which call
    name: str | None = None
    # an earlier reply's thinking, as the server returned it (vLLM's name, DeepSeek's): for templates that render it
    reasoning: str | None = None
    reasoning_content: str | None = None

    def text(self) -> str:
        """The message's text; content parts (the newer OpenAI form) must all be text, joined by newlines as vLLM joins
        them for templates that read a string."""
        if self.content is None:
            if not self.tool_calls:
                raise SpecDecodeError(f"messages: each {self.role!r} message needs content (or tool_calls)")
            return ""
        if isinstance(self.content, str):
            return self.content
        kinds = {part.type for part in self.content} - {"text"}
        if kinds:
            raise SpecDecodeError(
                f"messages: content parts of type {', '.join(sorted(kinds))} are not supported (text only)"
            )
        return "\n".join(part.text or "" for part in self.content)


class ChatRequest(CommonRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    # vLLM's: how the chat template renders the conversation
    echo: bool = False  # the reply's content begins with the last message's where that is the assistant's
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last message left open for the reply to go on with ("prefill")
    chat_template_kwargs: dict | None = None  # further variables for the template (Qwen3's enable_thinking)
    chat_template: str | None = None  # the template's text in place of the model's, where the server trusts requests'
    documents: list[dict] | None = None
    reasoning_effort: str | None = None
    add_special_tokens: bool = False  # a BOS on top of the template's (on: not supported)
    include_reasoning: bool = True  # vLLM's: with a reasoning parser, the reply's thinking returned (off: dropped)

    def template_options(self) -> dict:
        """What the chat template is given besides the messages and tools."""
        if self.add_generation_prompt and self.continue_final_message:
            raise SpecDecodeError(
                "continue_final_message goes on with the last message: set add_generation_prompt false"
            )
        if self.continue_final_message and (not self.messages or self.messages[-1].role != "assistant"):
            raise SpecDecodeError("continue_final_message continues the assistant's message: make it the last one")
        extra = template_variables(self.chat_template_kwargs)
        options = dict(
            add_generation_prompt=self.add_generation_prompt, continue_final_message=self.continue_final_message
        )
        if self.documents is not None:
            options["documents"] = self.documents
        if self.reasoning_effort is not None:
            extra.setdefault("reasoning_effort", self.reasoning_effort)
        return extra | options

    def echoed(self) -> str | None:
        """With echo, the text the reply begins with: the last message's, where it is the assistant's."""
        last = self.messages[-1] if self.messages else None
        return last.text() if self.echo and last is not None and last.role == "assistant" else None

    @cached_property
    def tool_use(self) -> Tools | None:
        """The request's tools and tool_choice, checked once (the prompt and the grammar both read them)."""
        return Tools.from_request(self.tools, self.tool_choice, self.parallel_tool_calls)

    def structured_output(self) -> StructuredOutput | None:
        """A call that tool_choice forces is a grammar of its own, which no other may join."""
        own = super().structured_output()
        forced = (tools := self.tool_use) and tools.constraint()
        if forced and own:
            raise SpecDecodeError(
                "tool_choice required or a named function constrains the output already; leave out "
                "response_format, structured_outputs and guided_* fields"
            )
        return forced or own

    def requested_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise SpecDecodeError("top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None


def given(**fields) -> dict:
    """The fields a request sets (not None): those it leaves out take the chat request's defaults, the model's."""
    return {name: value for name, value in fields.items() if value is not None}


def validated(body: type[BaseModel], /, **fields) -> BaseModel:
    """A request body made from another API's fields (the chat request a Responses or Messages request amounts to);
    what the body's type refuses as a SpecDecodeError, a 400 that names the field."""
    try:
        return body(**fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise SpecDecodeError(f"{'.'.join(map(str, first['loc']))}: {first['msg']}") from None


def refuse_unsupported_fields(req: BaseModel) -> None:
    if req.add_special_tokens != isinstance(req, CompletionRequest):
        raise SpecDecodeError(
            "add_special_tokens: a prompt gets the BOS its model wants (a chat's from its template); leave it out"
        )
    for name, value in (req.model_extra or {}).items():
        if name in UNSUPPORTED_UNLESS_DEFAULT and value not in (UNSUPPORTED_UNLESS_DEFAULT[name], None, {}, []):
            raise SpecDecodeError(f"{name} is not supported by this server yet; leave it out (or at its default)")


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt as /v1/completions reads it, or a chat's messages rendered as /v1/chat/completions
    renders them (with its template options and tools)."""

    model_config = ConfigDict(extra="forbid")  # a misspelt option would tokenize otherwise than asked
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # a prompt's BOS (default on); a chat's comes from its template
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    chat_template: str | None = None
    tools: list | None = None
    return_token_strs: bool = False  # each token's string in the vocabulary beside its id

    def chat(self) -> ChatRequest:
        """The chat request whose prompt these messages make."""
        if self.add_special_tokens:
            raise SpecDecodeError("add_special_tokens: a chat's BOS comes from its template; leave it out")
        return ChatRequest(
            messages=self.messages,
            tools=self.tools,
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            chat_template_kwargs=self.chat_template_kwargs,
            chat_template=self.chat_template,
        )


class DetokenizeRequest(BaseModel):
    """vLLM's /detokenize: token ids back to text, special tokens included."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]
