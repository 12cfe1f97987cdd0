"""The default objective: the next-token cross-entropy on windows of the dataset's tokens (pretraining, a
fine-tune on text or on conversations, LoRA). Its batches are gptkit/data/loader.py's (x, y) windows, its loss
gptkit/step.py's next_token_loss."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from gptkit.data.loader import BatchLoader, ValBatches
from gptkit.data.pairs import is_preference_dataset
from gptkit.objectives.base import Objective, ObjectiveError
from gptkit.runtime import Dist, Runtime
from gptkit.step import next_token_loss


class NextToken(Objective):
    name = "next_token"
    fp8_head = True

    def check_dataset(self, meta: dict, label: str) -> None:
        if is_preference_dataset(meta):
            raise ObjectiveError(f"dataset {label} holds preference pairs (prepare/preference.py), which the "
                                 f"next-token loss does not train on; add --objective=dpo (configs/dpo_chat.py), "
                                 f"or prepare conversations with prepare/chat.py")

    def fit_block_size(self, cfg, data_dir: Path, meta: dict, say: bool = True):
        """A fine-tune on a dataset too small for its block_size (a split shorter than one window of
        block_size + 1 tokens: a few conversations) trains on the longest windows both splits hold, and says so.
        A run from scratch keeps its block_size, the shape of its model (the loader's error says what to change),
        and so does batch_size=auto, whose tokens_per_step is whole sequences of block_size."""
        if cfg.init_from in ("scratch", "resume") or cfg.batch_size is None:
            return cfg
        held = min(int(meta["splits"][s]["tokens"]) for s in ("train", "val"))
        if held > cfg.block_size or held < 2:
            return cfg
        if say:
            split = min(("train", "val"), key=lambda s: int(meta["splits"][s]["tokens"]))
            print(f"note: the {split} split of dataset {cfg.dataset!r} has {held} tokens, fewer than block_size+1 = "
                  f"{cfg.block_size + 1}: this fine-tune uses block_size={held - 1}, the longest window it holds (a "
                  f"full fine-tune's model keeps that context); more data allows a longer one", flush=True)
        return dataclasses.replace(cfg, block_size=held - 1)

    def answers_only(self, meta: dict) -> bool:
        """A chat dataset's loss is over the assistant's replies (its mask), unless it trains on all tokens."""
        chat = meta.get("chat") or {}
        return bool(meta["splits"]["train"].get("masks")) and chat.get("train_on") != "all"

    def batches(self, cfg, data_dir: Path, d: Dist, rt: Runtime):
        common = dict(batch_size=cfg.batch_size, block_size=cfg.block_size, rank=d.rank, world_size=d.world_size,
                      device=rt.device)
        return (BatchLoader(data_dir, "train", seed=cfg.seed, mode=cfg.data_mode, **common),
                ValBatches(data_dir, "val", n_batches=cfg.eval_iters, **common))

    def __call__(self, model: torch.nn.Module, batch):
        return next_token_loss(model, batch)

    def trial_batch(self, cfg, raw_model: torch.nn.Module, batch_size: int, device: torch.device):
        x = torch.randint(raw_model.config.vocab_size, (batch_size, cfg.block_size), device=device)
        return self, (x, x)
