"""Train a GPT on prepared token shards.

    python train.py configs/shakespeare.py                      # one GPU, CPU or MPS
    python train.py configs/shakespeare.py --init_from=resume   # continue exactly where out_dir stopped
    torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_124m.py
    torchrun --nnodes=2 --node_rank=0 --master_addr=10.0.0.1 --master_port=29500 --nproc_per_node=8 train.py ...

A step: for each of the gradient-accumulation micro-batches, loader -> (x, y) -> model -> loss / accum ->
backward (DDP syncs gradients on the last micro-batch only); then clip, check for NaN/inf, AdamW step.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from checkpoint import load_checkpoint, save_checkpoint
from cli import UserError
from config import TrainConfig, build_config, config_to_dict, parse_args, print_config
from hf_gpt2 import load_pretrained
from loader import BatchLoader, ValBatches
from model import GPT, GPTConfig
from runtime import Runtime, resolve_compile, setup_runtime
from shards import dataset_dir, read_meta, require_dataset

GPT2_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
MODEL_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "bias")  # the shape a resumed run must keep
RESUME_KEYS = ("config", "model_config", "model", "optimizer", "scaler", "loader", "rng", "step", "best_val_loss")
# Scanning every token for out-of-vocabulary ids is cheap for small datasets; above this many tokens we trust
# the shards' meta.json (the prepare scripts check ids on write).
MAX_SCAN_TOKENS = 500_000_000

# Peak dense bf16 tensor-core FLOP/s from the vendors' datasheets, matched against the CUDA device name.
PEAK_BF16_FLOPS = (
    ("H200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("GH200", 989e12), ("B200", 2250e12),
    ("A100", 312e12), ("A800", 312e12), ("L40S", 362e12), ("L4", 121e12), ("A10G", 125e12), ("A10", 125e12),
    ("RTX 4090", 165e12), ("RTX 3090", 71e12), ("A6000", 155e12),
)


class TrainError(UserError):
    """A run that cannot start or continue; the message says why and what to do."""


# ----------------------------------------------------------------------------- small pieces


def get_lr(step: int, cfg: TrainConfig) -> float:
    """Linear warmup (never 0, even at step 0), then cosine decay from learning_rate to min_lr."""
    if not cfg.decay_lr:
        return cfg.learning_rate
    if step < cfg.warmup_iters:
        return cfg.learning_rate * (step + 1) / (cfg.warmup_iters + 1)
    if step >= cfg.lr_decay_iters:
        return cfg.min_lr
    progress = (step - cfg.warmup_iters) / max(1, cfg.lr_decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.learning_rate - cfg.min_lr)


def make_optimizer(model: GPT, cfg: TrainConfig, device_type: str) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices (linear weights, embeddings) only, not on biases and gains."""
    params = [p for p in model.parameters() if p.requires_grad]  # the tied wte/lm_head weight appears once
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # The fused CUDA kernel updates all parameters in a few launches instead of several per tensor.
    extra = {"fused": True} if device_type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), **extra)


def flops_per_token(model: GPT) -> float:
    """Training FLOPs per token (forward + backward), PaLM appendix B: 6N + 12 * L * C * T."""
    c = model.config
    return 6 * model.num_params() + 12 * c.n_layer * c.n_embd * c.block_size


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in name), None)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    if platform.system() == "Linux":  # peak resident set size of the process (kB on Linux)
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return float("nan")


def format_duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def library_versions() -> dict[str, str]:
    import numpy

    # str(): torch.__version__ is a TorchVersion object, which a weights_only load would refuse to unpickle
    versions = {"python": platform.python_version(), "torch": str(torch.__version__), "numpy": numpy.__version__}
    for name in ("tiktoken", "datasets", "safetensors"):
        try:
            versions[name] = str(__import__(name).__version__)
        except Exception:
            pass
    if torch.cuda.is_available():
        versions["cuda"] = str(torch.version.cuda)
    return versions


class StopFlag:
    """SIGTERM / Ctrl-C set a flag instead of killing the process: the loop finishes the step, saves last.pt
    and exits. A second Ctrl-C interrupts at once."""

    def __init__(self):
        self.requested = False
        self.previous = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        print(f"\n{signal.Signals(signum).name} received: finishing this step, then saving last.pt", flush=True)

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


