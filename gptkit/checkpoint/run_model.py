"""The model a training run trains, beside the loading of models (models.py): built from scratch, resumed from
its checkpoint, or a fine-tune's base loaded with its shape kept (block_size aside), its vocabulary grown by the
dataset's special tokens, and LoRA adapters attached.

    model, added = build_model(cfg, meta, ckpt)       # added: token ids a fine-tune added to its base's vocabulary
    cfg = with_base_shape(cfg, model, argv)           # a fine-tune records its base's shape (a new run only)
    check_vocab(data_dir, meta, model)                # no token id past the model's embedding
    lora_info = attach_lora(cfg, model, ckpt, added)  # adapters, and what the checkpoints record of them
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from gptkit import lora
from gptkit.checkpoint.models import GPT2_BPE, load_base_model, lora_model
from gptkit.cli import UserError
from gptkit.config import TrainConfig, lora_settings
from gptkit.hf_gpt2 import GPT2_NAMES
from gptkit.options import command_line_values, parse_args
from gptkit.shards import TokenDataset
from gptkit.tokenizer import Tokenizer
from model import GPT, GPTConfig

# Scanning every token for out-of-vocabulary ids is cheap for small datasets; above this many tokens we trust
# the shards' meta.json (the prepare scripts check ids on write).
MAX_SCAN_TOKENS = 500_000_000


class ModelError(UserError):
    """A model this run cannot train as asked (its base, its vocabulary, its LoRA settings); the message says
    why and what to do."""


def build_model(cfg: TrainConfig, meta: dict, ckpt: dict | None, keep_context: bool = False) -> tuple[GPT, int]:
    """The run's model, and how many token ids a fine-tune added to its base's vocabulary (special tokens).
    keep_context: a full fine-tune keeps its base's positions beyond block_size (the objective's
    keeps_base_context: DPO's, see below)."""
    vocab = int(meta["vocab_size"])
    if ckpt is not None:
        saved_tok = ckpt.get("tokenizer", {})
        diffs = [f"{k} (checkpoint {saved_tok.get(k)!r}, dataset {meta.get(k)!r})"
                 for k in ("tokenizer", "vocab_size") if saved_tok.get(k) != meta.get(k)]
        if diffs:
            raise ModelError(f"cannot resume on dataset {cfg.dataset!r}: its vocabulary differs: {'; '.join(diffs)}")
        if ckpt.get("lora"):  # its base, from where the run found it, with the saved adapters
            return lora_model(ckpt, cfg.dropout), 0
        # The shape is the checkpoint's; dropout may be changed when continuing a run.
        model = GPT(GPTConfig.from_dict({**ckpt["model_config"], "dropout": cfg.dropout}))
        model.load_state_dict(ckpt["model"])
        return model, 0
    if cfg.init_from == "scratch":
        # Round the embedding up to a multiple of 64 for a BPE vocabulary (50257 -> 50304): faster matmuls.
        return GPT(cfg.model_config(vocab, vocab_multiple=64 if meta["tokenizer"]["kind"] != "char" else 1)), 0
    # Fine-tuning: a GPT-2 name, a Hugging Face folder, or a checkpoint of this project.
    model, tokenizer = load_base_model(cfg.init_from, dropout=cfg.dropout)
    # (a block_size past the base's context: with_base_shape takes the base's, or refuses a --block_size)
    # A full fine-tune changes every weight at the first block_size positions only, so the model keeps those
    # (as nanoGPT does): the rows beyond would no longer match the network, and weight decay would shrink
    # them. A LoRA run keeps its frozen base whole, all positions included: block_size only limits the
    # training sequences, and the merged model still has the base's context. So does DPO (keep_context), whose block_size
    # is its pairs' length (a chat model keeps its context for conversations; its small steps barely move the
    # positions beyond).
    if cfg.block_size < model.config.block_size and not cfg.lora_rank and not keep_context:
        model.crop_block_size(cfg.block_size)
    added = 0
    if meta["tokenizer"] != tokenizer and added_special_tokens(tokenizer, meta):
        # The base's tokenizer plus special tokens (a chat dataset's): the model learns them from here on.
        added = vocab - model.config.vocab_size
        model.grow_vocab(vocab)
    elif meta["tokenizer"] == tokenizer and vocab > model.config.vocab_size:
        name = "GPT-2's BPE" if tokenizer == GPT2_BPE else "the tokenizer it was trained with"
        raise ModelError(f"{cfg.init_from} has a vocabulary of {model.config.vocab_size} tokens, fewer than the "
                         f"{vocab} of its tokenizer ({name}, which dataset {cfg.dataset!r} is tokenized with): "
                         f"the model and its tokenizer do not belong together; fine-tune a model whose vocab_size "
                         f"is {vocab}")
    elif meta["tokenizer"] != tokenizer:
        hint = ("prepare it with --tokenizer gpt2 (e.g. python prepare/shakespeare.py)" if tokenizer == GPT2_BPE
                else "prepare it with the same tokenizer")
        raise ModelError(f"dataset {cfg.dataset!r} is not tokenized with the tokenizer {cfg.init_from} was "
                         f"trained with ({tokenizer}); {hint}")
    return model, added


