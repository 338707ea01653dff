"""A small draft model fine-tuned on the target's own outputs: the seed's recipe, beside the draft head
for comparison. It learns from the same recording as a head (the target's greedy next token at every
position of the distill text), by cross-entropy of its own next-token distribution against that token.
Its decoder layers are trained; the embeddings and LM head (a third of a 0.5B model's weights, and the
costliest gradients) stay as they are. The result is a Hugging Face checkpoint folder, which loads as
a draft like any other (`--draft FOLDER`) and is quantized for drafting the same way."""

from __future__ import annotations

import json
import os
import time

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..models.families import llama_config_fields
from ..models.loader import LoadedModel, load_tokenizer, load_weights
from ..proposers.vocabulary import check_same_vocabulary
from .data import FeatureSet, collect_features
from .recipe import HELD_OUT, Recipe
from .train import Run, fit

FROZEN = ("model.embed_tokens.", "lm_head.")


def causal_lm(cfg: ModelConfig, weights: dict[str, torch.Tensor]):
    """A trainable transformers model of this architecture holding these (Hugging Face-named) weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..errors import SpecDecodeError

    if not cfg.is_llama_or_qwen2:
        raise SpecDecodeError(
            f"fine-tuning a draft model rebuilds it in transformers as a Llama or Qwen2 model; this "
            f"draft is a {cfg.arch} model: train a draft head instead (`specdecode distill`)"
        )
    hf_config = AutoConfig.for_model(
        cfg.arch,
        **llama_config_fields(cfg),
        tie_word_embeddings=cfg.tie_word_embeddings,
        attention_bias=cfg.qkv_bias,
        **({"head_dim": cfg.head_dim} if cfg.head_dim else {}),
    )
    model = AutoModelForCausalLM.from_config(hf_config).float()
    model.load_state_dict(weights, strict=not cfg.tie_word_embeddings)
    return model


def agreement(model, data: FeatureSet, batch: int = 4) -> float:
    """Top-1 agreement of the model's next token with the target's choice over every position of the
    chunks (teacher-forced: what greedy drafting of one token would have accepted)."""
    model.eval()
    agree, device = 0.0, model.device
    with torch.no_grad():
        for i in range(0, len(data), batch):
            logits = model(data.tokens[i : i + batch].to(device)).logits
            agree += float((logits.argmax(-1) == data.choice[i : i + batch].to(device)).float().sum())
    model.train()
    return agree / max(data.choice.numel(), 1)


def finetune_draft(
    target: LoadedModel, draft: str, out: str, recipe: Recipe | None = None, progress: bool = True
) -> dict:
    """Fine-tune the model `draft` (a name, file or folder) on `target`'s recorded outputs and write it to
    the folder `out`; returns the summary (also in out/distill.json)."""
    recipe = recipe or Recipe()
    started = time.time()
    tokenizer = load_tokenizer(draft)
    check_same_vocabulary(
        target,
        draft,
        tokenizer,
        "pick a draft model from the target's family (e.g. qwen2.5-coder-0.5b for qwen2.5-coder-1.5b)",
    )
    data = collect_features(
        target, recipe.sources, recipe.chunk, recipe.tokens, progress, (recipe.completions, recipe.completion_tokens)
    )
    train_set, held_out = data.split(HELD_OUT)
    cfg, weights = load_weights(draft, torch.float32, progress)
    model = causal_lm(cfg, weights).to(target.model.device)  # trains where the target runs (CUDA too)
    del weights
    collected = time.time()
    before = agreement(model, held_out)
    for name, p in model.named_parameters():
        p.requires_grad_(not name.startswith(FROZEN))

    def batch_loss(pick: torch.Tensor) -> tuple[torch.Tensor, dict]:
        logits = model(train_set.tokens[pick].to(model.device)).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), train_set.choice[pick].flatten().to(model.device))
        return loss, {"ce": loss.item()}

    run = Run(recipe.finetune_steps, recipe.batch, recipe.finetune_lr, recipe.warmup, recipe.seed, "fine-tuning draft")
    checkpoint = os.path.join(out, "training.ckpt")
    log = fit(model, batch_loss, len(train_set), run, checkpoint, progress)
    summary = {
        "draft": draft,
        "target": target.name,
        "recipe": vars(recipe),
        "held_out_top1_before": before,
        "held_out_top1_after": agreement(model, held_out),
        "train_tokens": int(train_set.tokens.numel()),
        "prepare_s": collected - started,
        "train_s": time.time() - collected,
        "final_train_ce": log[-1]["ce"] if log else None,
    }
    _save(model, tokenizer, out, summary)
    if os.path.exists(checkpoint):
        os.remove(checkpoint)
    return summary


def _save(model, tokenizer, out: str, summary: dict) -> None:
    """The weights in bfloat16 (half the bytes; drafting quantizes them further), the draft's tokenizer."""
    os.makedirs(out, exist_ok=True)
    model.to("cpu", torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tokenizer.hf.save_pretrained(out)
    with open(os.path.join(out, "distill.json"), "w") as f:
        json.dump(summary, f, indent=1)
