"""The `train.py CONFIG --plan` report: the run's model built from its config without weights (on the meta device:
no download, no checkpoint's tensors read), and its FLOPs, memory, time and cost per device as gptkit/plan/__init__.py
works them out, as plain values (make_plan) and as the table train.py prints (format_plan).

    report = make_plan(cfg, ckpt, world_size)    # a dict: the model's counts, one column per device kind
    print(format_plan(report, "train.py configs/gpt2_124m.py"))
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from gptkit import lora
from gptkit.checkpoint import load_checkpoint
from gptkit.checkpoint.layout import holds_checkpoint
from gptkit.checkpoint.models import no_run_yet
from gptkit.config import lora_settings
from gptkit.data.shards import PREPARE_COMMANDS, dataset_dir, prepare_command, read_meta
from gptkit.errors import UserError
from gptkit.hf_gpt2 import VOCAB_MULTIPLE, config_from_hf, read_json
from gptkit.metrics import peak_flops_for
from gptkit.objectives import make_objective
from gptkit.plan import (
    CPU_FLOPS_PER_CORE,
    PARALLEL,
    Device,
    GiB,
    Memory,
    Setup,
    choose_parallel,
    cpu_device,
    flops_per_token,
    format_bytes,
    format_seconds,
    largest_batch,
    largest_valid_batch,
    loss_rows,
    matmul_weights,
    memory,
    run_flops,
)
from gptkit.runtime import ram
from gptkit.settings import LoRASettings
from model import GPT, GPTConfig

# ----------------------------------------------------------------------------- the devices of the table

# No GPU has run this code yet (BENCHMARKS.md): the time on a GPU is the run's FLOPs at an assumed share of the
# datasheet's dense peak (gptkit/metrics.py's PEAK_FLOPS, the logs' MFU denominator). 40% is below this
# project's own target for GPT-2 124M on an H100 (550,000 tokens/s, ~48% of 989 TFLOP/s, BENCHMARKS.md) and
# what nanoGPT-style runs of that size are commonly reported to reach; small models (the char ones) reach
# far less. Replace it with a measured MFU once bench.py has run on a GPU.
ASSUMED_GPU_MFU = 0.40


def gpu(name: str, memory_gib: float, table_name: str, dtype: torch.dtype) -> Device:
    peak = peak_flops_for(table_name, dtype)
    return Device(name, "cuda", memory_gib * GiB, peak * ASSUMED_GPU_MFU, f"{ASSUMED_GPU_MFU:.0%} MFU assumed")


def named_gpus(dtype: torch.dtype, memory_gb: float = 0) -> list[Device]:
    """The GPUs of the plan's table (their memory as the vendors state it, in GiB), and a --device_memory_gb one."""
    devices = [gpu("24 GB GPU (RTX 4090)", 24, "RTX 4090", dtype), gpu("A100 40GB", 40, "A100", dtype),
               gpu("A100 80GB", 80, "A100", dtype), gpu("H100 80GB", 79.6, "H100", dtype)]
    if memory_gb:
        devices.insert(0, Device(f"your GPU ({memory_gb:g} GB)", "cuda", memory_gb * GiB, None, "n/a"))
    return devices


# ----------------------------------------------------------------------------- the run's model, without weights

# OpenAI's GPT-2 sizes (n_layer, n_head, n_embd), all with a 1,024-token context and 50,257 tokens: a plan
# knows a GPT-2 name's shape without downloading its weights.
GPT2_SHAPES = {"gpt2": (12, 12, 768), "gpt2-medium": (24, 16, 1024), "gpt2-large": (36, 20, 1280),
               "gpt2-xl": (48, 25, 1600)}
GPT2_VOCAB = 50257
# The vocabularies of the datasets that have a prepare script (shards.PREPARE_COMMANDS): a plan works before
# they are prepared. Tiny Shakespeare has 65 distinct characters; tasks/arithmetic.py's worked problems (README's
# GRPO recipe) its 13; the others are prepared with GPT-2's BPE.
KNOWN_DATASETS = {"shakespeare_char": ("char", 65), "arithmetic": ("char", 13), "shakespeare": ("gpt2", GPT2_VOCAB),
                  "openwebtext": ("gpt2", GPT2_VOCAB), "fineweb": ("gpt2", GPT2_VOCAB),
                  "fineweb_edu": ("gpt2", GPT2_VOCAB)}


