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

from ..models.draft_head import DraftHead
from ..models.runtime import Linear, RMSNorm
from .data import FeatureSet


@dataclass
class Recipe:
    steps: int = 600
    batch: int = 4  # chunks per step
    lr: float = 1e-3
    warmup: int = 30
    regression_weight: float = 1.0
    feature_noise: float = 0.05  # relative Gaussian noise on input features: drafting reads estimates
    seed: int = 0


def trainable(head: DraftHead) -> DraftHead:
    """The head with float, differentiable copies of the target's frozen parts (its norm and LM head rows
    may run on kernels that have no backward)."""
    norm = RMSNorm(head.norm.weight.shape[0], head.norm.eps)
    norm.weight = nn.Parameter(head.norm.weight.detach().float().clone(), requires_grad=False)
    lm_head = Linear(head.cfg.hidden_size, len(head.vocab_ids), bias=False)
    weight = head.lm_head.dequantize() if hasattr(head.lm_head, "dequantize") else head.lm_head.weight
    lm_head.weight = nn.Parameter(weight.detach().float().clone(), requires_grad=False)
    head.norm, head.lm_head = norm, lm_head
    for name, p in head.named_parameters():
        p.requires_grad_(name.split(".")[0] in DraftHead.OWNED)
    return head.train()


def head_losses(head: DraftHead, tokens: torch.Tensor, hidden: torch.Tensor,
                noise: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(soft cross-entropy, regression, top-1 agreement) over rows p = 0 .. T-2 of a batch of chunks."""
    tokens, hidden = tokens.to(head.device), hidden.to(head.device)
    features = hidden[:, :-1].float()
    if noise:
        features = features + noise * features.std(-1, keepdim=True) * torch.randn_like(features)
    logits, predicted = head(tokens[:, 1:], None, None, return_hidden=True, features=features)
    truth = hidden[:, 1:].reshape(-1, hidden.shape[-1]).float()
    with torch.no_grad():
        target_logp = F.log_softmax(head.lm_head(head.norm(truth)), -1)
    logp = F.log_softmax(logits, -1)
    soft_ce = -(target_logp.exp() * logp).sum(-1).mean()
    regression = F.smooth_l1_loss(head.norm(predicted), head.norm(truth))
    agree = (logits.argmax(-1) == target_logp.argmax(-1)).float().mean()
    return soft_ce, regression, agree


def evaluate(head: DraftHead, data: FeatureSet, batch: int = 4) -> float:
    """Top-1 agreement with the target's choice over the draft vocabulary on held-out chunks: the
    first-position acceptance of greedy drafting, where the target's choice is in the draft vocabulary."""
    head.eval()
    agree, n = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(data), batch):
            _, _, a = head_losses(head, data.tokens[i:i + batch], data.hidden[i:i + batch])
            rows = data.tokens[i:i + batch].shape[0]
            agree, n = agree + float(a) * rows, n + rows
    head.train()
    return agree / max(n, 1)


def train(head: DraftHead, data: FeatureSet, recipe: Recipe, checkpoint: str | None = None,
          progress: bool = True) -> list[dict]:
    """Train in place; every 50 steps the head and optimizer go to `checkpoint`, from which a rerun resumes."""
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=recipe.lr, betas=(0.9, 0.95), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / recipe.warmup) * 0.5 *
                                                 (1 + math.cos(math.pi * min(s, recipe.steps) / recipe.steps)))
    step, log = 0, []
    if checkpoint and os.path.exists(checkpoint):
        state = torch.load(checkpoint)
        head.load_state_dict(state["head"], strict=False)
        opt.load_state_dict(state["opt"])
        schedule.load_state_dict(state["schedule"])
        step, log = state["step"], state["log"]
    gen = torch.Generator().manual_seed(recipe.seed + step)
    bar = tqdm(total=recipe.steps, initial=step, desc="training head", unit="step", disable=not progress)
    while step < recipe.steps:
        pick = torch.randint(len(data), (recipe.batch,), generator=gen)
        soft_ce, regression, agree = head_losses(head, data.tokens[pick], data.hidden[pick], recipe.feature_noise)
        loss = soft_ce + recipe.regression_weight * regression
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        schedule.step()
        step += 1
        log.append({"step": step, "ce": soft_ce.item(), "reg": regression.item(), "agree": agree.item(),
                    "t": time.time()})
        bar.update(1)
        bar.set_postfix(ce=f"{log[-1]['ce']:.3f}", agree=f"{log[-1]['agree']:.2f}")
        if checkpoint and (step % 50 == 0 or step == recipe.steps):
            torch.save({"head": head.owned_state(), "opt": opt.state_dict(), "schedule": schedule.state_dict(),
                        "step": step, "log": log}, checkpoint + ".tmp")
            os.replace(checkpoint + ".tmp", checkpoint)
    bar.close()
    return log
