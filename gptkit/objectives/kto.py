"""KTO on unpaired rows (`objective = "kto"`): a prompt, one completion and a label, desirable or undesirable,
as prepare/preference.py writes them from rows of `prompt`, `completion` and `label`. DPO's sibling: the same
references, chunked log-probabilities and metric names, on rows instead of pairs (the loss:
gptkit/objectives/kto_loss.py; the batches: gptkit/data/unpaired.py).

batch_size counts rows per micro-batch, each one sequence trained on, with its KL sequence (its prompt and
another row's completion) scored beside it without gradients; rows are read in epochs (gptkit/data/pairs.py's
order) whatever data_mode says. The evaluation scores the val split's first eval_iters x batch_size rows,
each once: the val loss, and the rewards and their auc (gptkit/objectives/kto_loss.py's docstring).

beta is dpo_beta: KTO's beta is DPO's, the scale of the same implicit reward (TRL's KTOConfig.beta, 0.1 too).
The weights are kto_desirable_weight and kto_undesirable_weight (TRL's desirable_weight, undesirable_weight);
TRL advises lambda_D n_D / (lambda_U n_U) in [1, 4/3] (n: the train split's rows of each label), and a run
whose weights and rows miss that range says so in one line at its start, with the weight that would meet it.
A dataset without rows of one label is refused (KTO weighs each kind against the other), and so are DPO's
own settings (dpo_loss and the rest) set to anything but their defaults: they would do nothing here.

The reference is DPO's (gptkit/objectives/dpo.py): a LoRA run's model with its adapters off; a full
fine-tune's log-probabilities of every row's completion and of its KL sequence (the pairing is fixed, so they
can be), computed once before the first step (RowReference: 8 bytes a row), saved in every checkpoint under
"kto_reference" and read back on resume.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import torch

from gptkit.data.pairs import is_unpaired_dataset, unpaired_labels
from gptkit.data.unpaired import RowBatch, RowLoader, Rows, ValRows, check_unpaired_dataset
from gptkit.errors import ConfigError, DPOError
from gptkit.objectives.dpo import DPO
from gptkit.objectives.kto_loss import KTOObjective
from gptkit.objectives.preference_losses import AdapterOffReference, PrecomputedReference
from gptkit.runtime import Dist, Runtime
from gptkit.settings import KTO_RATIO, KTOSettings

# What the log's KTO numbers are, said once when a run starts.
KTO_LOG_UNITS = ("kto: the log's rewards are in beta x nats, means over the desirable (chosen) and undesirable "
                 "(rejected) rows; kl is the reference point z; auc the share of (desirable, undesirable) row pairs "
                 "ordered right, ties half (0.5 at step 0)")

# DPO's settings that KTO has no use for, and their defaults: set to anything else, a run refuses them
DPO_ONLY = {"dpo_loss": "sigmoid", "dpo_label_smoothing": 0.0, "dpo_nll_weight": 0.0, "dpo_simpo_gamma": 0.5}


def kto_settings(cfg) -> KTOSettings:
    """The run's KTO settings, from dpo_beta and its kto_* keys (a ConfigError naming a bad one)."""
    try:
        return KTOSettings(beta=cfg.dpo_beta, desirable_weight=cfg.kto_desirable_weight,
                           undesirable_weight=cfg.kto_undesirable_weight)
    except DPOError as e:
        raise ConfigError(str(e)) from None


class RowReference(PrecomputedReference):
    """The starting model's log-probabilities of every row of an unpaired dataset's splits: tables[split]
    (n, 2) float32, column 0 the row's completion's, 1 its KL sequence's (gptkit/data/unpaired.py)."""

    items = Rows
    batches = ValRows


