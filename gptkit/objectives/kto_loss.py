"""KTO's loss on unpaired rows, as plain functions, and the micro-batch the training step calls (the objective's
data, reference and state: gptkit/objectives/kto.py).

    objective = KTOObjective(KTOSettings(beta=0.1), reference)   # reference: as DPO's (preference_losses.py)
    loss, metrics = objective(model, loader.next_batch())        # a RowBatch (gptkit/data/unpaired.py)

The objective (Ethayarajh et al., 2024, "KTO: Model Alignment as Prospect Theoretic Optimization"), as TRL's
KTOTrainer computes it. A row is a prompt x, one completion y and a label (desirable or undesirable). Its
reward is the log ratio r = log pi(y|x) - log ref(y|x), the log-probabilities summed over the completion's
tokens (prompt, markers and padding masked as DPO masks them). The reference point z is the same log ratio
on mismatched sequences (each row's prompt with another row's completion: the KL sequences,
gptkit/data/unpaired.py), averaged over the micro-batch (and over the processes of a DDP or FSDP training
step), clamped at 0 and detached: an estimate of KL(pi || ref) that no gradient flows through. Then, with
beta (dpo_beta) and the weights lambda_D, lambda_U (kto_desirable_weight, kto_undesirable_weight):

    desirable row:    loss = lambda_D (1 - sigmoid(beta (r - z)))
    undesirable row:  loss = lambda_U (1 - sigmoid(beta (z - r)))

and the micro-batch's loss is the mean over its rows. A desirable row gains by a reward above z, an undesirable
one by a reward below it; rewards far on the right side saturate (the value function's concavity in gains,
convexity in losses). On a task whose rule is one token of a completion the rewards may not find it where
DPO's margins do (BENCHMARKS.md, "KTO on the rule task made unpaired"). TRL clamps each process's mean at 0 before averaging them; this clamps the mean over all
processes (the paper's z; the same on one process). An evaluation's z is each process's own, from its
micro-batch (its processes score different numbers of batches, so no collective runs there).

What a step logs: the loss; kl, z itself (TRL's name); the mean reward beta r of the desirable rows
(chosen_reward, TRL's rewards/chosen) and of the undesirable ones (rejected_reward, rewards/rejected), in
beta x nats (TRL's rewards/margins is their difference, which a mean over batches would not give: subtract
them); the rows' mean log-probabilities by label (chosen_logp, rejected_logp; TRL's logps/chosen,
logps/rejected); desirable, the share of desirable rows; and auc, the share of (desirable, undesirable) row pairs of a micro-batch whose desirable row has the higher
reward, ties counted half (0.5 at step 0, when every reward is 0; 1.0: every desirable row above every
undesirable one). A mean over one label is weighed by that label's rows in the step's and the evaluation's
means (metric_over): NaN ("n/a") only when no micro-batch has a row of it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from gptkit.data.unpaired import RowBatch
from gptkit.objectives.preference_losses import TRL_NAMES, AdapterOffReference, chunked_sequence_logps
from gptkit.settings import KTOSettings


def kto_loss(policy: torch.Tensor, reference: torch.Tensor, policy_kl: torch.Tensor, reference_kl: torch.Tensor,
             desirable: torch.Tensor, settings: KTOSettings,
             mean_over_processes: Callable[[torch.Tensor], torch.Tensor] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row (B,): the loss and the reward beta r (detached, for logging); and z (0-d, detached). policy,
    reference: the rows' log-probabilities of their completions (B,); policy_kl, reference_kl: those of their
    KL sequences (B,); desirable (B,) bool. `mean_over_processes`: the mean of a 0-d tensor over the
    processes of a training step (None: this process alone)."""
    ratio = policy - reference
    kl = (policy_kl - reference_kl).detach().mean()
    if mean_over_processes is not None:
        kl = mean_over_processes(kl)
    z = kl.clamp(min=0)
    beta = settings.beta
    gain = settings.desirable_weight * (1 - torch.sigmoid(beta * (ratio - z)))
    loss = settings.undesirable_weight * (1 - torch.sigmoid(beta * (z - ratio)))
    return torch.where(desirable, gain, loss), beta * ratio.detach(), z


# TRL's names beside ours (DPO's, without rewards/margins; kl is TRL's own name too)
KTO_TRL_NAMES = {trl: ours for trl, ours in TRL_NAMES.items() if trl != "rewards/margins"}


def reward_auc(rewards: torch.Tensor, desirable: torch.Tensor) -> torch.Tensor:
    """The share of (desirable, undesirable) pairs of rows whose desirable row has the higher reward, ties
    counted half (0-d; NaN without a pair)."""
    diff = rewards[:, None] - rewards[None, :]  # [i, j]: row i's reward - row j's
    pairs = (desirable[:, None] & ~desirable[None, :]).float()
    won = (diff > 0).float() + 0.5 * (diff == 0).float()
    return (won * pairs).sum() / pairs.sum()