class PlanError(UserError):
    """A run the plan cannot size; the message says why and what to do."""


def dataset_vocabulary(cfg) -> tuple[int, str, str] | None:
    """(vocab_size, tokenizer kind, where that comes from) of the run's dataset: its meta.json, or for a known
    dataset that is not prepared yet what preparing it gives; None when neither is known."""
    path = dataset_dir(cfg.dataset, cfg.data_root)
    if (path / "meta.json").is_file():
        meta = read_meta(path)
        return int(meta["vocab_size"]), meta["tokenizer"]["kind"], f"as in {path}/meta.json"
    if path.name in KNOWN_DATASETS:
        kind, vocab = KNOWN_DATASETS[path.name]
        how = f"its {vocab} characters" if kind == "char" else "GPT-2's BPE"
        made = PREPARE_COMMANDS.get(path.name, "README's GRPO recipe (tasks/arithmetic.py, prepare/text.py)")
        return vocab, kind, f"assumed: {path} is not prepared; {made} uses {how}"
    return None


def base_config(init_from: str, dropout: float) -> GPTConfig:
    """The shape of the model a fine-tuning run starts from, as checkpoint.load_base_model would load it, read
    without its weights: a GPT-2 name (known shapes), a Hugging Face folder (its config.json) or a checkpoint
    of this project or nanoGPT's (memory-mapped: only its config is read)."""
    path = Path(init_from)
    ours = holds_checkpoint(path)  # (as load_base_model decides: a file, a sharded folder, a run's or nanoGPT's out_dir)
    if init_from in GPT2_SHAPES:
        n_layer, n_head, n_embd = GPT2_SHAPES[init_from]
        return GPTConfig(block_size=1024, vocab_size=GPT2_VOCAB, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                         dropout=dropout, bias=True, vocab_multiple=VOCAB_MULTIPLE)
    if ours:
        ckpt = load_checkpoint(path)
        return GPTConfig.from_dict({**ckpt["model_config"], "dropout": dropout})
    hf = path / "config.json"
    missing = no_run_yet(init_from)
    if missing:
        raise PlanError(missing)
    if not hf.is_file():
        raise PlanError(f"unknown pretrained model {init_from!r}: use one of {', '.join(GPT2_SHAPES)}, a local "
                        f"Hugging Face GPT-2 folder (config.json + model.safetensors) or a checkpoint of this project")
    return replace(config_from_hf(read_json(hf), str(path)), vocab_multiple=VOCAB_MULTIPLE, dropout=dropout)


def plan_model(cfg, ckpt: dict | None, vocab: tuple[int, str, str] | None) -> tuple[GPT, str]:
    """The model gptkit/checkpoint/run_model.py's build_model and attach_lora make for this config, on the meta
    device (shapes only, nothing allocated), and a line saying where its shape and vocabulary come from."""
    with torch.device("meta"):
        if ckpt is not None:
            model = GPT(GPTConfig.from_dict({**ckpt["model_config"], "dropout": cfg.dropout}))
            if ckpt.get("lora"):
                lora.apply(model, LoRASettings(**ckpt["lora"]["settings"]))
            return model, f"resumed from {cfg.out_dir}/last.pt (step {ckpt.get('step')})"
        if cfg.init_from == "scratch":
            if vocab is None:
                path = dataset_dir(cfg.dataset, cfg.data_root)
                raise PlanError(f"dataset {cfg.dataset!r} is not prepared ({path}/meta.json is missing), so its "
                                f"vocabulary is unknown; prepare it first ({prepare_command(cfg.dataset, cfg.data_root)})")
            size, kind, where = vocab
            model = GPT(cfg.model_config(size, vocab_multiple=64 if kind != "char" else 1))
            return _with_lora(cfg, model), f"from scratch ({where})"
        base = base_config(cfg.init_from, cfg.dropout)
        if cfg.block_size > base.block_size:
            raise PlanError(f"block_size {cfg.block_size} exceeds {cfg.init_from}'s context of {base.block_size}; "
                            f"use --block_size={base.block_size} or less")
        model = GPT(base)
        if cfg.block_size < base.block_size and not cfg.lora_rank and not make_objective(cfg).keeps_base_context:
            model.crop_block_size(cfg.block_size)
        return _with_lora(cfg, model), f"fine-tuning {cfg.init_from} (its shape; no weights are read)"


