"""Tokenizer and chat template, from a GGUF file's metadata or a tokenizer.json folder (via transformers)."""

from __future__ import annotations

import copy
import os
import warnings

from ..errors import SpecDecodeError
from . import infill
from .pretokenizers import BOS_BY_DEFAULT, IGNORE_MERGES, NEVER_BOS, split_as_llama_cpp

# Tokens that end a turn in the families' chat templates (llama.cpp's end-of-generation list, in part)
END_OF_TURN = (
    *("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<end_of_turn>", "<|end|>"),
    *("<|return|>", "<|call|>"),  # gpt-oss's (o200k_harmony): its answer's end, and a tool call's
)
# gpt-oss's vocabulary (told by its <|return|> and <|call|>) ends a message with <|end|> inside its turn, the
# reasoning's channel before the answer's: not an end of generation there, as llama.cpp decides
HARMONY_ENDS, HARMONY_MESSAGE_END = ("<|return|>", "<|call|>"), "<|end|>"
# and its messages' markers, which decoding keeps in such a vocabulary: the server reads its channels out of them
HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", HARMONY_MESSAGE_END)
# Special tokens whose text the server reads calls and thinking out of (Mistral's and Magistral's markers): decoding
# keeps them where it leaves the other special tokens out, as Qwen's <tool_call> and <think>, ordinary added tokens,
# stay in the text
KEPT_MARKERS = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[THINK]", "[/THINK]", "<seed:think>", "</seed:think>")
# A reasoning model's thinking tags, where its vocabulary holds each as one token (Qwen3 and DeepSeek-R1's; Magistral's)
THINK_TAGS = (("<think>", "</think>"), ("[THINK]", "[/THINK]"), ("<seed:think>", "</seed:think>"))
GGUF_END_IDS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


# What a chat template is given as arguments of their own, and transformers' other arguments to render it (another
# template among them), which its variables (chat_template_kwargs) may not set
TEMPLATE_RESERVED = frozenset(
    {
        *("messages", "conversation", "tools", "add_generation_prompt", "continue_final_message", "documents"),
        *("tokenize", "chat_template", "return_dict", "return_tensors", "padding", "truncation", "max_length"),
        *("tokenizer_kwargs", "return_assistant_tokens_mask"),
    }
)


def template_variables(variables: dict | None) -> dict:
    """A chat template's own variables (vLLM's chat_template_kwargs, such as Qwen3's enable_thinking), checked not to
    stand for an argument of its own."""
    if clash := sorted(TEMPLATE_RESERVED & set(variables or {})):
        raise SpecDecodeError(f"chat_template_kwargs may not set {', '.join(clash)}: each is an argument of its own")
    return dict(variables or {})


def read_chat_template(source: str, files: bool = True) -> str:
    """A chat template given as a file or as its text (vLLM's --chat-template), checked to compile as transformers
    compiles templates. files=False: text only (a request's template, which must not name files on the server)."""
    if files and os.path.isfile(source):
        with open(source, encoding="utf-8") as f:
            source = f.read()
    elif "{{" not in source and "{%" not in source:
        where = "is no file here, and no" if files else "is no"
        raise SpecDecodeError(
            f"chat_template: {source[:80]!r} {where} Jinja template ({{{{ ... }}}} or {{% ... %}}); pass "
            + ("a template file or the template's text" if files else "the template's text")
        )
    from jinja2 import TemplateSyntaxError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment(extensions=[loopcontrols]).parse(source)
    except TemplateSyntaxError as exc:
        raise SpecDecodeError(f"chat_template does not compile: {exc.message} (line {exc.lineno})") from None
    return source


