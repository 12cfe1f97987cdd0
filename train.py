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
the window shifted by one) -> `gptkit/step.py`: `model.py` turns x into logits and the cross-entropy against y ->
backward -> after the last micro-batch, clip and `gptkit/optim.py`'s AdamW step -> `gptkit/metrics.py` logs ->
`gptkit/checkpoint/` saves.

This file: this run's setup (`setup_run`), then `train_loop`, the whole loop on one screen, its saves and its
stop. What the run continues from is gptkit/checkpoint/resume.py's, the model it trains
gptkit/checkpoint/run_model.py's, batch_size=auto gptkit/batch_size.py's and the step gptkit/step.py's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from gptkit import cli, fp8, hellaswag, lora, objectives, parallel, plan, startup
from gptkit.batch_size import choose_batch_size, oom_message
from gptkit.checkpoint import (
    build_checkpoint,
    load_sharded_optimizer,
    load_whole_optimizer,
    saved_checkpoint,
)
from gptkit.checkpoint.background import CheckpointSaver
from gptkit.checkpoint.resume import check_out_dir, resolve_config, set_aside_damaged_best
from gptkit.checkpoint.run_files import RunFiles
from gptkit.checkpoint.run_model import attach_lora, build_model, check_vocab, with_base_shape
from gptkit.cli import UserError
from gptkit.config import TrainConfig
from gptkit.cudagraph import GraphedStep
from gptkit.evaluation import evaluate, hellaswag_scores, load_hellaswag
from gptkit.files import OutDirBusyError, OutDirLock
from gptkit.loader import BatchLoader, ValBatches
from gptkit.metrics import Metrics, peak_flops, start_wandb
from gptkit.optim import describe, load_optimizer_state, make_optimizer
from gptkit.options import ConfigError, config_to_dict, print_config
from gptkit.plan_check import check_run_fits, fit_base_context
from gptkit.plan_report import format_plan, make_plan
from gptkit.preference import PairLoader, ValPairs
from gptkit.prepare.local import DownloadError
from gptkit.prepare.tiny_shakespeare import DATASETS as SHAKESPEARE_DATASETS
from gptkit.prepare.tiny_shakespeare import prepare_shakespeare
from gptkit.runtime import (
    Dist,
    Runtime,
    code_version,
    distributed,
    library_versions,
    process_elapsed,
    resolve_compile,
    resolve_cuda_graphs,
)
from gptkit.shards import DataError, dataset_dir, prepare_command, read_meta, require_dataset
from gptkit.step import (
    NonFiniteError,
    Objective,
    StepInterrupted,
    StepRequests,
    StopFlag,
    TrainStep,
    next_token_loss,
)
from gptkit.threads import Threads, resolve_threads
from gptkit.tokenizer import with_tokenizer_files
from model import GPT

# A run on the CPU that needs more training FLOPs than this was sized for a GPU (configs/shakespeare.py needs
# ~6e15; configs/shakespeare_cpu.py ~1e13): say so before it starts.
CPU_FLOPS_BUDGET = 1e14


# A run whose caller chose no thread count (setup_run called from Python): torch's own, left as it is.
TORCH_OWN = Threads(None, "torch's own count")


class TrainError(UserError):
    """A run that cannot start or continue; the message says why and what to do."""


# ----------------------------------------------------------------------------- before the run


def load_dataset(cfg: TrainConfig, d: Dist) -> tuple[Path, dict]:
    """The dataset's folder and meta.json. The two Shakespeare datasets are small: they are prepared on the fly
    (downloading the text) instead of failing."""
    path = dataset_dir(cfg.dataset, cfg.data_root)
    if d.master and not (path / "meta.json").is_file() and path.name in SHAKESPEARE_DATASETS:
        print(f"dataset {cfg.dataset!r} not prepared yet: preparing it at {path}")
        try:
            prepare_shakespeare(path, SHAKESPEARE_DATASETS[path.name])
        except DownloadError as e:  # no network: the prepare script takes a copy of the text
            out = "" if path == Path("data") / path.name else f" --out_dir {shlex.quote(str(path))}"
            raise TrainError(f"could not download the text of {path.name} to prepare {path} ({e.reason}); with a "
                             f"copy of it here, run: python prepare/{path.name}.py --input PATH_TO_THE_TEXT{out} "
                             f"(then this command again)") from None
        except DataError as e:
            raise TrainError(f"could not prepare {path}: {e}") from None
    d.barrier()  # every rank waits here, whatever it saw on disk, so the collectives stay in step
    path = require_dataset(cfg.dataset, cfg.data_root, how=prepare_hint(cfg))
    meta = read_meta(path)
    # A trained tokenizer's folder is read (and checked against its hash) now, not at the first save after
    # hours of training; the checkpoints carry these files.
    with_tokenizer_files(meta)
    return path, meta


