"""Checkpoint files: atomic saves, safe loads, finding the checkpoint in an out_dir, and loading a model with
its tokenizer for the scripts that use one (sample.py, eval.py): `load_model(ckpt, init_from)`.

A checkpoint is a dict of tensors and plain Python values (no pickled classes), so it loads with
`torch.load(weights_only=True)`; the model state is the unwrapped model's (no `module.` / `_orig_mod.` prefixes).
Keys written by train.py:
    format, model_config, model, tokenizer (the dataset's meta.json; for a trained BPE with its files inline,
    so the checkpoint needs no data/ folder), step, best_val_loss, config, argv, versions, and for resuming:
    optimizer, scaler, loader, rng.

A run under FSDP writes a sharded checkpoint instead: a folder (out_dir/last/, out_dir/best/) of
torch.distributed.checkpoint files, each process writing its own shards of the model and the optimizer state,
plus record.pt with every other entry above (see "sharded checkpoints" below). The loaders here read either
form: a reader never needs to know which one a run wrote.

Every checkpoint carries checksums (gptkit/checksum.py): the file a CRC-32C of each tensor and of everything
else ("checksums"), the sharded folder in record.pt those of .metadata and of each item of the shard files.
load_checkpoint verifies them, so every reader does (resume, sample, eval, chat, serve, export): a changed byte
is a one-line CorruptCheckpointError naming the file and the tensor and the checkpoint to use instead. One
saved before checksums loads with a note. nanoGPT's out_dir/ckpt.pt is read too (gptkit/nanogpt.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import sys
import warnings
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from gptkit import checksum, lora, nanogpt
from gptkit.cli import UserError, one_line
from gptkit.files import atomic_write
from gptkit.hf_gpt2 import GPT2_NAMES, load_pretrained
from gptkit.hf_tokenizer import GPTKIT_FILE
from gptkit.optim import keeping_implementation
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
    """Write atomically, with a checksum of every tensor and of the rest (gptkit/checksum.py) that every load
    verifies: a crash mid-save leaves the old file intact. A sharded checkpoint of the same name
    (out_dir/last/ for out_dir/last.pt: a run that went on without FSDP) is removed once the file is written."""
    obj = {**obj, checksum.KEY: checksum.record(obj)}
    with atomic_write(path) as tmp, open(tmp, "wb") as f:
        torch.save(obj, f)
    path = Path(path)
    if path.suffix == ".pt" and is_sharded_checkpoint(path.with_suffix("")):
        _remove_folders(path.with_suffix(""))


def remove_checkpoint(out_dir: str | Path, name: str) -> None:
    """Remove a run's checkpoint `name` ("last", "best") in either form: name.pt, a sharded name/ and what a
    killed save of it left (name.tmp/, name.old/)."""
    (Path(out_dir) / f"{name}.pt").unlink(missing_ok=True)
    _remove_folders(Path(out_dir) / name)


def _remove_folders(folder: Path) -> None:
    for path in (folder, folder.with_name(folder.name + TMP), folder.with_name(folder.name + OLD)):
        shutil.rmtree(path, ignore_errors=True)


def build_checkpoint(*, model, optimizer, scaler, loader, meta: dict, config: dict, argv: list[str], step: int,
                     best_val_loss: float, rng: list[dict], versions: dict, lora_info: dict | None = None,
                     sharded: bool = False) -> dict:
    """The checkpoint of a training run: a plain function of the run's state. `model` is the unwrapped
    model; `rng` holds every rank's RNG states (the dropout streams), in rank order. A LoRA run (lora_info:
    its settings and its base's name and fingerprint) stores only the adapters of the model. A trained
    tokenizer's files travel inside (`with_tokenizer_files`): sampling, serving and exporting need no data/.
    sharded: the record of a sharded checkpoint, without the model and optimizer (save_sharded writes them)."""
    state = {
        "format": FORMAT_VERSION, "model_config": model.config.to_dict(), "lora": lora_info,
        "tokenizer": with_tokenizer_files(meta), "step": step, "best_val_loss": best_val_loss, "config": config,
        "argv": ["train.py", *argv], "versions": versions, "scaler": scaler.state_dict(),
        "loader": loader.state_dict(), "rng": rng,
    }
    if not sharded:
        state["model"] = lora.adapter_state_dict(model) if lora_info else model.state_dict()
        state["optimizer"] = optimizer.state_dict()
    return state


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint file or sharded folder as given, or in a run's folder its best checkpoint if present, else
    its last (saved_checkpoint: best.pt or best/, last.pt or last/), else nanoGPT's ckpt.pt."""
    p = Path(path)
    if p.is_file() or is_sharded_checkpoint(p):
        return p
    if p.is_dir():
        for name in ("best", "last"):
            found = saved_checkpoint(p, name)
            if found is not None:
                return found
        if (p / nanogpt.CKPT_NAME).is_file():
            return p / nanogpt.CKPT_NAME
        raise CheckpointError(f"no checkpoint (best.pt or last.pt, or a sharded best/ or last/, or nanoGPT's "
                              f"ckpt.pt) in {p}/; {TRAIN_HINT}")
    raise CheckpointError(f"checkpoint {p} does not exist; {TRAIN_HINT}")


