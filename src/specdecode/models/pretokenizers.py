"""How llama.cpp splits text into words before a byte-level BPE vocabulary's merges, by the name a GGUF file gives
its pre-tokenizer (`tokenizer.ggml.pre`): a list of regular expressions applied one after another, each piece of
text split again by the next (llama.cpp's `llm_tokenizer_bpe`). transformers' reading of a GGUF file splits some
of them so and the rest by GPT-2's words; a name neither splits as llama.cpp does is refused, as llama.cpp refuses
a name it does not know."""

from __future__ import annotations

from ..errors import SpecDecodeError

GPT2_WORDS = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_LETTERS, _OTHERS = r"|[^\r\n\p{L}\p{N}]?\p{L}+|", r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
LLAMA3_WORDS = _CONTRACTIONS + _LETTERS + r"\p{N}{1,3}" + _OTHERS  # numerals in threes
QWEN2_WORDS = _CONTRACTIONS + _LETTERS + r"\p{N}" + _OTHERS  # numerals one by one
# character classes by code point: as characters, some would be normalised to others in an editor (U+1F7D to U+03CE)
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_KANA = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_DEEPSEEK_LLM_LETTERS = (
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
    "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d"
    "\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4"
    "\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a"
    "\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+"
)
_DEEPSEEK_LLM_MARKS = "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"
_DEEPSEEK3_WORDS = (
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# llama.cpp's splits that transformers' reading of the file does not make
SPLITS = {
    **dict.fromkeys(
        ("refact", "starcoder", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"),
        (r"\p{N}", GPT2_WORDS),  # each numeral on its own, then GPT-2's words
    ),
    **dict.fromkeys(("chatglm-bpe", "glm4", "glm5"), (LLAMA3_WORDS,)),
    **dict.fromkeys(("stablelm2", "hunyuan", "solar-open", "grok-2"), (QWEN2_WORDS,)),
    "deepseek-coder": (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"),
    "deepseek-llm": (r"[\r\n]", _DEEPSEEK_LLM_LETTERS, _DEEPSEEK_LLM_MARKS, r"\s+$", _CJK, r"\p{N}+"),
    "deepseek-v3": (r"\p{N}{1,3}", _KANA, _DEEPSEEK3_WORDS),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", GPT2_WORDS, "[0-9][0-9][0-9]"),
    # a file that names none (older conversions; llama.cpp warns that it encodes them worse than their own tokenizer)
    "default": (r"[\p{P}\$\+<=>\^~\|]+", GPT2_WORDS, r"\p{N}+", "[0-9][0-9][0-9]"),
}
# the Llama 3 family's names: whole words found in the vocabulary skip the merges, and a prompt begins with BOS
LLAMA3_NAMES = ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2")
# what transformers' reading splits as llama.cpp does: its own table of splits, and GPT-2's words (its default)
SPLIT_BY_TRANSFORMERS = (
    *LLAMA3_NAMES,
    *("dbrx", "smaug-bpe", "tekken", "qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "qwen35"),
    *("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"),
    *("gpt-2", "phi-2", "olmo", "jais", "trillion", "exaone4", "gigachat", "a.x-4.0", "mellum"),
)
IGNORE_MERGES = (*LLAMA3_NAMES, "tekken", "glm4", "glm5")
BOS_BY_DEFAULT = (*LLAMA3_NAMES, "tekken", "chameleon")
NEVER_BOS = ("chatglm-bpe", "glm4", "glm5")  # llama.cpp clears their BOS whatever the file says


def split_as_llama_cpp(backend, pre: str | None) -> None:
    """A byte-level BPE tokenizer's (tokenizers') pre-tokenizer as llama.cpp's named `pre`; refused where unknown."""
    from tokenizers import Regex, pre_tokenizers

    pre = pre or "default"
    if pre in SPLIT_BY_TRANSFORMERS:
        return
    if pre not in SPLITS:
        raise SpecDecodeError(
            f"this GGUF's vocabulary splits words by llama.cpp's {pre!r} pre-tokenizer, which specdecode does not "
            f"implement (supported: {', '.join(sorted({*SPLIT_BY_TRANSFORMERS, *SPLITS}))}); it is refused rather "
            "than encoded otherwise than the model was trained on"
        )
    splits = [pre_tokenizers.Split(Regex(expression), behavior="isolated") for expression in SPLITS[pre]]
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
