"""Train a GPT on prepared token shards.

    python train.py configs/shakespeare.py                      # one GPU, CPU or MPS
    python train.py configs/shakespeare.py --init_from=resume   # continue exactly where out_dir stopped
    python train.py configs/shakespeare.py --resume=auto        # continue if out_dir holds this run, else start
    python train.py configs/gpt2_124m.py --plan                 # memory, time and cost per device; trains nothing
    torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_124m.py
    torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_124m.py --parallel=fsdp  # sharded (auto: if needed)
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=NODE0:29500 --rdzv-id=gpt2 \
        --max-restarts=3 train.py configs/gpt2_124m.py --resume=auto            # on each node; restarts continue

Following one batch: `gptkit/loader.py` reads a window of tokens from the memory-mapped shards (x, y = the window and
the window shifted by one) -> `model.py` turns x into logits and the cross-entropy against y -> backward ->
after the last micro-batch, clip and `gptkit/optim.py`'s AdamW step -> `gptkit/metrics.py` logs -> `gptkit/checkpoint/` saves.

This file: build the run from the config (`setup_run`), then `train_loop`, the whole loop on one screen.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from gptkit import cli, hellaswag, lora, parallel, plan
from gptkit.checkpoint import (
    GPT2_BPE,
    RESUME_KEYS,
    build_checkpoint,
    load_base_model,
    load_checkpoint,
    load_sharded_optimizer,
    load_whole_optimizer,
    lora_model,
    remove_checkpoint,
    saved_checkpoint,
)
from gptkit.checkpoint.background import CheckpointSaver
from gptkit.cli import UserError
from gptkit.config import TrainConfig, build_config, config_to_dict, lora_settings, parse_args, print_config
from gptkit.cudagraph import GraphedStep, graph_batch_reserve
from gptkit.files import OutDirBusyError, OutDirLock
from gptkit.hf_gpt2 import GPT2_NAMES
from gptkit.loader import BatchLoader, ValBatches
from gptkit.metrics import LineProgress, Metrics, peak_flops, start_wandb
from gptkit.optim import can_mask, describe, load_optimizer_state, make_optimizer, set_lr, step_unless
from gptkit.prepare.tiny_shakespeare import DATASETS as SHAKESPEARE_DATASETS
from gptkit.prepare.tiny_shakespeare import prepare_shakespeare
from gptkit.runtime import (
    GO_ON,
    SAVE,
    STOP,
    Dist,
    Runtime,
    StepRequests,
    StopFlag,
    code_version,
    distributed,
    library_versions,
    process_elapsed,
    resolve_compile,
    resolve_cuda_graphs,
)
from gptkit.shards import DataError, TokenDataset, dataset_dir, read_meta, require_dataset
from gptkit.tokenizer import Tokenizer, with_tokenizer_files
from model import GPT, GPTConfig

# The shape and architecture a resumed run must keep (model.py's GPTConfig says which settings they are).
MODEL_KEYS = GPTConfig.shape_names()
# Scanning every token for out-of-vocabulary ids is cheap for small datasets; above this many tokens we trust
# the shards' meta.json (the prepare scripts check ids on write).
MAX_SCAN_TOKENS = 500_000_000
# A run on the CPU that needs more training FLOPs than this was sized for a GPU (configs/shakespeare.py needs
# ~6e15; configs/shakespeare_cpu.py ~1e13): say so before it starts.
CPU_FLOPS_BUDGET = 1e14


class TrainError(UserError):
    """A run that cannot start or continue; the message says why and what to do."""


# ----------------------------------------------------------------------------- before the run


def resolve_config(argv: list[str]) -> tuple[TrainConfig, dict | None]:
    """The run's config and, when resuming, the checkpoint. A resumed run starts from the checkpoint's config;
    what argv sets explicitly overrides it, except the model's shape, which must match."""
    values = parse_args(TrainConfig, argv)
    out_dir = Path(values.get("out_dir", TrainConfig.out_dir))
    auto = values.get("init_from") != "resume" and values.get("resume") == "auto"
    if values.get("init_from") != "resume":
        asked = build_config(TrainConfig, values)  # the run as the command starts it
        if not (auto and auto_resumes(asked, out_dir)):
            return asked, None
    last = saved_checkpoint(out_dir, "last")  # last.pt, or a sharded last/ (a run under FSDP)
    if last is None:
        if (out_dir / "ckpt.pt").is_file():  # nanoGPT's: no data position or RNG state to resume exactly
            raise TrainError(f"{out_dir}/ckpt.pt is nanoGPT's checkpoint, which cannot be resumed exactly here; "
                             f"continue from its weights with --init_from={out_dir} --out_dir=NEW_DIR")
        raise TrainError(f"nothing to resume: {out_dir}/last.pt does not exist; start with --init_from=scratch")
    # Not memory-mapped: the optimizer state would otherwise keep pointing into the file that the next save
    # replaces. (A --plan reads only the config: memory-mapped, nothing else is read.)
    ckpt = load_checkpoint(last, mmap=bool(values.get("plan")))
    # (a sharded checkpoint's optimizer state is read into the run later: restore_state)
    missing = [k for k in RESUME_KEYS if k not in ckpt and not (k == "optimizer" and ckpt.get("sharded"))]
    if missing:
        raise TrainError(f"{out_dir}/last.pt cannot be resumed: it has no {', '.join(missing)} (a weights-only "
                         f"checkpoint?); start a new run, or fine-tune from it")
    if auto:
        check_same_run(asked, values, ckpt, out_dir)
        if os.environ.get("RANK", "0") == "0":
            print(f"resume=auto: {last} holds step {ckpt['step']} of this run: continuing it", flush=True)
        if asked.init_from != "scratch":  # a fine-tune's block_size may have been fitted to its data: kept
            values.pop("block_size", None)
        values["init_from"] = "resume"
    base = dict(ckpt["config"])
    # Through GPTConfig: a checkpoint older than an option has its default, and `auto` options their values.
    saved_model = GPTConfig.from_dict(ckpt["model_config"]).to_dict()
    saved_shape = {k: saved_model[k] for k in MODEL_KEYS}
    if ckpt.get("lora"):  # the model has its base's positions; the run trained on sequences of block_size
        saved_shape["block_size"] = base["block_size"]
    differing = [f"{k} (checkpoint {saved_shape[k]!r}, asked {values[k]!r})"
                 for k in MODEL_KEYS if values.get(k) is not None and values[k] != saved_shape[k]]
    if differing:
        raise TrainError(f"cannot resume {out_dir}/last.pt with a different model shape: {'; '.join(differing)}")
    saved_optimizer = base.get("optimizer", "adamw")  # its state is that optimizer's
    if values.get("optimizer", saved_optimizer) != saved_optimizer:
        raise TrainError(f"cannot resume {out_dir}/last.pt with --optimizer={values['optimizer']}: it was trained "
                         f"with {saved_optimizer}; start a new run, or fine-tune from it")
    base.update(values)
    base.update(saved_shape)
    cfg = build_config(TrainConfig, base)
    if not cfg.plan and os.environ.get("RANK", "0") == "0":
        for line in resume_notes(cfg, values, ckpt, out_dir):
            print(f"note: {line}")
    return cfg, ckpt