class Tokenizer:
    """bos_id: the token a prompt must begin with, where the model was trained so (Gemma, Llama's
    SentencePiece models); encode() puts it there unless the text (a chat template's output) has it already."""

    def __init__(self, hf_tokenizer, extra_eos: tuple[int, ...] = (), bos_id: int | None = None, kind: str = ""):
        self.hf = hf_tokenizer
        self.bos_id = bos_id
        self.kind = kind or type(hf_tokenizer).__name__  # what it is, for messages: "SentencePiece (gemma3)"
        eos = {hf_tokenizer.eos_token_id, *extra_eos}
        eos.update(token_id(hf_tokenizer, name) for name in (*END_OF_TURN, *infill.ENDS))
        # gpt-oss's harmony format: its messages' ends and markers are read, not taken for ends of generation
        self.harmony = all(token_id(hf_tokenizer, name) is not None for name in HARMONY_ENDS)
        if self.harmony:
            eos.discard(token_id(hf_tokenizer, HARMONY_MESSAGE_END))
        self.eos_token_ids = frozenset(t for t in eos if t is not None)
        # None: the model cannot fill in the middle
        self.fim_ids = infill.fim_ids(lambda name: token_id(hf_tokenizer, name))
        # the ids of the thinking's opening and closing tags (THINK_TAGS), else None
        tags = ((token_id(hf_tokenizer, start), token_id(hf_tokenizer, end)) for start, end in THINK_TAGS)
        self.think_ids = next((ids for ids in tags if None not in ids), None)
        # the special tokens decoding leaves out where it keeps markers; None: those skip_special_tokens skips
        self.hidden_ids = hidden_ids(hf_tokenizer, self.harmony)
        self.own_template: str | None = None  # a chat template given in place of the model's (with_chat_template)

    def with_chat_template(self, template: str, files: bool = True) -> Tokenizer:
        """This tokenizer rendering chats with another template (a model's own replaced, or one given to a model that
        has none); the model's tokenizer, which others may share, is left as it is. files: see read_chat_template."""
        twin = copy.copy(self)
        twin.own_template = read_chat_template(template, files)
        return twin

    @property
    def chat_template(self) -> str | dict | None:
        """The template chats are rendered with (a dict: the model's several named ones, as transformers picks)."""
        return self.own_template or self.hf.chat_template

    @property
    def special_ids(self) -> set[int]:
        return set(self.hf.all_special_ids) | set(self.hf.added_tokens_decoder) | set(self.eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def get_vocab(self) -> dict[str, int]:
        return self.hf.get_vocab()

    def encode(self, text: str) -> list[int]:
        ids = self.hf.encode(text, add_special_tokens=False)
        return ids if self.bos_id is None or ids[:1] == [self.bos_id] else [self.bos_id, *ids]

    def encode_fragment(self, text: str) -> list[int]:
        """A piece of text as it is tokenized on its own, without the BOS a prompt begins with."""
        return self.hf.encode(text, add_special_tokens=False)

    def token_strings(self, ids: list[int]) -> list[str]:
        """Each token as the vocabulary spells it (byte-level BPE's "Ġ" for a space, SentencePiece's "▁")."""
        return self.hf.convert_ids_to_tokens(ids)

    def decode(
        self, ids: list[int], skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True
    ) -> str:
        if skip_special_tokens and self.hidden_ids is not None:
            ids, skip_special_tokens = [i for i in ids if i not in self.hidden_ids], False
        return self.hf.decode(
            ids, skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=spaces_between_special_tokens
        )

    def decode_stream(self, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True):
        """A function that takes the next token and returns the text it completes (None while a character waits
        for more bytes): the tokenizers library's incremental decoder, rendering what decode() would. None where
        decode() does more than the Rust tokenizer's own (a Python tokenizer, clean-up of spaces)."""
        backend = getattr(self.hf, "backend_tokenizer", None)  # a Rust tokenizer: spaces_between_special_tokens is moot
        if backend is None or getattr(self.hf, "clean_up_tokenization_spaces", False):
            return None
        from tokenizers.decoders import DecodeStream

        hidden = self.hidden_ids if skip_special_tokens else None
        stream = DecodeStream(skip_special_tokens=skip_special_tokens and hidden is None)
        if hidden is not None:
            return lambda token: "" if token in hidden else stream.step(backend, token)
        return lambda token: stream.step(backend, token)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None, **options) -> str:
        """tools: OpenAI function tools, rendered where the template asks for calls in a format read back
        (tool_call_format); options: what else the template reads (add_generation_prompt, default on;
        continue_final_message; the template's own variables, such as Qwen3's enable_thinking)."""
        if not self.chat_template:
            raise SpecDecodeError(
                "this model has no chat template; pass plain prompts instead of --chat/llm.chat, or give it one "
                "(--chat-template, LLM(chat_template=...))"
            )
        form = self.tool_call_format
        if tools and form is None:
            raise SpecDecodeError(
                "this model's chat template asks for no tool calls in a format this server reads (Hermes' "
                "<tool_call> blocks, Llama 3's bare JSON, Mistral's [TOOL_CALLS]); leave tools out"
            )
        if form == "mistral":  # its template refuses any call id but 9 letters or digits
            messages = [nine_character_ids(m) for m in messages]
        from jinja2 import TemplateError

        try:
            return self.hf.apply_chat_template(
                messages,
                tools=tools or None,
                tokenize=False,
                **({"chat_template": self.own_template} if self.own_template else {}),
                **({"add_generation_prompt": True} | options),
            )
        except (TemplateError, ValueError) as exc:  # its own checks (roles that alternate), a final message not found
            raise SpecDecodeError(f"the model's chat template refused these messages: {exc}") from None

    @property
    def tool_call_format(self) -> str | None:
        """How the chat template asks the model to call the tools it renders: "hermes" (<tool_call> blocks of JSON:
        Qwen2.5, Qwen3, Hermes; or of XML: Qwen3-Coder), "json" (a bare {"name", "parameters"} object: Llama
        3.1-3.3), "mistral" ([TOOL_CALLS] and a list of calls), else None."""
        template = self.chat_template if isinstance(self.chat_template, str) else ""
        if "tools" not in template:
            return None
        if "<tool_call>" in template:
            return "hermes"
        if "[TOOL_CALLS]" in template:
            return "mistral"
        return "json" if '"parameters": dictionary of argument name' in template else None

    @classmethod
    def from_gguf(cls, path: str, cache_dir: str) -> "Tokenizer":
        """The tokenizer a GGUF file describes, encoding as llama.cpp does. Building it from the metadata
        takes seconds; the result is saved and reused."""
        import json

        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        saved = os.path.join(cache_dir, "gguf_tokenizer-v2.json")  # v2: llama.cpp's splits (pretokenizers.py)
        if os.path.exists(saved) and os.path.exists(os.path.join(cache_dir, "tokenizer_config.json")):
            found = json.load(open(saved))
            return cls(
                AutoTokenizer.from_pretrained(cache_dir), tuple(found["end_ids"]), found["bos_id"], found["kind"]
            )
        meta = gguf_tokenizer_metadata(path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # the fast tokenizer class itself, not AutoTokenizer: that reads the whole file again for a model config
            # before it picks the class (docs/decisions.md#model-families-one-decoder-from-a-description)
            tok = PreTrainedTokenizerFast.from_pretrained(
                os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path)
            )
        encode_as_llama_cpp(tok, meta)
        found = {
            "end_ids": [meta[key] for key in GGUF_END_IDS if meta.get(key) is not None],
            "bos_id": gguf_bos_id(meta),
            "kind": gguf_tokenizer_kind(meta),
        }
        tok.save_pretrained(cache_dir)
        json.dump(found, open(saved, "w"))
        return cls(tok, tuple(found["end_ids"]), found["bos_id"], found["kind"])

    @classmethod
    def from_pretrained(cls, folder: str) -> "Tokenizer":
        import json

        from transformers import AutoTokenizer

        extra: tuple[int, ...] = ()
        gen_cfg = os.path.join(folder, "generation_config.json")
        if os.path.exists(gen_cfg):
            eos = json.load(open(gen_cfg)).get("eos_token_id")
            extra = tuple(eos) if isinstance(eos, list) else (eos,) if isinstance(eos, int) else ()
        tok = AutoTokenizer.from_pretrained(folder)
        kind = f"{type(tok).__name__} of {os.path.basename(os.path.normpath(folder))}"
        with_specials = tok.encode("a", add_special_tokens=True)  # what the checkpoint's own tokenizer prepends
        bos = tok.bos_token_id if tok.bos_token_id is not None and with_specials[:1] == [tok.bos_token_id] else None
        return cls(tok, extra, bos, kind)


