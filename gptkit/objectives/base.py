"""The protocol every objective follows: what a run asks of the thing it trains toward. The loop, the step, the
evaluation, the plan and the checkpoints call these methods and never test which objective the run has; a new
objective is a subclass registered by name in gptkit/objectives/__init__.py.

A run meets its objective in this order (gptkit/run.py, train.py):

    objective = make_objective(cfg)                         # cfg.objective's class, holding its own settings
    objective.check_config(cfg)                             # its settings: before anything is read or written
    objective.check_dataset(meta, label)                    # the dataset is of its kind
    cfg = objective.fit_block_size(cfg, data_dir, meta, say)
    objective.check_start(cfg, added_tokens)                # the starting model suits it
    line = objective.start(cfg, raw_model, data_dir, state, d, rt)   # a reference computed, or read back
    loader, val = objective.batches(cfg, data_dir, d, rt)   # after start(): they may read what it readied
    loss, metrics = objective(model, batch)                 # each micro-batch: what gptkit/step.py calls
    checkpoint[objective.state_key] = objective.state_dict()          # when not None (a resume reads it back)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch

from gptkit.errors import UserError
from gptkit.runtime import Dist, Runtime


@contextlib.contextmanager
def evaluating(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The model in eval mode (no dropout) inside the block, in its previous mode afterwards: how a reference
    model (DPO's, GRPO's KL) scores what the trained one is learning."""
    was = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was)


class ObjectiveError(UserError):
    """A run whose objective does not fit its data or its model; the message says why and what to do."""


class Objective:
    """An objective's defaults, those of the next-token loss; a subclass overrides what differs. `cfg`, the
    run's TrainConfig as the command gave it, is kept for the objective's own settings (which do not change
    during setup); a method that depends on the run's shape (block_size, batch_size, fitted during setup) takes
    the current cfg."""

    name: ClassVar[str] = ""
    # the metrics __call__ returns beside the loss, the same names whatever the batch (what an evaluation sums
    # across processes), and those that are means over a part of a batch: that part's share of the batch, by
    # which the evaluation weighs it (gptkit/evaluation.py)
    metric_names: ClassVar[tuple[str, ...]] = ()
    metric_over: ClassVar[dict[str, Any]] = {}
    # the sequences of one item of a micro-batch: what batch_size counts (a preference pair: 2)
    sequences_per_item: ClassVar[int] = 1
    # whether its loss can take the head's matmuls in FP8 (--fp8_head, gptkit/fp8.py: the next-token loss's)
    fp8_head: ClassVar[bool] = False
    # whether the whole step may be captured as one CUDA graph (cuda_graphs): not when a step draws new data
    # between its micro-batches (rollouts)
    graphable: ClassVar[bool] = True
    # what --plan counts for the loss (gptkit/plan/__init__.py's Setup.loss): "next_token" (the sliced cross-entropy) or
    # "sequence_logps" (each sequence's summed log-probability of its reply)
    plan_loss: ClassVar[str] = "next_token"
    # whether a full fine-tune keeps its base's positions (the context) when block_size is shorter; LoRA always
    # does (gptkit/checkpoint/run_model.py)
    keeps_base_context: ClassVar[bool] = False
    # whether the trained model is a chat model whatever the dataset (the run's last line points to chat.py)
    chat: ClassVar[bool] = False
    # the checkpoint key its state_dict is saved under (gptkit/checkpoint/file.py's build_checkpoint `states`)
    state_key: ClassVar[str] = ""

    def __init__(self, cfg):
        self.cfg = cfg

    # ---- before the run
    def check_config(self, cfg) -> None:
        """Its own settings (a ConfigError naming the key): called before anything is read or written. A
        subclass that checks more calls this first."""
        if cfg.fp8_head and not self.fp8_head:
            raise ObjectiveError(f"fp8_head is for the next-token loss, not objective={self.name}: drop "
                                 f"--fp8_head=True")

    def prepare_kind(self) -> str | None:
        """The prepare script its dataset comes from (shards.prepare_command's kind), None: the run's default."""
        return None

    def check_dataset(self, meta: dict, label: str) -> None:
        """Refuse (ObjectiveError) a dataset of another objective's kind; `label`: how to name it."""

    def fit_block_size(self, cfg, data_dir: Path, meta: dict, say: bool = True) -> Any:
        """The run's cfg with block_size fitted to its data (`say`: print a note when it changes)."""
        return cfg

    def plan_block_size(self, cfg, data_dir: Path, ckpt: dict | None) -> Any:
        """The cfg --plan plans: block_size as the run will fit it, where the data on disk tells."""
        return cfg

    def check_start(self, cfg, added_tokens: int) -> None:
        """Refuse a starting model this objective cannot tune (`added_tokens`: the dataset's special tokens it
        lacked)."""

    def answers_only(self, meta: dict) -> bool:
        """Whether the logged loss is over the answer tokens only (a chat dataset's mask)."""
        return False

    # ---- its data and its start
    def batches(self, cfg, data_dir: Path, d: Dist, rt: Runtime) -> tuple[Any, Any]:
        """(the training loader, the validation batches) on this process' device."""
        raise NotImplementedError

    def start(self, cfg, raw_model: torch.nn.Module, data_dir: Path, state: dict | None, d: Dist,
              rt: Runtime) -> str:
        """Ready it for the run's first step, before its batches are made: `raw_model` holds the starting
        weights (of a new run); `state`: what state_dict saved, read back from the checkpoint of a resumed run
        (None: a new run, or nothing saved). Returns the line that says what it optimises ("": nothing to say)."""
        return ""

    def notes(self, cfg) -> list[str]:
        """Notes for the run's first lines (settings that work against it)."""
        return []

    # ---- each micro-batch
    def __call__(self, model: torch.nn.Module, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The micro-batch's loss (0-d, to backpropagate) and its metrics (0-d device tensors)."""
        raise NotImplementedError

    def batch_items(self, batch) -> int:
        """How much `batch` weighs in the evaluation's mean: 1 a batch (all of the same size) by default."""
        return 1

    def trial_batch(self, cfg, raw_model: torch.nn.Module, batch_size: int, device: torch.device):
        """(the micro-batch loss, a micro-batch of batch_size made-up items for it): batch_size=auto's trial step
        (gptkit/plan/batch_size.py) runs the step the run will take on random tokens, before start() (a loss that
        needs what start() readies gets a stand-in of the same cost)."""
        raise NotImplementedError

    def describe_batch(self, cfg) -> str:
        """The micro-batch in words, for the run's first lines."""
        return f"{cfg.batch_size}"

    def plan_notes(self, cfg, items: int) -> list[str]:
        """What --plan says of this objective beside its table (`items`: the micro-batch's, in batch_size's
        unit)."""
        return []

    # ---- its state in the checkpoints
    def state_dict(self) -> dict | None:
        """What a checkpoint keeps of it (under state_key), None: nothing."""
        return None
