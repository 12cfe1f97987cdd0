"""GRPO (group-relative policy optimisation; Shao et al., 2024, "DeepSeekMath"): learning from a checker. The
path of one step, each hop a function of this module or of gptkit/objectives/grpo_rollouts.py:

    prompts  --grpo_rollouts.draw-->  n replies each (the serving engine, the model's current weights)
             --checker-->        a reward per reply (gptkit/checker.py)
             --group_advantages-->  A = (reward - the group's mean) / (the group's std + 1e-4)
             --grpo_loss-->      the clipped policy-gradient loss on the reply tokens   --> backward

The loss. For reply i of a prompt's group and each of its tokens t (the prompt and the padding are masked out),
with lp the token's log-probability under the model being trained, old its log-probability under the model
that drew the rollouts, ref under the starting model, r = exp(lp - old) and eps = grpo_clip:

    per token   l = -( min(r A, clip(r, 1 - eps, 1 + eps) A)  -  kl_coef (exp(ref - lp) - (ref - lp) - 1) )

(the KL term is the paper's unbiased, always positive estimator of KL(model || start), "k3"). A step takes one
optimizer update per batch of rollouts, so old is the model itself (r = 1 in value, its gradient that of lp):
the clipped surrogate then is the plain policy gradient A * grad lp; clipping acts, and the clip fraction
leaves 0, only when old differs (dropout on, or log-probabilities given from an earlier model).

Averaging (`grpo_averaging`):
    "token"     (the default) the sum over every reply token of the micro-batch / the number of those tokens:
                every token weighs the same, so a long reply is not worth less per token than a short one
                (DAPO's and Dr. GRPO's answer to the paper's length bias: with the per-sequence mean a wrong
                reply is punished less the longer it rambles);
    "sequence"  the paper's: each reply's mean over its tokens, then the mean over the replies.

Groups whose replies all earned the same reward (all right, all wrong) have A = 0 for every reply: no
gradient from them; their share is logged (no_signal) so that a run whose prompts are all too easy or too hard
says so instead of looking merely slow.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from gptkit import lora
from gptkit.errors import UserError
from gptkit.objectives.base import evaluating

AVERAGING = ("token", "sequence")
STD_EPS = 1e-4  # added to a group's std: a group of nearly equal rewards gets large advantages, not infinite


class GRPOError(UserError):
    """Bad GRPO settings, or a run GRPO cannot take."""


@dataclass(frozen=True)
class GRPOSettings:
    n: int = 8  # replies drawn per prompt (the group)
    clip: float = 0.2  # eps: the ratio exp(lp - old) is clipped to [1 - eps, 1 + eps]
    kl: float = 0.0  # kl_coef: the weight of the KL penalty to the starting model (0: none, nothing computed)
    averaging: str = "token"  # "token" or "sequence" (the module's docstring)

    def __post_init__(self):
        if not (isinstance(self.n, int) and self.n >= 2):
            raise GRPOError(f"grpo_n must be an integer >= 2 (the replies per prompt compared with each other), "
                            f"got {self.n!r}")
        if not (isinstance(self.clip, (int, float)) and 0 < self.clip < 1):
            raise GRPOError(f"grpo_clip must be in (0, 1), got {self.clip!r} (0.2 is usual)")
        if not (isinstance(self.kl, (int, float)) and math.isfinite(self.kl) and self.kl >= 0):
            raise GRPOError(f"grpo_kl must be a number >= 0 (0: no KL penalty), got {self.kl!r}")
        if self.averaging not in AVERAGING:
            raise GRPOError(f"grpo_averaging must be one of {', '.join(AVERAGING)}, got {self.averaging!r}")


def group_advantages(rewards: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """rewards (G * n,), each group's n replies together -> (advantages (G * n,), the groups with no signal
    (0-d: their rewards all equal)). Within a group: (reward - mean) / (std + STD_EPS), std the sample
    standard deviation (n - 1 in the denominator, as TRL's GRPOTrainer)."""
    grouped = rewards.float().view(-1, n)
    mean, std = grouped.mean(1, keepdim=True), grouped.std(1, keepdim=True)
    advantages = (grouped - mean) / (std + STD_EPS)
    flat = (grouped == grouped[:, :1]).all(1)
    advantages = torch.where(flat[:, None], torch.zeros_like(advantages), advantages)  # exactly 0, no rounding
    return advantages.flatten(), flat.sum().float()


def token_logps(model: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A head_loss (model.py's forward hook): each position's log-probability of its target, (B, T) float32,
    0 where the target is -1. The logits of the micro-batch are made whole, in float32: GRPO's replies are
    short, and a task's model small (a GPT-2-sized vocabulary: 200 KB a token)."""
    logits = model.head(hidden).float()
    picked = logits.gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    return (picked - torch.logsumexp(logits, -1)) * (targets != -1)


def policy_token_logps(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(B, T): the model's log-probability of each target token (through the forward: any wrapper works)."""
    return model(x, y, head_loss=token_logps)[1]


def grpo_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              settings: GRPOSettings, ref_logps: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The micro-batch's loss from its token log-probabilities (B, T) (old_logps and ref_logps detached), each
    reply's advantage (B,) and the mask of its reply tokens (B, T); and its metrics (detached): kl (the mean
    per-token estimate; 0 without a reference) and clip_fraction (the share of reply tokens whose ratio the
    clipping held: it took the gradient away)."""
    mask = mask.float()
    ratio = torch.exp(logps - old_logps)
    a = advantages[:, None].float()
    unclipped, clipped = ratio * a, ratio.clamp(1 - settings.clip, 1 + settings.clip) * a
    per_token = -torch.minimum(unclipped, clipped)
    kl = torch.zeros_like(logps)
    if ref_logps is not None and settings.kl:
        d = ref_logps - logps
        kl = torch.exp(d) - d - 1
        per_token = per_token + settings.kl * kl
    tokens = mask.sum().clamp(min=1)
    if settings.averaging == "token":
        loss = (per_token * mask).sum() / tokens
    else:
        loss = ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()
    held = (clipped < unclipped).float()  # min() took the clipped term: the ratio is out of range
    metrics = {"kl": ((kl * mask).sum() / tokens).detach(), "clip_fraction": ((held * mask).sum() / tokens).detach()}
    return loss, metrics


@dataclass
class RolloutBatch:
    """A micro-batch of rollouts: x (B, T) prompt + reply tokens, y (B, T) the next tokens with -1 on the
    prompt and the padding (so y != -1 is the reply mask), each reply's advantage (B,), and for the log its
    reward (B,), its length in tokens (B,) and the share of the step's groups with no signal (0-d, the same on
    every micro-batch of the step). old_logps (B, T): the drawing model's, or None (the model itself, detached)."""

    x: torch.Tensor
    y: torch.Tensor
    advantages: torch.Tensor
    rewards: torch.Tensor
    lengths: torch.Tensor
    no_signal: torch.Tensor
    old_logps: torch.Tensor | None = None


class AdapterOffReference:
    """The starting model of a LoRA run: the model itself with its adapters off, in eval mode (no copy)."""

    def __init__(self, model: nn.Module):
        if not lora.trains_adapters_only(model):
            raise GRPOError("the adapters-off reference needs a model whose LoRA adapters are all it trains")

    @torch.no_grad()
    def logps(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with lora.adapters_off(model), evaluating(model):
            return policy_token_logps(model, x, y)


class CopyReference:
    """The starting model of a full fine-tune: a frozen copy of its weights, made when the run starts (the
    weights once more on the device for the whole run: the price of grpo_kl > 0 without LoRA)."""

    def __init__(self, model: nn.Module):
        self.model = copy.deepcopy(model).eval().requires_grad_(False)

    @torch.no_grad()
    def logps(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return policy_token_logps(self.model, x, y)


class GRPOObjective:
    """What the training step calls on each micro-batch of rollouts: (loss, metrics). `reference`: None, or
    something with logps(model, x, y) -> (B, T) token log-probabilities of the starting model (no gradient)."""

    metric_names = ("reward", "no_signal", "reply_tokens", "kl", "clip_fraction")

    def __init__(self, settings: GRPOSettings, reference=None):
        self.settings, self.reference = settings, reference

    def __call__(self, model: nn.Module, batch: RolloutBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logps = policy_token_logps(model, batch.x, batch.y)
        old = logps.detach() if batch.old_logps is None else batch.old_logps
        ref = None
        if self.reference is not None and self.settings.kl:
            ref = self.reference.logps(model, batch.x, batch.y)
        loss, metrics = grpo_loss(logps, old, batch.advantages, batch.y != -1, self.settings, ref)
        metrics.update(reward=batch.rewards.float().mean(), no_signal=batch.no_signal.float(),
                       reply_tokens=batch.lengths.float().mean())
        return loss, metrics
