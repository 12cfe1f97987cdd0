"""nanoGPT's checkpoints, read as this project's: a nanoGPT user's `out/ckpt.pt` samples, evaluates, exports,
chats, serves and fine-tunes here as it is.

nanoGPT's train.py saves one dict: `model` (its GPT's state dict: `_orig_mod.` before every key when the model
was compiled), `model_args` (n_layer, n_head, n_embd, block_size, bias, vocab_size, dropout), `optimizer`,
`iter_num`, `best_val_loss` and `config` (the run's settings). Its GPT is GPT-2's, with nn.Linear layers as ours
(so no weight is transposed), a causal-mask buffer `attn.bias` in each block on old PyTorch versions (dropped:
our attention needs none) and the head tied to the token embedding, as ours.

The tokenizer is not in the checkpoint: a character-level run's is the `meta.pkl` (stoi, itos, vocab_size) of
its dataset, which nanoGPT reads from data/DATASET/meta.pkl relative to the working directory. It is looked for
beside the checkpoint first (copy it there to keep them together), then there; without one the model is taken
to use GPT-2's BPE, as nanoGPT's sample.py does, unless its vocabulary is too small for it.

nanoGPT's MLP uses the exact (erf) GELU (nn.GELU()), where GPT-2 uses the tanh approximation: the converted
model config says activation="gelu", so the logits are nanoGPT's (the tanh form moves a trained model's by
~1e-4 to 1e-3, enough to change greedy samples), and every checkpoint saved from it (a fine-tuned run) keeps it.
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path

from gptkit.errors import UserError
from model import GPTConfig

CKPT_NAME = "ckpt.pt"  # the one checkpoint file nanoGPT's train.py writes into its out_dir
GPT2_VOCAB = 50257
_MASK_BUFFER = re.compile(r"^transformer\.h\.\d+\.attn\.bias$")
_ARGS = ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size")
NANOGPT_ACTIVATION = "gelu"  # its MLP's nn.GELU(): the exact erf form (GPTConfig.activation)


class NanoGPTError(UserError):
    """A nanoGPT checkpoint or meta.pkl that cannot be used; the message says why and what to do."""


def is_nanogpt(obj) -> bool:
    """Whether a loaded checkpoint is nanoGPT's (its model and model_args; none of our keys)."""
    return isinstance(obj, dict) and "model_args" in obj and "model" in obj and "model_config" not in obj


def convert(obj: dict, path: Path) -> dict:
    """A nanoGPT checkpoint as this project's checkpoint dict (weights, model_config, tokenizer, step,
    best_val_loss; nanoGPT's settings under "nanogpt_config"). Its optimizer state is left out: a nanoGPT run
    is fine-tuned from here, not resumed."""
    args = obj["model_args"]
    if not isinstance(obj["model"], dict):
        raise NanoGPTError(f"{path} is a nanoGPT checkpoint whose model entry is not a state dict")
    if not isinstance(args, dict) or any(k not in args for k in _ARGS):
        raise NanoGPTError(f"{path} is a nanoGPT checkpoint without its model_args ({', '.join(_ARGS)})")
    config = obj.get("config") if isinstance(obj.get("config"), dict) else {}
    meta = tokenizer_meta(config, path, int(args["vocab_size"]))
    vocab = int(meta["vocab_size"])
    model_vocab = int(args["vocab_size"])
    # nanoGPT pads GPT-2's 50257 to 50304 rows; ours keeps the real size and pads by vocab_multiple instead,
    # so the padding rows are never sampled.
    multiple = 64 if vocab < model_vocab and -(-vocab // 64) * 64 == model_vocab else 1
    try:
        model_config = GPTConfig(
            n_layer=int(args["n_layer"]), n_head=int(args["n_head"]), n_embd=int(args["n_embd"]),
            block_size=int(args["block_size"]), bias=bool(args["bias"]), dropout=float(args.get("dropout", 0.0)),
            vocab_size=vocab if multiple > 1 else model_vocab, vocab_multiple=multiple, arch="gpt2",
            activation=NANOGPT_ACTIVATION,
        )
    except (TypeError, ValueError) as e:
        raise NanoGPTError(f"{path}: its model_args do not describe a GPT ({e})") from None
    state = {}
    for key, tensor in obj["model"].items():
        key = key.removeprefix("_orig_mod.")  # a compiled model's keys
        if not _MASK_BUFFER.match(key):
            state[key] = tensor
    best = obj.get("best_val_loss")
    return {
        "format": 1, "model_config": model_config.to_dict(), "model": state, "tokenizer": meta,
        "step": int(obj.get("iter_num", 0)), "best_val_loss": float(best) if best is not None else None,
        "nanogpt_config": config, "nanogpt": str(path),
    }


def tokenizer_meta(config: dict, path: Path, model_vocab: int) -> dict:
    """The tokenizer (a dataset meta entry: {"tokenizer": ..., "vocab_size": ...}) of a nanoGPT checkpoint:
    its dataset's meta.pkl, beside the checkpoint or at data/DATASET/meta.pkl; else GPT-2's BPE."""
    dataset = str(config.get("dataset", "")) if config.get("dataset") else ""
    places = [path.parent / "meta.pkl"] + ([Path("data") / dataset / "meta.pkl"] if dataset else [])
    for place in places:
        if place.is_file():
            return _char_meta(place)
    if model_vocab < GPT2_VOCAB:
        where = " or ".join(str(p) for p in places)
        raise NanoGPTError(
            f"{path} is a nanoGPT checkpoint with a {model_vocab}-token vocabulary, but its meta.pkl is not at "
            f"{where}; copy nanoGPT's data/{dataset or 'DATASET'}/meta.pkl beside the checkpoint")
    return {"tokenizer": {"kind": "tiktoken", "name": "gpt2"}, "vocab_size": GPT2_VOCAB}


class _PlainUnpickler(pickle.Unpickler):
    """meta.pkl holds dicts, ints and strings only: no class may be loaded (a pickle could run code)."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"it refers to {module}.{name}; a nanoGPT meta.pkl holds only plain values")


def _char_meta(place: Path) -> dict:
    """nanoGPT's meta.pkl (stoi, itos, vocab_size) as this project's character tokenizer."""
    try:
        meta = _PlainUnpickler(io.BytesIO(place.read_bytes())).load()
        itos = meta["itos"]
        chars = [itos[i] for i in range(len(itos))]
        if not all(isinstance(c, str) and len(c) == 1 for c in chars):
            raise ValueError("its itos is not one character per id")
    except (OSError, pickle.UnpicklingError, EOFError, KeyError, TypeError, ValueError) as e:
        raise NanoGPTError(f"cannot use {place} as a nanoGPT meta.pkl: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    return {"tokenizer": {"kind": "char", "chars": chars}, "vocab_size": len(chars)}
