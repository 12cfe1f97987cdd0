"""DPO: tuning a chat model on preference pairs against the model it started from, as plain functions; its
reference log-probabilities; and scoring pairs with any model (eval.py --task preference).

    objective = DPOObjective(DPOSettings(beta=0.1), AdapterOffReference(model))     # LoRA
    objective = DPOObjective(settings, PrecomputedReference.compute(model, "data/mypairs", block_size=1024,
                                                                  batch_size=8))    # a full fine-tune
    loss, metrics = objective(model, loader.next_batch())     # one micro-batch: what the training step calls

The objective (Rafailov et al., 2023, "Direct Preference Optimization"). For a pair (a prompt, a chosen and a
rejected reply), pi_c and pi_r are the log-probabilities of the two replies given the prompt under the model
being tuned, summed over the reply tokens, and ref_c, ref_r the same under the reference model; n_c and n_r
the replies' token counts. With h = (pi_c - ref_c) - (pi_r - ref_r), the losses by TRL's names (`dpo_loss`):

    "sigmoid" (DPO):  loss = -log sigmoid(beta h)
                      with label_smoothing e (conservative DPO: e is the share of pairs assumed mislabelled)
                      loss = -(1 - e) log sigmoid(beta h) - e log sigmoid(-beta h)
    "hinge" (SLiC, Zhao et al., 2023):  loss = max(0, 1 - beta h)
    "robust" (Chowdhury et al., 2024, "Provably robust DPO"): unbiased under a share e of flipped labels,
                      loss = ((1 - e) (-log sigmoid(beta h)) - e (-log sigmoid(-beta h))) / (1 - 2e)
    "ipo" (Azar et al., 2023):  loss = (h - 1 / (2 beta))^2, on the summed log-probabilities as in the paper
    "ipo_per_token":  the same on each reply's log-probabilities averaged over its tokens (pi_c / n_c, ...):
                      TRL's loss_type="ipo", whose beta means this one's (with the sums a beta gives a margin
                      n times larger in nats for replies of n tokens)
    "simpo" (Meng et al., 2024):  loss = -log sigmoid(beta (pi_c / n_c - pi_r / n_r) - gamma), reference-free,
                      gamma (simpo_gamma, TRL's too) the margin asked for; label smoothing as sigmoid's
    "orpo" (Hong et al., 2024):  loss = NLL + beta (-log sigmoid(lo_c - lo_r)), reference-free, where the log
                      odds lo = a - log(1 - exp(a)) of a reply's mean per-token log-probability a = pi / n, and
                      NLL the chosen replies' negative log-likelihood per token (weight 1: TRL's beta is beta)

The reference-free losses (simpo, orpo) compute no reference at all (`DPOSettings.reference_free`).
The loss of a micro-batch is the mean over its pairs, plus, with nll_weight w > 0, w times the chosen replies'
negative log-likelihood per token (an anchor: RPO, Pang et al., 2024; TRL's rpo_alpha; Llama 3's recipe).
DPO's loss sees only differences between a pair's two replies: what they share (a common start, the <|end|>
after them) cancels, and so does any change to the chosen replies' likelihood that the rejected ones share.
Adam still moves the weights in those directions, at its learning rate whatever the size of their gradients,
and both replies' log-probabilities can then fall together while the margin barely moves: on
benchmarks/dpo_rule.py's task, whose replies differ in one token, plain DPO took the chosen replies from -1.1
to -58 nats in 25 steps, the held-out accuracy still 50%, and ended at 100% with them at -60 (greedy chat
replies by the rule: 35%); with nll_weight=0.5 they ended at -0.01, the accuracy at 100% from step 75, the
chat replies 100% by the rule (BENCHMARKS.md, "Preference tuning"). The anchor keeps the chosen replies
likely.

What a step logs (`pair_metrics`, means over the pairs): DPO's loss; the implicit rewards chosen =
beta (pi_c - ref_c) and rejected = beta (pi_r - ref_r) (ipo_per_token: per token, beta (pi_c - ref_c) / n_c
and beta (pi_r - ref_r) / n_r, what its loss compares; reference-free losses: beta pi_c / n_c and
beta pi_r / n_r, their implicit rewards), and the reward margin, chosen - rejected, all three in beta x nats (eval.py's margin is in nats: with the same reference it is reward_margin / beta); the accuracy,
the share of the decided pairs (margin != 0) with margin > 0, and the ties, the share of pairs with margin
exactly 0 (all of them at step 0, when the model is its reference: the accuracy is then NaN, "n/a" in the
log, rather than a 0 that would read as every pair wrong); pi_c and pi_r, to see that the chosen replies'
log-probability does not collapse while the margin grows; and the chosen replies' NLL per token.
`pair_outcomes` counts the wins and ties for the log and for eval.py alike. The same numbers also go to
metrics.jsonl under TRL's names (TRL_NAMES: rewards/chosen, rewards/rejected, rewards/margins, logps/chosen,
logps/rejected), and TRL's rewards/accuracies, the share of all pairs won (ties as losses).

The reference: the model the tuning starts from, its log-probabilities computed without dropout (eval mode).
- With LoRA: the same model with its adapters off (`AdapterOffReference`, lora.adapters_off): no second copy
  of the weights, one more forward per step without a backward (its activations are freed at once), and
  exactly the starting model's function as long as only the adapters train (checked).
- Without LoRA: the reference's log-probabilities precomputed once over the dataset, before the first step
  (`PrecomputedReference`), rather than a frozen copy of the model. Memory: a copy is the weights once more on
  every device for the whole run (GPT-2 124M: 0.5 GB in float32; gpt2-xl: 6.2 GB), where the table is 8 bytes
  per pair (60,000 pairs: 0.5 MB), small enough to save in the checkpoint. Compute: a copy does one forward
  per pair every time the pair is trained on; the table one forward per pair in all, so it never costs more
  unless a run stops before one epoch (it then also scored the pairs the run never reached). A resumed run
  reads the table back instead of computing it again from weights that have since changed.

The log-probabilities are computed from the model's hidden states and its head a slice of rows at a time
(`chunked_sequence_logps`, run inside the model's forward through its head_loss hook, so the same call works
through DDP, FSDP and torch.compile wrappers), in float32, with the same values and gradients as the log-softmax
of the whole logits (`sequence_logps`, the direct computation). The whole (2B, T, V) logits never exist: a DPO
step holds a few slices of them, as the next-token loss does (BENCHMARKS.md, "DPO's memory").
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from gptkit import lora
from gptkit.data.pairs import PairBatch, Pairs, ValPairs
from gptkit.errors import DPOError
from gptkit.objectives.base import evaluating
from gptkit.settings import LENGTH_NORMALISED, DPOSettings
from model import loss_chunk_rows

# What the log's DPO numbers are, said once when a run starts (train.py's "objective: DPO ..." line).
DPO_LOG_UNITS = ("dpo: the log's rewards and reward_margin are in beta x nats (eval.py's margin_nats is in nats), accuracy is "
                 "over the pairs not tied (n/a while all tie, as at step 0), ties their share")


# ----------------------------------------------------------------------------------------------------------
# The math


def sequence_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each row's log-probability of its targets: logits (N, T, V), targets (N, T) with -1 = not counted ->
    (N,) float32, the sum over the positions with a target of log softmax(logits)[target], in float32."""
    token = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1, reduction="none")
    return -token.view(targets.shape).sum(-1)


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor | None,
             ref_rejected: torch.Tensor | None, settings: DPOSettings, chosen_tokens: torch.Tensor | None = None,
             rejected_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per pair (B,): the loss (settings.loss, the module's docstring; orpo's without its NLL term, which
    dpo_microbatch adds), and the chosen and the rejected reward (detached: they are for logging). The
    references are None for a reference-free loss; chosen_tokens and rejected_tokens (B,), each reply's token
    count, are needed by the LENGTH_NORMALISED ones."""
    beta, e, name = settings.beta, settings.label_smoothing, settings.loss
    if name in LENGTH_NORMALISED:
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError(f"the {name} loss needs each reply's token count")
        n_c, n_r = chosen_tokens.clamp(min=1), rejected_tokens.clamp(min=1)
    if settings.reference_free:
        chosen, rejected = policy_chosen / n_c, policy_rejected / n_r  # mean per-token log-probabilities
    else:
        chosen, rejected = policy_chosen - ref_chosen, policy_rejected - ref_rejected
    if name == "ipo_per_token":  # the log ratios per token: the loss's, and so the rewards logged (TRL's too)
        chosen, rejected = chosen / n_c, rejected / n_r
    h = chosen - rejected
    if name == "ipo" or name == "ipo_per_token":
        losses = (h - 1 / (2 * beta)) ** 2
    elif name == "hinge":
        losses = torch.relu(1 - beta * h)
    elif name == "robust":
        losses = ((1 - e) * -F.logsigmoid(beta * h) + e * F.logsigmoid(-beta * h)) / (1 - 2 * e)
    elif name == "orpo":
        # log odds of p = exp(a): a - log(1 - exp(a)), log(1 - exp(a)) = log(-expm1(a)) exact near a = 0; a
        # reply whose every token has probability 1 in float32 (a = 0) counts as a = -1e-6 (no gradient)
        def log_odds(a):
            a = a.clamp(max=-1e-6)
            return a - torch.log(-torch.expm1(a))

        losses = beta * -F.logsigmoid(log_odds(chosen) - log_odds(rejected))
    else:  # sigmoid, simpo
        z = beta * h - (settings.simpo_gamma if name == "simpo" else 0.0)
        losses = -F.logsigmoid(z) * (1 - e) - F.logsigmoid(-z) * e
    return losses, beta * chosen.detach(), beta * rejected.detach()


def pair_outcomes(margin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(wins, ties) of the pairs' margins (B,), as 0-d float32 tensors: how many pairs the model orders right
    (margin > 0) and how many it leaves undecided (margin exactly 0: the model is its reference, at a run's
    first step; or the pair's replies score alike). The rest it orders wrong. The one count behind the log's
    accuracy and eval.py's."""
    return (margin > 0).sum().float(), (margin == 0).sum().float()