def holds_checkpoint(path: str | Path) -> bool:
    """Whether `path` is a checkpoint (a file, a sharded folder) or a run's folder holding one."""
    p = Path(path)
    return p.is_file() or (p.is_dir() and (is_sharded_checkpoint(p) or (p / nanogpt.CKPT_NAME).is_file() or any(
        saved_checkpoint(p, n) is not None for n in ("best", "last"))))


def saved_checkpoint(out_dir: str | Path, name: str) -> Path | None:
    """A run's checkpoint `name` ("last" or "best"): the file name.pt, or the sharded folder name/ (or name.old/,
    the previous one, when a save was killed between its two renames); the newer when there are both. None
    when there is none."""
    out_dir = Path(out_dir)
    folder = out_dir / name
    if not is_sharded_checkpoint(folder):
        folder = out_dir / f"{name}{OLD}"
    found = [p for p in (out_dir / f"{name}.pt", folder) if p.is_file() or is_sharded_checkpoint(p)]
    return max(found, key=lambda p: (p / RECORD if p.is_dir() else p).stat().st_mtime_ns, default=None)


class CorruptCheckpointError(CheckpointError):
    """A checkpoint whose bytes changed since it was saved (a checksum does not match, or it is cut short)."""


def corrupt(p: Path, what: str) -> CorruptCheckpointError:
    """The one-line error for a damaged checkpoint: what is wrong, that nothing was changed, what to try."""
    return CorruptCheckpointError(f"{p}{'/' * p.is_dir()} is corrupt: {what}; nothing on disk was changed; "
                                  f"{_fallback(p)}")


