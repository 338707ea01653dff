"""A draft's vocabulary against its target's: the same ids required, and a draft's LM head cut to the ids most used."""

from __future__ import annotations

import torch

from ..errors import SpecDecodeError
from ..models.loader import LoadedModel


def check_same_vocabulary(
    target: LoadedModel,
    draft_name: str,
    draft_tokenizer,
    hint: str = "pick a draft from the target's model family, or use --ngram",
) -> None:
    """A draft model proposes token ids, so it must read and write the target's."""
    if target.tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise SpecDecodeError(
            f"draft {draft_name!r} and target {target.name!r} have different vocabularies: the draft's is "
            f"{describe_tokenizer(draft_tokenizer)}, the target's {describe_tokenizer(target.tokenizer)}; {hint}"
        )


def describe_tokenizer(tokenizer) -> str:
    """ "byte-level BPE (qwen2), 151,665 tokens": which tokenizer, in a user's words."""
    kind = getattr(tokenizer, "kind", None)
    return f"{kind + ', ' if kind else ''}{tokenizer.vocab_size:,} tokens"


def restrict_draft_vocab(draft: LoadedModel, size: int) -> None:
    """Keep the draft LM head's `size` lowest token ids (byte-level BPE ranks ≈ frequency) plus the
    special tokens. The draft stays a valid proposer (q = 0 elsewhere), so verification stays lossless;
    the head of a 0.5B draft is ~25% of its weights, so this cuts the draft's step cost."""
    vocab = draft.config.vocab_size
    if size >= vocab:
        return
    draft.model.restrict_vocab(in_row_groups(torch.arange(size), draft.tokenizer.special_ids, vocab))


def in_row_groups(ids: torch.Tensor, special_ids, vocab_size: int) -> torch.Tensor:
    """A draft vocabulary: `ids` plus the special tokens, rounded up to whole 16-row groups with the
    lowest remaining ids, so that a 4-bit LM head stays in its kernel's format. Sorted."""
    special = torch.tensor([i for i in sorted(special_ids) if i < vocab_size], dtype=torch.long)
    ids = torch.unique(torch.cat([ids.long(), special]))
    rest = torch.arange(vocab_size)
    rest = rest[~torch.isin(rest, ids)][: min(vocab_size, -(-len(ids) // 16) * 16) - len(ids)]
    return torch.unique(torch.cat([ids, rest]))
