"""Fill in the middle: a code model given the text before a gap and after it, in its FIM tokens, generates the gap
(OpenAI's `suffix`, llama.cpp's /infill). The tokens are found by their spellings, as llama.cpp finds them where a
GGUF file names none (the ids a file names are not read); the prompt is prefix-suffix-middle, as llama.cpp lays
it out."""

from __future__ import annotations

from collections.abc import Callable

from ..errors import SpecDecodeError

# Each family's prefix, suffix and middle tokens, as llama.cpp looks them up where a GGUF file names none
TRIPLES = {
    "Qwen2.5-Coder": ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    "StarCoder, Granite": ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    "SantaCoder": ("<fim-prefix>", "<fim-suffix>", "<fim-middle>"),
    "DeepSeek-Coder": ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
    "CodeLlama": ("▁<PRE>", "▁<SUF>", "▁<MID>"),
    "CodeLlama, as some GGUF files spell them": ("<PRE>", "<SUF>", "<MID>"),
    "GLM-4.5": ("<|code_prefix|>", "<|code_suffix|>", "<|code_middle|>"),
}
# A FIM model's padding and its repository and file separators end generation (llama.cpp's end-of-generation ids):
# past the gap a model trained on whole repositories goes on to another file
ENDS = (
    *("<|fim_pad|>", "<fim-pad>", "<fim_pad>"),
    *("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<reponame>"),
    "<|file_sep|>",
)


def fim_ids(id_of: Callable[[str], int | None]) -> dict[str, int] | None:
    """The prefix, suffix and middle tokens' ids of the first family whose three the vocabulary holds (id_of: a
    spelling's id, None where the vocabulary has none), or None."""
    for triple in TRIPLES.values():
        ids = [id_of(spelling) for spelling in triple]
        if None not in ids:
            return dict(zip(("prefix", "suffix", "middle"), ids))
    return None


def infill_ids(tokenizer, prefix: str | list[int], suffix: str | list[int]) -> list[int]:
    """The prompt whose continuation fills the gap between prefix and suffix (text, or token ids as they are): the
    model's BOS where it wants one, then prefix, suffix and middle, each after its FIM token."""
    ids = getattr(tokenizer, "fim_ids", None)  # a tokenizer of the engine's own (Tokenizer) finds them
    if ids is None:
        raise SpecDecodeError(
            f"this model has no fill-in-the-middle tokens (such as {', '.join(TRIPLES['Qwen2.5-Coder'])}); leave suffix"
            " out, or use a code model trained to fill in (Qwen2.5-Coder, StarCoder, DeepSeek-Coder)"
        )
    bos = getattr(tokenizer, "bos_id", None)
    before, after = (
        _without_bos(part if isinstance(part, list) else tokenizer.encode(part), bos) for part in (prefix, suffix)
    )
    return [*([] if bos is None else [bos]), ids["prefix"], *before, ids["suffix"], *after, ids["middle"]]


def _without_bos(ids: list[int], bos: int | None) -> list[int]:
    """A part's tokens without the BOS that encode() puts first where the model wants one: it goes before the FIM
    prefix token, once."""
    return ids[1:] if bos is not None and ids[:1] == [bos] else ids