def auto_resumes(asked: TrainConfig, out_dir: Path) -> bool:
    """resume=auto: whether out_dir holds a checkpoint to continue (last.pt, or a sharded last/), said in the
    run's first line (rank 0)."""
    last = saved_checkpoint(out_dir, "last")
    if last is None and os.environ.get("RANK", "0") == "0":
        start = "from scratch" if asked.init_from == "scratch" else f"from {asked.init_from}"
        print(f"resume=auto: no checkpoint in {out_dir}/ (no last.pt or last/): starting {start}", flush=True)
    return last is not None


def check_same_run(asked: TrainConfig, values: dict, ckpt: dict, out_dir: Path) -> None:
    """resume=auto continues a checkpoint of this run only: one of another dataset, or another model shape
    (all of it for a run from scratch; what the command sets explicitly for a fine-tune, whose base decides the
    rest) is a one-line error naming the difference. (The tokenizer is checked against the dataset's later.)"""
    saved = ckpt["config"]
    diffs = []
    here = dataset_dir(asked.dataset, asked.data_root).resolve()
    there = dataset_dir(saved.get("dataset", ""), saved.get("data_root", TrainConfig.data_root)).resolve()
    if here != there:
        diffs.append(f"dataset (checkpoint {str(there)!r}, this run {str(here)!r})")
    saved_model = GPTConfig.from_dict(ckpt["model_config"]).to_dict()
    wanted = asked.model_config(vocab_size=1).to_dict() if asked.init_from == "scratch" else values
    keys = [k for k in MODEL_KEYS if k in wanted and not (k == "block_size" and asked.init_from != "scratch")]
    diffs += [f"{k} (checkpoint {saved_model[k]!r}, this run {wanted[k]!r})"
              for k in keys if wanted[k] is not None and wanted[k] != saved_model[k]]
    if diffs:
        raise TrainError(f"resume=auto: {out_dir}/ holds a checkpoint of another run: {'; '.join(diffs)}; choose "
                         f"another --out_dir (or, to replace it, drop --resume=auto and pass --overwrite=True)")


def resume_notes(cfg: TrainConfig, values: dict, ckpt: dict, out_dir: Path) -> list[str]:
    """What a resumed run does that its command line may not have meant: a run that is finished already, or a
    max_iters raised past the schedule's end (lr_decay_iters, kept from the checkpoint)."""
    notes, step = [], int(ckpt["step"])
    raised = values.get("max_iters", cfg.max_iters) > ckpt["config"].get("max_iters", cfg.max_iters)
    if step >= cfg.max_iters and not cfg.eval_only:
        notes.append(f"{out_dir}/last.pt is at step {step}, and max_iters is {cfg.max_iters}: the run is finished, "
                     f"so it is evaluated once and nothing is trained; to train on, raise --max_iters (and "
                     f"--lr_decay_iters with it)")
    elif raised and cfg.decay_lr and "lr_decay_iters" not in values and cfg.lr_decay_iters < cfg.max_iters:
        notes.append(f"max_iters is {cfg.max_iters} but lr_decay_iters stays the checkpoint's {cfg.lr_decay_iters}: "
                     f"from step {cfg.lr_decay_iters} on the learning rate stays at min_lr ({cfg.min_lr:g}); to "
                     f"decay over the longer run, add --lr_decay_iters={cfg.max_iters}")
    return notes


def load_dataset(cfg: TrainConfig, d: Dist) -> tuple[Path, dict]:
    """The dataset's folder and meta.json. The two Shakespeare datasets are small: they are prepared on the fly
    (downloading the text) instead of failing."""
    path = dataset_dir(cfg.dataset, cfg.data_root)
    if d.master and not (path / "meta.json").is_file() and path.name in SHAKESPEARE_DATASETS:
        print(f"dataset {cfg.dataset!r} not prepared yet: preparing it at {path}")
        try:
            prepare_shakespeare(path, SHAKESPEARE_DATASETS[path.name])
        except DataError as e:  # e.g. no network
            raise TrainError(f"could not prepare {path}: {e} (with a local copy: python prepare/{path.name}.py "
                             f"--input PATH)") from None
    d.barrier()  # every rank waits here, whatever it saw on disk, so the collectives stay in step
    path = require_dataset(cfg.dataset, cfg.data_root)
    meta = read_meta(path)
    # A trained tokenizer's folder is read (and checked against its hash) now, not at the first save after
    # hours of training; the checkpoints carry these files.
    with_tokenizer_files(meta)
    return path, meta


def fit_block_size(cfg: TrainConfig, meta: dict, d: Dist) -> TrainConfig:
    """A fine-tune on a dataset too small for its block_size (a split shorter than one window of block_size + 1
    tokens: a few conversations) trains on the longest windows both splits hold, and says so. A run from
    scratch keeps its block_size, the shape of its model (the loader's error says what to change), and so
    does batch_size=auto, whose tokens_per_step is whole sequences of block_size."""
    if cfg.init_from in ("scratch", "resume") or cfg.batch_size is None:
        return cfg
    held = min(int(meta["splits"][s]["tokens"]) for s in ("train", "val"))
    if held > cfg.block_size or held < 2:
        return cfg
    if d.master:
        split = min(("train", "val"), key=lambda s: int(meta["splits"][s]["tokens"]))
        print(f"note: the {split} split of dataset {cfg.dataset!r} has {held} tokens, fewer than block_size+1 = "
              f"{cfg.block_size + 1}: this fine-tune uses block_size={held - 1}, the longest window it holds (a full "
              f"fine-tune's model keeps that context); more data allows a longer one", flush=True)
    return dataclasses.replace(cfg, block_size=held - 1)


@contextlib.contextmanager
def lock_out_dir(out_dir: str, d: Dist):
    """Rank 0 holds out_dir's lock for the whole run; every rank learns whether it got it."""
    lock, refusal = OutDirLock(out_dir), [None]
    if d.master:
        try:
            lock.acquire()
        except OutDirBusyError as e:
            refusal[0] = str(e)
    if d.enabled:
        dist.broadcast_object_list(refusal, src=0)
    if refusal[0]:
        raise OutDirBusyError(refusal[0])
    if lock.notice:
        print(f"note: {lock.notice}")
    try:
        yield
    finally:
        lock.release()


