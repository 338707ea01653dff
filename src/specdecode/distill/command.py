"""The distill pipeline: target features -> draft vocabulary -> head -> training -> a head file."""

from __future__ import annotations

import os
import time
from dataclasses import asdict

import torch

from ..models.draft_head import HeadSpec, build_head, head_base, read_head, save_head, target_fingerprint
from ..models.loader import LoadedModel
from ..proposers.draft_head import head_path
from .data import collect_features, draft_vocabulary
from .recipe import GENERATION_SHARE, HELD_OUT, RECORDING_SHARE, Recipe, recipe_for
from .train import evaluate, train, trainable


def distill(target: LoadedModel, out: str, recipe: Recipe | None = None, progress: bool = True) -> dict:
    """Train a head for `target` and write it to OUT.safetensors / OUT.json; returns the summary."""
    recipe = recipe or Recipe()
    started = time.time()
    budget = recipe.minutes * 60 if recipe.minutes else None
    data = collect_features(
        target,
        recipe.sources,
        recipe.chunk,
        recipe.tokens,
        progress,
        (recipe.completions, recipe.completion_tokens),
        started + RECORDING_SHARE * budget if budget else None,
        started + GENERATION_SHARE * budget if budget else None,
    )
    collected = time.time()
    # a recording cut short by the budget trains proportionally fewer steps (as many passes over its text)
    steps = max(1, round(recipe.steps * len(data) / data.planned)) if data.planned else recipe.steps
    train_set, held_out = data.split(HELD_OUT)
    torch.manual_seed(recipe.seed)
    head = trainable(_starting_head(target, train_set, recipe))
    spec = HeadSpec(
        target.name,
        target_fingerprint(target.model),
        head.cfg.intermediate_size,
        len(head.vocab_ids),
        recipe=asdict(recipe),
    )
    log = train(
        head, train_set, recipe, head_base(out) + ".ckpt", progress, steps, started + budget if budget else None
    )
    agreement = evaluate(head, held_out, recipe.rounds)
    coverage = float(torch.isin(held_out.choice, head.vocab_ids.cpu()).float().mean())
    spec.measured = {
        "held_out_top1_per_round": agreement,
        "held_out_vocab_coverage": coverage,
        "train_tokens": int(train_set.tokens.numel()),
        "steps": log[-1]["step"] if log else 0,
        "collect_s": collected - started,
        "train_s": time.time() - collected,
        "final_train_ce": log[-1]["ce"] if log else None,
    }
    save_head(head, spec, out)
    if os.path.exists(head_base(out) + ".ckpt"):
        os.remove(head_base(out) + ".ckpt")
    return spec.measured


def _starting_head(target: LoadedModel, train_set, recipe: Recipe):
    """The head that training starts from: `recipe.init`'s (refused if made for another target), else a
    fresh one over the draft vocabulary of the training text."""
    if recipe.init:
        spec, tensors = read_head(head_path(recipe.init))
        return build_head(spec, tensors, target.model)
    vocab = draft_vocabulary(train_set, recipe.draft_vocab_size, target.tokenizer.special_ids, target.config.vocab_size)
    spec = HeadSpec(target.name, target_fingerprint(target.model), recipe.intermediate_size, len(vocab))
    return build_head(spec, None, target.model, vocab)


def run_distill_cli(args) -> int:
    import json

    from ..models.loader import load_model
    from ..models.lora import Adapter

    adapters = [Adapter.parse(spec) for spec in args.lora]
    target = load_model(args.model, args.device, "auto", True, args.quantization, lora=adapters)
    recipe = recipe_for(
        target.model.device.type,
        sources=args.data,
        tokens=args.tokens,
        completions=args.completions,
        completion_tokens=args.completion_tokens,
        chunk=args.chunk,
        steps=args.steps,
        batch=args.batch,
        lr=args.lr,
        draft_vocab_size=args.draft_vocab_size,
        intermediate_size=args.intermediate_size,
        init=args.init,
        finetune_steps=args.finetune_steps,
        finetune_lr=args.finetune_lr,
        minutes=args.minutes,
    )
    if args.draft_model:
        from .draft_model import finetune_draft

        print(json.dumps(finetune_draft(target, args.draft_model, args.out, recipe), indent=1))
        print(f"wrote the folder {args.out}; use it with --draft {args.out}")
        return 0
    summary = distill(target, args.out, recipe)
    print(json.dumps(summary, indent=1))
    if summary["steps"] < recipe.steps:
        print(
            f"the {recipe.minutes:g}-minute budget left time for {summary['train_tokens']:,} tokens of training text "
            f"and {summary['steps']} of {recipe.steps} steps on this machine; --minutes 0 runs the whole recipe"
        )
    print(f"wrote {head_base(args.out)}.safetensors and .json; use it with --draft head:{head_base(args.out)}")
    return 0