def _fallback(p: Path) -> str:
    """Which other checkpoint of the run to use instead of the damaged `p`, and how to resume from it."""
    out_dir = p.parent
    name = p.name.removesuffix(OLD) if p.is_dir() else p.stem
    others = []
    old = out_dir / f"{name}{OLD}"
    if p.is_dir() and p != old and is_sharded_checkpoint(old):
        others.append(old)  # the previous save of this one, left by a save killed between its renames
    for other in ("best", "last"):
        found = saved_checkpoint(out_dir, other) if other != name else None
        if found is not None and found not in others:
            others.append(found)
    if not others:
        return "restore it from a copy (no other checkpoint is beside it)"
    shown = [f"{o}{'/' * o.is_dir()}" for o in others]
    resume = ""
    if name == "last":
        target = out_dir / ("last" if others[0].is_dir() else "last.pt")
        resume = (f" (to resume from it: move {p}{'/' * p.is_dir()} aside, copy {shown[0]} to "
                  f"{target}{'/' * others[0].is_dir()}, then --init_from=resume)")
    return f"try {' or '.join(shown)} instead{resume}"


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu", mmap: bool = True) -> dict:
    """Load a checkpoint safely, verifying its checksums. Memory-mapped by default, so tensors that are never
    used (the optimizer's, when sampling) are never read from disk: such a load verifies everything but the
    optimizer state (which only a resumed run uses, and it loads without mmap). A sharded checkpoint (a folder)
    comes as the same dict, its model's weights whole, without the optimizer state (load_sharded_optimizer
    restores that) and with "sharded": the folder. nanoGPT's ckpt.pt comes converted (gptkit/nanogpt.py)."""
    p = find_checkpoint(path)
    if p.is_dir():
        return _read_sharded(p, map_location, verify_optimizer=not mmap)
    damage = _zip_damage(p)  # the metadata's own zip CRC, checked first: a damaged pickle can fail any way
    if damage:
        raise corrupt(p, damage)
    try:
        ckpt = torch.load(p, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        # torch's message is long; the line naming the refused global is the useful one
        first = next((line for line in lines if "WeightsUnpickler error" in line), lines[0] if lines else "unsafe")
        raise CheckpointError(f"refusing to load {p}: it is not a plain-tensor checkpoint ({first})") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        # torch's first sentence only: the rest is its advice, or a raw mmap or zip-library message
        raise corrupt(p, f"it cannot be read ({_first_sentence(e)}); it may be truncated") from None
    if nanogpt.is_nanogpt(ckpt):
        print(f"note: {p} is a nanoGPT checkpoint: it carries no checksums, so damage to it cannot be detected",
              file=sys.stderr)
        return nanogpt.convert(ckpt, p)
    if not isinstance(ckpt, dict) or "model" not in ckpt or "model_config" not in ckpt:
        raise CheckpointError(f"{p} is not a checkpoint written by train.py (no model/model_config keys)")
    if ckpt.get("format", 0) > FORMAT_VERSION:
        raise CheckpointError(f"{p} has checkpoint format {ckpt['format']}; this code reads up to {FORMAT_VERSION}")
    _verify(ckpt, p, skip=("optimizer",) if mmap else ())
    return ckpt


def _verify(ckpt: dict, p: Path, skip: tuple[str, ...] = ()) -> None:
    """Check a loaded checkpoint dict against its checksums (removing them from it); one written before they
    were recorded gets a note."""
    if checksum.KEY not in ckpt:
        print(f"note: {p} carries no checksums (it was saved before they were recorded): damage to it cannot be "
              f"detected; saving it again (e.g. export.py --format pt) adds them", file=sys.stderr)
        return
    wrong = checksum.mismatch(ckpt, ckpt[checksum.KEY], skip)
    if wrong:
        raise corrupt(p, f"{wrong} does not match the checksum saved with it")
    del ckpt[checksum.KEY]


def _zip_damage(p: Path) -> str | None:
    """What is wrong with a checkpoint file's zip container, read without torch: not a complete zip archive
    (cut short, or not a checkpoint), or a pickled entry (data.pkl, the keys and settings) that fails the CRC
    the zip stores for it. None when neither. (A CRC of 0 is what torch writes when told not to compute them.)"""
    try:
        with zipfile.ZipFile(p) as z:
            for info in z.infolist():
                if info.filename.endswith(".pkl") and info.CRC:
                    z.read(info)  # raises BadZipFile on a CRC mismatch
    except zipfile.BadZipFile as e:
        if "CRC" in str(e):
            return "its metadata (data.pkl) does not match the CRC stored in the file"
        return "it is not a complete checkpoint file (cut short, or not a checkpoint at all)"
    except (OSError, EOFError, ValueError, NotImplementedError) as e:
        return f"its zip container cannot be read ({_first_sentence(e)})"
    return None


def _first_sentence(e: BaseException) -> str:
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return text.split(". ")[0].rstrip(".")


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
    Hugging Face GPT-2 folder (the GPT-2 BPE), or a checkpoint of this project (a .pt file or a sharded folder,
    or a run's out_dir holding best.pt or last.pt, or their sharded folders; its own tokenizer), or nanoGPT's."""
    path = Path(init_from)
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
    is given) or GPT-2 weights (`init_from`: a GPT-2 name or a local Hugging Face folder). Returns the model
    (on the CPU, in eval mode), its tokenizer, and a few words saying what was loaded."""
    if init_from:
        if init_from not in GPT2_NAMES and holds_checkpoint(init_from):
            raise CheckpointError(f"{init_from} is a checkpoint of this project, not Hugging Face GPT-2 weights: "
                                  f"pass it as --ckpt {init_from}")
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


# ----------------------------------------------------------------------------- sharded checkpoints (FSDP)

# A sharded checkpoint is a folder: torch.distributed.checkpoint's files (.metadata, one __R_0.distcp per
# process R) holding {"model": the model's state dict, "optimizer": the optimizer's (get_optimizer_state_dict:
# keyed by parameter name)}, and RECORD, every other entry of build_checkpoint. DCP writes .metadata last, once
# every process has written its part; the folder is written as NAME.tmp/ and renamed to NAME/ once complete.
RECORD = "record.pt"
SHARDS_KEY = "shard_checksums"  # RECORD's entry with the CRC-32C of .metadata and of every item of the shards
TMP, OLD = ".tmp", ".old"  # the suffixes of a folder being written, and of the one it replaces


def is_sharded_checkpoint(path: str | Path) -> bool:
    """Whether `path` is a complete sharded checkpoint folder."""
    p = Path(path)
    return (p / RECORD).is_file() and (p / ".metadata").is_file()


def _optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside ours (optim.MuonAdamW holds two)."""
    return [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else [optimizer.muon, optimizer.adamw]


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_sharded(folder: str | Path, record: dict | None, model: torch.nn.Module, optimizer, *,
                 adapters_only: bool = False) -> None:
    """Write a sharded checkpoint. Every process calls this at once, each writing its own shards of the model
    (a LoRA run's adapters only, with adapters_only) and of the optimizer state, in parallel; the process
    that passes `record` (rank 0; None on the others) writes it and renames the folder into place.

    Atomic: the files go into FOLDER.tmp/; once complete, FOLDER/ is renamed to FOLDER.old/ and FOLDER.tmp/ to
    FOLDER/, then FOLDER.old/ is removed. A save killed before the renames leaves FOLDER/ as it was (the next
    save clears the partial FOLDER.tmp/); one killed between them leaves FOLDER.old/, which saved_checkpoint
    falls back to."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    folder = Path(folder)
    tmp, old = folder.with_name(folder.name + TMP), folder.with_name(folder.name + OLD)
    if record is not None:
        shutil.rmtree(tmp, ignore_errors=True)  # what a killed save left
        tmp.mkdir(parents=True)
    _barrier()  # no process writes into FOLDER.tmp/ before it is clean
    weights = lora.adapter_state_dict(model) if adapters_only else model.state_dict()  # (this process' shards)
    state = {"model": weights, "optimizer": get_optimizer_state_dict(model, _optimizers(optimizer))}
    with _alone_quietly():  # (one process alone: no process group)
        dcp.save(state, checkpoint_id=tmp)  # each process its part; .metadata last, once all have written
    if record is None:
        return
    record = {**record, SHARDS_KEY: _shard_checksums(tmp)}
    record = {**record, checksum.KEY: checksum.record(record)}
    with open(tmp / RECORD, "wb") as f:
        torch.save(record, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync(tmp)
    shutil.rmtree(old, ignore_errors=True)
    if folder.exists():
        os.replace(folder, old)
    os.replace(tmp, folder)
    _fsync(folder.parent)
    shutil.rmtree(old, ignore_errors=True)
    folder.with_name(folder.name + ".pt").unlink(missing_ok=True)  # the file of a run that went on under FSDP


def _shard_checksums(folder: Path) -> dict:
    """CRC-32C of the .metadata file and of every item DCP wrote (each process' part of each tensor, and the
    optimizer's other entries), read back from the files: {"metadata": crc, "items": {item: crc}}."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    items = _storage_items(metadata)
    with ThreadPoolExecutor(checksum.THREADS) as pool:
        crcs = pool.map(lambda loc: checksum.file_range_crc(folder / loc[0], loc[1], loc[2]), items.values())
        found = dict(zip(items, crcs))
    meta_file = folder / ".metadata"
    return {"metadata": checksum.file_range_crc(meta_file, 0, meta_file.stat().st_size), "items": found}


def _storage_items(metadata) -> dict[str, tuple[str, int, int]]:
    """{item: (file, offset, length)} of a DCP checkpoint's metadata; an item is a tensor's name and the offset
    of one process' part of it ("model.transformer.wte.weight@0,0"), or the name of a non-tensor entry."""
    items = {}
    for index, info in metadata.storage_data.items():
        where = "" if index.offset is None else "@" + ",".join(map(str, index.offset))
        items[f"{index.fqn}{where}"] = (info.relative_path, info.offset, info.length)
    return items


def _verify_shards(folder: Path, record: dict, metadata, prefixes: tuple[str, ...]) -> None:
    """Check the items of the DCP files whose names start with `prefixes` against the record's checksums."""
    expected = record[SHARDS_KEY]["items"]
    items = {k: v for k, v in _storage_items(metadata).items() if k.startswith(prefixes)}
    missing = [k for k in items if k not in expected]
    if missing:
        raise corrupt(folder, f"its .metadata lists {missing[0]}, which was not saved")
    with ThreadPoolExecutor(checksum.THREADS) as pool:
        crcs = pool.map(lambda loc: checksum.file_range_crc(folder / loc[0], loc[1], loc[2]), items.values())
        bad = [k for k, c in zip(items, crcs) if c != expected[k]]
    if bad:
        raise corrupt(folder, f"tensor {bad[0]} in {items[bad[0]][0]} does not match the checksum saved with it")


def _read_sharded(folder: Path, map_location: str | torch.device = "cpu", verify_optimizer: bool = False) -> dict:
    """A sharded checkpoint as load_checkpoint returns a file's: its record, the model's weights whole (read
    from every process' shards, in this process alone: no process group is needed), and "sharded": the folder.
    The optimizer state is not read (load_sharded_optimizer restores it into a run); its checksums are verified
    with verify_optimizer (a resumed run)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    damage = _zip_damage(folder / RECORD)
    if damage:
        raise corrupt(folder, f"{RECORD}: {damage}")
    try:
        record = torch.load(folder / RECORD, map_location=map_location, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f"cannot read sharded checkpoint {folder}/: {one_line(e)}") from None
    if isinstance(record, dict) and checksum.KEY in record:
        _verify(record, folder / RECORD)
        meta_file = folder / ".metadata"
        if checksum.file_range_crc(meta_file, 0, meta_file.stat().st_size) != record[SHARDS_KEY]["metadata"]:
            raise corrupt(folder, ".metadata (the index of the shards) does not match the checksum saved with it")
    elif isinstance(record, dict):
        _verify(record, folder)  # the note: saved before checksums were recorded
    try:
        metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f"cannot read sharded checkpoint {folder}/: {one_line(e)}") from None
    if isinstance(record, dict) and SHARDS_KEY in record:
        _verify_shards(folder, record, metadata, ("model.", "optimizer.") if verify_optimizer else ("model.",))
    weights = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata):
            weights[key.removeprefix("model.")] = torch.empty(meta.size, dtype=meta.properties.dtype)
    try:
        with _alone_quietly():
            dcp.load({"model": weights}, checkpoint_id=folder, no_dist=True)
    except Exception as e:  # DCP wraps a missing or truncated shard file in its own exception types
        raise CheckpointError(f"cannot read sharded checkpoint {folder}/: {one_line(e)}; a shard file may be "
                              f"missing or truncated") from None
    if not isinstance(record, dict) or "model_config" not in record:
        raise CheckpointError(f"{folder}/ is not a checkpoint written by train.py (no model_config in {RECORD})")
    record = {k: v for k, v in record.items() if k != SHARDS_KEY}
    return {**record, "model": {k: v.to(map_location) for k, v in weights.items()}, "sharded": str(folder)}


@contextlib.contextmanager
def _alone_quietly():
    """Around a DCP load or save: without a process group it warns that it works in this one process, which is
    what we ask of it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def load_sharded_optimizer(folder: str | Path, model: torch.nn.Module, optimizer) -> None:
    """Restore the optimizer state of a sharded checkpoint into a run's optimizer, whatever the run's number
    of processes and wrapper: sharded (each process reads the parts of the saved shards its own shards cover:
    torch.distributed.checkpoint reshards on load), or whole (one process, or DDP). Every process calls it.
    The implementation settings of this machine (fused, foreach) are kept, as load_optimizer_state does."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    optimizers = _optimizers(optimizer)
    state = {"optimizer": get_optimizer_state_dict(model, optimizers)}
    with _alone_quietly():
        dcp.load(state, checkpoint_id=Path(folder))  # (a collective under torchrun)
    with keeping_implementation(optimizer):
        set_optimizer_state_dict(model, optimizers, state["optimizer"])


def load_whole_optimizer(model: torch.nn.Module, optimizer, state: dict) -> None:
    """Restore a single-file checkpoint's optimizer state (torch's own form, keyed by the position of each
    parameter in its optimizer) into a sharded run: keyed by name instead, then cut into this process'
    shards by set_optimizer_state_dict. Every process calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    optimizers = _optimizers(optimizer)
    parts = [state] if len(optimizers) == 1 else [state["muon"], state["adamw"]]
    names = {id(p): name for name, p in model.named_parameters()}
    by_name = {"state": {}, "param_groups": []}
    for o, saved in zip(optimizers, parts, strict=True):
        for group, saved_group in zip(o.param_groups, saved["param_groups"], strict=True):
            fqns = [names[id(p)] for p in group["params"]]
            by_name["param_groups"].append({**saved_group, "params": fqns})
            for index, fqn in zip(saved_group["params"], fqns, strict=True):
                if index in saved["state"]:
                    by_name["state"][fqn] = saved["state"][index]
    with keeping_implementation(optimizer):
        set_optimizer_state_dict(model, optimizers, by_name, options=StateDictOptions(full_state_dict=True))