def check_out_dir(cfg: TrainConfig) -> None:
    """Never let a new run silently replace the checkpoints of an earlier one."""
    if cfg.init_from == "resume" or cfg.overwrite:
        return
    existing = [p.name + "/" * p.is_dir() for p in (saved_checkpoint(cfg.out_dir, n) for n in ("last", "best"))
                if p is not None]
    if existing:
        raise TrainError(
            f"{cfg.out_dir}/ already holds {' and '.join(existing)}; continue it with --init_from=resume, "
            f"choose another --out_dir, or pass --overwrite=True to replace it"
        )


def build_model(cfg: TrainConfig, meta: dict, ckpt: dict | None) -> tuple[GPT, int]:
    """The run's model, and how many token ids a fine-tune added to its base's vocabulary (special tokens)."""
    vocab = int(meta["vocab_size"])
    if ckpt is not None:
        saved_tok = ckpt.get("tokenizer", {})
        diffs = [f"{k} (checkpoint {saved_tok.get(k)!r}, dataset {meta.get(k)!r})"
                 for k in ("tokenizer", "vocab_size") if saved_tok.get(k) != meta.get(k)]
        if diffs:
            raise TrainError(f"cannot resume on dataset {cfg.dataset!r}: its vocabulary differs: {'; '.join(diffs)}")
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
    if cfg.block_size > model.config.block_size:
        raise TrainError(f"block_size {cfg.block_size} exceeds {cfg.init_from}'s context of "
                         f"{model.config.block_size}; use --block_size={model.config.block_size} or less")
    # A full fine-tune changes every weight at the first block_size positions only, so the model keeps those
    # (as nanoGPT does): the rows beyond would no longer match the network, and weight decay would shrink
    # them. A LoRA run keeps its frozen base whole, all positions included: block_size only limits the
    # training sequences, and the merged model still has the base's context.
    if cfg.block_size < model.config.block_size and not cfg.lora_rank:
        model.crop_block_size(cfg.block_size)
    added = 0
    if meta["tokenizer"] != tokenizer and added_special_tokens(tokenizer, meta):
        # The base's tokenizer plus special tokens (a chat dataset's): the model learns them from here on.
        added = vocab - model.config.vocab_size
        model.grow_vocab(vocab)
    elif meta["tokenizer"] == tokenizer and vocab > model.config.vocab_size:
        name = "GPT-2's BPE" if tokenizer == GPT2_BPE else "the tokenizer it was trained with"
        raise TrainError(f"{cfg.init_from} has a vocabulary of {model.config.vocab_size} tokens, fewer than the "
                         f"{vocab} of its tokenizer ({name}, which dataset {cfg.dataset!r} is tokenized with): "
                         f"the model and its tokenizer do not belong together; fine-tune a model whose vocab_size "
                         f"is {vocab}")
    elif meta["tokenizer"] != tokenizer:
        hint = ("prepare it with --tokenizer gpt2 (e.g. python prepare/shakespeare.py)" if tokenizer == GPT2_BPE
                else "prepare it with the same tokenizer")
        raise TrainError(f"dataset {cfg.dataset!r} is not tokenized with the tokenizer {cfg.init_from} was "
                         f"trained with ({tokenizer}); {hint}")
    return model, added