def hidden_ids(hf_tokenizer, harmony: bool = False) -> frozenset[int] | None:
    """The special tokens other than the markers (and harmony's, in its vocabulary), where the vocabulary has markers as
    special tokens."""
    special = set(hf_tokenizer.all_special_ids)
    special.update(i for i, token in hf_tokenizer.added_tokens_decoder.items() if token.special)
    kept = (*KEPT_MARKERS, *HARMONY_MARKERS) if harmony else KEPT_MARKERS
    markers = {token_id(hf_tokenizer, name) for name in kept} & special
    return frozenset(special - markers) if markers else None


def token_id(hf_tokenizer, name: str) -> int | None:
    """The id of the token spelt `name`, None where the vocabulary has no such token (transformers answers with the
    unknown token's id, or None): one lookup, where the whole vocabulary as a dict is built anew each time."""
    tid = hf_tokenizer.convert_tokens_to_ids(name)
    return tid if isinstance(tid, int) and tid != hf_tokenizer.unk_token_id else None


def gguf_tokenizer_metadata(path: str) -> dict:
    """The GGUF fields that say how the vocabulary encodes and which tokens end a turn."""
    from .families import field
    from .gguf_loader import MappedReader

    reader = MappedReader(path)
    keys = (
        "tokenizer.ggml.model",
        "tokenizer.ggml.pre",
        "tokenizer.ggml.add_space_prefix",
        "tokenizer.ggml.add_bos_token",
        "tokenizer.ggml.bos_token_id",
        *GGUF_END_IDS,
    )
    return {key: field(reader, key) for key in keys}