def accuracy_of(wins, ties, pairs):
    """The share of the decided pairs (not tied) that were won: wins / (pairs - ties); NaN (a tensor) or None
    (numbers) when every pair tied, where no accuracy exists (0 would read as every pair ordered wrong)."""
    if isinstance(wins, torch.Tensor):
        return wins / (pairs - ties)  # 0 / 0 = NaN, without reading the device
    return wins / (pairs - ties) if pairs > ties else None


def pair_metrics(losses: torch.Tensor, chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor,
                 policy_chosen: torch.Tensor, policy_rejected: torch.Tensor) -> dict[str, torch.Tensor]:
    """The means over the pairs a step logs, as 0-d float32 tensors (reading one syncs the device: the caller
    decides when). `dpo_loss` is DPO's alone, without the NLL anchor (the step's loss has it); `accuracy` is
    over the decided pairs (NaN when all tie: DPOObjective.metric_over says so to the evaluation, which weighs
    it by them), `ties` the share of tied pairs."""
    margin = chosen_rewards - rejected_rewards
    wins, ties = pair_outcomes(margin)
    B = len(margin)
    ours = {"dpo_loss": losses.detach().mean(), "reward_margin": margin.mean(), "chosen_reward": chosen_rewards.mean(),
            "rejected_reward": rejected_rewards.mean(), "accuracy": accuracy_of(wins, ties, B), "ties": ties / B,
            "chosen_logp": policy_chosen.detach().mean(), "rejected_logp": policy_rejected.detach().mean()}
    trl = {name: ours[same] for name, same in TRL_NAMES.items()}
    return {**ours, **trl, "rewards/accuracies": wins / B}


