"""Training a draft head on recorded target features (EAGLE's objective).

Row p reads the target's features at p and token p + 1; its output is trained toward the target's
features at p + 1 (a smooth-L1 regression after the target's final norm) and, through the target's own
norm and LM head rows of the draft vocabulary, toward the target's next-token distribution there (soft
cross-entropy). The target's parts stay frozen, in float32, so gradients reach the head only."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from ..executor.backends import resolve_dtype
from ..models.draft_head import DraftHead
from ..models.layers import Linear, softcapped
from .data import FeatureSet
from .recipe import Recipe


def trainable(head: DraftHead) -> DraftHead:
    """The head with float, differentiable copies of the target's frozen parts (its norm and LM head rows
    may run on kernels that have no backward)."""
    norm = type(head.norm)(head.norm.weight.shape[0], head.norm.eps)  # the target's kind: RMSNorm or LayerNorm
    norm.weight = nn.Parameter(head.norm.weight.detach().float().clone(), requires_grad=False)
    lm_head = Linear(head.cfg.hidden_size, len(head.vocab_ids), bias=False)
    weight = head.lm_head.dequantize() if hasattr(head.lm_head, "dequantize") else head.lm_head.weight
    lm_head.weight = nn.Parameter(weight.detach().float().clone(), requires_grad=False)
    head.norm, head.lm_head = norm, lm_head
    for name, p in head.named_parameters():
        p.requires_grad_(name.split(".")[0] in DraftHead.OWNED)
    return head.train()


def head_losses(
    head: DraftHead, tokens: torch.Tensor, hidden: torch.Tensor, noise: float = 0.0, steps: int = 1
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per drafting round (see DraftHead.unrolled): (soft cross-entropy, regression, top-1 agreement) over
    the rows p = round .. T-2 of a batch of chunks, each row's truth the target's at p + 1."""
    tokens, hidden = tokens.to(head.device), hidden.to(head.device)
    features = hidden[:, :-1].float()
    if noise:
        features = features + noise * features.std(-1, keepdim=True) * torch.randn_like(features)
    truth = hidden[:, 1:].float()
    with torch.no_grad():
        truth_logits = head.lm_head(head.norm(truth.reshape(-1, truth.shape[-1])))
        target_logp = F.log_softmax(softcapped(truth_logits, head.final_softcap), -1)
    width = truth.shape[1]
    losses = []
    for step, (logits, predicted) in enumerate(head.unrolled(tokens[:, 1:], features, steps)):
        valid = (torch.arange(width, device=head.device) >= step).repeat(truth.shape[0])
        logp = F.log_softmax(logits[valid], -1)
        soft_ce = -(target_logp[valid].exp() * logp).sum(-1).mean()
        regression = F.smooth_l1_loss(head.norm(predicted[valid]), head.norm(truth.reshape(-1, truth.shape[-1])[valid]))
        agree = (logp.argmax(-1) == target_logp[valid].argmax(-1)).float().mean()
        losses.append((soft_ce, regression, agree))
    return losses


def evaluate(head: DraftHead, data: FeatureSet, steps: int = 1, batch: int = 4) -> list[float]:
    """Top-1 agreement with the target's choice over the draft vocabulary on held-out chunks, per drafting
    round: the acceptance of greedy drafting at each position given the previous ones accepted, where the
    target's choice is in the draft vocabulary."""
    head.eval()
    agree, n = [0.0] * steps, 0
    with torch.no_grad():
        for i in range(0, len(data), batch):
            rows = data.tokens[i : i + batch].shape[0]
            for step, (_, _, a) in enumerate(
                head_losses(head, data.tokens[i : i + batch], data.hidden[i : i + batch], steps=steps)
            ):
                agree[step] += float(a) * rows
            n += rows
    head.train()
    return [a / max(n, 1) for a in agree]


def training_precision(device: torch.device):
    """bf16 autocast where matmuls run natively in bf16 (CUDA; CPUs with AVX512-BF16 or AMX: a training
    step there takes half the time or less), float32 elsewhere. Weights and optimizer state stay float32."""
    native = resolve_dtype("auto", device) == torch.bfloat16
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=native)


# a killed run loses at most this much training; on a GPU a step takes milliseconds, and saving the
# optimizer's state every few steps would take longer than the steps
CHECKPOINT_SECONDS = 30.0


