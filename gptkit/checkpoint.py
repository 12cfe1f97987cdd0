"""Checkpoint files: atomic saves, safe loads, finding the checkpoint in an out_dir, and loading a model with
its tokenizer for the scripts that use one (sample.py, eval.py): `load_model(ckpt, init_from)`.

A checkpoint is a dict of tensors and plain Python values (no pickled classes), so it loads with
`torch.load(weights_only=True)`; the model state is the unwrapped model's (no `module.` / `_orig_mod.` prefixes).
Keys written by train.py:
    format, model_config, model, tokenizer (the dataset's meta.json; for a trained BPE with its files inline,
    so the checkpoint needs no data/ folder), step, best_val_loss, config, argv, versions, and for resuming:
    optimizer, scaler, loader, rng.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch

from gptkit import lora
from gptkit.cli import UserError, one_line
from gptkit.files import atomic_write
from gptkit.hf_gpt2 import GPT2_NAMES, load_pretrained
from gptkit.hf_tokenizer import GPTKIT_FILE
from gptkit.shards import DataError
from gptkit.tokenizer import Tokenizer, with_tokenizer_files
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
                     best_val_loss: float, rng: list[dict], versions: dict, lora_info: dict | None = None) -> dict:
    """The checkpoint of a training run: a plain function of the run's state. `model` is the unwrapped
    model; `rng` holds every rank's RNG states (the dropout streams), in rank order. A LoRA run (lora_info:
    its settings and its base's name and fingerprint) stores only the adapters of the model. A trained
    tokenizer's files travel inside (`with_tokenizer_files`): sampling, serving and exporting need no data/."""
    weights = lora.adapter_state_dict(model) if lora_info else model.state_dict()
    return {
        "format": FORMAT_VERSION, "model_config": model.config.to_dict(), "model": weights, "lora": lora_info,
        "tokenizer": with_tokenizer_files(meta), "step": step, "best_val_loss": best_val_loss, "config": config,
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


def model_from_checkpoint(ckpt: dict, device: str | torch.device = "cpu", merge_lora: bool = True) -> GPT:
    """Rebuild the GPT a checkpoint holds (weights only). A LoRA run's checkpoint holds only its adapters: its
    base model is loaded from where the run took it, checked against its fingerprint, and the adapters are
    put on it and, with merge_lora, folded into its weights (an ordinary GPT computing the same function)."""
    if ckpt.get("lora"):
        model = lora_model(ckpt)
        return (lora.merge(model) if merge_lora else model).to(device)
    model = GPT(GPTConfig.from_dict(ckpt["model_config"]))
    model.load_state_dict(ckpt["model"])
    return model.to(device)


# ----------------------------------------------------------------------------- fine-tuning bases and LoRA


GPT2_BPE = {"kind": "tiktoken", "name": "gpt2"}


def load_base_model(init_from: str, dropout: float = 0.0) -> tuple[GPT, dict | None]:
    """The model a fine-tuning run starts from, and the tokenizer it was trained with: a GPT-2 name or a local
    Hugging Face GPT-2 folder (the GPT-2 BPE), or a checkpoint of this project (a .pt file, or a run's out_dir
    holding best.pt or last.pt; its own tokenizer)."""
    path = Path(init_from)
    ours = path.is_file() or (path.is_dir() and any((path / n).is_file() for n in ("best.pt", "last.pt")))
    if init_from in GPT2_NAMES or not ours:
        return load_pretrained(init_from, dropout=dropout), GPT2_BPE  # a bad name or folder: an HFGPT2Error
    ckpt = load_checkpoint(path)
    model = model_from_checkpoint(ckpt)
    model.config.dropout = dropout
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = dropout
    meta = ckpt.get("tokenizer") or {}
    return model, meta.get("tokenizer")


def lora_base(ref: dict, block_size: int, dropout: float = 0.0, vocab_size: int | None = None) -> GPT:
    """The base model a LoRA checkpoint names, with the checkpoint's block_size (the base's own; runs written
    before LoRA kept its base whole cropped it) and vocab_size (a run that added special tokens grew the base's
    vocabulary, deterministically, before the fingerprint was taken); refused unless it is the very model the
    adapters were trained on."""
    try:
        base, _ = load_base_model(ref["init_from"], dropout)
    except UserError as e:
        raise CheckpointError(f"cannot load the base model {ref['init_from']!r} of this LoRA checkpoint ({e}); "
                              f"make it available where the run found it") from None
    if base.config.block_size > block_size:
        base.crop_block_size(block_size)
    if vocab_size is not None and vocab_size > base.config.vocab_size:
        base.grow_vocab(vocab_size)
    found = lora.fingerprint(base.state_dict())
    # Checkpoints written before GPT-2 weights were loaded with a padded vocabulary fingerprinted them without
    # the padding rows: the same weights, so they are accepted too.
    if found != ref["fingerprint"] and lora.fingerprint(_without_vocab_padding(base)) != ref["fingerprint"]:
        raise CheckpointError(f"the base model {ref['init_from']!r} is not the one these LoRA adapters were "
                              f"trained on (fingerprint {found}, expected {ref['fingerprint']}); restore that base")
    return base


def _without_vocab_padding(model: GPT) -> dict[str, torch.Tensor]:
    """The model's state dict with the token embedding and head cut to the real vocabulary (views)."""
    c = model.config
    return {k: v[: c.vocab_size] if k in ("transformer.wte.weight", "lm_head.weight") else v
            for k, v in model.state_dict().items()}


def lora_model(ckpt: dict, dropout: float = 0.0) -> GPT:
    """A LoRA checkpoint's base with its adapters on (unmerged, trainable adapters, frozen base)."""
    info = ckpt["lora"]
    config = ckpt["model_config"]
    model = lora_base(info["base"], config["block_size"], dropout, config["vocab_size"])
    lora.apply(model, lora.LoRASettings(**info["settings"]))
    if info.get("train_embeddings"):
        lora.unfreeze_embeddings(model)
    lora.load_adapters(model, ckpt["model"])
    return model


# ----------------------------------------------------------------------------- a model and its tokenizer


def load_model(ckpt: str = "", init_from: str = "") -> tuple[GPT, Tokenizer, str]:
    """What sample.py and eval.py run: a trained checkpoint (`ckpt`: a file or an out_dir, 'out' when neither
    is given) or GPT-2 weights (`init_from`: a GPT-2 name or a local Hugging Face folder). Returns the model
    (on the CPU, in eval mode), its tokenizer, and a few words saying what was loaded."""
    if init_from:
        model = _load_pretrained(init_from)  # a bad name or folder is an HFGPT2Error: a UserError
        tokenizer = _pretrained_tokenizer(init_from)
        what = f"GPT-2 weights {init_from}"
    else:
        path = find_checkpoint(ckpt or "out")
        state = load_checkpoint(path, map_location="cpu")
        try:
            model = model_from_checkpoint(state)
        except (ValueError, RuntimeError, TypeError) as e:  # a bad model_config, or weights of another shape
            raise CheckpointError(f"{path}: cannot rebuild its model: {one_line(e)}") from None
        tokenizer = _checkpoint_tokenizer(state, path)
        step = state.get("step")
        what = f"{path}" + (f" (step {step})" if step is not None else "")
    if model.config.vocab_size < tokenizer.vocab_size:
        # The text could then hold ids the embedding has no row for.
        raise CheckpointError(
            f"the model has {model.config.vocab_size} tokens but its tokenizer {tokenizer.vocab_size}; "
            "the checkpoint and its tokenizer do not belong together"
        )
    return model.eval(), tokenizer, what


def _load_pretrained(name_or_path: str) -> GPT:
    try:
        return load_pretrained(name_or_path)
    except ModuleNotFoundError as e:  # the Hub names need huggingface_hub: a dependency, maybe not installed
        raise CheckpointError(
            f"cannot load GPT-2 weights {name_or_path!r}: {one_line(e)}; install it (pip install {e.name})"
        ) from None


def _pretrained_tokenizer(name_or_path: str) -> Tokenizer:
    """Every OpenAI GPT-2 shares one BPE vocabulary. A folder exported by export.py carries our own description
    of its tokenizer (GPTKIT_FILE: any kind, special tokens included); older exports of character-level
    models carry their characters in char_vocab.json."""
    if name_or_path not in GPT2_NAMES:
        for name in (GPTKIT_FILE, "char_vocab.json"):
            path = Path(name_or_path) / name
            if path.is_file():
                try:
                    meta = json.loads(path.read_text(encoding="utf-8"))
                    if not isinstance(meta, dict):
                        raise DataError("it does not hold a JSON object")
                    return Tokenizer.from_meta(meta)
                except (OSError, ValueError, DataError) as e:  # unreadable, not JSON (or UTF-8), not a tokenizer
                    raise CheckpointError(f"cannot use {path}: {one_line(e)}") from None
    return Tokenizer.tiktoken("gpt2")


def _checkpoint_tokenizer(ckpt: dict, path: Path) -> Tokenizer:
    meta = ckpt.get("tokenizer")
    if meta is None:  # never guess a tokenizer: a wrong one prints fluent-looking garbage
        raise CheckpointError(f"{path} stores no tokenizer; it was not written by train.py")
    try:
        return Tokenizer.from_meta(meta)
    except DataError as e:
        raise CheckpointError(f"{path}: its tokenizer entry is unusable: {e}") from None