# TRL's names for the metrics a step logs, beside ours (metrics.jsonl and W&B only: gptkit/metrics.py keeps
# names with a slash off the console line, which shows ours). rewards/accuracies is TRL's own measure: the
# share of all pairs won, ties counted as lost (0.0 at step 0), where our accuracy leaves the tied pairs out.
TRL_NAMES = {"rewards/chosen": "chosen_reward", "rewards/rejected": "rejected_reward",
             "rewards/margins": "reward_margin", "logps/chosen": "chosen_logp", "logps/rejected": "rejected_logp"}


def chunked_sequence_logps(model: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, *,
                           chunk_elements: int | None = None) -> torch.Tensor:
    """sequence_logps of the logits `model.head` would make of hidden (N, T, C), without holding them: (N,)
    float32, computed a slice of token rows at a time (model.loss_chunk_rows: chunk_elements logits, by default
    the device type's). The model's head_loss hook: policy_logps(model, batch) calls it inside the forward."""
    w = model.lm_head.weight
    device_type = hidden.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
    rows = loss_chunk_rows(w.size(0), device_type, chunk_elements)
    N, T = targets.shape
    return _ChunkedSequenceLogps.apply(hidden.flatten(0, 1), w, targets.flatten(), N, T, rows,
                                       float(model.config.logit_softcap), dtype, model.config.vocab_size)