def row_metrics(losses: torch.Tensor, rewards: torch.Tensor, policy: torch.Tensor, desirable: torch.Tensor,
                z: torch.Tensor) -> dict[str, torch.Tensor]:
    """The means a step logs (the module docstring), as 0-d float32 tensors; TRL's names beside ours."""
    d, u = desirable.float(), (~desirable).float()

    def mean_of(values, part):
        return (values.detach() * part).sum() / part.sum()  # (NaN without a row of that part)

    chosen, rejected = mean_of(rewards, d), mean_of(rewards, u)
    ours = {"kl": z.float(), "chosen_reward": chosen, "rejected_reward": rejected, "chosen_logp": mean_of(policy, d),
            "rejected_logp": mean_of(policy, u), "desirable": d.mean(), "auc": reward_auc(rewards, desirable)}
    return {**ours, **{name: ours[same] for name, same in KTO_TRL_NAMES.items()}}


def _of_desirable(metrics):
    return metrics["desirable"]


def _of_undesirable(metrics):
    return 1 - metrics["desirable"]


def _of_both(metrics):
    return metrics["desirable"] * (1 - metrics["desirable"])  # (in proportion to the batch's row pairs)


# metric -> the share of the micro-batch it is a mean over (gptkit/evaluation.py's and gptkit/step.py's weights)
METRIC_OVER = {"chosen_reward": _of_desirable, "chosen_logp": _of_desirable, "rejected_reward": _of_undesirable,
               "rejected_logp": _of_undesirable, "auc": _of_both}
METRIC_OVER.update({trl: METRIC_OVER[ours] for trl, ours in KTO_TRL_NAMES.items()})


def reference_logps(reference: Any, model: nn.Module, batch: RowBatch) -> torch.Tensor:
    """(2B,) the reference's log-probabilities of the rows' completions, then of their KL sequences': a
    precomputed reference's, read with the batch or looked up; the adapters-off model's, a half at a time (the
    shapes of the policy's forwards, so a compiled model compiles no other)."""
    if isinstance(reference, AdapterOffReference):
        return torch.cat([reference.logps(model, batch.half(kl)) for kl in (False, True)])
    return reference.logps(model, batch)


def sequence_logps_of(model: nn.Module, half) -> torch.Tensor:
    """(B,) each sequence's log-probability of its reply under `model` (chunked, inside its forward)."""
    return model(half.x, half.y, head_loss=chunked_sequence_logps)[1]


def _mean_over_processes(value: torch.Tensor) -> torch.Tensor:
    value = value.clone()
    dist.all_reduce(value)
    return value / dist.get_world_size()


def kto_microbatch(model: nn.Module, batch: RowBatch, reference: Any, settings: KTOSettings, across: bool = False
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one micro-batch of rows (0-d, the mean over its rows) and its metrics. The KL sequences are
    scored by the model without gradients (z is detached), in its current mode, as TRL scores them. `across`
    (a run of several processes): z is the mean over all of them in a training step (a collective in every
    micro-batch, which every process runs alike), each process's own in an evaluation (the model in eval
    mode)."""
    B = len(batch)
    ref = reference_logps(reference, model, batch)  # first: nothing of it stays alive during the policy's forward
    with torch.no_grad():
        policy_kl = sequence_logps_of(model, batch.half(kl=True))
    policy = sequence_logps_of(model, batch.half(kl=False))
    desirable = batch.labels > 0.5
    losses, rewards, z = kto_loss(policy, ref[:B], policy_kl, ref[B:], desirable, settings,
                                  _mean_over_processes if across and model.training else None)
    return losses.mean(), row_metrics(losses, rewards, policy, desirable, z)


@dataclass
class KTOObjective:
    """The micro-batch loss the training step calls in place of the language-model loss: loss, metrics =
    objective(model, batch)."""

    settings: KTOSettings
    reference: Any  # AdapterOffReference, or a precomputed one (kto.py's RowReference)
    across: bool = False  # the run has several processes: a training step's z is their mean (kto_microbatch)
    metric_names = ("kl", "chosen_reward", "rejected_reward", "chosen_logp", "rejected_logp", "desirable", "auc",
                    *KTO_TRL_NAMES)
    metric_over = METRIC_OVER

    def __call__(self, model: nn.Module, batch: RowBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return kto_microbatch(model, batch, self.reference, self.settings, self.across)

    def batch_items(self, batch: RowBatch) -> int:
        """A batch's weight in an evaluation's mean: its rows (gptkit/evaluation.py)."""
        return len(batch)