class KTO(DPO):
    name = "kto"
    metric_names = KTOObjective.metric_names
    metric_over = KTOObjective.metric_over
    sequences_per_item = 1  # a row: its KL sequence is scored without gradients (not in the plan's batch)
    items, unit, unit_note = Rows, "row", " (with their KL sequences)"
    state_key = "kto_reference"
    reference_kind = RowReference

    def check_config(self, cfg) -> None:
        super(DPO, self).check_config(cfg)  # the protocol's checks, not DPO's (its pairs and its dpo_loss)
        kto_settings(cfg)
        for key, default in DPO_ONLY.items():
            if getattr(cfg, key) != default:
                raise ConfigError(f"{key} is DPO's; objective=kto has its own loss (its settings: dpo_beta, "
                                  f"kto_desirable_weight, kto_undesirable_weight): drop --{key}")
        if cfg.init_from == "scratch":
            raise ConfigError("objective=kto tunes a trained chat model against itself: set --init_from to its "
                              "checkpoint (e.g. out-chat/, from configs/finetune_chat.py)")

    def check_dataset(self, meta: dict, label: str) -> None:
        check_unpaired_dataset(meta, label)

    def holds_its_data(self, meta: dict) -> bool:
        return is_unpaired_dataset(meta)

    def start(self, cfg, raw_model: torch.nn.Module, data_dir: Path, state: dict | None, d: Dist,
              rt: Runtime) -> str:
        """The reference (DPO's: the adapters off, or the log-probabilities precomputed or read back) and the
        loss; the line says what it optimises, and whether the weights meet TRL's advice on this train split."""
        settings = kto_settings(cfg)
        self.reference, against = self.make_reference(cfg, raw_model, data_dir, state, d, rt)
        self.loss = KTOObjective(settings, self.reference, across=d.enabled and d.world_size > 1)
        weights = (f", weights {settings.desirable_weight:g} desirable / {settings.undesirable_weight:g} "
                   f"undesirable" if (settings.desirable_weight, settings.undesirable_weight) != (1, 1) else "")
        lines = [f"objective: KTO (beta {settings.beta:g}{weights}) on the unpaired rows of {cfg.dataset}, against "
                 f"{against}", KTO_LOG_UNITS]
        note = ratio_note(settings, unpaired_labels(data_dir, "train"))
        return "\n".join(lines + ([note] if note else []))

    def batches(self, cfg, data_dir: Path, d: Dist, rt: Runtime):
        """Rows with their KL sequences; a precomputed reference's table is read with each training batch."""
        common = dict(batch_size=cfg.batch_size, block_size=cfg.block_size, rank=d.rank, world_size=d.world_size,
                      device=rt.device)
        lookup = self.reference.lookup if isinstance(self.reference, PrecomputedReference) else None
        return (RowLoader(data_dir, "train", seed=cfg.seed, reference_logps=lookup, **common),
                ValRows(data_dir, "val", limit=cfg.eval_iters * cfg.batch_size, **common))

    def __call__(self, model: torch.nn.Module, batch: RowBatch):
        if self.loss is None:
            raise RuntimeError("KTO.start() readies the reference before the first micro-batch")
        return self.loss(model, batch)

    def trial_batch(self, cfg, raw_model: torch.nn.Module, batch_size: int, device: torch.device):
        """Rows of block_size sequences whose second half is the completion, with KL sequences alike and half of
        them desirable, against the reference the run will have (a LoRA run's: the adapters off, two more
        forwards; a full fine-tune's: log-probabilities read with the batch)."""
        vocab, T, B = raw_model.config.vocab_size, cfg.block_size, batch_size
        x = torch.randint(vocab, (2 * B, T), device=device)
        y = x.clone()
        y[:, : T // 2] = -1  # the prompt: no target
        labels = (torch.arange(B, device=device) % 2).float()
        if cfg.lora_rank:
            reference, ref = AdapterOffReference(raw_model), None
        else:
            reference, ref = RowReference({}, "", T), torch.zeros(2 * B, device=device)
        batch = RowBatch(x, y, torch.arange(B), "train", ref, labels=labels)
        return KTOObjective(kto_settings(cfg), reference), batch

    def describe_batch(self, cfg) -> str:
        return f"{cfg.batch_size} rows (+ {cfg.batch_size} KL sequences without gradients)"

    def plan_notes(self, cfg, items: int) -> list[str]:
        """What the table says of a KTO run and leaves out of its FLOPs: the KL sequences' forward (without
        gradients: its memory is less than the training forward's) and the reference."""
        reference = ("the reference, the model with its adapters off: two more forwards per micro-batch" if
                     cfg.lora_rank else "the reference's log-probabilities: one forward over every row and its KL "
                     "sequence before the first step")
        text = (f"KTO: the micro-batch of {items} rows is planned as {items} sequences of {cfg.block_size:,} tokens "
                f"(the longest row's length, once the rows are prepared), their loss each sequence's "
                f"log-probability of its reply, by slices of rows of logits. Not in the FLOPs: the forward of their "
                f"{items} KL sequences (without gradients), {reference}, nor the backward's second computation of "
                f"the logits.")
        return textwrap.wrap(text, 110, initial_indent="  ", subsequent_indent="  ", break_on_hyphens=False)


def ratio_note(settings: KTOSettings, labels) -> str:
    """One line when lambda_D n_D / (lambda_U n_U) of the train split's labels is outside TRL's advised range
    (KTO_RATIO), with the desirable weight that would put it at the range's bottom; "" when it holds."""
    desirable = int(labels.sum())
    undesirable = len(labels) - desirable
    if not (desirable and undesirable):
        return ""  # (refused before: check_unpaired_dataset)
    ratio = settings.ratio(desirable, undesirable)
    lo, hi = KTO_RATIO
    if lo <= ratio <= hi:
        return ""
    fit = (lo if ratio < lo else hi) * settings.undesirable_weight * undesirable / desirable
    return (f"note: kto_desirable_weight x desirable rows / (kto_undesirable_weight x undesirable rows) = "
            f"{settings.desirable_weight:g} x {desirable:,} / ({settings.undesirable_weight:g} x {undesirable:,}) = "
            f"{ratio:.3g}, outside [1, 4/3], the range TRL advises; --kto_desirable_weight={fit:.3g} puts it at "
            f"{lo if ratio < lo else hi:.3g}")
