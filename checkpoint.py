"""Checkpoint files: atomic saves, safe loads, and finding the checkpoint in an out_dir.

A checkpoint is a dict of tensors and plain Python values (no pickled classes), so it loads with
`torch.load(weights_only=True)`; the model state is the unwrapped model's (no `module.` / `_orig_mod.` prefixes).
Keys written by train.py:
    format, model_config, model, tokenizer (the dataset's meta.json), step, best_val_loss, config, argv,
    versions, and for resuming: optimizer, scaler, loader, rng.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

from cli import UserError
from files import atomic_write
from model import GPT, GPTConfig

FORMAT_VERSION = 1
TRAIN_HINT = "train one with: python train.py configs/shakespeare.py"
# What a checkpoint needs beyond the weights to continue its run exactly.
RESUME_KEYS = ("config", "model_config", "model", "optimizer", "scaler", "loader", "rng", "step", "best_val_loss")


class CheckpointError(UserError):
    """A missing, unreadable or incompatible checkpoint; the message names the path and the fix."""


def save_checkpoint(obj: dict, path: str | Path) -> None:
    """Write atomically: a crash mid-save leaves the old file intact."""
    with atomic_write(path) as tmp, open(tmp, "wb") as f:
        torch.save(obj, f)


def build_checkpoint(*, model, optimizer, scaler, loader, meta: dict, config: dict, argv: list[str], step: int,
                     best_val_loss: float, rng: list[dict], versions: dict) -> dict:
    """The checkpoint of a training run: a plain function of the run's state. `model` is the unwrapped
    model; `rng` holds every rank's RNG states (the dropout streams), in rank order."""
    return {
        "format": FORMAT_VERSION, "model_config": model.config.to_dict(), "model": model.state_dict(),
        "tokenizer": meta, "step": step, "best_val_loss": best_val_loss, "config": config,
        "argv": ["train.py", *argv], "versions": versions, "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(), "loader": loader.state_dict(), "rng": rng,
    }


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint file as given, or in a folder best.pt if present, else last.pt."""
    p = Path(path)
    if p.is_file():
        return p
    if p.is_dir():
        for name in ("best.pt", "last.pt"):
            if (p / name).is_file():
                return p / name
        raise CheckpointError(f"no checkpoint (best.pt or last.pt) in {p}/; {TRAIN_HINT}")
    raise CheckpointError(f"checkpoint {p} does not exist; {TRAIN_HINT}")


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu", mmap: bool = True) -> dict:
    """Load a checkpoint safely. Memory-mapped by default, so tensors that are never used (the optimizer's,
    when sampling) are never read from disk."""
    p = find_checkpoint(path)
    try:
        ckpt = torch.load(p, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        # torch's message is long; the line naming the refused global is the useful one
        first = next((line for line in lines if "WeightsUnpickler error" in line), lines[0] if lines else "unsafe")
        raise CheckpointError(f"refusing to load {p}: it is not a plain-tensor checkpoint ({first})") from None
    except (RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f"cannot read checkpoint {p}: {str(e).splitlines()[0]}; it may be truncated") from None
    if not isinstance(ckpt, dict) or "model" not in ckpt or "model_config" not in ckpt:
        raise CheckpointError(f"{p} is not a checkpoint written by train.py (no model/model_config keys)")
    if ckpt.get("format", 0) > FORMAT_VERSION:
        raise CheckpointError(f"{p} has checkpoint format {ckpt['format']}; this code reads up to {FORMAT_VERSION}")
    return ckpt


def model_from_checkpoint(ckpt: dict, device: str | torch.device = "cpu") -> GPT:
    """Rebuild the GPT a checkpoint holds (weights only)."""
    model = GPT(GPTConfig.from_dict(ckpt["model_config"]))
    model.load_state_dict(ckpt["model"])
    return model.to(device)