@dataclass
class Dist:
    """Where this process sits in a torchrun job (world_size 1 without torchrun)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def master(self) -> bool:
        return self.rank == 0


def setup_distributed(cfg: TrainConfig) -> tuple[Dist, Runtime]:
    try:
        return _setup_distributed(cfg)
    except UserError as e:  # e.g. --device=cuda on a machine without CUDA
        raise TrainError(str(e)) from None


def _setup_distributed(cfg: TrainConfig) -> tuple[Dist, Runtime]:
    if "RANK" not in os.environ:
        return Dist(), setup_runtime(cfg.device, cfg.dtype)
    d = Dist(int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"]))
    device = cfg.device
    if device in ("auto", "cuda") and torch.cuda.is_available():
        device = f"cuda:{d.local_rank}"  # one GPU per process
    elif device == "auto":
        device = "cpu"
    rt = setup_runtime(device, cfg.dtype)
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if rt.device_type == "cuda" else "gloo")
    dist.init_process_group(backend=backend)
    return d, rt


# ----------------------------------------------------------------------------- the run


def resolve_config(argv: list[str]) -> tuple[TrainConfig, dict | None]:
    """The run's config and, when resuming, the checkpoint. A resumed run starts from the checkpoint's config;
    what argv sets explicitly overrides it, except the model's shape, which must match."""
    values = parse_args(TrainConfig, argv)
    if values.get("init_from") != "resume":
        return build_config(TrainConfig, values), None
    out_dir = Path(values.get("out_dir", TrainConfig.out_dir))
    if not (out_dir / "last.pt").is_file():
        raise TrainError(f"nothing to resume: {out_dir}/last.pt does not exist; start with --init_from=scratch")
    # Not memory-mapped: the optimizer state would otherwise keep pointing into the file that the next save
    # replaces.
    ckpt = load_checkpoint(out_dir / "last.pt", mmap=False)
    missing = [k for k in RESUME_KEYS if k not in ckpt]
    if missing:
        raise TrainError(f"{out_dir}/last.pt cannot be resumed: it has no {', '.join(missing)} (a weights-only "
                         f"checkpoint?); start a new run, or fine-tune from it")
    base = dict(ckpt["config"])
    saved_shape = {k: ckpt["model_config"][k] for k in MODEL_KEYS}
    differing = [f"{k} (checkpoint {saved_shape[k]!r}, asked {values[k]!r})"
                 for k in MODEL_KEYS if k in values and values[k] != saved_shape[k]]
    if differing:
        raise TrainError(f"cannot resume {out_dir}/last.pt with a different model shape: {'; '.join(differing)}")
    base.update(values)
    base.update(saved_shape)
    return build_config(TrainConfig, base), ckpt


def check_out_dir(cfg: TrainConfig) -> None:
    """Never let a new run silently replace the checkpoints of an earlier one."""
    if cfg.init_from == "resume" or cfg.overwrite:
        return
    existing = [n for n in ("last.pt", "best.pt") if (Path(cfg.out_dir) / n).exists()]
    if existing:
        raise TrainError(
            f"{cfg.out_dir}/ already holds {' and '.join(existing)}; continue it with --init_from=resume, "
            f"choose another --out_dir, or pass --overwrite=True to replace it"
        )


def load_dataset_meta(cfg: TrainConfig, d: Dist) -> tuple[Path, dict]:
    path = dataset_dir(cfg.dataset, cfg.data_root)
    # The two Shakespeare datasets are small: prepare them on the fly (downloads the text) instead of failing.
    if d.master and not (path / "meta.json").is_file() and path.name in ("shakespeare_char", "shakespeare"):
        print(f"dataset {cfg.dataset!r} not prepared yet: preparing it at {path}")
        import importlib

        try:
            importlib.import_module(f"prepare.{path.name}").main(["--out_dir", str(path)])
        except SystemExit as e:  # the prepare script's one-line error (e.g. no network)
            if e.code:
                raise TrainError(f"could not prepare {path}: {str(e.code).removeprefix('error: ')} "
                                 f"(with a local copy: python prepare/{path.name}.py --input PATH)") from None
    if d.enabled:
        dist.barrier()  # every rank waits here, whatever it saw on disk, so the collectives stay in step
    path = require_dataset(cfg.dataset, cfg.data_root)
    return path, read_meta(path)