def with_base_shape(cfg: TrainConfig, model: GPT, argv: list[str], say: bool = True) -> TrainConfig:
    """A fine-tune's model has its base's shape (block_size aside, which may crop it): a shape setting that the
    command or its config files set to another value is a one-line error, and the run's config (config.json,
    the checkpoints) records the base's values, what ran. A block_size past the base's context is an error when
    the command line asks for it; from a config file (configs/finetune_chat.py's GPT-2 context, on a smaller
    base) the run takes the base's context and says so (`say`)."""
    values, ran = parse_args(TrainConfig, argv), model.config.to_dict()
    if cfg.block_size > model.config.block_size:
        context = model.config.block_size
        if "block_size" in command_line_values(TrainConfig, argv):
            raise ModelError(f"block_size {cfg.block_size} exceeds {cfg.init_from}'s context of {context}; use "
                             f"--block_size={context} or less")
        if say:
            print(f"note: block_size {cfg.block_size} (the config file's) exceeds {cfg.init_from}'s context of "
                  f"{context}: this fine-tune uses block_size={context}, its base's context", flush=True)
        cfg = dataclasses.replace(cfg, block_size=context)
    keys = [k for k in GPTConfig.shape_names() if k != "block_size"]
    differing = [f"{k}={values[k]!r} (the base has {ran[k]!r})" for k in keys
                 if values.get(k) is not None and values[k] != ran[k]]
    if differing:
        raise ModelError(f"{cfg.init_from} decides the model's shape, and this run sets another: "
                         f"{'; '.join(differing)}; drop these settings to fine-tune it, or train a new model with "
                         f"--init_from=scratch")
    return dataclasses.replace(cfg, **{k: ran[k] for k in keys})


def added_special_tokens(base_spec: dict | None, meta: dict) -> bool:
    """Whether the dataset's tokenizer is the base model's with special tokens added after its last id (what
    prepare/chat.py makes of a base's tokenizer), the only change of vocabulary a fine-tune can take."""
    if base_spec is None:
        return False
    base, data = Tokenizer.from_meta(base_spec), Tokenizer.from_meta(meta)
    return data.vocab_size > base.vocab_size and base.with_special(data.special) == data


def attach_lora(cfg: TrainConfig, model: GPT, ckpt: dict | None, added_tokens: int = 0) -> dict | None:
    """With lora_rank > 0, freeze the model and give it adapters; returns what the checkpoints record about
    them (settings, and the base's name and fingerprint). A resumed LoRA run has its adapters already.
    With added_tokens (new special tokens: their embedding rows start at the mean and must be learnt), the
    token embedding (and an untied head) is trained as a whole too, and saved with the adapters."""
    settings = lora_settings(cfg)
    if ckpt is not None:
        saved = ckpt.get("lora")
        if (saved or {}).get("settings") != (settings.to_dict() if settings else None):
            raise ModelError(f"cannot resume {cfg.out_dir}/last.pt with other LoRA settings than it was trained "
                             f"with ({(saved or {}).get('settings')}); start a new run")
        return saved
    if settings is None:
        return None
    if cfg.init_from == "scratch":
        raise ModelError("LoRA adapts a trained model: set --init_from to a GPT-2 name, a Hugging Face GPT-2 "
                         "folder or a checkpoint of this project (e.g. an out_dir), or set --lora_rank=0")
    # A local base is recorded by its absolute path: the checkpoint must find it from anywhere.
    where = cfg.init_from if cfg.init_from in GPT2_NAMES else str(Path(cfg.init_from).resolve())
    info = {"settings": settings.to_dict(), "base": {"init_from": where, "fingerprint": lora.fingerprint(
        model.state_dict())}, "train_embeddings": bool(added_tokens)}
    lora.apply(model, settings)
    if added_tokens:
        lora.unfreeze_embeddings(model)
    return info


def check_vocab(data_dir: Path, meta: dict, model: GPT) -> None:
    """Catch token ids the model has no embedding for now, not as an index error deep inside a step."""
    if int(meta["vocab_size"]) > model.config.vocab_size:
        raise ModelError(f"dataset vocab_size {meta['vocab_size']} exceeds the model's {model.config.vocab_size}")
    for split in ("train", "val"):
        ds = TokenDataset(data_dir, split)
        if len(ds) <= MAX_SCAN_TOKENS and ds.max_token() >= model.config.vocab_size:
            raise ModelError(f"{split} split of {data_dir} holds token id {ds.max_token()} >= the model's "
                             f"vocab_size {model.config.vocab_size}; re-prepare the dataset")