def prepare_hint(cfg: TrainConfig) -> str:
    """How to prepare this run's dataset: pairs for DPO, conversations (or text) for a fine-tune, in its base's
    tokenizer; text for a run from scratch."""
    base = None if cfg.init_from in ("scratch", "resume") else cfg.init_from
    if objectives.is_dpo(cfg):
        return prepare_command(cfg.dataset, cfg.data_root, "preference", base)
    if base is None:
        return prepare_command(cfg.dataset, cfg.data_root)
    return (f"{prepare_command(cfg.dataset, cfg.data_root, 'chat', base)} (conversations; for plain text: "
            f"{prepare_command(cfg.dataset, cfg.data_root, 'text', base)})")


def check_accumulation(cfg: TrainConfig, world_size: int) -> None:
    """gradient_accumulation_steps counts the micro-batches of all processes together: a multiple of their
    number, or a one-line error (before any process group: every process says it alike, one prints it) with the
    setting that works, and the batch size that keeps the tokens per step where there is one."""
    accum = cfg.gradient_accumulation_steps
    if cfg.batch_size is None or accum % world_size == 0:  # (batch_size=auto chooses the accumulation itself)
        return
    fit = -(-accum // world_size) * world_size  # the next multiple
    keep = ""
    if cfg.batch_size * accum % fit == 0:
        keep = (f"; to keep its {cfg.batch_size * accum * cfg.block_size:,} tokens per step: "
                f"--gradient_accumulation_steps={fit} --batch_size={cfg.batch_size * accum // fit}")
    raise ConfigError(f"gradient_accumulation_steps ({accum}) counts the micro-batches of all {world_size} "
                      f"processes together, so it must be a multiple of {world_size}: use "
                      f"--gradient_accumulation_steps={fit}{keep}")


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


def write_run_info(cfg: TrainConfig, argv: list[str], d: Dist, rt: Runtime, threads: Threads,
                   files: RunFiles) -> None:
    out = Path(cfg.out_dir)
    # A new run starts new logs; with --overwrite=True the old run's checkpoints are set aside now, so that a
    # stale best.pt can never be mistaken for this run's (removed at this run's first save, back if it fails).
    files.begin()
    (out / "config.json").write_text(json.dumps(config_to_dict(cfg), indent=2) + "\n")
    info = {"argv": ["train.py", *argv], "config": config_to_dict(cfg), "versions": library_versions(),
            "code": code_version(Path(__file__).resolve().parent),
            "world_size": d.world_size, "device": str(rt.device), "dtype": rt.dtype_name,
            "threads": threads.record(), "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "start": startup.record()}
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
    loader: BatchLoader | PairLoader
    val: ValBatches | ValPairs
    accum: int  # micro-batches per process per step
    objective: Objective = next_token_loss  # the micro-batch loss (gptkit/objectives.py: next-token or DPO)
    reference: object = None  # DPO's reference (gptkit/dpo.py), saved in the checkpoints when precomputed
    lora: dict | None = None  # a LoRA run's settings and base (checkpoint.build_checkpoint's lora_info)
    graphed: GraphedStep | None = None  # with cuda_graphs: the whole step, replayed as one CUDA graph
    hellaswag: list[hellaswag.Encoded] | None = None  # HellaSwag's items, when hellaswag_interval is set
    saver: CheckpointSaver = field(default_factory=CheckpointSaver)  # writes in the background with async_save
    threads: Threads = TORCH_OWN  # torch's CPU threads (gptkit/threads.py), chosen at the start
    files: RunFiles | None = None  # rank 0: out_dir's files until the first checkpoint (checkpoint/run_files.py)
    evaluated: bool = False  # a resumed run whose start step's evaluation metrics.jsonl holds already

    @property
    def tokens_per_step(self) -> int:
        return objectives.sequences_per_batch(self.cfg) * self.cfg.block_size * self.accum * self.d.world_size


def setup_run(cfg: TrainConfig, ckpt: dict | None, argv: list[str], d: Dist, rt: Runtime,
              data_dir: Path, meta: dict, threads: Threads | None = None,
              files: RunFiles | None = None) -> tuple[Run, int, float]:
    """The model, optimizer, data and wrappers of a new or resumed run; returns it with its step and best
    val loss. `threads`: torch's CPU threads, already applied (None: torch's own count). `files`: rank 0's
    record of out_dir's files until the first checkpoint (None: one of this run's own, which removes an earlier
    run's files at the first save, and puts nothing back on a failure: the caller's to do)."""
    threads = threads or TORCH_OWN
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    model, added_tokens = build_model(cfg, meta, ckpt)
    objectives.check_start(cfg, added_tokens)
    if ckpt is None and cfg.init_from != "scratch":
        cfg = with_base_shape(cfg, model, argv, say=d.master)
    check_vocab(data_dir, meta, model)
    lora_info = attach_lora(cfg, model, ckpt, added_tokens)
    if lora_info and rt.device_type == "cuda" and rt.dtype == torch.bfloat16:
        lora.cast_frozen_base(model, torch.bfloat16)  # the blocks' frozen weights: half their memory
    model.activation_checkpointing = cfg.activation_checkpointing
    model.to(rt.device)
    startup.mark("model", rt.device)
    use_compile, why = resolve_compile(cfg.compile, rt.device)
    # Under torchrun DDP or FSDP (gptkit/parallel.py), decided before the batch size (FSDP holds less per process)
    sharing, parallel_line = parallel.decide(model, cfg, d, rt, use_compile)
    cfg = choose_batch_size(cfg, model, ckpt, d, rt, sharing)
    if cfg.fp8_head:  # a one-line error where the GPU or the sizes cannot (gptkit/fp8.py)
        fp8.use_fp8_head(model, rt.device, tokens=cfg.batch_size * cfg.block_size)
    # FSDP shards in place: the optimizer comes after
    wrapped = parallel.wrap(model, sharing, rt, use_compile, cfg.compile_scope)
    graphs, graphs_line = resolve_cuda_graphs(cfg.cuda_graphs, rt, world_size=d.world_size,
                                              optimizer=cfg.optimizer, compiled=use_compile)
    # the training sequences are block_size long (a LoRA run's model may have more positions: its base's)
    loader, val = objectives.make_batches(cfg, data_dir, d, rt)
    # the micro-batch loss; DPO's reference, precomputed here with the starting weights (or read back on resume)
    loss_of, reference, objective_line = objectives.make_objective(cfg, model, loader, data_dir, ckpt, d, rt)
    run = Run(
        cfg=cfg, argv=argv, d=d, rt=rt, meta=meta, raw_model=model, model=wrapped,
        optimizer=make_optimizer(model, cfg, rt.device_type, graphable=graphs),
        scaler=torch.amp.GradScaler(rt.device_type, enabled=rt.needs_grad_scaler),
        loader=loader, val=val, accum=cfg.gradient_accumulation_steps // d.world_size, objective=loss_of,
        reference=reference, threads=threads, lora=lora_info, saver=CheckpointSaver(background=cfg.async_save),
    )
    if graphs:  # (the capture waits for a checkpoint still being written: no other thread on the device then)
        run.graphed = GraphedStep(wrapped, run.optimizer, rt.device, accum=run.accum, grad_clip=cfg.grad_clip,
                                  autocast=lambda: rt.autocast(cache=False), objective=loss_of,
                                  before_capture=run.saver.wait)
    torch.manual_seed(cfg.seed + d.rank)  # dropout masks: a different stream per rank
    step, best_val = restore_state(run, ckpt) if ckpt is not None else (0, float("inf"))
    startup.mark("setup")  # (the batch size, the wrappers, the loader, the optimizer)
    if d.master:
        print(startup.line())
        print("config:")
        print_config(cfg)
        files = files or RunFiles(cfg.out_dir, new=cfg.init_from != "resume")  # (removed at the first save)
        write_run_info(cfg, argv, d, rt, threads, files)
        run.files = files
        print(why)
        if rt.device_type == "cpu":
            print(f"threads: {threads.describe()}")
        if rt.device_type == "cuda":
            print(graphs_line)
        if parallel_line:
            print(parallel_line)
        print(describe(run.optimizer))
        for line in (objective_line, objectives.dropout_note(cfg)):
            if line:
                print(line)
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


def save(run: Run, name: str, step: int, best_val: float, requests: StepRequests | None = None,
         asked: str = "") -> None:
    """Every rank calls this at the same steps: each contributes its RNG state; rank 0 writes, or under FSDP
    every rank writes its shards of a sharded checkpoint, the folder `name` without .pt (rank 0 the rest).
    `requests`: a save of last.pt restarts the clock of checkpoint_interval_s. `asked`: what asked for this
    save (SIGUSR1, the clock): rank 0 says when it is written (with async_save, once the write is done)."""
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
                                 lora_info=run.lora, sharded=sharded,
                                 dpo_reference=objectives.reference_state(run.reference))
    path = Path(run.cfg.out_dir) / (Path(name).stem if sharded else name)
    first = run.files if d.master and run.files is not None and not run.files.settled else None
    done = None
    if (asked or first) and d.master:  # (one write of the whole line: with async_save the writing thread prints it)
        def done():
            if asked:
                sys.stdout.write(f"saved {path}{'/' * sharded} at step {step} ({asked}); going on\n")
                sys.stdout.flush()
            if first is not None:  # the run's first checkpoint: an earlier run's files set aside go
                first.saved()
    if sharded:
        run.saver.save_sharded(path, state, run.raw_model, run.optimizer, adapters_only=bool(run.lora), done=done)
    elif d.master:
        run.saver.save(state, path, done=done)


def earlier_log(out_dir: str, step: int) -> tuple[float, bool]:
    """What metrics.jsonl holds of the run a resumed run continues: the elapsed_s of its last entry (the resumed
    run's entries go on from there), and whether step `step`'s evaluation is logged already (a finished run,
    run again: not logged twice)."""
    elapsed, evaluated = 0.0, False
    with contextlib.suppress(OSError):
        for line in Path(out_dir, "metrics.jsonl").read_text().splitlines():
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                entry = json.loads(line)
                elapsed = float(entry.get("elapsed_s", elapsed))
                evaluated |= entry.get("step") == step and "val_loss" in entry
    return elapsed, evaluated


def make_metrics(run: Run, start_step: int = 0) -> Metrics:
    cfg, d, rt = run.cfg, run.d, run.rt
    earlier, run.evaluated = earlier_log(cfg.out_dir, start_step) if cfg.init_from == "resume" else (0.0, False)
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
              f"{rt.device} | {rt.dtype_name} | {run.tokens_per_step:,} tokens per step "
              f"({objectives.describe_batch(cfg)} x "
              f"{cfg.block_size} x {run.accum} accumulation x {d.world_size} processes)")
        if rt.device_type == "cpu":
            total = fpt * run.tokens_per_step * max(0, cfg.max_iters - start_step)
            if total > CPU_FLOPS_BUDGET:
                training, evaluation = plan.run_flops(run.raw_model, cfg, run.tokens_per_step,
                                                      cfg.activation_checkpointing, done=start_step)
                cpu = plan.cpu_device()
                why = "no GPU here, so this runs on the CPU, but" if cfg.device == "auto" else "on the CPU:"
                print(f"note: {why} this config is sized for a GPU "
                      f"({total:.1e} training FLOPs): the plan estimates "
                      f"{plan.format_seconds((training + evaluation) / cpu.flops)} on this CPU (python train.py "
                      f"... --plan); the ETA follows the first logged steps. For a run sized for a CPU: python "
                      f"train.py configs/shakespeare_cpu.py", flush=True)
        if rt.device_type == "cpu" and rt.dtype == torch.float16:
            print("note: float16 on the CPU is emulated, many times slower than float32; drop --dtype (auto is "
                  "float32 on the CPU) or use --dtype=float32", flush=True)
    chat = run.meta.get("chat") or {}
    answers_only = (bool(run.meta["splits"]["train"].get("masks")) and chat.get("train_on") != "all"
                    and not objectives.is_dpo(cfg))
    if answers_only and d.master:
        print("loss: over the answer tokens only (a chat dataset: the assistant's replies and their <|end|> are the "
              "targets; the rest is context)")
    metrics = Metrics(cfg.out_dir, master=d.master, tokens_per_step=run.tokens_per_step, flops_per_token=fpt,
                      peak_flops=peak_flops(rt.device, rt.dtype), world_size=d.world_size,
                      max_iters=cfg.max_iters, device=rt.device, wandb_run=wandb_run, answers_only=answers_only,
                      log_interval=cfg.log_interval, started=time.perf_counter() - process_elapsed() - earlier,
                      cpu_threads=run.threads.count if rt.device_type == "cpu" else None)
    metrics.step = start_step  # (for its progress lines)
    return metrics


