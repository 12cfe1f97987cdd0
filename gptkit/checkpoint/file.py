"""Checkpoint files: the dict a training run saves, written atomically with its checksums, and read back safely
and verified, whatever form it has on disk (a file, a sharded folder, nanoGPT's ckpt.pt).

A checkpoint is a dict of tensors and plain Python values (no pickled classes), so it loads with
`torch.load(weights_only=True)`; the model state is the unwrapped model's (no `module.` / `_orig_mod.` prefixes).
Keys written by train.py:
    format, model_config, model, tokenizer (the dataset's meta.json; for a trained BPE with its files inline,
    so the checkpoint needs no data/ folder), step, best_val_loss, config, argv, versions, and for resuming:
    optimizer, scaler, loader, rng; and the state of each other part of the run that has one, under its own
    key (a DPO run's precomputed reference log-probabilities: dpo_reference).

Every checkpoint carries checksums (gptkit/checksum.py): a CRC-32C of each tensor and of everything else
("checksums"). load_checkpoint verifies them, so every reader does (resume, sample, eval, chat, serve, export):
a changed byte is a one-line error naming the file and the tensor and the checkpoint to use instead
(gptkit/checkpoint/damage.py). One saved before checksums loads with a note.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import torch

from gptkit import checksum, lora, nanogpt
from gptkit.checkpoint.damage import check_container, corrupt, first_sentence, verify
from gptkit.checkpoint.layout import CheckpointError, find_checkpoint, is_sharded_checkpoint, remove_folders
from gptkit.checkpoint.sharded import read as read_sharded
from gptkit.checkpoint.sharded import verify_folder
from gptkit.files import atomic_write
from gptkit.tokenizer import with_tokenizer_files

FORMAT_VERSION = 1
# What a checkpoint needs beyond the weights to continue its run exactly.
RESUME_KEYS = ("config", "model_config", "model", "optimizer", "scaler", "loader", "rng", "step", "best_val_loss")


def build_checkpoint(*, model, optimizer, scaler, loader, meta: dict, config: dict, argv: list[str], step: int,
                     best_val_loss: float, rng: list[dict], versions: dict, lora_info: dict | None = None,
                     sharded: bool = False, states: dict[str, dict | None] | None = None) -> dict:
    """The checkpoint of a training run: a plain function of the run's state. `model` is the unwrapped
    model; `rng` holds every rank's RNG states (the dropout streams), in rank order. A LoRA run (lora_info:
    its settings and its base's name and fingerprint) stores only the adapters of the model. A trained
    tokenizer's files travel inside (`with_tokenizer_files`): sampling, serving and exporting need no data/.
    sharded: the record of a sharded checkpoint, without the model and optimizer (save_sharded writes them).
    states: the state_dict of each other part of the run, under its key (a part with nothing to keep: None,
    left out); a resume hands each back to its part (the objective's: gptkit/objectives/)."""
    state = {
        "format": FORMAT_VERSION, "model_config": model.config.to_dict(), "lora": lora_info,
        "tokenizer": with_tokenizer_files(meta), "step": step, "best_val_loss": best_val_loss, "config": config,
        "argv": ["train.py", *argv], "versions": versions, "scaler": scaler.state_dict(),
        "loader": loader.state_dict(), "rng": rng,
    }
    for key, part in (states or {}).items():
        if key in state:
            raise ValueError(f"a part of the run saves its state under {key!r}, a key the checkpoint uses already")
        if part is not None:
            state[key] = part
    if not sharded:
        state["model"] = lora.adapter_state_dict(model) if lora_info else model.state_dict()
        state["optimizer"] = optimizer.state_dict()
    return state


def save_checkpoint(obj: dict, path: str | Path) -> None:
    """Write atomically, with a checksum of every tensor and of the rest (gptkit/checksum.py) that every load
    verifies: a crash mid-save leaves the old file intact. A sharded checkpoint of the same name
    (out_dir/last/ for out_dir/last.pt: a run that went on without FSDP) is removed once the file is written."""
    obj = {**obj, checksum.KEY: checksum.record(obj)}
    with atomic_write(path) as tmp, open(tmp, "wb") as f:
        torch.save(obj, f)
    path = Path(path)
    if path.suffix == ".pt" and is_sharded_checkpoint(path.with_suffix("")):
        remove_folders(path.with_suffix(""))


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu", mmap: bool = True,
                    damaged_optimizer: str | None = None) -> dict:
    """Load a checkpoint safely, verifying all its checksums. Memory-mapped by default (sample, eval, export:
    readers of the weights), where damage in the optimizer state alone is a one-line note and the optimizer
    state is left out of the dict; mmap=False (a resumed run) reads everything and refuses any damage.
    damaged_optimizer ("note" or "error") overrides what mmap chooses.

    A sharded checkpoint (a folder) comes as the same dict, its model's weights whole, without the optimizer
    state (load_sharded_optimizer restores that) and with "sharded": the folder. nanoGPT's ckpt.pt comes
    converted (gptkit/nanogpt.py)."""
    p = find_checkpoint(path)
    damaged_optimizer = damaged_optimizer or ("note" if mmap else "error")
    if p.is_dir():
        return read_sharded(p, map_location, damaged_optimizer)
    check_container(p)
    # Reading everything into memory: mapped, then copied and checked in one pass (damage.verify's copy)
    read_once = not mmap and torch.device(map_location).type == "cpu"
    try:
        ckpt = torch.load(p, map_location=map_location, weights_only=True, mmap=mmap or read_once)
    except pickle.UnpicklingError as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        # torch's message is long; the line naming the refused global is the useful one
        first = next((line for line in lines if "WeightsUnpickler error" in line), lines[0] if lines else "unsafe")
        raise CheckpointError(f"refusing to load {p}: it is not a plain-tensor checkpoint ({first})") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        # torch's first sentence only: the rest is its advice, or a raw mmap or zip-library message
        raise corrupt(p, f"it cannot be read ({first_sentence(e)}); it may be truncated") from None
    if nanogpt.is_nanogpt(ckpt):
        print(f"note: {p} is a nanoGPT checkpoint: it carries no checksums, so damage to it cannot be detected",
              file=sys.stderr)
        return nanogpt.convert(ckpt, p)
    if not isinstance(ckpt, dict) or "model" not in ckpt or "model_config" not in ckpt:
        raise CheckpointError(f"{p} is not a checkpoint written by train.py (no model/model_config keys)")
    if ckpt.get("format", 0) > FORMAT_VERSION:
        raise CheckpointError(f"{p} has checkpoint format {ckpt['format']}; this code reads up to {FORMAT_VERSION}")
    verify(ckpt, p, damaged_optimizer, copy=read_once)
    return ckpt


def verify_checkpoint(path: str | Path) -> None:
    """Check a saved checkpoint (a file or a sharded folder) through, all its checksums, the optimizer state's
    included, keeping nothing in memory (a file memory-mapped, a folder's shards checked in place): returns
    when it is whole, else raises the error a reader would meet (CorruptCheckpointError for damage)."""
    p = Path(path)
    if p.is_dir():
        verify_folder(p)
    else:
        load_checkpoint(p, mmap=True, damaged_optimizer="error")
