"""DPO on preference pairs (`objective = "dpo"`): the run's batches, data check, reference and state; the loss
math, the references themselves and pair scoring are gptkit/objectives/preference_losses.py's.

DPO's batches are whole pairs: batch_size counts pairs per micro-batch, each pair two sequences of block_size
(the chosen reply's and the rejected one's), read in epochs over the pairs (gptkit/data/pairs.py) whatever
data_mode says. The evaluation scores the val split's first eval_iters x batch_size pairs, each once.

DPO's reference is the model the run starts from:
- a LoRA run's is the model itself with its adapters off (`AdapterOffReference`): no second copy, one forward
  more per micro-batch, without gradients. The run loads its starting chat model as the base and puts fresh
  adapters on it, so the adapters are all it trains and "adapters off" is exactly the start.
- a full fine-tune's are the starting model's log-probabilities of every pair of both splits, computed once
  before the first step (`PrecomputedReference`: 8 bytes a pair, against a copy of the weights for the whole
  run), saved in every checkpoint (this objective's state, under "dpo_reference") and read back on resume (the
  weights have moved on since). The training loader is handed the table's lookup when it is made, and reads
  each batch's rows with the batch, so a step (a CUDA graph too) finds them on the device.
"""

from __future__ import annotations

import dataclasses
import sys
import textwrap
from pathlib import Path

import torch
from tqdm import tqdm

from gptkit import parallel
from gptkit.data.pairs import (
    PairBatch,
    PairLoader,
    Pairs,
    ValPairs,
    check_preference_dataset,
    is_preference_dataset,
)
from gptkit.data.shards import read_meta
from gptkit.errors import ConfigError, DPOError
from gptkit.objectives.base import Objective, ObjectiveError
from gptkit.objectives.preference_losses import (
    DPO_LOG_UNITS,
    AdapterOffReference,
    DPOObjective,
    PrecomputedReference,
)
from gptkit.runtime import Dist, Runtime
from gptkit.settings import DPOSettings


def dpo_settings(cfg) -> DPOSettings:
    """The run's DPO settings, from its dpo_* keys (a ConfigError naming a bad one)."""
    try:
        return DPOSettings(beta=cfg.dpo_beta, label_smoothing=cfg.dpo_label_smoothing, loss=cfg.dpo_loss,
                           nll_weight=cfg.dpo_nll_weight, simpo_gamma=cfg.dpo_simpo_gamma)
    except DPOError as e:
        raise ConfigError(str(e)) from None