# ----------------------------------------------------------------------------- the loop


def stop_run(run: Run, step: int, best_val: float, start_step: int) -> None:
    """A stop signal: save the last finished step (unless last.pt holds it already) and say what is saved and
    what to run next. A new run stopped before its first step has nothing to save: it says so."""
    if step > start_step:
        save(run, "last.pt", step, best_val)
    if not run.d.master:
        return
    last = f"{run.cfg.out_dir}/last.pt"
    # (resume=auto: the same command)
    again = rerun_command(run.argv, resume=run.cfg.resume != "auto", block_size=run.cfg.block_size)
    if step > start_step or run.cfg.init_from == "resume":  # (resumed: last.pt holds the start step already)
        print(f"stopped at step {step}; {last} holds it; continue with: {again}")
    else:
        print(f"stopped at step {step}, before the first step finished: nothing was saved (no {last}); start "
              f"again with: {rerun_command(run.argv)}")


def rerun_command(argv: list[str], resume: bool = False, block_size: int | None = None) -> str:
    """The command line of this run (as typed), to run again; with resume, continuing out_dir's last.pt: its
    --init_from goes, and so does a --block_size other than the `block_size` the run trained with (a fine-tune
    fits it to its data or base; the resumed run takes the checkpoint's)."""
    args, i = [], 0
    while i < len(argv):
        key, eq, value = argv[i].partition("=")
        if not eq and key.startswith("--") and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value, i = argv[i + 1], i + 1  # written "--key VALUE"
        drop = resume and (key == "--init_from" or key == "--block_size" and value != str(block_size))
        if not drop:
            args += [argv[i]] if eq or argv[i] == key else [key, value]
        i += 1
    return shlex.join(["python", "train.py", *args, *(["--init_from=resume"] if resume else [])])