class _ChunkedSequenceLogps(torch.autograd.Function):
    """Each sequence's summed log-probability of its targets, over slices of `rows` token rows, recomputing each
    slice's logits in the backward.

    Forward, per slice: logits s = x_c @ W^T (in `dtype`, then fp32; soft-capped z = cap tanh(s / cap) when the
    model caps), logp = z[target] - logsumexp(z) over the real vocabulary, added to its sequence's sum; the
    slice is then dropped. Nothing (T, V)-sized is kept: the backward's input, d(loss)/d(sum) per sequence,
    depends on the sums themselves (DPO's sigmoid of the margin), so the gradients cannot be formed during the
    forward as model.py's _ChunkedLinearCrossEntropy does for a mean. Backward, per slice: the logits once more,
    dz = (onehot(target) - softmax(z)) x the sequence's d(loss)/d(sum) (x (1 - tanh^2) with the cap), then
    grad_x_c = dz @ W and grad_W += dz^T @ x_c. Cost: one head matmul more than keeping the logits (four instead
    of three); memory: a couple of slices of logits. The softmax and sums are float32 (float64 for a float64
    model: the tests' exact reference), the matmuls in `dtype` (autocast's when it is on), as the next-token loss.
    """

    @staticmethod
    def forward(ctx, x, weight, targets, n_seq: int, seq_len: int, rows: int, softcap: float, dtype: torch.dtype,
                n_real: int):
        with torch.autocast(x.device.type, enabled=False):
            mm = _Head(x, weight, dtype)
            valid = targets != -1
            safe = targets.clamp(min=0)[:, None]
            token = torch.empty(x.size(0), device=x.device, dtype=mm.acc)
            for lo in range(0, x.size(0), rows):
                part = slice(lo, lo + rows)
                z = _slice_logits(mm, part, softcap, n_real)[0]
                token[part] = (z.gather(1, safe[part]) - torch.logsumexp(z, dim=-1, keepdim=True)).squeeze(1)
            out = (token * valid).view(n_seq, seq_len).sum(-1)
        ctx.save_for_backward(x, weight, targets)
        ctx.settings = (seq_len, rows, softcap, dtype, n_real)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, targets = ctx.saved_tensors
        seq_len, rows, softcap, dtype, n_real = ctx.settings
        need_x, need_w = ctx.needs_input_grad[:2]
        with torch.autocast(x.device.type, enabled=False):
            mm = _Head(x, weight, dtype)
            # each token's factor: its sequence's d(loss)/d(sum), 0 where it has no target
            scale = grad_out.to(mm.acc).repeat_interleave(seq_len) * (targets != -1)
            safe = targets.clamp(min=0)[:, None]
            grad_w = torch.zeros(weight.shape, device=weight.device, dtype=mm.acc) if need_w else None
            grad_x = []
            for lo in range(0, x.size(0), rows):
                part = slice(lo, lo + rows)
                z, cap = _slice_logits(mm, part, softcap, n_real)
                g = z.sub_(torch.logsumexp(z, dim=-1, keepdim=True)).exp_().neg_()  # -softmax, in place
                g.scatter_add_(1, safe[part], torch.ones_like(safe[part], dtype=g.dtype))  # + onehot(target)
                g.mul_(scale[part, None])
                if cap is not None:
                    g.mul_(1 - cap * cap)
                g = g.to(dtype)
                if need_w:
                    grad_w += (g.t() @ mm.x[part]).to(mm.acc)
                if need_x:
                    grad_x.append(g @ mm.w)
        dx = torch.cat(grad_x).to(x.dtype) if need_x else None
        dw = grad_w.to(weight.dtype) if need_w else None
        return dx, dw, *(None,) * 7


