"""A training run's setup and its state, as one object: train.py's loop works with a `Run`, and its
checkpoints are the run's state_dict().

    data_dir, meta = load_dataset(cfg, d)
    run, step, best_val = setup_run(cfg, ckpt, argv, d, rt, data_dir, meta)   # new, or resumed from ckpt
    save(run, "last.pt", step, best_val)          # every rank, at the same steps: run.state_dict() written

A run's state (`Run.state_dict` / `Run.load_state_dict`): the model, the optimizer, the loss scaler, the
loader's position, every rank's RNG state (the dropout streams), and the state of each part that registers in
`Run.parts` (the objective's: DPO's precomputed reference). The checkpoint layout is gptkit/checkpoint/'s; a
part is saved because it registers here, under its own key, not through a keyword of build_checkpoint.

What the run continues from is gptkit/checkpoint/resume.py's, the model it trains
gptkit/checkpoint/run_model.py's, what it trains toward gptkit/objectives/', batch_size=auto
gptkit/batch_size.py's and the step gptkit/step.py's.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gptkit import fp8, hellaswag, lora, parallel, plan, startup
from gptkit.batch_size import choose_batch_size
from gptkit.checkpoint import (
    build_checkpoint,
    load_sharded_optimizer,
    load_whole_optimizer,
    saved_checkpoint,
)
from gptkit.checkpoint.background import CheckpointSaver
from gptkit.checkpoint.run_files import RunFiles
from gptkit.checkpoint.run_model import attach_lora, build_model, check_vocab, with_base_shape
from gptkit.cli import UserError
from gptkit.config import TrainConfig
from gptkit.cudagraph import GraphedStep
from gptkit.files import OutDirBusyError, OutDirLock
from gptkit.metrics import Metrics, peak_flops, start_wandb
from gptkit.objectives import Objective, make_objective
from gptkit.optim import describe, load_optimizer_state, make_optimizer
from gptkit.options import ConfigError, config_to_dict, print_config
from gptkit.prepare.local import DownloadError
from gptkit.prepare.tiny_shakespeare import DATASETS as SHAKESPEARE_DATASETS
from gptkit.prepare.tiny_shakespeare import prepare_shakespeare
from gptkit.runtime import (
    Dist,
    Runtime,
    code_version,
    library_versions,
    process_elapsed,
    resolve_compile,
    resolve_cuda_graphs,
)
from gptkit.shards import DataError, dataset_dir, prepare_command, read_meta, require_dataset
from gptkit.step import StepRequests
from gptkit.threads import Threads
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
    kind = make_objective(cfg).prepare_kind()
    if kind is not None:
        return prepare_command(cfg.dataset, cfg.data_root, kind, base)
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
            "code": code_version(Path(__file__).resolve().parents[1]),
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
    loader: Any  # the objective's training loader (gptkit/loader.py's BatchLoader, or PairLoader for DPO)
    val: Any  # its validation batches
    accum: int  # micro-batches per process per step
    objective: Objective  # what the run trains toward (gptkit/objectives/): its loss, metrics and state
    lora: dict | None = None  # a LoRA run's settings and base (checkpoint.build_checkpoint's lora_info)
    graphed: GraphedStep | None = None  # with cuda_graphs: the whole step, replayed as one CUDA graph
    hellaswag: list[hellaswag.Encoded] | None = None  # HellaSwag's items, when hellaswag_interval is set
    saver: CheckpointSaver = field(default_factory=CheckpointSaver)  # writes in the background with async_save
    threads: Threads = TORCH_OWN  # torch's CPU threads (gptkit/threads.py), chosen at the start
    files: RunFiles | None = None  # rank 0: out_dir's files until the first checkpoint (checkpoint/run_files.py)
    evaluated: bool = False  # a resumed run whose start step's evaluation metrics.jsonl holds already

    @property
    def tokens_per_step(self) -> int:
        per = self.objective.sequences_per_item
        return per * self.cfg.batch_size * self.cfg.block_size * self.accum * self.d.world_size

    def parts(self) -> dict[str, Any]:
        """The run's parts with a state of their own beyond the model, optimizer, scaler and loader, by the key
        their state_dict() is saved under: each is saved because it is listed here (a new feature registers
        here, not as a keyword of build_checkpoint). The objective's comes back to it at its start (setup_run:
        DPO's reference is needed before its batches are made)."""
        return {self.objective.state_key: self.objective} if self.objective.state_key else {}

    def state_dict(self, step: int, best_val: float) -> dict | None:
        """The run's state as its checkpoint holds it (gptkit/checkpoint/file.py's layout): model, optimizer,
        scaler, loader position, every rank's RNG state and each registered part's state. Every rank calls it
        at the same steps (each contributes its RNG state); rank 0 gets the checkpoint, the others None. Under
        FSDP it is the record of a sharded checkpoint, whose weights and optimizer state save() writes."""
        rng = {"torch": torch.get_rng_state(),
               "cuda": torch.cuda.get_rng_state(self.rt.device) if self.rt.device_type == "cuda" else None}
        rngs = [rng]
        if self.d.enabled:
            rngs = [None] * self.d.world_size
            dist.all_gather_object(rngs, rng)
        if not self.d.master:
            return None
        return build_checkpoint(model=self.raw_model, optimizer=self.optimizer, scaler=self.scaler,
                                loader=self.loader, meta=self.meta, config=config_to_dict(self.cfg), argv=self.argv,
                                step=step, best_val_loss=best_val, rng=rngs, versions=library_versions(),
                                lora_info=self.lora, sharded=parallel.is_sharded(self.model),
                                states={key: part.state_dict() for key, part in self.parts().items()})

    def load_state_dict(self, ckpt: dict) -> tuple[int, float]:
        """Continue a run exactly from its checkpoint: optimizer, loss scaler, data position and every rank's
        dropout stream (the model's weights and the objective's state are read at setup); returns the step and
        the best val loss. A sharded checkpoint's optimizer state is resharded to this run's processes, whatever
        their number and wrapper."""
        if ckpt.get("sharded"):
            load_sharded_optimizer(ckpt["sharded"], self.raw_model, self.optimizer)
        elif parallel.is_sharded(self.model):
            load_whole_optimizer(self.raw_model, self.optimizer, ckpt["optimizer"])
        else:
            load_optimizer_state(self.optimizer, ckpt["optimizer"])
        if self.scaler.is_enabled() and ckpt["scaler"]:  # a bf16/fp32 run saved an empty (disabled) scaler
            self.scaler.load_state_dict(ckpt["scaler"])
        self.loader.load_state_dict(ckpt["loader"])
        rng, d = ckpt["rng"], self.d
        if len(rng) == d.world_size:
            torch.set_rng_state(rng[d.rank]["torch"])
            if self.rt.device_type == "cuda" and rng[d.rank].get("cuda") is not None:
                torch.cuda.set_rng_state(rng[d.rank]["cuda"], self.rt.device)
        elif d.master:
            print(f"note: the checkpoint was written by {len(rng)} process(es), this run has {d.world_size}: "
                  f"dropout masks start a new random stream")
        return int(ckpt["step"]), float(ckpt["best_val_loss"])