def cuts_steps(run: Run) -> bool:
    """Whether a stop signal cuts a step short (gptkit/step.py's TrainStep `stop`): one process, the plain
    model (not compiled nor graphed), whose steps a check between its blocks can leave."""
    return (not run.d.enabled and run.graphed is None and run.model is run.raw_model
            and not resolve_compile(run.cfg.compile, run.rt.device)[0])


def train_loop(run: Run, step: int, best_val: float, metrics: Metrics, requests: StepRequests) -> dict:
    cfg, d, stop = run.cfg, run.d, requests.stop
    start_step, val_loss, stopped, save_asked = step, None, False, False
    train_step = TrainStep(run.model, run.optimizer, run.scaler, run.rt, d, cfg, accum=run.accum,
                           objective=run.objective, graphed=run.graphed, stop=stop if cuts_steps(run) else None,
                           blocks=list(run.raw_model.transformer.h))
    while True:
        # ---- evaluate and checkpoint
        if step % cfg.eval_interval == 0 or step >= cfg.max_iters or cfg.eval_only:
            verdict = train_step.settle()  # the last step's flags, before anything is evaluated or saved
            if verdict.bad_step is not None:
                raise NonFiniteError(verdict)
            save_asked |= verdict.save
            try:
                with train_step.cut_short():  # (a stop signal leaves a long evaluation batch too)
                    evaluated = None if verdict.stop else evaluate(run.model, run.val, run.rt, d, stop, run.objective)
            except StepInterrupted:
                evaluated = None
            if evaluated is None:  # a stop signal, before or during the evaluation (evaluated again on resume)
                stop_run(run, step, best_val, start_step)
                stopped = True
                break
            val_loss, val_metrics = evaluated  # (best.pt: by the val loss, DPO's with its anchor as trained)
            improved = val_loss < best_val
            best_val = min(best_val, val_loss)
            scores = {**{f"val_{k}": v for k, v in val_metrics.items()}, **hellaswag_scores(run.model, run.raw_model, run.hellaswag, run.cfg, step, run.rt, d)}
            if step == start_step and run.evaluated:  # (the run it continues logged this evaluation)
                if d.master:
                    print(f"step {step}: val {metrics.label} {val_loss:.4f} (logged in metrics.jsonl before)")
            else:
                metrics.log_eval(step, val_loss, best_val, improved, scores)
            # Step 0 of a fresh run is the random initialisation: not worth a file. A resumed run may start on a
            # step whose evaluation the stopped run never did: an improvement there is saved too.
            if improved and step > 0:
                save(run, "best.pt", step, best_val)
            if step > start_step and (improved or cfg.always_save_checkpoint or step >= cfg.max_iters or save_asked):
                # (on the start step last.pt holds this state)
                save(run, "last.pt", step, best_val, requests, asked=requests.why_saved() if save_asked else "")
            save_asked = False
            if step > start_step:
                metrics.start_timing()  # keep the evaluation out of the step timings
        if cfg.eval_only or step >= cfg.max_iters:
            break

        # ---- one step (gptkit/step.py): learning rate, forward + backward over the micro-batches, clip, the
        # NaN/inf, stop and save flags of every rank (this step's, or on a GPU the previous step's), the update
        try:
            out = train_step(step, run.loader, requests.next)
        except StepInterrupted:  # a stop signal cut the step short: nothing of it kept, the last one saved
            verdict = train_step.settle()
            if verdict.bad_step is not None:
                raise NonFiniteError(verdict) from None
            stop_run(run, step, best_val, start_step)
            stopped = True
            break
        if out.verdict.bad_step is not None:  # that step's update was not applied, nor this one's
            raise NonFiniteError(out.verdict)
        step += 1
        metrics.step_done()
        if step == start_step + 1:
            metrics.start_timing()  # the first step compiles and warms up: it is left out of the rates

        # ---- log (the loss is read every log_interval steps only: on a GPU the loop's one host sync)
        if step % cfg.log_interval == 0 or step == cfg.max_iters:
            loss, grad_norm, extra = out.read(d)
            metrics.log_step(step, loss, out.lr, grad_norm, run.loader.epoch, extra)
        if out.verdict.stop:  # a signal on any rank: every rank leaves after this same step
            stop_run(run, step, best_val, start_step)
            stopped = True
            break
        save_asked = out.verdict.save  # SIGUSR1 or the clock, on any rank: save last.pt, then go on
        if save_asked and step % cfg.eval_interval and step < cfg.max_iters:  # (else with the evaluation)
            save(run, "last.pt", step, best_val, requests, asked=requests.why_saved())
            save_asked = False
    return {"step": step, "val_loss": val_loss, "best_val_loss": best_val, "stopped": stopped}