class DPO(Objective):
    name = "dpo"
    metric_names = DPOObjective.metric_names
    metric_over = DPOObjective.metric_over
    sequences_per_item = 2
    items, unit, unit_note = Pairs, "pair", ""  # the dataset's reader, and fit_block_size's words for its items
    plan_loss = "sequence_logps"
    # a chat model keeps its context for conversations; its small steps barely move the positions beyond
    keeps_base_context = True
    chat = True
    state_key = "dpo_reference"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.reference = None  # set by start(): AdapterOffReference, PrecomputedReference, or None
        self.loss: DPOObjective | None = None

    def check_config(self, cfg) -> None:
        super().check_config(cfg)
        dpo_settings(cfg)  # names a bad dpo_beta, dpo_loss, dpo_label_smoothing or dpo_nll_weight
        if cfg.batch_size is None and cfg.tokens_per_step % (2 * cfg.block_size):
            raise ConfigError(f"tokens_per_step ({cfg.tokens_per_step}) must be a multiple of 2 x block_size "
                              f"({2 * cfg.block_size}) with objective=dpo and batch_size=auto: a step is made "
                              f"of whole pairs, each two sequences")
        if cfg.init_from == "scratch":
            raise ConfigError("objective=dpo tunes a trained chat model against itself: set --init_from to "
                              "its checkpoint (e.g. out-chat/, from configs/finetune_chat.py)")

    def prepare_kind(self) -> str | None:
        return "preference"

    def check_dataset(self, meta: dict, label: str) -> None:
        check_preference_dataset(meta, label)

    def fit_block_size(self, cfg, data_dir: Path, meta: dict | None = None, say: bool = True):
        """A new run trains on sequences as long as its dataset's longest (both splits'; a pair's or a row's, with
        KTO's KL sequences), when that is less than block_size: no padding to a context the data never reach.
        The model keeps its context (keeps_base_context). A resumed run keeps its own. With batch_size=auto,
        tokens_per_step shrinks with it: the pairs (rows) per step stay what it asked."""
        if cfg.init_from == "resume":
            return cfg
        longest = max(self.items(data_dir, split).longest for split in ("train", "val"))
        if longest - 1 >= cfg.block_size or longest < 2:
            return cfg  # (longer: the loader's error says how to prepare them; KTO's KL prompts are cut to fit)
        tokens, per, unit = cfg.tokens_per_step, self.sequences_per_item, self.unit
        if cfg.batch_size is None:  # batch_size=auto keeps the units per step, tokens_per_step / (per x block_size)
            units = tokens // (per * cfg.block_size)
            if not units:
                each, times = (" of two sequences", "2 x ") if per == 2 else ("", "")
                raise ObjectiveError(f"tokens_per_step ({tokens}) is less than one {unit}{each} of block_size "
                                     f"{cfg.block_size}; set it to {unit}s per step x {times}block_size")
            tokens = units * per * (longest - 1)
        if say:
            print(f"note: the longest sequence of the {unit}s of dataset {cfg.dataset!r}{self.unit_note} has "
                  f"{longest} tokens: this {self.name.upper()} run's batches are block_size={longest - 1} long (the "
                  f"model keeps its context)" + (f"; tokens_per_step={tokens} keeps its "
                                                 f"{tokens // (per * (longest - 1))} {unit}s per step"
                                                 if tokens != cfg.tokens_per_step else ""), flush=True)
        return dataclasses.replace(cfg, block_size=longest - 1, tokens_per_step=tokens)

    def plan_block_size(self, cfg, data_dir: Path, ckpt: dict | None):
        """--plan: a new run's sequences are its data's length once they are prepared (else block_size)."""
        if ckpt is None and (data_dir / "meta.json").is_file() and self.holds_its_data(read_meta(data_dir)):
            return self.fit_block_size(cfg, data_dir, say=False)
        return cfg

    def holds_its_data(self, meta: dict) -> bool:
        return is_preference_dataset(meta)

    def check_start(self, cfg, added_tokens: int) -> None:
        """DPO tunes a chat model: a base that lacks the dataset's special tokens (the chat markers) has never
        seen the template its pairs are written in."""
        if added_tokens:
            raise ObjectiveError(f"{cfg.init_from} lacks {added_tokens} of the dataset's special tokens (the chat "
                                 f"template's markers): objective={self.name} tunes a chat model; fine-tune it on "
                                 f"conversations first (configs/finetune_chat.py), then tune that checkpoint with "
                                 f"{self.name.upper()}")

    def start(self, cfg, raw_model: torch.nn.Module, data_dir: Path, state: dict | None, d: Dist,
              rt: Runtime) -> str:
        """The reference: a LoRA run's adapters off; a full fine-tune's log-probabilities, computed here (every
        process its share of the pairs, `raw_model` holding the starting weights: under FSDP sharded, the
        module that runs) or, on resume, read back from `state`."""
        settings = dpo_settings(cfg)
        reference, against = self.make_reference(cfg, raw_model, data_dir, state, d, rt, settings.reference_free)
        self.reference, self.loss = reference, DPOObjective(settings, reference)
        anchor = f", + {settings.nll_weight:g} x the chosen replies' NLL per token" if settings.nll_weight else ""
        smoothing = f", label smoothing {settings.label_smoothing:g}" if settings.label_smoothing else ""
        gamma = f", gamma {settings.simpo_gamma:g}" if settings.loss == "simpo" else ""
        anchor = ", + the chosen replies' NLL per token" if settings.loss == "orpo" else anchor
        return (f"objective: DPO ({settings.loss} loss, beta {settings.beta:g}{smoothing}{gamma}{anchor}) on pairs "
                f"of {cfg.dataset}, against {against}\n{DPO_LOG_UNITS}")

    # the precomputed reference of a full fine-tune (KTO's: of its rows and their KL sequences)
    reference_kind: type[PrecomputedReference] = PrecomputedReference

    def make_reference(self, cfg, raw_model: torch.nn.Module, data_dir: Path, state: dict | None, d: Dist,
                       rt: Runtime, reference_free: bool = False) -> tuple[object, str]:
        """(the reference, what it is in words): none for a reference-free loss; a LoRA run's adapters off; a
        full fine-tune's log-probabilities, read back from `state` on resume, else computed here."""
        resumed = cfg.init_from == "resume"
        if reference_free:
            reference, against = None, "no reference (the loss is of the model alone)"
        elif cfg.lora_rank:
            reference = AdapterOffReference(raw_model)  # (check_start leaves no run that trains more than adapters)
            against = "the model with its LoRA adapters off (the starting model; no second copy)"
        elif resumed:
            kind = self.name.upper()
            if state is None:
                raise ObjectiveError(f"{cfg.out_dir}/last.pt holds no reference log-probabilities (it is not a {kind} "
                                     f"run's checkpoint); resume it with its own objective, or start a {kind} run "
                                     f"from it with --init_from={cfg.out_dir} --out_dir=NEW_DIR")
            reference = self.reference_kind.from_state_dict(state, data_dir, cfg.block_size)
            against = "the starting model's log-probabilities, precomputed (read back from the checkpoint)"
        else:
            reference = precompute(cfg, raw_model, data_dir, d, rt, self.reference_kind)
            against = (f"the starting model's log-probabilities, precomputed (8 bytes a "
                       f"{self.reference_kind.items.noun[:-1]}, saved in the checkpoints)")
        return reference, against

    def batches(self, cfg, data_dir: Path, d: Dist, rt: Runtime):
        """Pairs; a precomputed reference's table is read with each training batch (after start())."""
        common = dict(batch_size=cfg.batch_size, block_size=cfg.block_size, rank=d.rank, world_size=d.world_size,
                      device=rt.device)
        lookup = self.reference.lookup if isinstance(self.reference, PrecomputedReference) else None
        return (PairLoader(data_dir, "train", seed=cfg.seed, reference_logps=lookup, **common),
                ValPairs(data_dir, "val", limit=cfg.eval_iters * cfg.batch_size, **common))

    def notes(self, cfg) -> list[str]:
        """DPO compares the tuned model's log-probabilities with the reference's, computed without dropout: with
        dropout on, they differ from the first step on for that reason alone."""
        rates = [f"{name}={getattr(cfg, name):g}" for name in ("dropout", "lora_dropout")
                 if getattr(cfg, name) and (name == "dropout" or cfg.lora_rank)]
        if not rates:
            return []
        return [f"note: {', '.join(rates)} with objective={self.name}: the reference is scored without dropout, "
                f"the tuned model with it, so their log-probabilities differ from the first step on for that alone; "
                f"configs/dpo_chat.py sets both to 0"]

    def __call__(self, model: torch.nn.Module, batch: PairBatch):
        if self.loss is None:
            raise RuntimeError("DPO.start() readies the reference before the first micro-batch")
        return self.loss(model, batch)

    def batch_items(self, batch: PairBatch) -> int:
        return len(batch)  # a pair each

    def trial_batch(self, cfg, raw_model: torch.nn.Module, batch_size: int, device: torch.device):
        """Pairs of two block_size sequences whose second half is the reply, against the reference the run will
        have (a LoRA run's: the adapters off, one more forward; a full fine-tune's: log-probabilities read with
        the batch)."""
        vocab, T = raw_model.config.vocab_size, cfg.block_size
        x = torch.randint(vocab, (2 * batch_size, T), device=device)
        y = x.clone()
        y[:, : T // 2] = -1  # the prompt: no target
        settings = dpo_settings(cfg)
        if settings.reference_free:
            reference, ref = None, None
        elif cfg.lora_rank:
            reference, ref = AdapterOffReference(raw_model), None
        else:
            reference, ref = PrecomputedReference({}, "", T), torch.zeros(2 * batch_size, device=device)
        return DPOObjective(settings, reference), PairBatch(x, y, torch.arange(batch_size), "train", ref)

    def describe_batch(self, cfg) -> str:
        return f"{cfg.batch_size} pairs = {2 * cfg.batch_size} sequences"

    def plan_notes(self, cfg, items: int) -> list[str]:
        """What the table says of a DPO run and leaves out of its FLOPs: its micro-batch in sequences, its loss
        (the per-sequence log-probabilities, by slices as the next-token loss), and its reference: a LoRA run's
        costs one more forward per micro-batch (without gradients: its memory is less than the training
        forward's), a full fine-tune's one forward over every pair before the first step."""
        reference = ("the reference, the model with its adapters off: one more forward per micro-batch (about a "
                     "third more)" if cfg.lora_rank else "the reference's log-probabilities: one forward over every "
                     "pair before the first step")
        if dpo_settings(cfg).reference_free:
            reference = f"nothing for a reference ({cfg.dpo_loss} has none)"
        text = (f"DPO: the micro-batch of {items} pairs is planned as {2 * items} sequences of {cfg.block_size:,} "
                f"tokens (the longest pair's length, once the pairs are prepared): batch and largest count "
                f"sequences. Its loss, each sequence's log-probability of its reply, is counted as computed: by "
                f"slices of rows of logits, in the forward and again in the backward. Not in the FLOPs: "
                f"{reference}, nor the backward's second computation of the logits.")
        return textwrap.wrap(text, 110, initial_indent="  ", subsequent_indent="  ", break_on_hyphens=False)

    def state_dict(self) -> dict | None:
        """A precomputed reference's tables (None for any other reference)."""
        return self.reference.state_dict() if isinstance(self.reference, PrecomputedReference) else None


def precompute(cfg, raw_model: torch.nn.Module, data_dir: Path, d: Dist, rt: Runtime,
               kind: type[PrecomputedReference] = PrecomputedReference) -> PrecomputedReference:
    """The starting model's log-probabilities of every pair (`kind`'s items) of the splits the run reads (val
    alone for an eval_only run), under the run's autocast, every process scoring its share, with a progress bar
    on a terminal."""
    splits = ("val",) if cfg.eval_only else ("train", "val")
    quiet = not (d.master and sys.stdout.isatty())
    noun = kind.items.noun
    if d.master:
        print(f"{cfg.objective}: scoring the {' and '.join(splits)} {noun} with the starting model (the reference), "
              f"once", flush=True)
    # Under FSDP with the whole weights gathered (as an evaluation): every unit, the root's too, sharded again
    # afterwards, before the optimizer takes the parameters.
    with parallel.gathered(raw_model), tqdm(desc="reference", unit=noun[:-1], leave=False, delay=3,
                                            disable=quiet) as bar:
        return kind.compute(raw_model, data_dir, block_size=cfg.block_size, batch_size=cfg.batch_size, splits=splits,
                            autocast=rt.autocast, rank=d.rank, world_size=d.world_size, progress=bar.update)