def setup_run(cfg: TrainConfig, ckpt: dict | None, argv: list[str], d: Dist, rt: Runtime,
              data_dir: Path, meta: dict, threads: Threads | None = None,
              files: RunFiles | None = None) -> tuple[Run, int, float]:
    """The model, optimizer, data and wrappers of a new or resumed run; returns it with its step and best
    val loss. `threads`: torch's CPU threads, already applied (None: torch's own count). `files`: rank 0's
    record of out_dir's files until the first checkpoint (None: one of this run's own, which removes an earlier
    run's files at the first save, and puts nothing back on a failure: the caller's to do)."""
    threads = threads or TORCH_OWN
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    objective = make_objective(cfg)
    model, added_tokens = build_model(cfg, meta, ckpt, keep_context=objective.keeps_base_context)
    objective.check_start(cfg, added_tokens)
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
    sharing, parallel_line = parallel.decide(model, cfg, d, rt, use_compile, objective)
    cfg = choose_batch_size(cfg, model, ckpt, d, rt, sharing)
    if cfg.fp8_head:  # a one-line error where the GPU or the sizes cannot (gptkit/fp8.py)
        fp8.use_fp8_head(model, rt.device, tokens=cfg.batch_size * cfg.block_size)
    # FSDP shards in place: the optimizer comes after
    wrapped = parallel.wrap(model, sharing, rt, use_compile, cfg.compile_scope)
    graphs, graphs_line = resolve_cuda_graphs(cfg.cuda_graphs, rt, world_size=d.world_size,
                                              optimizer=cfg.optimizer, compiled=use_compile,
                                              ungraphable=None if objective.graphable else objective.name)
    # the training sequences are block_size long (a LoRA run's model may have more positions: its base's)
    # DPO's reference, precomputed here with the starting weights (or read back on resume), then the batches
    state = None if ckpt is None or not objective.state_key else ckpt.get(objective.state_key)
    objective_line = objective.start(cfg, model, data_dir, state, d, rt)
    loader, val = objective.batches(cfg, data_dir, d, rt)
    run = Run(
        cfg=cfg, argv=argv, d=d, rt=rt, meta=meta, raw_model=model, model=wrapped,
        optimizer=make_optimizer(model, cfg, rt.device_type, graphable=graphs),
        scaler=torch.amp.GradScaler(rt.device_type, enabled=rt.needs_grad_scaler),
        loader=loader, val=val, accum=cfg.gradient_accumulation_steps // d.world_size, objective=objective,
        threads=threads, lora=lora_info, saver=CheckpointSaver(background=cfg.async_save),
    )
    if graphs:  # (the capture waits for a checkpoint still being written: no other thread on the device then)
        run.graphed = GraphedStep(wrapped, run.optimizer, rt.device, accum=run.accum, grad_clip=cfg.grad_clip,
                                  autocast=lambda: rt.autocast(cache=False), objective=objective,
                                  before_capture=run.saver.wait)
    torch.manual_seed(cfg.seed + d.rank)  # dropout masks: a different stream per rank
    step, best_val = run.load_state_dict(ckpt) if ckpt is not None else (0, float("inf"))
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
        for line in (objective_line, *objective.notes(cfg)):
            if line:
                print(line)
    return run, step, best_val


def save(run: Run, name: str, step: int, best_val: float, requests: StepRequests | None = None,
         asked: str = "") -> None:
    """Save the run's state (run.state_dict). Every rank calls this at the same steps: each contributes its RNG
    state; rank 0 writes, or under FSDP every rank writes its shards of a sharded checkpoint, the folder `name`
    without .pt (rank 0 the rest).
    `requests`: a save of last.pt restarts the clock of checkpoint_interval_s. `asked`: what asked for this
    save (SIGUSR1, the clock): rank 0 says when it is written (with async_save, once the write is done)."""
    if requests is not None:
        requests.saved()
    d = run.d
    sharded = parallel.is_sharded(run.model)
    state = run.state_dict(step, best_val)
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
              f"({run.objective.describe_batch(cfg)} x "
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
    answers_only = run.objective.answers_only(run.meta)
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