GGUF_TOKENIZER_MODELS = {"gpt2": "byte-level BPE", "llama": "SentencePiece"}


def gguf_tokenizer_kind(meta: dict) -> str:
    model, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
    return f"{GGUF_TOKENIZER_MODELS.get(model, model)}{f' ({pre})' if pre and pre != 'default' else ''}"


def gguf_bos_id(meta: dict) -> int | None:
    """The BOS a prompt begins with, as llama.cpp decides: the file's add_bos_token, else its default for the
    vocabulary (SentencePiece's and Llama 3's add one)."""
    add = meta.get("tokenizer.ggml.add_bos_token")
    if meta.get("tokenizer.ggml.pre") in NEVER_BOS:
        add = False
    elif add is None:
        add = meta.get("tokenizer.ggml.model") == "llama" or meta.get("tokenizer.ggml.pre") in BOS_BY_DEFAULT
    return meta.get("tokenizer.ggml.bos_token_id") if add else None


def encode_as_llama_cpp(tok, meta: dict) -> None:
    """Where transformers' reading of GGUF metadata encodes otherwise than llama.cpp (and the model's own
    tokenizer) does: the words a byte-level BPE vocabulary's pre-tokenizer splits (pretokenizers.py), Llama 3's
    whole-word vocabulary lookups before the merges, SentencePiece's dummy prefix, a space before the text whether
    or not it begins with one (unless the file turns it off, as Gemma's do)."""
    from tokenizers import normalizers, pre_tokenizers

    backend = tok.backend_tokenizer
    if meta.get("tokenizer.ggml.model") == "gpt2":
        split_as_llama_cpp(backend, meta.get("tokenizer.ggml.pre"))
    if meta.get("tokenizer.ggml.pre") in IGNORE_MERGES:
        backend.model.ignore_merges = True
    if meta.get("tokenizer.ggml.model") == "llama" and isinstance(backend.pre_tokenizer, pre_tokenizers.Metaspace):
        spaces = normalizers.Replace(" ", "▁")
        prefix = meta.get("tokenizer.ggml.add_space_prefix")
        backend.normalizer = (
            normalizers.Sequence([normalizers.Prepend("▁"), spaces]) if prefix in (None, True) else spaces
        )
        backend.pre_tokenizer = None


def nine_character_ids(message: dict) -> dict:
    """The message with its call ids as Mistral's template demands, each derived from the id sent (so a call and its
    result still name the same one); ids already so are kept."""
    out = dict(message)
    if out.get("tool_call_id") is not None:
        out["tool_call_id"] = _nine_characters(str(out["tool_call_id"]))
    if out.get("tool_calls"):
        out["tool_calls"] = [{**c, "id": _nine_characters(str(c.get("id", "")))} for c in out["tool_calls"]]
    return out


def _nine_characters(call_id: str) -> str:
    import hashlib

    if len(call_id) == 9 and call_id.isalnum():
        return call_id
    return hashlib.blake2b(call_id.encode(), digest_size=5).hexdigest()[:9]