def train(cfg: TrainConfig, ckpt: dict | None, argv: list[str], d: Dist, rt: Runtime,
          threads: Threads | None = None) -> dict:
    """Run the training loop; returns a summary (final step, last val loss, best val loss). `threads`: torch's
    CPU threads, applied by the caller."""
    data_dir, meta = load_dataset(cfg, d)
    startup.mark("data")
    objectives.check_dataset(cfg, meta, repr(cfg.dataset))  # pairs for DPO, token windows for the next token
    cfg = fit_base_context(cfg, argv, say=d.master)  # a config file's block_size past a fine-tune's base's context
    cfg = objectives.fit_block_size(cfg, data_dir, d.master) if objectives.is_dpo(cfg) else fit_block_size(cfg, meta, d)
    hellaswag_items = load_hellaswag(cfg, meta, d)  # now: no network is an error at the start, not at step 5000
    # the plan's peak for one step against this machine's memory, before anything is built or allocated
    check_run_fits(cfg, ckpt, meta, rt.device, rt.dtype, d.world_size,
                   compile=resolve_compile(cfg.compile, rt.device)[0])
    # rank 0: until the first checkpoint, a failure or a stop puts out_dir back as it was (checkpoint/run_files.py)
    files = RunFiles(cfg.out_dir, new=cfg.init_from != "resume") if d.master else None
    try:
        with lock_out_dir(cfg.out_dir, d):
            summary, stop, aside = train_in(cfg, ckpt, argv, d, rt, threads, data_dir, meta, hellaswag_items, files)
    except BaseException:
        if files is not None:
            files.remove_if_empty()  # (the lock released: a folder this run made and left empty)
        raise
    if summary["stopped"]:  # by a signal (on this rank or another): exit as the signal would have
        if files is not None:
            files.remove_if_empty()
        raise SystemExit(stop.exit_code)
    if d.master and not cfg.eval_only:
        chat = bool(meta.get("chat")) or objectives.is_dpo(cfg)  # (a chat model: chat.py is the next step)
        print(where_checkpoints_are(cfg.out_dir, summary, aside, chat=chat))
    return summary


