"""Tokenizer and chat template, from a GGUF file's metadata or a tokenizer.json folder (via transformers)."""
from __future__ import annotations

import os
import warnings

from ..errors import SpecDecodeError


class Tokenizer:
    def __init__(self, hf_tokenizer, extra_eos: tuple[int, ...] = ()):
        self.hf = hf_tokenizer
        eos = {hf_tokenizer.eos_token_id, *extra_eos}
        for name in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>"):
            tid = hf_tokenizer.convert_tokens_to_ids(name)
            if isinstance(tid, int) and tid != hf_tokenizer.unk_token_id:
                eos.add(tid)
        self.eos_token_ids = frozenset(t for t in eos if t is not None)

    @property
    def special_ids(self) -> set[int]:
        return set(self.hf.all_special_ids) | set(self.hf.added_tokens_decoder) | set(self.eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def get_vocab(self) -> dict[str, int]:
        return self.hf.get_vocab()

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict]) -> str:
        if not self.hf.chat_template:
            raise SpecDecodeError("this model has no chat template; pass plain prompts instead of --chat/llm.chat")
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    @classmethod
    def from_gguf(cls, path: str, cache_dir: str) -> "Tokenizer":
        """Building a tokenizer from GGUF metadata takes seconds; the result is saved and reused."""
        from transformers import AutoTokenizer

        if os.path.exists(os.path.join(cache_dir, "tokenizer_config.json")):
            return cls(AutoTokenizer.from_pretrained(cache_dir))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                                gguf_file=os.path.basename(path))
        tok.save_pretrained(cache_dir)
        return cls(tok)

    @classmethod
    def from_pretrained(cls, folder: str) -> "Tokenizer":
        import json

        from transformers import AutoTokenizer

        extra: tuple[int, ...] = ()
        gen_cfg = os.path.join(folder, "generation_config.json")
        if os.path.exists(gen_cfg):
            eos = json.load(open(gen_cfg)).get("eos_token_id")
            extra = tuple(eos) if isinstance(eos, list) else (eos,) if isinstance(eos, int) else ()
        return cls(AutoTokenizer.from_pretrained(folder), extra)