def with_base_shape(cfg: TrainConfig, model: GPT, argv: list[str]) -> TrainConfig:
    """A fine-tune's model has its base's shape (block_size aside, which may crop it): a shape setting that the
    command or its config files set to another value is a one-line error, and the run's config (config.json,
    the checkpoints) records the base's values, what ran."""
    values, ran = parse_args(TrainConfig, argv), model.config.to_dict()
    keys = [k for k in MODEL_KEYS if k != "block_size"]
    differing = [f"{k}={values[k]!r} (the base has {ran[k]!r})" for k in keys
                 if values.get(k) is not None and values[k] != ran[k]]
    if differing:
        raise TrainError(f"{cfg.init_from} decides the model's shape, and this run sets another: "
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
            raise TrainError(f"cannot resume {cfg.out_dir}/last.pt with other LoRA settings than it was trained "
                             f"with ({(saved or {}).get('settings')}); start a new run")
        return saved
    if settings is None:
        return None
    if cfg.init_from == "scratch":
        raise TrainError("LoRA adapts a trained model: set --init_from to a GPT-2 name, a Hugging Face GPT-2 "
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
        raise TrainError(f"dataset vocab_size {meta['vocab_size']} exceeds the model's {model.config.vocab_size}")
    for split in ("train", "val"):
        ds = TokenDataset(data_dir, split)
        if len(ds) <= MAX_SCAN_TOKENS and ds.max_token() >= model.config.vocab_size:
            raise TrainError(f"{split} split of {data_dir} holds token id {ds.max_token()} >= the model's "
                             f"vocab_size {model.config.vocab_size}; re-prepare the dataset")


def choose_batch_size(cfg: TrainConfig, model: GPT, ckpt: dict | None, d: Dist, rt: Runtime,
                      sharing: str = "single") -> TrainConfig:
    """batch_size=auto: the largest micro-batch that fits, among those that divide the step's sequences, and
    the gradient_accumulation_steps that keep tokens_per_step. On CUDA real training steps are tried, from
    the plan's estimate up or down (gptkit/plan.py's search_batch); on the CPU and MPS, and under FSDP (whose
    steps need the sharded model), the plan's figure for the free memory is used. A resumed run keeps the
    batch it chose; under DDP or FSDP every rank takes the smallest. sharing: parallel.decide's choice."""
    if cfg.batch_size is not None:
        return cfg
    sequences = cfg.tokens_per_step // cfg.block_size
    candidates = plan.valid_batches(sequences, d.world_size)
    if not candidates or sequences % d.world_size:
        raise TrainError(f"tokens_per_step ({cfg.tokens_per_step:,}) is {sequences} sequences of {cfg.block_size}, "
                         f"which {d.world_size} processes cannot share equally; use a multiple of "
                         f"{cfg.block_size * d.world_size}")
    saved = (ckpt or {}).get("config", {}).get("batch_size")
    setup = plan.Setup(rt.device_type, rt.dtype, cfg.block_size, cfg.optimizer, accum=2, world_size=d.world_size,
                       checkpointing=cfg.activation_checkpointing, parallel="fsdp" if sharing == "fsdp" else "ddp")
    if saved in candidates:
        batch, how = saved, "the batch this run chose when it started"
    elif rt.device_type == "cuda" and sharing == "fsdp":
        fits = plan.largest_batch(model, setup, gpu_free_bytes(rt), limit=candidates[-1])
        batch = max([b for b in candidates if b <= fits], default=None)
        how = f"under FSDP, the plan's largest for this GPU's free memory is {fits}"
    elif rt.device_type == "cuda":
        # replayed as one CUDA graph, the step's memory stays in the graph's pool: a margin is held back
        reserve = graph_batch_reserve(gpu_free_bytes(rt)) if cfg.cuda_graphs else 0
        estimate = plan.largest_batch(model, setup, gpu_free_bytes(rt) - reserve)
        batch = plan.search_batch(candidates, estimate, lambda b: fits_on_gpu(model, cfg, rt, b, reserve))
        how = (f"the largest that ran a training step here{' with the CUDA graph margin held back' if reserve else ''}"
               f"; the plan estimated {estimate}")
    else:
        # the processes of a CPU job share the machine's RAM
        fits = plan.largest_batch(model, setup, plan.cpu_device().capacity / d.world_size, limit=candidates[-1])
        batch = max([b for b in candidates if b <= fits], default=None)
        how = (f"the plan's largest for the free RAM is {fits}" if fits < candidates[-1] else
               "by the plan, the free RAM holds all of a step's sequences at once")
    if d.enabled:  # the ranks' GPUs may differ: all take the smallest choice (a candidate too)
        smallest = torch.tensor([batch or 0], device=rt.device)
        dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
        batch = int(smallest.item()) or None
    if batch is None:
        raise TrainError(f"batch_size=auto: not even one sequence of {cfg.block_size} tokens fits on {rt.device}; "
                         f"use --activation_checkpointing=True, --lora_rank, or a smaller block_size or model "
                         f"(python train.py ... --plan shows the memory)")
    accum = sequences // batch
    if d.master:
        print(f"batch_size=auto: {batch} ({how}); gradient_accumulation_steps={accum} keeps "
              f"{cfg.tokens_per_step:,} tokens per step")
    return dataclasses.replace(cfg, batch_size=batch, gradient_accumulation_steps=accum)


def gpu_free_bytes(rt: Runtime) -> int:
    return torch.cuda.mem_get_info(rt.device)[0]


def trial_step(model: GPT, optimizer, rt: Runtime, batch: int, block_size: int) -> None:
    """A training step on random tokens (forward, backward, optimizer step), for batch_size=auto."""
    x = torch.randint(model.config.vocab_size, (batch, block_size), device=rt.device)
    with rt.autocast():
        loss = model(x, x)[1]
    loss.backward()
    optimizer.step()


def fits_on_gpu(model: GPT, cfg: TrainConfig, rt: Runtime, batch: int, reserve: int = 0) -> bool:
    """Whether a real training step at `batch` sequences fits, with `reserve` bytes held aside: its optimizer
    steps at learning rate 0, so the weights stay as they were; everything it allocated is released before the
    next try."""
    optimizer = make_optimizer(model, cfg, rt.device_type)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    held = None
    try:
        held = torch.empty(reserve, dtype=torch.uint8, device=rt.device) if reserve else None
        trial_step(model, optimizer, rt, batch, cfg.block_size)
        fits = True
    except torch.OutOfMemoryError:  # (its traceback, which holds the step's tensors, is gone after this block)
        fits = False
    optimizer.zero_grad(set_to_none=True)
    del optimizer, held
    gc.collect()
    if rt.device_type == "cuda":
        torch.cuda.empty_cache()
    return fits


def write_run_info(cfg: TrainConfig, argv: list[str], d: Dist, rt: Runtime) -> None:
    out = Path(cfg.out_dir)
    if cfg.init_from != "resume":
        # A new run starts new logs; with --overwrite=True the old run's checkpoints go now, so that a stale
        # best.pt can never be mistaken for this run's.
        for name in ("metrics.jsonl", "runs.jsonl"):
            (out / name).unlink(missing_ok=True)
        for name in ("best", "last"):
            remove_checkpoint(out, name)  # name.pt, or a sharded name/
    (out / "config.json").write_text(json.dumps(config_to_dict(cfg), indent=2) + "\n")
    info = {"argv": ["train.py", *argv], "config": config_to_dict(cfg), "versions": library_versions(),
            "code": code_version(Path(__file__).resolve().parent),
            "world_size": d.world_size, "device": str(rt.device), "dtype": rt.dtype_name,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    with open(out / "runs.jsonl", "a") as f:  # one line per invocation: a resumed run keeps the history
        f.write(json.dumps(info) + "\n")


# ----------------------------------------------------------------------------- the run's state


@dataclass
class Run:
    """Everything the loop works with. `model` is what runs the steps (maybe DDP- and compile-wrapped);
    `raw_model` is the plain GPT whose state_dict is saved (under FSDP the same module as `model`, sharded)."""

    cfg: TrainConfig
    argv: list[str]
    d: Dist
    rt: Runtime
    meta: dict
    raw_model: GPT
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    loader: BatchLoader
    val: ValBatches
    accum: int  # micro-batches per process per step
    lora: dict | None = None  # a LoRA run's settings and base (checkpoint.build_checkpoint's lora_info)
    graphed: GraphedStep | None = None  # with cuda_graphs: the whole step, replayed as one CUDA graph
    hellaswag: list[hellaswag.Encoded] | None = None  # HellaSwag's items, when hellaswag_interval is set
    saver: CheckpointSaver = field(default_factory=CheckpointSaver)  # writes in the background with async_save

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.batch_size * self.cfg.block_size * self.accum * self.d.world_size


def setup_run(cfg: TrainConfig, ckpt: dict | None, argv: list[str], d: Dist, rt: Runtime,
              data_dir: Path, meta: dict) -> tuple[Run, int, float]:
    """The model, optimizer, data and wrappers of a new or resumed run; returns it with its step and best
    val loss."""
    if cfg.batch_size is not None and cfg.gradient_accumulation_steps % d.world_size:  # (auto: chosen below)
        raise TrainError(f"gradient_accumulation_steps ({cfg.gradient_accumulation_steps}) must be divisible by "
                         f"the number of processes ({d.world_size})")
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    model, added_tokens = build_model(cfg, meta, ckpt)
    if ckpt is None and cfg.init_from != "scratch":
        cfg = with_base_shape(cfg, model, argv)
    check_vocab(data_dir, meta, model)
    lora_info = attach_lora(cfg, model, ckpt, added_tokens)
    if lora_info and rt.device_type == "cuda" and rt.dtype == torch.bfloat16:
        lora.cast_frozen_base(model, torch.bfloat16)  # the blocks' frozen weights: half their memory
    model.activation_checkpointing = cfg.activation_checkpointing
    model.to(rt.device)
    use_compile, why = resolve_compile(cfg.compile, rt.device)
    # Under torchrun DDP or FSDP (gptkit/parallel.py), decided before the batch size (FSDP holds less per process)
    sharing, parallel_line = parallel.decide(model, cfg, d, rt, use_compile)
    cfg = choose_batch_size(cfg, model, ckpt, d, rt, sharing)
    # FSDP shards in place: the optimizer comes after
    wrapped = parallel.wrap(model, sharing, rt, use_compile, cfg.compile_scope)
    graphs, graphs_line = resolve_cuda_graphs(cfg.cuda_graphs, rt, world_size=d.world_size,
                                              optimizer=cfg.optimizer, compiled=use_compile)
    block = cfg.block_size  # the training sequences (a LoRA run's model may have more positions: its base's)
    run = Run(
        cfg=cfg, argv=argv, d=d, rt=rt, meta=meta, raw_model=model, model=wrapped,
        optimizer=make_optimizer(model, cfg, rt.device_type, graphable=graphs),
        scaler=torch.amp.GradScaler(rt.device_type, enabled=rt.needs_grad_scaler),
        loader=BatchLoader(data_dir, "train", batch_size=cfg.batch_size, block_size=block, seed=cfg.seed,
                           mode=cfg.data_mode, rank=d.rank, world_size=d.world_size, device=rt.device),
        val=ValBatches(data_dir, "val", batch_size=cfg.batch_size, block_size=block, n_batches=cfg.eval_iters,
                       rank=d.rank, world_size=d.world_size, device=rt.device),
        accum=cfg.gradient_accumulation_steps // d.world_size, lora=lora_info,
    )
    if graphs:
        run.graphed = GraphedStep(wrapped, run.optimizer, rt.device, accum=run.accum, batch_size=cfg.batch_size,
                                  block_size=block, grad_clip=cfg.grad_clip, autocast=lambda: rt.autocast(cache=False))
    torch.manual_seed(cfg.seed + d.rank)  # dropout masks: a different stream per rank
    step, best_val = restore_state(run, ckpt) if ckpt is not None else (0, float("inf"))
    if d.master:
        print("config:")
        print_config(cfg)
        write_run_info(cfg, argv, d, rt)
        print(why)
        if rt.device_type == "cuda":
            print(graphs_line)
        if parallel_line:
            print(parallel_line)
        print(describe(run.optimizer))
    return run, step, best_val


def restore_state(run: Run, ckpt: dict) -> tuple[int, float]:
    """Continue a run exactly: optimizer, loss scaler, data position and every rank's dropout stream. A sharded
    checkpoint's optimizer state is resharded to this run's processes, whatever their number and wrapper."""
    if ckpt.get("sharded"):
        load_sharded_optimizer(ckpt["sharded"], run.raw_model, run.optimizer)
    elif parallel.is_sharded(run.model):
        load_whole_optimizer(run.raw_model, run.optimizer, ckpt["optimizer"])
    else:
        load_optimizer_state(run.optimizer, ckpt["optimizer"])
    if run.scaler.is_enabled() and ckpt["scaler"]:  # a bf16/fp32 run saved an empty (disabled) scaler
        run.scaler.load_state_dict(ckpt["scaler"])
    run.loader.load_state_dict(ckpt["loader"])
    rng, d = ckpt["rng"], run.d
    if len(rng) == d.world_size:
        torch.set_rng_state(rng[d.rank]["torch"])
        if run.rt.device_type == "cuda" and rng[d.rank].get("cuda") is not None:
            torch.cuda.set_rng_state(rng[d.rank]["cuda"], run.rt.device)
    elif d.master:
        print(f"note: the checkpoint was written by {len(rng)} process(es), this run has {d.world_size}: "
              f"dropout masks start a new random stream")
    return int(ckpt["step"]), float(ckpt["best_val_loss"])


def save(run: Run, name: str, step: int, best_val: float, requests: StepRequests | None = None) -> None:
    """Every rank calls this at the same steps: each contributes its RNG state; rank 0 writes, or under FSDP
    every rank writes its shards of a sharded checkpoint, the folder `name` without .pt (rank 0 the rest).
    `requests`: a save of last.pt restarts the clock of checkpoint_interval_s."""
    if requests is not None:
        requests.saved()
    rt, d = run.rt, run.d
    rng = {"torch": torch.get_rng_state(),
           "cuda": torch.cuda.get_rng_state(rt.device) if rt.device_type == "cuda" else None}
    rngs = [rng]
    if d.enabled:
        rngs = [None] * d.world_size
        dist.all_gather_object(rngs, rng)
    sharded = parallel.is_sharded(run.model)
    state = None
    if d.master:
        state = build_checkpoint(model=run.raw_model, optimizer=run.optimizer, scaler=run.scaler,
                                 loader=run.loader, meta=run.meta, config=config_to_dict(run.cfg), argv=run.argv,
                                 step=step, best_val_loss=best_val, rng=rngs, versions=library_versions(),
                                 lora_info=run.lora, sharded=sharded)
    if sharded:
        run.saver.save_sharded(Path(run.cfg.out_dir) / Path(name).stem, state, run.raw_model, run.optimizer,
                               adapters_only=bool(run.lora))
    elif d.master:
        run.saver.save(state, Path(run.cfg.out_dir) / name)


def make_metrics(run: Run, start_step: int = 0) -> Metrics:
    cfg, d, rt = run.cfg, run.d, run.rt
    wandb_run = None
    if cfg.wandb_log and d.master:
        wandb_run = start_wandb(cfg.wandb_project, cfg.wandb_run_name or Path(cfg.out_dir).name,
                                config_to_dict(cfg), cfg.out_dir)
    fpt = plan.flops_per_token(run.raw_model, cfg.block_size)  # the run's sequences, not the model's context
    if d.master:
        trainable = f" ({lora.trainable_parameters(run.raw_model) / 1e6:.3f}M trainable: LoRA)" if run.lora else ""
        # every parameter, as --plan counts them (num_params() would leave out the position embedding)
        params = run.raw_model.num_params(non_embedding=False)
        print(f"model: {params / 1e6:.2f}M parameters{trainable} | {d.world_size} process(es) on "
              f"{rt.device} | {rt.dtype_name} | {run.tokens_per_step:,} tokens per step ({cfg.batch_size} x "
              f"{cfg.block_size} x {run.accum} accumulation x {d.world_size} processes)")
        if rt.device_type == "cpu" and cfg.device == "auto":
            total = fpt * run.tokens_per_step * max(0, cfg.max_iters - start_step)
            if total > CPU_FLOPS_BUDGET:
                training, evaluation = plan.run_flops(run.raw_model, cfg, run.tokens_per_step,
                                                      cfg.activation_checkpointing, done=start_step)
                cpu = plan.cpu_device()
                print(f"note: no GPU here, so this runs on the CPU, but this config is sized for a GPU "
                      f"({total:.1e} training FLOPs): the plan estimates "
                      f"{plan.format_seconds((training + evaluation) / cpu.flops)} on this CPU (python train.py "
                      f"... --plan); the ETA follows the first logged steps. For a run sized for a CPU: python "
                      f"train.py configs/shakespeare_cpu.py", flush=True)
        if rt.device_type == "cpu" and rt.dtype == torch.float16:
            print("note: float16 on the CPU is emulated, many times slower than float32; drop --dtype (auto is "
                  "float32 on the CPU) or use --dtype=float32", flush=True)
    chat = run.meta.get("chat") or {}
    answers_only = bool(run.meta["splits"]["train"].get("masks")) and chat.get("train_on") != "all"
    if answers_only and d.master:
        print("loss: over the answer tokens only (a chat dataset: the assistant's replies and their <|end|> are the "
              "targets; the rest is context)")
    metrics = Metrics(cfg.out_dir, master=d.master, tokens_per_step=run.tokens_per_step, flops_per_token=fpt,
                      peak_flops=peak_flops(rt.device, rt.dtype), world_size=d.world_size,
                      max_iters=cfg.max_iters, device=rt.device, wandb_run=wandb_run, answers_only=answers_only,
                      log_interval=cfg.log_interval, started=time.perf_counter() - process_elapsed())
    metrics.step = start_step  # (for its progress lines)
    return metrics


# ----------------------------------------------------------------------------- one step, evaluation


def forward_backward(model, optimizer, scaler, next_batch, accum: int, rt: Runtime, grad_clip: float,
                     prefetch=None):
    """The gradient half of a training step: `accum` micro-batches of forward + backward, then unscale and
    clip. Returns the mean loss and the gradient norm as device tensors (reading them would sync the host).
    `prefetch` (the loader's) reads the next batch while the GPU runs the forward just queued; after the last
    micro-batch that is the next step's first, read while the device still runs this step."""
    loss_sum = torch.zeros((), device=rt.device)
    for micro in range(accum):
        x, y = next_batch()
        # Under DDP gradients are all-reduced on the last micro-batch only (the others accumulate locally); under
        # FSDP every micro-batch's are reduce-scattered, so none is ever held whole (gptkit/parallel.py's no_sync).
        with parallel.no_sync(model) if micro < accum - 1 else contextlib.nullcontext():
            with rt.autocast():
                # With targets the model returns no logits (None): the loss is computed without ever holding them.
                loss = model(x, y)[1] / accum
            if prefetch is not None:
                prefetch()
            scaler.scale(loss).backward()
        loss_sum += loss.detach()
    scaler.unscale_(optimizer)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grad_norm = parallel.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))  # (FSDP: sharded)
    return loss_sum, grad_norm


def step_flags(loss: torch.Tensor, grad_norm: torch.Tensor, request: float, rt: Runtime,
               d: Dist) -> torch.Tensor:
    """The step's flags on the device, (2,) float32: [a NaN/inf anywhere, the largest request of any rank for
    the step boundary (runtime.StepRequests: GO_ON, SAVE or STOP; a bool: a stop signal or none)], one small
    reduction deciding for all ranks. Nothing is read to the host here. With fp16 an inf gradient is routine
    (the GradScaler skips that step and lowers its scale): only a non-finite loss is an error there."""
    bad = ~torch.isfinite(loss)
    if not rt.needs_grad_scaler:
        bad = bad | ~torch.isfinite(grad_norm)
    flags = torch.zeros(2, device=rt.device)
    flags[0] = bad
    flags[1].fill_(float(request))  # a scalar fill: no host-to-device copy
    if d.enabled:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return flags


@dataclass
class Verdict:
    """What a step's flags say, once read: `bad_step` the step whose loss or gradients were not finite (its
    update was not applied), with its loss and gradient norm on this rank; `stop` a stop signal on any rank;
    `save` a save asked for on any rank (SIGUSR1, or rank 0's clock: checkpoint_interval_s), and no stop."""

    bad_step: int | None = None
    loss: float = 0.0
    grad_norm: float = 0.0
    stop: bool = False
    save: bool = False


class StepGuard:
    """The guarantees of every step, a NaN/inf step is never applied and a stop signal on any rank stops every
    rank at the same step boundary, with no host synchronisation in the step on a GPU.

    On CUDA (where the optimizer can skip its update on the device: fused AdamW, Muon; optim.can_mask) the
    step is applied unless its flag is set (`optim.step_unless`), and the flags are copied to pinned host
    memory without blocking and read one step later, after the next step's forward and backward are queued:
    the GPU never idles waiting for the host, as nanoGPT's loop. A bad step stops the run one step later (that
    step not applied either), a stop signal one step later, at the same step on every rank.
    Elsewhere the flags are read at once, before the optimizer step: on the CPU nothing runs ahead of the host,
    so reading costs nothing; with fp16 the GradScaler reads its own flags anyway."""

    def __init__(self, optimizer, rt: Runtime, d: Dist):
        self.rt, self.d = rt, d
        self.deferred = rt.device_type in DEFERRED_DEVICE_TYPES and not rt.needs_grad_scaler and can_mask(optimizer)
        self.pending: tuple[int, torch.Tensor, torch.cuda.Event | None] | None = None
        # Deferred, one pinned host buffer and one event serve every step (the previous step's values are read
        # before this step's are copied in): nothing is allocated per step, so the host's work stays flat.
        cuda = rt.device_type == "cuda"
        self.host = torch.zeros(4, pin_memory=cuda) if self.deferred else None
        self.event = torch.cuda.Event() if self.deferred and cuda else None

    def check(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, request: float = GO_ON,
              flags: torch.Tensor | None = None) -> Verdict:
        """Called after the step's backward, before its optimizer step: what is known so far (this step's
        flags, or when deferred the previous step's). `flags`: the step's own, when it computed them (a CUDA
        graph's step, already applied or masked)."""
        self.flags = step_flags(loss, grad_norm, request, self.rt, self.d) if flags is None else flags
        values = torch.cat([self.flags, loss.detach().float().reshape(1), grad_norm.detach().float().reshape(1)])
        if not self.deferred:
            self.pending = (step, values, None)
            return self.settle()
        verdict = self.settle()  # the previous step's: finished, or nearly (this step is queued behind it)
        self.host.copy_(values, non_blocking=True)
        if self.event is not None:
            self.event.record()
        self.pending = (step, self.host, self.event)
        return verdict

    def optimizer_step(self, optimizer, scaler: torch.amp.GradScaler) -> None:
        """The optimizer step: skipped on the device when deferred and this step's flag is set."""
        if self.deferred:
            step_unless(optimizer, self.flags[0])
        else:
            scaler.step(optimizer)
            scaler.update()

    def settle(self) -> Verdict:
        """The flags of the last checked step, read now (waiting for that step if needed); a Verdict of nothing
        when none is pending."""
        if self.pending is None:
            return Verdict()
        step, host, event = self.pending
        self.pending = None
        if event is not None:
            event.synchronize()
        bad, request, loss, grad_norm = host.tolist()
        return Verdict(bad_step=step if bad else None, loss=loss, grad_norm=grad_norm, stop=request >= STOP,
                       save=SAVE <= request < STOP)


# Where the flags are read a step late (the step masked on the device instead): where the host would wait.
DEFERRED_DEVICE_TYPES = ("cuda",)


def non_finite_error(v: Verdict) -> TrainError:
    return TrainError(
        f"non-finite loss or gradient norm at step {v.bad_step} (loss {v.loss:.4g}, grad norm {v.grad_norm:.4g}); "
        f"its update was not applied and checkpoints were left as they were. Try a lower --learning_rate, "
        f"--grad_clip=1.0, or --dtype=bfloat16/float32")


def mean_over_ranks(value: torch.Tensor, d: Dist) -> float:
    if d.enabled:
        value = value.clone()
        dist.all_reduce(value)  # a sum: gloo has no AVG
        value /= d.world_size
    return value.item()


@torch.no_grad()
def evaluate(model, batches: ValBatches, rt: Runtime, d: Dist, stop: StopFlag | None = None) -> float | None:
    """Mean loss over the fixed validation batches, each rank taking its share; None when a stop signal cut
    it short on any rank (a preempted job has seconds, not the minutes an evaluation may take). A progress
    bar shows on a terminal when an evaluation takes more than a few seconds. Under FSDP the model holds its
    whole weights meanwhile (parallel.gathered): its forwards gather nothing, so the ranks' counts may differ."""
    model.eval()
    total = torch.zeros(3, device=rt.device, dtype=torch.float64)  # [sum of batch losses, batches, cut short]
    quiet = not (d.master and sys.stdout.isatty())
    # not on a terminal (a log file, a pipe): plain lines instead of the bar, when it takes more than seconds
    lines = LineProgress("evaluating", len(batches), "batches") if quiet and d.master else None
    with parallel.gathered(model):
        for i, (x, y) in enumerate(tqdm(batches, desc="evaluating", unit="batch", leave=False, delay=3,
                                        disable=quiet)):
            if stop is not None and stop.requested:
                total[2] = 1
                break
            with rt.autocast():
                loss = model(x, y)[1]  # no logits with targets: the loss is computed a slice at a time
            total[0] += loss.double()
            total[1] += 1
            if lines is not None:
                lines.update(i + 1)  # (on a GPU the batches are only queued: the lines show the host's pace)
    if d.enabled:
        dist.all_reduce(total)  # evaluation's one collective: ranks agree on the loss and on a cut
    model.train()
    return None if total[2] else (total[0] / total[1]).item()


def load_hellaswag(cfg: TrainConfig, meta: dict, d: Dist) -> list[hellaswag.Encoded] | None:
    """HellaSwag's items in the dataset's tokens, when hellaswag_interval asks for them: the file is obtained
    (downloaded once into the cache) and read before the run starts."""
    if not cfg.hellaswag_interval:
        return None
    tokenizer = Tokenizer.from_meta(meta)
    if tokenizer.kind == "char":
        raise TrainError(f"hellaswag_interval needs a BPE dataset such as GPT-2's, and {cfg.dataset!r} is "
                         f"character-level; set --hellaswag_interval=0")
    items = hellaswag.read_items(hellaswag.obtain_once(d), cfg.hellaswag_limit or None)
    return hellaswag.encode(items, tokenizer, cfg.block_size)


def hellaswag_scores(run: Run, step: int) -> dict[str, float]:
    """HellaSwag accuracies for this evaluation's log line when they are due at `step`, else nothing. The
    plain model is scored (not its DDP or compiled wrapper; under FSDP with its whole weights gathered); each
    rank scores its share of the items."""
    cfg = run.cfg
    if run.hellaswag is None or not (step % cfg.hellaswag_interval == 0 or step >= cfg.max_iters or cfg.eval_only):
        return {}
    quiet = not (run.d.master and sys.stdout.isatty())
    with parallel.gathered(run.model):
        scores = hellaswag.score(run.raw_model, run.hellaswag, run.rt, run.d, progress=not quiet)
    return {"hellaswag_acc": scores["acc"], "hellaswag_acc_norm": scores["acc_norm"]}


# ----------------------------------------------------------------------------- the loop


def stop_run(run: Run, step: int, best_val: float, start_step: int) -> None:
    """A stop signal: save the last finished step (unless last.pt holds it already) and say what is saved and
    what to run next. A new run stopped before its first step has nothing to save: it says so."""
    if step > start_step:
        save(run, "last.pt", step, best_val)
    if not run.d.master:
        return
    last = f"{run.cfg.out_dir}/last.pt"
    again = rerun_command(run.argv, resume=run.cfg.resume != "auto")  # (resume=auto: the same command)
    if step > start_step or run.cfg.init_from == "resume":  # (resumed: last.pt holds the start step already)
        print(f"stopped at step {step}; {last} holds it; continue with: {again}")
    else:
        print(f"stopped at step {step}, before the first step finished: nothing was saved (no {last}); start "
              f"again with: {rerun_command(run.argv)}")


def rerun_command(argv: list[str], resume: bool = False) -> str:
    """The command line of this run (as typed), to run again; with resume, continuing out_dir's last.pt."""
    args, skip = [], False
    for a in argv:
        if resume and (skip or a.startswith("--init_from=")):
            skip = False
            continue
        skip = resume and a == "--init_from"  # written "--init_from VALUE": its value goes too
        if not skip:
            args.append(a)
    return shlex.join(["python", "train.py", *args, *(["--init_from=resume"] if resume else [])])


def train_loop(run: Run, step: int, best_val: float, metrics: Metrics, requests: StepRequests) -> dict:
    cfg, rt, d, stop = run.cfg, run.rt, run.d, requests.stop
    start_step, val_loss, stopped, save_asked = step, None, False, False
    guard = StepGuard(run.optimizer, rt, d)
    while True:
        # ---- evaluate and checkpoint
        if step % cfg.eval_interval == 0 or step >= cfg.max_iters or cfg.eval_only:
            verdict = guard.settle()  # the last step's flags, before anything is evaluated or saved
            if verdict.bad_step is not None:
                raise non_finite_error(verdict)
            save_asked |= verdict.save
            val_loss = None if verdict.stop else evaluate(run.model, run.val, rt, d, stop)
            if val_loss is None:  # a stop signal, before or during the evaluation (evaluated again on resume)
                stop_run(run, step, best_val, start_step)
                stopped = True
                break
            improved = val_loss < best_val
            best_val = min(best_val, val_loss)
            metrics.log_eval(step, val_loss, best_val, improved, hellaswag_scores(run, step))
            # Step 0 of a fresh run is the random initialisation: not worth a file. A resumed run may start on a
            # step whose evaluation the stopped run never did: an improvement there is saved too.
            if improved and step > 0:
                save(run, "best.pt", step, best_val)
            if step > start_step and (improved or cfg.always_save_checkpoint or step >= cfg.max_iters or save_asked):
                save(run, "last.pt", step, best_val, requests)  # (on the start step last.pt holds this state)
            save_asked = False
            if step > start_step:
                metrics.start_timing()  # keep the evaluation out of the step timings
        if cfg.eval_only or step >= cfg.max_iters:
            break

        # ---- learning rate, then forward + backward over the micro-batches
        lr = set_lr(run.optimizer, step, cfg)
        if run.graphed is None:
            loss, grad_norm = forward_backward(run.model, run.optimizer, run.scaler, run.loader.next_batch,
                                               run.accum, rt, cfg.grad_clip, prefetch=run.loader.prefetch)
            # ---- NaN/inf, a stop or a save asked for on any rank (this step's flags, or on a GPU the previous step's)
            verdict = guard.check(step, loss, grad_norm, requests.next())
            if verdict.bad_step is not None:
                raise non_finite_error(verdict)
            # ---- the optimizer step (on a GPU skipped on the device if this step's flag is set)
            guard.optimizer_step(run.optimizer, run.scaler)
            run.optimizer.zero_grad(set_to_none=True)
        else:  # ---- the same step as one CUDA graph: the update masked on the device from a bad step on
            loss, grad_norm, flags = run.graphed(run.loader, requests.next())
            verdict = guard.check(step, loss, grad_norm, flags=flags)
            if verdict.bad_step is not None:
                raise non_finite_error(verdict)
        step += 1
        metrics.step_done()
        if step == start_step + 1:
            metrics.start_timing()  # the first step compiles and warms up: it is left out of the rates

        # ---- log (the loss is read every log_interval steps only: on a GPU the loop's one host sync)
        if step % cfg.log_interval == 0 or step == cfg.max_iters:
            metrics.log_step(step, mean_over_ranks(loss, d), lr, grad_norm.item(), run.loader.epoch)
        if verdict.stop:  # a signal on any rank: every rank leaves after this same step
            stop_run(run, step, best_val, start_step)
            stopped = True
            break
        save_asked = verdict.save  # SIGUSR1 or the clock, on any rank: save last.pt, then go on
        if save_asked and step % cfg.eval_interval and step < cfg.max_iters:  # (else with the evaluation)
            save(run, "last.pt", step, best_val, requests)
            save_asked = False
    return {"step": step, "val_loss": val_loss, "best_val_loss": best_val, "stopped": stopped}


def train(cfg: TrainConfig, ckpt: dict | None, argv: list[str], d: Dist, rt: Runtime) -> dict:
    """Run the training loop; returns a summary (final step, last val loss, best val loss)."""
    data_dir, meta = load_dataset(cfg, d)
    cfg = fit_block_size(cfg, meta, d)
    hellaswag_items = load_hellaswag(cfg, meta, d)  # now: no network is an error at the start, not at step 5000
    with lock_out_dir(cfg.out_dir, d):
        check_out_dir(cfg)
        run, step, best_val = setup_run(cfg, ckpt, argv, d, rt, data_dir, meta)
        run.hellaswag = hellaswag_items
        metrics = make_metrics(run, step)
        run.saver = CheckpointSaver(background=cfg.async_save)
        try:
            with StopFlag() as stop, run.saver:  # (leaving, on a signal or an error too: waits for a pending save)
                requests = StepRequests(stop, cfg.checkpoint_interval_s, owns_clock=d.master)
                summary = train_loop(run, step, best_val, metrics, requests)
        except torch.OutOfMemoryError:
            raise TrainError(oom_message(run)) from None
        finally:
            metrics.close()
    if summary["stopped"]:  # by a signal (on this rank or another): exit as the signal would have
        raise SystemExit(stop.exit_code)
    if d.master and not cfg.eval_only:
        print(where_checkpoints_are(cfg.out_dir, summary))
    return summary


def where_checkpoints_are(out_dir: str, summary: dict) -> str:
    """The run's last line: where its checkpoints are, and how to use them."""
    saved = [p.name for p in (saved_checkpoint(out_dir, n) for n in ("best", "last")) if p is not None]
    if not saved:
        return f"done at step {summary['step']}; no checkpoint was saved in {out_dir}/"
    return (f"done at step {summary['step']} (best val loss {summary['best_val_loss']:.4f}); checkpoints in "
            f"{out_dir}/: {', '.join(saved)}; sample with: python sample.py --ckpt {out_dir}/")


def oom_message(run: Run) -> str:
    """The one-line error for running out of GPU memory mid-run, with the largest micro-batch that the plan
    says fits this GPU and the accumulation that keeps the tokens per step."""
    cfg, rt, d = run.cfg, run.rt, run.d
    if rt.device_type != "cuda":
        return f"out of memory at micro-batch {cfg.batch_size} x {cfg.block_size}; lower --batch_size"
    total = torch.cuda.get_device_properties(rt.device).total_memory
    setup = plan.Setup("cuda", rt.dtype, cfg.block_size, cfg.optimizer, accum=2, world_size=d.world_size,
                       compile=resolve_compile(cfg.compile, rt.device)[0], checkpointing=cfg.activation_checkpointing,
                       parallel="fsdp" if parallel.is_sharded(run.model) else "ddp")
    fits = plan.largest_batch(run.raw_model, setup, plan.Device("", "cuda", total, None, "").capacity)
    sequences = cfg.batch_size * cfg.gradient_accumulation_steps
    batch = max([b for b in plan.valid_batches(sequences, d.world_size) if b <= fits], default=0)
    advice = (f"use --batch_size={batch} --gradient_accumulation_steps={sequences // batch} (the same tokens per "
              f"step)" if batch else "use --activation_checkpointing=True, --lora_rank or a smaller model")
    return (f"out of GPU memory at micro-batch {cfg.batch_size} x {cfg.block_size}; the plan puts the largest that "
            f"fits this GPU ({plan.format_bytes(total)}) at {fits}: {advice}, or --batch_size=auto "
            f"--tokens_per_step={sequences * cfg.block_size}")


def plan_run(cfg: TrainConfig, ckpt: dict | None, argv: list[str]) -> dict:
    """--plan: print the run's memory, FLOPs, time and cost per device (gptkit/plan.py) and return them;
    nothing is trained, written or loaded but configs (and a resumed checkpoint's config)."""
    world_size = cfg.plan_gpus or int(os.environ.get("WORLD_SIZE", 1))
    report = plan.make_plan(cfg, ckpt, world_size)
    title = " ".join(["train.py", *(a for a in argv if a.split("=")[0] != "--plan")])
    print(plan.format_plan(report, title))
    return report


@cli.entry_point(oom_hint="lower --batch_size and raise --gradient_accumulation_steps to keep the same tokens "
                          "per step")
def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg, ckpt = resolve_config(argv)
    if cfg.plan:
        return plan_run(cfg, ckpt, argv)
    with distributed(cfg.device, cfg.dtype, cfg.backend) as (d, rt):
        return train(cfg, ckpt, argv, d, rt)


if __name__ == "__main__":
    main()