def _with_lora(cfg, model: GPT) -> GPT:
    settings = lora_settings(cfg)
    if settings is None:
        return model
    if cfg.init_from == "scratch":
        raise PlanError("LoRA adapts a trained model: set --init_from to a GPT-2 name, a Hugging Face GPT-2 folder "
                        "or a checkpoint of this project, or set --lora_rank=0")
    return lora.apply(model, settings)


# ----------------------------------------------------------------------------- the plan


@dataclass
class Column:
    """One way of running the config: on the CPU (float32) or on CUDA GPUs (bf16, compiled), as train.py's
    auto settings would choose there, with the devices of that kind the plan sizes it for. With more than one
    process, under DDP (`setup`, `memory`) and under FSDP (`fsdp`), and what --parallel=auto picks on the main
    device (`parallel`: its name, the choice and why)."""

    label: str
    setup: Setup
    model: GPT
    batch_size: int  # the micro-batch of the breakdown: the configured one, or what batch_size=auto picks
    batch_note: str
    memory: Memory
    devices: list[Device]
    fsdp: Memory | None = None
    parallel: tuple[str, str, str] | None = None


def _kinds(cfg) -> list[str]:
    if cfg.device == "auto":
        return ["cpu", "cuda"]
    try:
        return [torch.device(cfg.device).type]
    except RuntimeError:
        raise PlanError(f"device {cfg.device!r} is not a device; use auto, cpu, cuda, cuda:N or mps") from None


def _dtype(cfg, kind: str) -> torch.dtype:
    """runtime.resolve_dtype's choice, for a GPU of the named kinds (all compute bf16 natively)."""
    if cfg.dtype == "auto":
        return torch.bfloat16 if kind == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg.dtype]


def auto_batch(model, setup: Setup, capacity: float, sequences_per_step: int) -> int:
    """batch_size=auto from the plan (plan.largest_valid_batch): the largest micro-batch that fits `capacity` and
    keeps the tokens per step exactly; a PlanError when not even one sequence fits."""
    batch, _ = largest_valid_batch(model, setup, capacity, sequences_per_step)
    if not batch:
        raise PlanError(f"not even one sequence of {setup.seq_len} tokens fits in {format_bytes(capacity)} "
                        f"(the plan's peak for it: {format_bytes(memory(model, setup, 1).peak)}); use a smaller "
                        f"block_size or model, --lora_rank, or --activation_checkpointing=True")
    return batch


def sequences_per_step(cfg, world_size: int) -> int:
    """Sequences per optimizer step over all processes: tokens_per_step / block_size with batch_size=auto,
    else batch_size x gradient_accumulation_steps (which counts micro-batches over all processes)."""
    if cfg.batch_size is None:
        return cfg.tokens_per_step // cfg.block_size
    return cfg.batch_size * cfg.gradient_accumulation_steps


