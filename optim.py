"""The optimizer and its learning-rate schedule.

    optimizer = make_optimizer(model, cfg, device_type)
    lr = set_lr(optimizer, step, cfg)        # every step, before the update
"""

from __future__ import annotations

import math

import torch

from config import TrainConfig


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, device_type: str) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices (linear weights, embeddings) only, not on biases and gains."""
    params = [p for p in model.parameters() if p.requires_grad]  # the tied wte/lm_head weight appears once
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # The fused CUDA kernel updates all parameters in a few launches instead of several per tensor.
    extra = {"fused": True} if device_type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), **extra)


def get_lr(step: int, cfg: TrainConfig) -> float:
    """Linear warmup (never 0, even at step 0), then cosine decay from learning_rate to min_lr."""
    if not cfg.decay_lr:
        return cfg.learning_rate
    if step < cfg.warmup_iters:
        return cfg.learning_rate * (step + 1) / (cfg.warmup_iters + 1)
    if step >= cfg.lr_decay_iters:
        return cfg.min_lr
    progress = (step - cfg.warmup_iters) / max(1, cfg.lr_decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.learning_rate - cfg.min_lr)


def set_lr(optimizer: torch.optim.Optimizer, step: int, cfg: TrainConfig) -> float:
    """Set every group's learning rate for `step`; returns it."""
    lr = get_lr(step, cfg)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr
