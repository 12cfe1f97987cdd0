"""What a training run trains for: the next-token loss on token windows (the default), or DPO on preference
pairs (`objective = "dpo"`, gptkit/dpo.py). For the run's objective this module gives train.py the check of its
dataset, its batches, the function the step calls on each micro-batch and, for DPO, the reference it is tuned
against, so that train.py's loop, step, evaluation and checkpoints are the same for both.

    check_dataset(cfg, meta, label)                      # a dataset of the other kind: a one-line error
    cfg = fit_block_size(cfg, data_dir)                  # DPO: sequences as long as the longest pair's
    loader, val = make_batches(cfg, data_dir, d, rt)     # BatchLoader + ValBatches, or PairLoader + ValPairs
    objective, reference, line = make_objective(cfg, raw_model, loader, data_dir, ckpt, d, rt)
    loss, metrics = objective(model, batch)              # what gptkit/step.py calls (and the evaluation)

DPO's batches are whole pairs: batch_size counts pairs per micro-batch, each pair two sequences of block_size
(the chosen reply's and the rejected one's), read in epochs over the pairs (gptkit/data/pairs.py) whatever
data_mode says. The evaluation scores the val split's first eval_iters x batch_size pairs, each once.

DPO's reference is the model the run starts from:
- a LoRA run's is the model itself with its adapters off (`dpo.AdapterOffReference`): no second copy, one
  forward more per micro-batch, without gradients. The run loads its starting chat model as the base and puts
  fresh adapters on it, so the adapters are all it trains and "adapters off" is exactly the start.
- a full fine-tune's are the starting model's log-probabilities of every pair of both splits, computed once
  before the first step (`dpo.PrecomputedReference`: 8 bytes a pair, against a copy of the weights for the
  whole run), saved in every checkpoint and read back on resume (the weights have moved on since). The
  training loader reads each batch's rows of the table with the batch, so a step (a CUDA graph too) finds them
  on the device.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from gptkit import parallel
from gptkit.config import TrainConfig, dpo_settings
from gptkit.data.loader import BatchLoader, ValBatches
from gptkit.data.pairs import (
    PairBatch,
    PairLoader,
    Pairs,
    ValPairs,
    check_preference_dataset,
    is_preference_dataset,
)
from gptkit.dpo import DPO_LOG_UNITS, AdapterOffReference, DPOObjective, PrecomputedReference
from gptkit.errors import UserError
from gptkit.runtime import Dist, Runtime
from gptkit.step import Objective, next_token_loss


class ObjectiveError(UserError):
    """A run whose objective does not fit its data or its model; the message says why and what to do."""


def is_dpo(cfg: TrainConfig) -> bool:
    return cfg.objective == "dpo"


def sequences_per_batch(cfg: TrainConfig) -> int:
    """The sequences of one micro-batch: batch_size, or under DPO twice its pairs."""
    return 2 * cfg.batch_size if is_dpo(cfg) else cfg.batch_size


def describe_batch(cfg: TrainConfig) -> str:
    """The micro-batch in words, for the run's first lines: "12", or under DPO "8 pairs = 16 sequences"."""
    return f"{cfg.batch_size} pairs = {2 * cfg.batch_size} sequences" if is_dpo(cfg) else f"{cfg.batch_size}"


def check_dataset(cfg: TrainConfig, meta: dict, label: str) -> None:
    """Preference pairs for DPO and token windows for the next-token loss: the other kind is a one-line error."""
    if is_dpo(cfg):
        check_preference_dataset(meta, label)
    elif is_preference_dataset(meta):
        raise ObjectiveError(f"dataset {label} holds preference pairs (prepare/preference.py), which the next-token "
                             f"loss does not train on; add --objective=dpo (configs/dpo_chat.py), or prepare "
                             f"conversations with prepare/chat.py")


def check_start(cfg: TrainConfig, added_tokens: int) -> None:
    """DPO tunes a chat model: a base that lacks the dataset's special tokens (the chat markers) has never seen
    the template its pairs are written in."""
    if is_dpo(cfg) and added_tokens:
        raise ObjectiveError(f"{cfg.init_from} lacks {added_tokens} of the dataset's special tokens (the chat "
                             f"template's markers): objective=dpo tunes a chat model; fine-tune it on "
                             f"conversations first (configs/finetune_chat.py), then tune that checkpoint with DPO")


def fit_block_size(cfg: TrainConfig, data_dir: Path, say: bool = True) -> TrainConfig:
    """A new DPO run trains on sequences as long as its longest pair's (both splits'), when that is less than
    block_size: no padding to a context the pairs never reach. The model keeps its context (run_model's
    build_model crops none under DPO). A resumed run keeps its own. `say`: print a note when it changes. With
    batch_size=auto, tokens_per_step shrinks with it: the pairs per step stay what it asked."""
    if not is_dpo(cfg) or cfg.init_from == "resume":
        return cfg
    longest = max(Pairs(data_dir, split).longest for split in ("train", "val"))
    if longest - 1 >= cfg.block_size or longest < 2:
        return cfg  # (longer: the loader's error says how to prepare them)
    tokens = cfg.tokens_per_step
    if cfg.batch_size is None:  # batch_size=auto keeps the pairs per step, tokens_per_step / (2 x block_size)
        pairs = tokens // (2 * cfg.block_size)
        if not pairs:
            raise ObjectiveError(f"tokens_per_step ({tokens}) is less than one pair of two sequences of block_size "
                                 f"{cfg.block_size}; set it to pairs per step x 2 x block_size")
        tokens = pairs * 2 * (longest - 1)
    if say:
        print(f"note: the longest sequence of the pairs of dataset {cfg.dataset!r} has {longest} tokens: this DPO "
              f"run's batches are block_size={longest - 1} long (the model keeps its context)"
              + (f"; tokens_per_step={tokens} keeps its {tokens // (2 * (longest - 1))} pairs per step"
                 if tokens != cfg.tokens_per_step else ""), flush=True)
    return dataclasses.replace(cfg, block_size=longest - 1, tokens_per_step=tokens)


def make_batches(cfg: TrainConfig, data_dir: Path, d: Dist, rt: Runtime):
    """The run's training loader and validation batches on this process' device."""
    common = dict(batch_size=cfg.batch_size, block_size=cfg.block_size, rank=d.rank, world_size=d.world_size,
                  device=rt.device)
    if is_dpo(cfg):
        return (PairLoader(data_dir, "train", seed=cfg.seed, **common),
                ValPairs(data_dir, "val", limit=cfg.eval_iters * cfg.batch_size, **common))
    return (BatchLoader(data_dir, "train", seed=cfg.seed, mode=cfg.data_mode, **common),
            ValBatches(data_dir, "val", n_batches=cfg.eval_iters, **common))


def trial_batch(cfg: TrainConfig, raw_model: torch.nn.Module, batch_size: int, device: torch.device
                ) -> tuple[Objective, Any]:
    """(the run's micro-batch loss, a micro-batch of batch_size random items for it): what batch_size=auto's
    trial step runs on a GPU (gptkit/plan/batch_size.py), the step the run will take on made-up tokens. DPO: pairs
    of two block_size sequences whose second half is the reply, against the reference the run will have (a
    LoRA run's: the adapters off, one more forward; a full fine-tune's: log-probabilities read with the batch)."""
    vocab, T = raw_model.config.vocab_size, cfg.block_size
    if not is_dpo(cfg):
        x = torch.randint(vocab, (batch_size, T), device=device)
        return next_token_loss, (x, x)
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
    batch = PairBatch(x, y, torch.arange(batch_size), "train", ref)
    return DPOObjective(settings, reference), batch


def make_objective(cfg: TrainConfig, raw_model: torch.nn.Module, loader, data_dir: Path, ckpt: dict | None,
                   d: Dist, rt: Runtime) -> tuple[Objective, Any, str]:
    """(the micro-batch loss the step calls, DPO's reference or None, a line saying what the run optimizes).
    `raw_model`: the model on its device, unwrapped (under FSDP sharded: it is the module that runs), holding
    the starting weights of a new run. A precomputed reference is computed here (every process its share of
    the pairs) or, on resume, read from the checkpoint; the training loader then reads it with each batch."""
    if not is_dpo(cfg):
        return next_token_loss, None, ""
    settings = dpo_settings(cfg)
    if settings.reference_free:
        reference = None
        against = "no reference (the loss is of the model alone)"
    elif cfg.lora_rank:
        reference = AdapterOffReference(raw_model)  # (check_start leaves no run that trains more than adapters)
        against = "the model with its LoRA adapters off (the starting model; no second copy)"
    elif ckpt is not None:
        if "dpo_reference" not in ckpt:
            raise ObjectiveError(f"{cfg.out_dir}/last.pt holds no reference log-probabilities (it is not a DPO "
                                 f"run's checkpoint); resume it with its own objective, or start a DPO run from it "
                                 f"with --init_from={cfg.out_dir} --out_dir=NEW_DIR")
        reference = PrecomputedReference.from_state_dict(ckpt["dpo_reference"], data_dir, cfg.block_size)
        against = "the starting model's log-probabilities, precomputed (read back from the checkpoint)"
    else:
        reference = precompute(cfg, raw_model, data_dir, d, rt)
        against = "the starting model's log-probabilities, precomputed (8 bytes a pair, saved in the checkpoints)"
    if isinstance(reference, PrecomputedReference):
        loader.reference_logps = reference.lookup  # read with each training batch, into batch.ref
    anchor = f", + {settings.nll_weight:g} x the chosen replies' NLL per token" if settings.nll_weight else ""
    smoothing = f", label smoothing {settings.label_smoothing:g}" if settings.label_smoothing else ""
    gamma = f", gamma {settings.simpo_gamma:g}" if settings.loss == "simpo" else ""
    anchor = ", + the chosen replies' NLL per token" if settings.loss == "orpo" else anchor
    line = (f"objective: DPO ({settings.loss} loss, beta {settings.beta:g}{smoothing}{gamma}{anchor}) on pairs of "
            f"{cfg.dataset}, against {against}\n{DPO_LOG_UNITS}")
    return DPOObjective(settings, reference), reference, line


def precompute(cfg: TrainConfig, raw_model: torch.nn.Module, data_dir: Path, d: Dist,
               rt: Runtime) -> PrecomputedReference:
    """The starting model's log-probabilities of every pair of the splits the run reads (val alone for an
    eval_only run), under the run's autocast, every process scoring its share, with a progress bar on a
    terminal."""
    splits = ("val",) if cfg.eval_only else ("train", "val")
    quiet = not (d.master and sys.stdout.isatty())
    if d.master:
        print(f"dpo: scoring the {' and '.join(splits)} pairs with the starting model (the reference), once",
              flush=True)
    # Under FSDP with the whole weights gathered (as an evaluation): every unit, the root's too, sharded again
    # afterwards, before the optimizer takes the parameters.
    with parallel.gathered(raw_model), tqdm(desc="reference", unit="pair", leave=False, delay=3,
                                            disable=quiet) as bar:
        return PrecomputedReference.compute(raw_model, data_dir, block_size=cfg.block_size, batch_size=cfg.batch_size,
                                            splits=splits, autocast=rt.autocast, rank=d.rank,
                                            world_size=d.world_size, progress=bar.update)


def reference_state(reference) -> dict | None:
    """What a checkpoint keeps of the reference: a precomputed one's tables (None for any other)."""
    return reference.state_dict() if isinstance(reference, PrecomputedReference) else None


def metric_names(objective: Objective) -> tuple[str, ...]:
    """The names of the metrics the objective returns beside its loss (the same on every process, whatever its
    batches: what an evaluation sums across processes)."""
    return getattr(objective, "metric_names", ())


def dropout_note(cfg: TrainConfig) -> str | None:
    """DPO compares the tuned model's log-probabilities with the reference's, computed without dropout: with
    dropout on, they differ from the first step on for that reason alone."""
    rates = [f"{name}={getattr(cfg, name):g}" for name in ("dropout", "lora_dropout")
             if getattr(cfg, name) and (name == "dropout" or cfg.lora_rank)]
    if not is_dpo(cfg) or not rates:
        return None
    return (f"note: {', '.join(rates)} with objective=dpo: the reference is scored without dropout, the tuned "
            f"model with it, so their log-probabilities differ from the first step on for that alone; "
            f"configs/dpo_chat.py sets both to 0")
