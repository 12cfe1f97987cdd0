"""The models that checkpoints hold, rebuilt: a checkpoint's GPT (a LoRA run's on its base, checked against the
base's fingerprint), the base a fine-tuning run starts from (a GPT-2 name or folder, a checkpoint of this project
or nanoGPT's), and for the scripts that sample (sample.py, eval.py, chat.py, serve.py) a model with its
tokenizer: `load_model(ckpt, init_from)`, or `load_model_and_settings` with the settings of the run that wrote
it."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from gptkit import lora
from gptkit.checkpoint.file import load_checkpoint
from gptkit.checkpoint.layout import CheckpointError, find_checkpoint, holds_checkpoint
from gptkit.cli import one_line
from gptkit.errors import DataError, UserError
from gptkit.gguf_load import is_gguf, load_gguf
from gptkit.hf_gpt2 import GPT2_NAMES, load_pretrained
from gptkit.hf_tokenizer import GPTKIT_FILE
from gptkit.options import read_config_file
from gptkit.tokenizer import Tokenizer
from model import GPT, GPTConfig


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


CONFIGS = Path(__file__).resolve().parents[2] / "configs"  # the recipes, whose out_dir a later recipe starts from


def no_run_yet(init_from: str) -> str | None:
    """When `init_from` names a run folder that holds no checkpoint yet (no best.pt, last.pt, nor a Hugging Face
    config.json), what to say: that it has none, and which recipe of configs/ makes it (its out_dir); else None."""
    path = Path(init_from)
    if init_from in GPT2_NAMES or holds_checkpoint(path) or (path / "config.json").is_file():
        return None
    recipes = []
    for config in sorted(CONFIGS.glob("*.py")):
        try:
            out_dir = read_config_file(str(config)).get("out_dir")
        except UserError:
            continue
        if out_dir is not None and Path(out_dir) == path:
            recipes.append(f"python train.py configs/{config.name}")
    if recipes:
        return (f"{init_from}/ has no checkpoint yet (no best.pt or last.pt); make it first with "
                f"{' or '.join(recipes)}")
    if path.is_dir():
        return f"{init_from}/ holds no checkpoint (best.pt or last.pt) nor a Hugging Face config.json"
    return None


def load_base_model(init_from: str, dropout: float = 0.0) -> tuple[GPT, dict | None]:
    """The model a fine-tuning run starts from, and the tokenizer it was trained with: a GPT-2 name or a local
    Hugging Face GPT-2 folder (the GPT-2 BPE), or a checkpoint of this project (a .pt file or a sharded folder,
    or a run's out_dir holding best.pt or last.pt, or their sharded folders; its own tokenizer), or nanoGPT's."""
    path = Path(init_from)
    missing = no_run_yet(init_from)
    if missing:
        raise CheckpointError(missing)
    if init_from in GPT2_NAMES or not holds_checkpoint(path):
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
    is given; a GGUF file of export.py's too: gptkit/gguf_load.py) or GPT-2 weights (`init_from`: a GPT-2 name
    or a local Hugging Face folder). Returns the model (on the CPU, in eval mode), its tokenizer, and a few
    words saying what was loaded."""
    model, tokenizer, what, _ = load_model_and_settings(ckpt, init_from)
    return model, tokenizer, what


def load_model_and_settings(ckpt: str = "", init_from: str = "") -> tuple[GPT, Tokenizer, str, dict]:
    """load_model's three, and the settings of the run that wrote the checkpoint (train.py's config, e.g. its
    dataset; nanoGPT's for its ckpt.pt); {} for GPT-2 weights, which record none."""
    settings: dict = {}
    if init_from:
        if init_from not in GPT2_NAMES and holds_checkpoint(init_from):
            raise CheckpointError(f"{init_from} is a checkpoint of this project, not Hugging Face GPT-2 weights: "
                                  f"pass it as --ckpt {init_from}")
        model = _load_pretrained(init_from)  # a bad name or folder is an HFGPT2Error: a UserError
        tokenizer = _pretrained_tokenizer(init_from)
        what = f"GPT-2 weights {init_from}"
    elif ckpt and is_gguf(ckpt):  # a GGUF file of export.py's, read back as it is
        model, tokenizer, what = load_gguf(ckpt)
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
        found = state.get("config") or state.get("nanogpt_config")
        settings = found if isinstance(found, dict) else {}
    if model.config.vocab_size < tokenizer.vocab_size:
        # The text could then hold ids the embedding has no row for.
        raise CheckpointError(
            f"the model has {model.config.vocab_size} tokens but its tokenizer {tokenizer.vocab_size}; "
            "the checkpoint and its tokenizer do not belong together"
        )
    return model.eval(), tokenizer, what, settings


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