def build_model(cfg: TrainConfig, meta: dict, ckpt: dict | None) -> GPT:
    vocab = int(meta["vocab_size"])
    if ckpt is not None:
        saved_tok = ckpt.get("tokenizer", {})
        diffs = [f"{k} (checkpoint {saved_tok.get(k)!r}, dataset {meta.get(k)!r})"
                 for k in ("tokenizer", "vocab_size") if saved_tok.get(k) != meta.get(k)]
        if diffs:
            raise TrainError(f"cannot resume on dataset {cfg.dataset!r}: its vocabulary differs: {'; '.join(diffs)}")
        # The shape is the checkpoint's; dropout may be changed when continuing a run.
        model = GPT(GPTConfig.from_dict({**ckpt["model_config"], "dropout": cfg.dropout}))
        model.load_state_dict(ckpt["model"])
        return model
    if cfg.init_from == "scratch":
        # Round the embedding up to a multiple of 64 for a BPE vocabulary (50257 -> 50304): faster matmuls.
        multiple = 64 if meta["tokenizer"]["kind"] != "char" else 1
        return GPT(GPTConfig(block_size=cfg.block_size, vocab_size=vocab, n_layer=cfg.n_layer, n_head=cfg.n_head,
                             n_embd=cfg.n_embd, dropout=cfg.dropout, bias=cfg.bias, vocab_multiple=multiple))
    if cfg.init_from in GPT2_NAMES or Path(cfg.init_from).is_dir():
        try:
            model = load_pretrained(cfg.init_from, dropout=cfg.dropout)
        except (ValueError, OSError) as e:  # no network, a malformed folder, an unsupported config
            raise TrainError(str(e)) from None
        if cfg.block_size < model.config.block_size:
            model.crop_block_size(cfg.block_size)
        elif cfg.block_size > model.config.block_size:
            raise TrainError(f"block_size {cfg.block_size} exceeds {cfg.init_from}'s context of "
                             f"{model.config.block_size}; use --block_size={model.config.block_size} or less")
        if meta["tokenizer"] != {"kind": "tiktoken", "name": "gpt2"} or vocab > model.config.vocab_size:
            raise TrainError(f"dataset {cfg.dataset!r} is not tokenized with the GPT-2 BPE that {cfg.init_from} "
                             f"expects; prepare it with --tokenizer gpt2 (e.g. python prepare/shakespeare.py)")
        return model
    raise TrainError(f"init_from {cfg.init_from!r} is not 'scratch', 'resume', one of {', '.join(GPT2_NAMES)}, "
                     f"or an existing Hugging Face GPT-2 folder")


def check_vocab(data_dir: Path, meta: dict, model: GPT) -> None:
    """Catch token ids the model has no embedding for now, not as an index error deep inside a step."""
    from shards import TokenDataset

    if int(meta["vocab_size"]) > model.config.vocab_size:
        raise TrainError(f"dataset vocab_size {meta['vocab_size']} exceeds the model's {model.config.vocab_size}")
    for split in ("train", "val"):
        ds = TokenDataset(data_dir, split)
        if len(ds) <= MAX_SCAN_TOKENS and ds.max_token() >= model.config.vocab_size:
            raise TrainError(f"{split} split of {data_dir} holds token id {ds.max_token()} >= the model's "
                             f"vocab_size {model.config.vocab_size}; re-prepare the dataset")


def forward_backward(model, optimizer, scaler, next_batch, accum: int, rt: Runtime, grad_clip: float):
    """The gradient half of a training step: `accum` micro-batches of forward + backward, then unscale and
    clip. Returns the mean loss and the gradient norm as device tensors (reading them would sync the host)."""
    loss_sum = torch.zeros((), device=rt.device)
    for micro in range(accum):
        x, y = next_batch()
        # Under DDP gradients are all-reduced only on the last micro-batch; the others accumulate locally.
        no_sync = getattr(model, "no_sync", None)  # DDP's (also reachable through a compiled DDP model)
        sync = no_sync is None or micro == accum - 1
        with (contextlib.nullcontext() if sync else no_sync()), rt.autocast():
            _, loss = model(x, y)
            loss = loss / accum
        scaler.scale(loss).backward()
        loss_sum += loss.detach()
    scaler.unscale_(optimizer)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    return loss_sum, grad_norm