def train_in(cfg: TrainConfig, ckpt: dict | None, argv: list[str], d: Dist, rt: Runtime, threads: Threads | None,
             data_dir: Path, meta: dict, hellaswag_items, files: RunFiles | None) -> tuple[dict, StopFlag, Path | None]:
    """The run, holding out_dir's lock: its summary, its stop flag, and where a damaged best checkpoint was set
    aside. An error or a stop before the first checkpoint leaves out_dir as it found it (`files`, rank 0's)."""
    start, metrics = int((ckpt or {}).get("step", 0)), None
    try:
        check_out_dir(cfg)
        # a resumed run checks best.pt as it checked last.pt: a damaged one is set aside, said in one line
        aside = set_aside_damaged_best(cfg.out_dir, ckpt["best_val_loss"]) if ckpt is not None and d.master else None
        run, step, best_val = setup_run(cfg, ckpt, argv, d, rt, data_dir, meta, threads, files)
        run.hellaswag = hellaswag_items
        metrics = make_metrics(run, step)
        try:
            # (leaving, on a signal or an error too: waits for a pending save)
            with StopFlag(cuts_steps=cuts_steps(run)) as stop, run.saver:
                requests = StepRequests(stop, cfg.checkpoint_interval_s, owns_clock=d.master)
                summary = train_loop(run, step, best_val, metrics, requests)
        except torch.OutOfMemoryError:
            raise TrainError(oom_message(run.cfg, run.rt, run.d, run.raw_model, parallel.is_sharded(run.model))) from None
        finally:
            metrics.close()
    except BaseException:
        if files is not None:
            files.failed(trained=metrics is not None and metrics.step > start)
        raise
    if files is not None:  # (a stop, or an eval_only run: no checkpoint saved, an earlier run's files back)
        files.failed(trained=summary["step"] > start or not summary["stopped"])
    return summary, stop, aside