@dataclass
class Run:
    """One training run's schedule: AdamW, linear warm-up then cosine decay to zero, random batches."""

    steps: int
    batch: int
    lr: float
    warmup: int
    seed: int
    name: str  # for the progress bar
    deadline: float | None = None  # a time.time() by which to end: steps shrink to what the rest's pace allows

    def shorten(self, step: int, seconds_per_step: float, now: float) -> None:
        """Fewer steps in all where the rest would end past the deadline (never fewer than taken); the
        cosine schedule follows the new length."""
        affordable = step + int(max(0.0, self.deadline - now) / seconds_per_step)
        self.steps = max(step, min(self.steps, affordable))


def train(
    head: DraftHead,
    data: FeatureSet,
    recipe: Recipe,
    checkpoint: str | None = None,
    progress: bool = True,
    steps: int | None = None,
    deadline: float | None = None,
) -> list[dict]:
    """Train the head in place (see fit) for `steps` (default: the recipe's), ending by `deadline`."""
    steps = steps or recipe.steps

    def batch_loss(pick: torch.Tensor) -> tuple[torch.Tensor, dict]:
        losses = head_losses(head, data.tokens[pick], data.hidden[pick], recipe.feature_noise, recipe.rounds)
        loss = sum(
            recipe.round_decay**i * (ce + recipe.regression_weight * reg) for i, (ce, reg, _) in enumerate(losses)
        )
        return loss, {"ce": losses[0][0].item(), "agree": [a.item() for _, _, a in losses]}

    run = Run(steps, recipe.batch, recipe.lr, recipe.warmup, recipe.seed, "training head", deadline)
    return fit(head, batch_loss, len(data), run, checkpoint, progress)


def fit(
    model: nn.Module, batch_loss, examples: int, run: Run, checkpoint: str | None = None, progress: bool = True
) -> list[dict]:
    """Train `model`'s parameters that require gradients, in place: batch_loss(indices of run.batch
    random examples) -> (loss, figures for the log). Every CHECKPOINT_SECONDS, and at the end, those
    parameters and the optimizer go to `checkpoint`, from which a rerun resumes."""
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(named.values(), lr=run.lr, betas=(0.9, 0.95), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / run.warmup) * 0.5 * (1 + math.cos(math.pi * min(s, run.steps) / run.steps))
    )
    step, log = 0, []
    device = next(iter(named.values())).device
    if checkpoint and os.path.exists(checkpoint):
        state = torch.load(checkpoint, map_location=device)
        model.load_state_dict(state["params"], strict=False)
        opt.load_state_dict(state["opt"])
        schedule.load_state_dict(state["schedule"])
        step, log = state["step"], state["log"]
    gen = torch.Generator().manual_seed(run.seed + step)
    bar = tqdm(total=run.steps, initial=step, desc=run.name, unit="step", disable=not progress)
    precision = training_precision(device)
    paced = None  # (step, time) after this process's first step: the pace is measured from there
    saved = time.time()
    while step < run.steps:
        with precision:
            loss, figures = batch_loss(torch.randint(examples, (run.batch,), generator=gen))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(named.values(), 1.0)
        opt.step()
        schedule.step()
        step += 1
        log.append({"step": step, **figures, "t": time.time()})
        paced = paced or (step, log[-1]["t"])
        if run.deadline is not None and step - paced[0] >= 3:
            run.shorten(step, (log[-1]["t"] - paced[1]) / (step - paced[0]), log[-1]["t"])
            bar.total = run.steps
        bar.update(1)
        bar.set_postfix(
            {k: " ".join(f"{x:.2f}" for x in v) if isinstance(v, list) else f"{v:.3f}" for k, v in figures.items()}
        )
        if checkpoint and (step == run.steps or log[-1]["t"] - saved >= CHECKPOINT_SECONDS):
            saved = log[-1]["t"]
            os.makedirs(os.path.dirname(checkpoint) or ".", exist_ok=True)
            params = {n: p.detach() for n, p in named.items()}
            torch.save(
                {
                    "params": params,
                    "opt": opt.state_dict(),
                    "schedule": schedule.state_dict(),
                    "step": step,
                    "log": log,
                },
                checkpoint + ".tmp",
            )
            os.replace(checkpoint + ".tmp", checkpoint)
    bar.close()
    return log