@torch.no_grad()
def evaluate(model, batches: ValBatches, rt: Runtime, d: Dist) -> float:
    """Mean loss over the fixed validation batches, each rank taking its share."""
    model.eval()
    total = torch.zeros(2, device=rt.device, dtype=torch.float64)  # [sum of batch losses, batch count]
    for x, y in batches:
        with rt.autocast():
            _, loss = model(x, y)
        total[0] += loss.double()
        total[1] += 1
    if d.enabled:
        dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


def write_run_info(cfg: TrainConfig, argv: list[str], d: Dist, rt: Runtime) -> None:
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.init_from != "resume":
        # A new run starts new logs; with --overwrite=True the old run's checkpoints go now, so that a stale
        # best.pt can never be mistaken for this run's.
        for name in ("metrics.jsonl", "runs.jsonl", "best.pt", "last.pt"):
            (out / name).unlink(missing_ok=True)
    (out / "config.json").write_text(json.dumps(config_to_dict(cfg), indent=2) + "\n")
    info = {"argv": ["train.py", *argv], "config": config_to_dict(cfg), "versions": library_versions(),
            "world_size": d.world_size, "device": str(rt.device), "dtype": rt.dtype_name,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    with open(out / "runs.jsonl", "a") as f:  # one line per invocation: a resumed run keeps the history
        f.write(json.dumps(info) + "\n")


def train(cfg: TrainConfig, ckpt: dict | None, argv: list[str]) -> dict:
    """Run the training loop; returns a summary (final step, last val loss, best val loss)."""
    d, rt = setup_distributed(cfg)
    try:
        return _train(cfg, ckpt, argv, d, rt)
    finally:
        if d.enabled and dist.is_initialized():
            dist.destroy_process_group()


def _train(cfg: TrainConfig, ckpt: dict | None, argv: list[str], d: Dist, rt: Runtime) -> dict:
    log = print if d.master else (lambda *a, **k: None)
    if cfg.gradient_accumulation_steps % d.world_size:
        raise TrainError(f"gradient_accumulation_steps ({cfg.gradient_accumulation_steps}) must be divisible by "
                         f"the number of processes ({d.world_size})")
    accum = cfg.gradient_accumulation_steps // d.world_size  # micro-batches per process per step
    check_out_dir(cfg)
    data_dir, meta = load_dataset_meta(cfg, d)

    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    model = build_model(cfg, meta, ckpt)
    check_vocab(data_dir, meta, model)
    model.to(rt.device)
    optimizer = make_optimizer(model, cfg, rt.device_type)
    scaler = torch.amp.GradScaler(rt.device_type, enabled=rt.needs_grad_scaler)
    loader = BatchLoader(data_dir, "train", batch_size=cfg.batch_size, block_size=model.config.block_size,
                         seed=cfg.seed, mode=cfg.data_mode, rank=d.rank, world_size=d.world_size, device=rt.device)
    val = ValBatches(data_dir, "val", batch_size=cfg.batch_size, block_size=model.config.block_size,
                     n_batches=cfg.eval_iters, rank=d.rank, world_size=d.world_size, device=rt.device)
    step, best_val = 0, float("inf")
    if ckpt is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
        if scaler.is_enabled() and ckpt["scaler"]:  # a bf16/fp32 run saved an empty (disabled) scaler
            scaler.load_state_dict(ckpt["scaler"])
        loader.load_state_dict(ckpt["loader"])
        step, best_val = int(ckpt["step"]), float(ckpt["best_val_loss"])
    # Dropout masks: a different stream per rank, restored exactly on resume (every rank's state is saved).
    torch.manual_seed(cfg.seed + d.rank)
    if ckpt is not None:
        rng = ckpt["rng"]
        if len(rng) == d.world_size:
            torch.set_rng_state(rng[d.rank]["torch"])
            if rt.device_type == "cuda" and rng[d.rank].get("cuda") is not None:
                torch.cuda.set_rng_state(rng[d.rank]["cuda"], rt.device)
        else:
            log(f"note: the checkpoint was written by {len(rng)} process(es), this run has {d.world_size}: "
                f"dropout masks start a new random stream")
    ckpt = None  # free the loaded tensors

    if d.master:
        print("config:")
        print_config(cfg)
        write_run_info(cfg, argv, d, rt)
    use_compile, why = resolve_compile(cfg.compile, rt.device)
    log(why)
    raw_model = model  # the unwrapped model: its state_dict has no "module." or "_orig_mod." prefixes
    if d.enabled:
        # The model has no buffers, so DDP's forward syncs nothing: evaluation, where ranks may run different
        # numbers of batches, involves no collective until evaluate's own all_reduce.
        model = DDP(model, device_ids=[rt.device.index] if rt.device_type == "cuda" else None)
    if use_compile:
        # Compiling the DDP-wrapped model lets DDP's graph splitting overlap the gradient all-reduce with the
        # backward pass.
        model = torch.compile(model)

    block_size = raw_model.config.block_size
    tokens_per_step = cfg.batch_size * block_size * accum * d.world_size
    peak = peak_flops(rt.device)
    log(f"model: {raw_model.num_params() / 1e6:.2f}M parameters | {d.world_size} process(es) on {rt.device} | "
        f"{rt.dtype_name} | {tokens_per_step:,} tokens per step ({cfg.batch_size} x {block_size} x "
        f"{accum} accumulation x {d.world_size} processes)")
    metrics_path = Path(cfg.out_dir) / "metrics.jsonl"
    wandb_run = None
    if cfg.wandb_log and d.master:
        import wandb

        try:
            wandb_run = wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name or Path(cfg.out_dir).name,
                                   config=config_to_dict(cfg))
        except Exception as e:  # not logged in, no network, ...: wandb raises many types
            raise TrainError(f"could not start Weights & Biases ({type(e).__name__}: {str(e).splitlines()[0]}); "
                             f"run `wandb login`, set WANDB_MODE=offline, or drop --wandb_log") from None

    def record(entry: dict) -> None:
        if not d.master:
            return
        with open(metrics_path, "a") as f:
            f.write(json.dumps(entry) + "\n")
        if wandb_run is not None:
            wandb_run.log({k: v for k, v in entry.items() if k != "step"}, step=entry["step"])

    def save(name: str) -> None:
        """Every rank calls this at the same steps: each contributes its RNG state; rank 0 writes."""
        rng = {"torch": torch.get_rng_state(),
               "cuda": torch.cuda.get_rng_state(rt.device) if rt.device_type == "cuda" else None}
        rngs = [rng]
        if d.enabled:
            rngs = [None] * d.world_size
            dist.all_gather_object(rngs, rng)
        if not d.master:
            return
        state = {
            "format": 1, "model_config": raw_model.config.to_dict(), "model": raw_model.state_dict(),
            "tokenizer": meta, "step": step, "best_val_loss": best_val, "config": config_to_dict(cfg),
            "argv": ["train.py", *argv], "versions": library_versions(), "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict(), "loader": loader.state_dict(), "rng": rngs,
        }
        save_checkpoint(state, Path(cfg.out_dir) / name)

    start_step, val_loss = step, None
    t_log, steps_since_log, step_times = time.perf_counter(), 0, []
    stop = StopFlag()
    with stop:
        while True:
            # ---- evaluate and checkpoint
            if step % cfg.eval_interval == 0 or step >= cfg.max_iters or cfg.eval_only:
                val_loss = evaluate(model, val, rt, d)
                improved = val_loss < best_val
                best_val = min(best_val, val_loss)
                log(f"step {step}: val loss {val_loss:.4f}" + (" (best so far)" if improved else ""))
                record({"step": step, "val_loss": val_loss, "best_val_loss": best_val})
                # A resumed run may start on a step whose evaluation the stopped run never did: an improvement
                # there is saved too. Step 0 of a fresh run is the random initialisation: not worth a file.
                if improved and step > 0:
                    save("best.pt")
                if step > start_step and (improved or cfg.always_save_checkpoint or step >= cfg.max_iters):
                    save("last.pt")  # (on the start step last.pt already holds this state)
                t_log, steps_since_log = time.perf_counter(), 0  # keep evaluation out of the step timings
            if cfg.eval_only or step >= cfg.max_iters:
                break

            # ---- one optimizer step
            lr = get_lr(step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum, grad_norm = forward_backward(model, optimizer, scaler, loader.next_batch, accum, rt,
                                                   cfg.grad_clip)
            # One small reduction decides for all ranks: a NaN/inf anywhere, or a stop signal on any rank.
            # With fp16 an inf gradient is routine (the GradScaler skips that step and lowers its scale).
            bad = ~torch.isfinite(loss_sum)
            if not rt.needs_grad_scaler:
                bad = bad | ~torch.isfinite(grad_norm)
            flags = torch.zeros(2, device=rt.device)
            flags[0] = bad
            flags[1].fill_(float(stop.requested))  # a scalar fill: no host-to-device copy
            if d.enabled:
                dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            # The step's one host synchronisation: needed to stop *before* the optimizer step on NaN/inf.
            is_bad, stop_now = flags.tolist()
            if is_bad:
                raise TrainError(
                    f"non-finite loss or gradient norm at step {step} (loss {loss_sum.item():.4g}, grad norm "
                    f"{grad_norm.item():.4g}); stopped before the optimizer step, checkpoints left as they were. "
                    f"Try a lower --learning_rate, --grad_clip=1.0, or --dtype=bfloat16/float32")
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            steps_since_log += 1

            # ---- log
            if step % cfg.log_interval == 0 or step == cfg.max_iters:
                loss_val = loss_sum
                if d.enabled:
                    dist.all_reduce(loss_val, op=dist.ReduceOp.AVG if rt.device_type == "cuda" else dist.ReduceOp.SUM)
                    if rt.device_type != "cuda":  # gloo has no AVG
                        loss_val = loss_val / d.world_size
                loss_f = loss_val.item()  # a second host sync, every log_interval steps only
                now = time.perf_counter()
                dt = (now - t_log) / steps_since_log
                t_log, steps_since_log = now, 0
                if step > start_step + 1 or cfg.max_iters - start_step <= 1:  # skip the compile/warm-up step
                    step_times.append(dt)
                avg = sorted(step_times[-20:])[len(step_times[-20:]) // 2] if step_times else dt
                tok_s = tokens_per_step / dt
                mfu = flops_per_token(raw_model) * tok_s / (peak * d.world_size) if peak else None
                entry = {"step": step, "loss": loss_f, "lr": lr, "grad_norm": grad_norm.item(),
                         "ms_per_step": dt * 1000, "tokens_per_s": tok_s, "mfu": mfu,
                         "peak_mem_mb": peak_memory_mb(rt.device), "epoch": loader.epoch}
                record(entry)
                eta = format_duration(avg * (cfg.max_iters - step))
                log(f"step {step}/{cfg.max_iters} | loss {loss_f:.4f} | lr {lr:.2e} | grad {entry['grad_norm']:.3f} | "
                    f"{dt * 1000:.1f} ms/step | {tok_s:,.0f} tok/s | MFU {f'{mfu * 100:.1f}%' if mfu else 'n/a'} | "
                    f"mem {entry['peak_mem_mb']:,.0f} MB | ETA {eta}", flush=True)

            if stop_now:  # a signal on any rank: every rank leaves after this same step
                save("last.pt")
                log(f"stopped at step {step}; saved {cfg.out_dir}/last.pt; continue with --init_from=resume")
                break
    if wandb_run is not None:
        wandb_run.finish()
    return {"step": step, "val_loss": val_loss, "best_val_loss": best_val}


def main(argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        cfg, ckpt = resolve_config(argv)
        return train(cfg, ckpt, argv)
    except UserError as e:
        sys.exit(f"error: {e}")
    except OSError as e:  # an unwritable out_dir, a full disk, ...
        sys.exit(f"error: {e.strerror or e}: {e.filename or ''}".rstrip(": "))
    except torch.cuda.OutOfMemoryError:
        sys.exit("error: out of GPU memory; lower --batch_size and raise --gradient_accumulation_steps to keep "
                 "the same tokens per step")


if __name__ == "__main__":
    main()