def _column(cfg, ckpt, vocab, kind: str, world_size: int) -> tuple[Column, str]:
    model, where = plan_model(cfg, ckpt, vocab)
    dtype = _dtype(cfg, kind)
    if cfg.lora_rank and kind == "cuda" and dtype == torch.bfloat16:
        lora.cast_frozen_base(model, torch.bfloat16)  # as gptkit/run.py's setup_run does on a GPU
    compiled = cfg.compile if cfg.compile is not None else kind == "cuda"
    if kind == "cuda":
        devices = named_gpus(dtype, cfg.device_memory_gb)
    elif kind == "cpu":
        devices = [cpu_device()]
    else:
        devices = [Device("this machine's memory (MPS)", kind, ram()[1], None, "n/a")]
    sequences = sequences_per_step(cfg, world_size)
    setup = Setup.of_run(cfg, kind, dtype, world_size, compile=compiled, objective=make_objective(cfg))
    # the device batch_size=auto and --parallel=auto are sized for: --device_memory_gb's GPU, else the largest
    main = devices[0] if kind != "cuda" or cfg.device_memory_gb else devices[-1]
    sharded = world_size > 1  # more than one process: DDP and FSDP side by side
    if cfg.batch_size is None:  # sized for the strategy the run takes: --parallel, or what auto picks
        strategy = getattr(cfg, "parallel", "auto") if sharded else "ddp"
        if strategy not in PARALLEL:
            strategy = choose_parallel(model, setup, main.capacity)[0]
        batch = auto_batch(model, replace(setup, parallel=strategy), main.capacity, sequences)
        note = f"batch_size=auto on {main.name}" + (" under FSDP" if strategy == "fsdp" else "")
    else:
        batch, note = cfg.batch_size, "configured"
    setup = replace(setup, accum=max(1, sequences // (batch * world_size)))
    label = f"{kind}: {str(dtype).removeprefix('torch.')}" + (", compiled" if compiled else "")
    column = Column(label, setup, model, batch, note, memory(model, setup, batch), devices)
    if sharded:
        column.fsdp = memory(model, replace(setup, parallel="fsdp"), batch)
        column.parallel = (main.name, *choose_parallel(model, setup, main.capacity, cfg.batch_size))
    return column, where


def make_plan(cfg, ckpt: dict | None = None, world_size: int = 1) -> dict:
    """Everything the plan prints, as plain values: the model's counts, the FLOPs, one memory breakdown per
    device kind and one row per device."""
    if world_size < 1 or (cfg.batch_size is not None and cfg.gradient_accumulation_steps % world_size):
        raise PlanError(f"gradient_accumulation_steps ({cfg.gradient_accumulation_steps}) must be divisible by the "
                        f"number of processes ({world_size})")
    objective = make_objective(cfg)
    # DPO: a micro-batch of B pairs is 2B sequences of the longest pair's length (when prepared: else
    # block_size), each scored by the same forward and backward (batch_size=auto: an even number of them)
    cfg = objective.plan_block_size(cfg, dataset_dir(cfg.dataset, cfg.data_root), ckpt)
    per = objective.sequences_per_item  # the plan counts sequences
    if cfg.batch_size is not None:
        cfg = replace(cfg, batch_size=per * cfg.batch_size)
    vocab = dataset_vocabulary(cfg) if ckpt is None else None
    columns, where = [], ""
    for kind in _kinds(cfg):
        column, where = _column(cfg, ckpt, vocab, kind, world_size)
        columns.append(column)
    model = columns[0].model
    T = cfg.block_size
    tokens = sequences_per_step(cfg, world_size) * T
    trainable, frozen = matmul_weights(model)
    plan = {
        "model": where, "n_layer": model.config.n_layer, "n_head": model.config.n_head,
        "n_embd": model.config.n_embd, "block_size": T, "vocab_size": model.config.vocab_size,
        "parameters": sum(p.numel() for p in model.parameters()),
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "world_size": world_size, "tokens_per_step": tokens, "max_iters": cfg.max_iters,
        "steps_done": int(ckpt["step"]) if ckpt is not None else 0,
        "flops_per_token": flops_per_token(model, T), "matmul_weights": trainable + frozen, "columns": [],
    }
    for column in columns:
        train, evaluation = run_flops(column.model, replace(cfg, batch_size=column.batch_size), tokens,
                                      cfg.activation_checkpointing, done=plan["steps_done"])
        rows = []
        for device in column.devices:
            rows.append(_device_row(column, device, train + evaluation, world_size, cfg.usd_per_gpu_hour))
        parallel = None
        if column.parallel:
            parallel = dict(zip(("device", "choice", "reason"), column.parallel))
        plan["columns"].append({"label": column.label, "batch_size": column.batch_size, "batch_note": column.batch_note,
                                "accum": column.setup.accum, "loss_rows": loss_rows(column.model, column.setup),
                                "memory": column.memory.as_dict(), "train_flops": train, "eval_flops": evaluation,
                                "fsdp_memory": column.fsdp.as_dict() if column.fsdp else None,
                                "parallel": parallel, "devices": rows})
    notes = objective.plan_notes(cfg, columns[0].batch_size // per)
    if notes:
        plan["notes"] = notes
    return plan


def _device_row(column: Column, device: Device, flops: float, world_size: int, usd_per_gpu_hour: float) -> dict:
    capacity = device.capacity
    largest = largest_batch(column.model, replace(column.setup, accum=2), capacity)
    parallel = world_size if device.kind == "cuda" else 1  # DDP processes on one CPU share its cores
    seconds = flops / (device.flops * parallel) if device.flops else None
    cost = seconds / 3600 * parallel * usd_per_gpu_hour if seconds and device.kind == "cuda" and usd_per_gpu_hour else None
    row = {"name": device.name, "memory": device.memory, "capacity": capacity,
           "fits": column.memory.peak <= capacity, "largest_batch": largest, "seconds": seconds,
           "flops_note": device.flops_note, "usd": cost}
    if column.fsdp:  # the same under FSDP, and what --parallel=auto would run on this device
        batch = None if column.batch_note != "configured" else column.batch_size
        row.update(fsdp_fits=column.fsdp.peak <= capacity,
                   fsdp_largest_batch=largest_batch(column.model, replace(column.setup, accum=2, parallel="fsdp"),
                                                    capacity),
                   parallel=choose_parallel(column.model, column.setup, capacity, batch)[0])
    return row


def format_plan(plan: dict, title: str) -> str:
    """The plan as the short table `train.py CONFIG --plan` prints."""
    n, cols, T = plan["parameters"], plan["columns"], plan["block_size"]
    trainable = "all trainable" if plan["trainable"] == n else f"{plan['trainable'] / 1e6:,.2f}M trainable (LoRA)"
    first = cols[0]
    lines = [
        f"plan: {title}",
        f"  model            {plan['n_layer']} layers x {plan['n_embd']} wide, {plan['n_head']} heads, "
        f"vocabulary {plan['vocab_size']:,}",
        f"                   {plan['model']}",
        f"  parameters       {n / 1e6:,.2f}M, {trainable}",
        f"  tokens per step  {plan['tokens_per_step']:,} = {plan['tokens_per_step'] // T:,} sequences of {T:,} "
        f"tokens, over {plan['world_size']} process{'es' if plan['world_size'] > 1 else ''}",
        f"  training FLOPs   {plan['flops_per_token']:.3g} per token (the logs' MFU counts the same); "
        f"{first['train_flops']:.3g} for {plan['max_iters'] - plan['steps_done']:,} steps"
        + (f" (of {plan['max_iters']:,})" if plan["steps_done"] else "") + f", {first['eval_flops']:.2g} more to evaluate",
        "",
    ]
    width, col = 34, 28
    n = plan["world_size"]
    sharded = n > 1 and all(c["fsdp_memory"] for c in cols)
    per = "memory per GPU, DDP" if sharded else "memory per GPU" if n > 1 else "memory per process"
    lines += _memory_rows(per, cols, "memory", T, width, col)
    autos = [f"{c['label']}: {c['batch_note']}" for c in cols if c["batch_note"] != "configured"]
    if autos:
        lines.append(f"  (batch_size=auto picks the micro-batch: {'; '.join(autos)})")
    if sharded:
        lines += ["", *_memory_rows(f"memory per GPU, FSDP over {n}", cols, "fsdp_memory", T, width, col)]
        for c in cols:  # one line each: what --parallel=auto runs on the main device, and why
            which = f"{c['label']}, on " if len(cols) > 1 else "on "
            lines.append(f"  --parallel=auto, {which}{c['parallel']['device']}: {c['parallel']['choice']} "
                         f"({c['parallel']['reason']})")
    for c in cols:
        costs = any(r["usd"] for r in c["devices"])
        fits = f"{'batch ' + str(c['batch_size']):>10}{'largest':>9}"
        if sharded:  # fits and largest under DDP, then under FSDP, then what --parallel=auto runs
            fits = (f"{'DDP b' + str(c['batch_size']):>10}{'largest':>9}{'FSDP b' + str(c['batch_size']):>10}"
                    f"{'largest':>9}{'auto':>6}")
        lines += ["", f"{'devices, ' + c['label']:<{width}}{'memory':>10}{fits}{'time':>12}"
                      + (f"{'cost':>10}" if costs else "")]
        for r in c["devices"]:
            time = format_seconds(r["seconds"]) if r["seconds"] is not None else "n/a"
            usd = "" if r["usd"] is None else f"${r['usd']:,.0f}" if r["usd"] >= 10 else f"${r['usd']:.2f}"
            fits = f"{'fits' if r['fits'] else 'too big':>10}{r['largest_batch']:>9}"
            if sharded:
                fits += f"{'fits' if r['fsdp_fits'] else 'too big':>10}{r['fsdp_largest_batch']:>9}{r['parallel']:>6}"
            lines.append(f"  {r['name']:<{width - 2}}{format_bytes(r['memory']):>10}{fits}{time:>12}"
                         + (f"{usd:>10}" if costs else ""))
    lines += ["", *NOTES, *(FSDP_NOTES if sharded else ()), *plan.get("notes", ())]
    return "\n".join(lines)


def _memory_rows(title: str, cols: list[dict], key: str, T: int, width: int, col: int) -> list[str]:
    """One memory breakdown (`key`: the columns' "memory", DDP's or one process', or "fsdp_memory")."""
    lines = [f"{title:<{width}}" + "".join(f"{c['label']:>{col}}" for c in cols)]
    size = lambda name: [format_bytes(c[key][name]) if c[key][name] else "-" for c in cols]  # noqa: E731
    rows = [
        ("  micro-batch", [f"{c['batch_size']} x {T}, {c['accum']} per step" for c in cols]),
        ("  weights", size("weights")),
        ("  gradients", size("gradients")),
        ("  optimizer states", size("optimizer")),
        ("  activations (one micro-batch)", size("activations")),
        ("  autocast's weight copies", size("autocast_copies")),
        *([("  parameters gathered at once", size("gathered")),
           ("  gradients accumulated whole", size("accumulated"))] if key == "fsdp_memory" else []),
        ("  loss, kept for the backward", size("loss")),
        ("  working memory at the peak", size("working")),
        ("  peak", size("peak")),
    ]
    return lines + [f"{name:<{width}}" + "".join(f"{v:>{col}}" for v in values) for name, values in rows]


NOTES = (
    "notes: the peak is one training step's tensors (exact counts; activations as autograd keeps them). \"largest\"",
    "  is the largest micro-batch that fits, leaving 1 GiB + 5% of a GPU to the CUDA context and fragmentation",
    "  (on the CPU: 0.5 GiB to the process, then half the RAM left, for the freed memory glibc keeps resident).",
    "  A compiled step's activations are an estimate until measured on a GPU.",
    f"  Time: GPUs at {ASSUMED_GPU_MFU:.0%} of their datasheet peak, an assumption (not measured on a GPU yet);",
    f"  the CPU at {CPU_FLOPS_PER_CORE:.2g} FLOP/s per core, measured on the 2-core development VM (BENCHMARKS.md).",
    "  Evaluations are included, HellaSwag is not.",
)
FSDP_NOTES = (
    "  FSDP: each GPU holds its 1/N of every weight, gradient and optimizer state, and gathers whole the root's",
    "  parameters (embeddings, final norm, head) and two blocks' (the running one and the next, prefetched), in",
    "  bf16 under the mixed-precision policy; with several micro-batches per step each one's gradients are",
    "  reduce-scattered after its backward, so no GPU holds them whole. Communication time is not in the time.",
)