class _Head:
    """The head's weight and the hidden states in the matmuls' dtype, and the dtype of the softmax and sums."""

    def __init__(self, x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype):
        self.x, self.w = x.to(dtype), weight.to(dtype)
        self.acc = torch.float64 if dtype == torch.float64 else torch.float32

    def logits(self, part: slice) -> torch.Tensor:
        return (self.x[part] @ self.w.t()).to(self.acc)


def _slice_logits(mm: _Head, part: slice, softcap: float, n_real: int
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A slice's float32 (float64) logits over the padded vocabulary, soft-capped when softcap > 0 (and the tanh, for the
    cap's derivative), the padding columns at -inf (probability 0, so gradient 0)."""
    z = mm.logits(part)
    cap = None
    if softcap:
        cap = torch.tanh(z / softcap)
        z = cap * softcap
    if n_real < z.size(1):
        z[:, n_real:] = float("-inf")
    return z, cap


def policy_logps(model: nn.Module, batch: PairBatch) -> torch.Tensor:
    """(2B,) float32: the log-probability of each sequence's reply under the model, the chosen ones first
    (chunked_sequence_logps, inside the model's forward: `model` may be a DDP, FSDP or compiled wrapper)."""
    return model(batch.x, batch.y, head_loss=chunked_sequence_logps)[1]


# ----------------------------------------------------------------------------------------------------------
# The reference


class AdapterOffReference:
    """The reference of a LoRA run: the model itself with its adapters off, in eval mode, without gradients."""

    def __init__(self, model: nn.Module):
        if not lora.trains_adapters_only(model):
            raise DPOError("the adapters-off reference needs a model whose LoRA adapters are all it trains "
                           "(anything else trained would change the reference too); precompute the reference "
                           "instead")

    @torch.no_grad()
    def logps(self, model: nn.Module, batch: PairBatch) -> torch.Tensor:
        with lora.adapters_off(model), evaluating(model):
            return policy_logps(model, batch)


class PrecomputedReference:
    """The reference's log-probabilities of every pair of a dataset's splits: tables[split] (n, 2) float32 on
    the CPU, column 0 the chosen reply's, 1 the rejected one's; `dataset` the fingerprint of the dataset they
    belong to (its meta.json's), `block_size` the length they were computed at. A subclass scores other items
    of the same interface (`items` and `batches`: KTO's rows and their KL sequences, gptkit/objectives/kto.py)."""

    items: ClassVar[type] = Pairs  # a split's items: their number, the dataset's meta
    batches: ClassVar[type] = ValPairs  # their fixed batches, each item once (two sequences an item)

    def __init__(self, tables: dict[str, torch.Tensor], dataset: str, block_size: int):
        self.tables, self.dataset, self.block_size = tables, dataset, block_size

    @classmethod
    @torch.no_grad()
    def compute(cls, model: nn.Module, data_dir: str | os.PathLike, *, block_size: int, batch_size: int,
                splits: tuple[str, ...] = ("train", "val"), autocast: Callable[[], Any] = contextlib.nullcontext,
                rank: int = 0, world_size: int = 1, progress: Callable[[int], None] | None = None
                ) -> PrecomputedReference:
        """Score every pair of the splits with `model` (the starting model) in eval mode. Under several
        processes each scores every world_size-th batch and the tables are summed across them (the others'
        rows are zero), so every process ends with the whole tables; every process runs the same number of
        forwards (one whose batches ran out scores one again, unused), as FSDP's collectives (and DDP's buffer
        broadcasts) in a forward need. `progress(pairs)` after each batch."""
        device = next(model.parameters()).device
        meta = cls.items(data_dir, splits[0]).dataset.meta
        tables = {}
        for split in splits:
            batches = cls.batches(data_dir, split, batch_size=batch_size, block_size=block_size, rank=rank,
                               world_size=world_size, device=device)
            table = torch.zeros(batches.n, 2, dtype=torch.float32, device=device)
            mine = iter(batches)
            with evaluating(model):
                for _ in range(-(-batches.n_batches // world_size)):  # the most batches any process has
                    batch = next(mine, None)
                    with autocast():
                        logps = policy_logps(model, batch if batch is not None else batches.first())
                    if batch is not None:
                        table[batch.pairs.to(device)] = logps.view(2, -1).t()
                        if progress is not None:
                            progress(len(batch))
            if world_size > 1:
                dist.all_reduce(table)
            tables[split] = table.cpu()
        return cls(tables, meta.get("fingerprint", ""), block_size)

    def logps(self, model: nn.Module, batch: PairBatch) -> torch.Tensor:
        """(2B,) the batch's reference log-probabilities, the chosen ones first (as policy_logps): batch.ref
        when they were read with the batch (PairLoader.reference_logps = reference.lookup), else looked up."""
        return batch.ref if batch.ref is not None else self.lookup(batch)

    def lookup(self, batch: PairBatch) -> torch.Tensor:
        """The batch's rows of the table, gathered on the CPU and copied to the batch's device (without
        blocking: from pinned memory on CUDA)."""
        table = self.tables.get(batch.split)
        if table is None:
            raise DPOError(f"the precomputed reference has no {batch.split!r} split (it has "
                           f"{', '.join(self.tables)}); compute it for every split the run reads")
        rows = table[batch.pairs].t().reshape(-1)
        if batch.x.device.type == "cuda":
            rows = rows.pin_memory()
        return rows.to(batch.x.device, non_blocking=True)

    def state_dict(self) -> dict[str, Any]:
        return {"tables": dict(self.tables), "dataset": self.dataset, "block_size": self.block_size}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any], data_dir: str | os.PathLike, block_size: int
                        ) -> PrecomputedReference:
        """The saved tables, checked against the dataset and block_size of the run that reads them."""
        pairs = {s: len(cls.items(data_dir, s)) for s in state["tables"]}
        meta = cls.items(data_dir, next(iter(state["tables"]))).dataset.meta
        if state["dataset"] != meta.get("fingerprint", "") or state["block_size"] != block_size or any(
                len(t) != pairs[s] for s, t in state["tables"].items()):
            raise DPOError(f"the saved reference log-probabilities belong to another dataset or block_size than "
                           f"{data_dir} at block_size {block_size}; resume with the run's own dataset and "
                           f"block_size")
        return cls(dict(state["tables"]), state["dataset"], state["block_size"])


# ----------------------------------------------------------------------------------------------------------
# One micro-batch


def dpo_microbatch(model: nn.Module, batch: PairBatch, reference: Any,
                   settings: DPOSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one micro-batch of pairs, a 0-d tensor to backpropagate (the loss's mean over its pairs,
    plus the NLL anchor when settings.nll_weight > 0, or orpo's NLL term), and its metrics (pair_metrics, and
    "nll": the chosen replies' negative log-likelihood per token). Called under the step's autocast;
    `reference` has logps(model, batch), and is not called for a reference-free loss (it may be None)."""
    B = len(batch)
    ref = None if settings.reference_free else reference.logps(model, batch)  # first: nothing of it stays alive
    policy = policy_logps(model, batch)  # during the policy's forward
    tokens = (batch.y != -1).sum(-1)
    r_c, r_r = (None, None) if ref is None else (ref[:B], ref[B:])
    losses, chosen, rejected = dpo_loss(policy[:B], policy[B:], r_c, r_r, settings, tokens[:B], tokens[B:])
    nll = -policy[:B].sum() / tokens[:B].sum().clamp(min=1)
    nll_weight = 1.0 if settings.loss == "orpo" else settings.nll_weight
    loss = losses.mean() + nll_weight * nll if nll_weight else losses.mean()
    return loss, {**pair_metrics(losses, chosen, rejected, policy[:B], policy[B:]), "nll": nll.detach()}


@dataclass
class DPOObjective:
    """The micro-batch loss the training step calls in place of the language-model loss: loss, metrics =
    objective(model, batch)."""

    settings: DPOSettings
    reference: Any  # AdapterOffReference or PrecomputedReference
    # the metrics each call returns (pair_metrics' and the NLL), the same whatever the batch
    metric_names = ("dpo_loss", "reward_margin", "chosen_reward", "rejected_reward", "accuracy", "ties",
                    "chosen_logp", "rejected_logp", "nll", *TRL_NAMES, "rewards/accuracies")
    # metrics that are means over a part of the pairs, and that part's share of them: the evaluation weighs
    # each batch's accuracy by its decided pairs (gptkit/evaluation.py), so the mean is wins / decided pairs
    metric_over = {"accuracy": lambda metrics: 1 - metrics["ties"]}

    def __call__(self, model: nn.Module, batch: PairBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return dpo_microbatch(model, batch, self.reference, self.settings)

    def batch_items(self, batch: PairBatch) -> int:
        """A batch's weight in an evaluation's mean: its pairs (gptkit/evaluation.py)."""
        return len(batch)


# ----------------------------------------------------------------------------------------------------------
# Scoring pairs (eval.py --task preference)


@torch.no_grad()
def score_pairs(model: nn.Module, batches: Iterable[PairBatch], *, reference: nn.Module | None = None,
                autocast: Callable[[], Any] = contextlib.nullcontext, world_size: int = 1,
                progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """How a model orders the pairs: accuracy, the share of the decided pairs (margin != 0) whose chosen reply
    it prefers (None when every pair ties), ties, the share of pairs with margin exactly 0, and the mean
    margin, in nats of log-probability (the training log's reward_margin is in beta x nats). Without a
    reference it prefers the reply of higher log-probability, margin = pi_c - pi_r; with one, the reply whose
    log-probability rose more (or fell less) from the reference's: DPO's implicit reward over beta, margin =
    (pi_c - ref_c) - (pi_r - ref_r) (the reference against itself ties every pair). Also the mean
    log-probabilities of the chosen and the rejected replies. Under several processes pass each its own
    batches and world_size: the sums are added across them."""
    device = next(model.parameters()).device
    sums = torch.zeros(6, dtype=torch.float64, device=device)  # pairs, wins, ties, margin, chosen, rejected
    for batch in batches:
        with autocast():
            policy = policy_logps(model, batch)
            ref = policy_logps(reference, batch) if reference is not None else torch.zeros_like(policy)
        B = len(batch)
        margin = (policy[:B] - ref[:B]) - (policy[B:] - ref[B:])
        sums += torch.stack([torch.tensor(float(B), device=device), *pair_outcomes(margin), margin.sum(),
                             policy[:B].sum(), policy[B:].sum()]).double()
        if progress is not None:
            progress(B)
    if world_size > 1:
        dist.all_reduce(sums)
    n, wins, ties, margin, chosen, rejected = sums.tolist()
    if not n:
        raise DPOError("there are no pairs to score")
    return {"pairs": int(n), "accuracy": accuracy_of(wins, ties, n), "ties": ties / n, "margin_nats": margin / n,
            "chosen_logp": chosen / n, "rejected_logp": rejected / n}


def evaluate_preference(model: nn.Module, data_dir: str | os.PathLike, split: str, *, batch_size: int,
                        reference: nn.Module | None = None, autocast: Callable[[], Any] = contextlib.nullcontext,
                        rank: int = 0, world_size: int = 1, limit: int = 0,
                        progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """score_pairs over a split's pairs (its first `limit` when limited), each scored once, the batches only
    as long as the split's longest sequence; this process's share of them under several processes."""
    block = model.config.block_size
    longest = Pairs(data_dir, split).longest
    if longest - 1 > block:
        raise DPOError(f"the {split} split of {data_dir} has sequences of {longest} tokens, more than the model's "
                       f"block_size + 1 = {block + 1}; prepare the pairs with --block_size {block}")
    device = next(model.parameters()).device
    batches = ValPairs(data_dir, split, batch_size=batch_size, block_size=max(1, longest - 1), rank=rank,
                       world_size=world_size, device=device, limit=limit)
    return score_pairs(model, batches, reference=reference, autocast=autocast, world_size=world_size,
                       progress=progress)