def where_checkpoints_are(out_dir: str, summary: dict, aside: Path | None = None, chat: bool = False) -> str:
    """The run's last line: where its checkpoints are, and how to use them (`chat`: a chat model's, chat.py).
    `aside`: where a damaged best checkpoint was set aside at the start, said again when no later evaluation
    replaced it."""
    saved = [p.name for p in (saved_checkpoint(out_dir, n) for n in ("best", "last")) if p is not None]
    if not saved:
        return f"done at step {summary['step']}; no checkpoint was saved in {out_dir}/"
    best = f"best val loss {summary['best_val_loss']:.4f}"
    if aside is not None and saved_checkpoint(out_dir, "best") is None:
        best += f", reached by the damaged best checkpoint set aside as {aside}; none since beat it"
    nxt = (f"chat with: python chat.py --ckpt {out_dir}/" if chat else
           f"sample with: python sample.py --ckpt {out_dir}/")
    return f"done at step {summary['step']} ({best}); checkpoints in {out_dir}/: {', '.join(saved)}; {nxt}"


def plan_run(cfg: TrainConfig, ckpt: dict | None, argv: list[str]) -> dict:
    """--plan: print the run's memory, FLOPs, time and cost per device (gptkit/plan_report.py) and return them;
    nothing is trained, written or loaded but configs (and a resumed checkpoint's config)."""
    world_size = cfg.plan_gpus or int(os.environ.get("WORLD_SIZE", 1))
    cfg = fit_base_context(cfg, argv, say=False)  # as the run would
    report = make_plan(cfg, ckpt, world_size)
    title = " ".join(["train.py", *(a for a in argv if a.split("=")[0] != "--plan")])
    print(format_plan(report, title))
    return report


@cli.entry_point(oom_hint="lower --batch_size and raise --gradient_accumulation_steps to keep the same tokens "
                          "per step")
def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    startup.begin()
    cfg, ckpt = resolve_config(argv)
    startup.mark("config")
    if cfg.plan:
        return plan_run(cfg, ckpt, argv)
    check_accumulation(cfg, int(os.environ.get("WORLD_SIZE", 1)))
    with distributed(cfg.device, cfg.dtype, cfg.backend) as (d, rt):
        startup.mark("device", rt.device)
        with resolve_threads(cfg.threads, rt.device_type).applied() as threads:  # (left as they were on return)
            return train(cfg, ckpt, argv, d, rt, threads)


if __name__ == "__main__":
    main()
