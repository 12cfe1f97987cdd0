"""The micro-batch a device holds: batch_size=auto's choice, and the advice when a step runs out of GPU memory.
Both size the run by one plan.Setup built from its config (setup_of) and plan.largest_valid_batch.

    cfg = choose_batch_size(cfg, model, ckpt, d, rt, sharing)   # batch_size and gradient_accumulation_steps set
    raise TrainError(oom_message(run))                          # the largest micro-batch the plan says fits

batch_size=auto keeps tokens_per_step: the micro-batch is one that divides the sequences each process takes per
step (plan.valid_batches), and gradient_accumulation_steps makes up the rest. On CUDA real training steps are
tried, from the plan's estimate up or down (plan.search_batch); on the CPU and MPS, and under FSDP (whose steps
need the sharded model), the plan's figure for the free memory is used.

Under DPO (objective = "dpo") batch_size counts pairs, each two sequences: the plan sizes the micro-batch in
sequences, an even number (whole pairs), and the trial step is DPO's (gptkit/objectives/'s trial_batch:
both sequences of each pair, the reference's forward of a LoRA run, the per-sequence log-probabilities).
"""

from __future__ import annotations

import dataclasses
import gc

import torch
import torch.distributed as dist

from gptkit import parallel, plan
from gptkit.cli import UserError
from gptkit.config import TrainConfig
from gptkit.cudagraph import graph_batch_reserve
from gptkit.objectives import make_objective
from gptkit.optim import make_optimizer
from gptkit.runtime import Dist, Runtime, resolve_compile
from model import GPT


class BatchSizeError(UserError):
    """No micro-batch this run can take; the message says what would help."""


def setup_of(cfg: TrainConfig, rt: Runtime, d: Dist, *, compile: bool = False, sharded: bool = False) -> plan.Setup:
    """The step as the plan sizes it for this run's micro-batch: the config's, on this runtime's device and dtype,
    over the job's processes, under FSDP when `sharded`."""
    return plan.Setup.of_run(cfg, rt.device_type, rt.dtype, d.world_size, compile=compile,
                             parallel="fsdp" if sharded else "ddp", objective=make_objective(cfg))


def choose_batch_size(cfg: TrainConfig, model: GPT, ckpt: dict | None, d: Dist, rt: Runtime,
                      sharing: str = "single") -> TrainConfig:
    """batch_size=auto (this module's docstring): the config with batch_size and gradient_accumulation_steps
    set, said in one line. A resumed run keeps the batch it chose; under DDP or FSDP every rank takes the
    smallest. sharing: parallel.decide's choice."""
    if cfg.batch_size is not None:
        return cfg
    sequences = cfg.tokens_per_step // cfg.block_size
    setup = setup_of(cfg, rt, d, sharded=sharing == "fsdp")
    per = setup.sequences_per_item  # DPO: 2, and batch_size counts pairs
    candidates = plan.valid_batches(sequences, d.world_size, per)  # (in sequences)
    if not candidates or sequences % (d.world_size * per):
        raise BatchSizeError(f"tokens_per_step ({cfg.tokens_per_step:,}) is {sequences} sequences of "
                             f"{cfg.block_size}, which {d.world_size} processes cannot share equally"
                             f"{' in whole pairs' if per > 1 else ''}; use a multiple of "
                             f"{cfg.block_size * d.world_size * per}")
    saved = (ckpt or {}).get("config", {}).get("batch_size")
    saved = saved * per if isinstance(saved, int) else saved
    if saved in candidates:
        batch, how = saved, "the batch this run chose when it started"
    elif rt.device_type == "cuda" and sharing == "fsdp":
        batch, fits = plan.largest_valid_batch(model, setup, gpu_free_bytes(rt), sequences, limit=candidates[-1])
        how = f"under FSDP, the plan's largest for this GPU's free memory is {fits}"
    elif rt.device_type == "cuda":
        # replayed as one CUDA graph, the step's memory stays in the graph's pool: a margin is held back
        reserve = graph_batch_reserve(gpu_free_bytes(rt)) if cfg.cuda_graphs else 0
        estimate = plan.largest_batch(model, dataclasses.replace(setup, accum=2), gpu_free_bytes(rt) - reserve)
        batch = plan.search_batch(candidates, estimate, lambda b: fits_on_gpu(model, cfg, rt, b // per, reserve))
        how = (f"the largest that ran a training step here{' with the CUDA graph margin held back' if reserve else ''}"
               f"; the plan estimated {estimate}")
    else:
        # the processes of a CPU job share the machine's RAM
        capacity = plan.process_capacity(rt.device, d.world_size)
        batch, fits = plan.largest_valid_batch(model, setup, capacity, sequences, limit=candidates[-1])
        how = (f"the plan's largest for the free RAM is {fits}" if fits < candidates[-1] else
               "by the plan, the free RAM holds all of a step's sequences at once")
    if d.enabled:  # the ranks' GPUs may differ: all take the smallest choice (a candidate too)
        smallest = torch.tensor([batch or 0], device=rt.device)
        dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
        batch = int(smallest.item())
    if not batch:
        raise BatchSizeError(f"batch_size=auto: not even one sequence of {cfg.block_size} tokens fits on "
                             f"{rt.device}; use --activation_checkpointing=True, --lora_rank, or a smaller block_size "
                             f"or model (python train.py ... --plan shows the memory)")
    accum = sequences // batch
    said = f"{batch // per} pairs = {batch} sequences" if per > 1 else f"{batch}"
    if d.master:
        print(f"batch_size=auto: {said} ({how}); gradient_accumulation_steps={accum} keeps "
              f"{cfg.tokens_per_step:,} tokens per step")
    return dataclasses.replace(cfg, batch_size=batch // per, gradient_accumulation_steps=accum)


def gpu_free_bytes(rt: Runtime) -> int:
    return torch.cuda.mem_get_info(rt.device)[0]


def trial_step(model: GPT, optimizer, rt: Runtime, cfg: TrainConfig, batch: int) -> None:
    """A training step of the run's objective (forward, backward, optimizer step) on a micro-batch of `batch`
    random items (sequences, or DPO's pairs: the objective's trial_batch), for batch_size=auto."""
    objective, batch = make_objective(cfg).trial_batch(cfg, model, batch, rt.device)
    with rt.autocast():
        loss = objective(model, batch)[0]
    loss.backward()
    optimizer.step()


def fits_on_gpu(model: GPT, cfg: TrainConfig, rt: Runtime, batch: int, reserve: int = 0) -> bool:
    """Whether a real training step at micro-batch `batch` (sequences, or DPO's pairs) fits, with `reserve` bytes held aside: its optimizer
    steps at learning rate 0, so the weights stay as they were; everything it allocated is released before the
    next try."""
    optimizer = make_optimizer(model, cfg, rt.device_type)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    held = None
    try:
        held = torch.empty(reserve, dtype=torch.uint8, device=rt.device) if reserve else None
        trial_step(model, optimizer, rt, cfg, batch)
        fits = True
    except torch.OutOfMemoryError:  # (its traceback, which holds the step's tensors, is gone after this block)
        fits = False
    optimizer.zero_grad(set_to_none=True)
    del optimizer, held
    gc.collect()
    if rt.device_type == "cuda":
        torch.cuda.empty_cache()
    return fits


def oom_message(run) -> str:
    """The one-line error for running out of GPU memory mid-run (`run`: gptkit/run.py's Run), with the largest
    micro-batch that the plan says fits this GPU and the accumulation that keeps the tokens per step."""
    cfg, rt, d = run.cfg, run.rt, run.d
    if rt.device_type != "cuda":
        return f"out of memory at micro-batch {cfg.batch_size} x {cfg.block_size}; lower --batch_size"
    total = torch.cuda.get_device_properties(rt.device).total_memory
    setup = setup_of(cfg, rt, d, compile=resolve_compile(cfg.compile, rt.device)[0],
                     sharded=parallel.is_sharded(run.model))
    per = setup.sequences_per_item  # DPO's batch_size counts pairs
    sequences = cfg.batch_size * cfg.gradient_accumulation_steps * per
    batch, fits = plan.largest_valid_batch(run.raw_model, setup, plan.process_capacity(rt.device), sequences)
    advice = (f"use --batch_size={batch // per} --gradient_accumulation_steps={sequences // batch} (the same "
              f"tokens per step)" if batch else "use --activation_checkpointing=True, --lora_rank or a smaller model")
    return (f"out of GPU memory at micro-batch {cfg.batch_size} x {cfg.block_size}; the plan puts the largest that "
            f"fits this GPU ({plan.format_bytes(total)}) at {fits}{' sequences' if per > 1 else ''}: {advice}, or --batch_size=auto "
            f"--tokens_per_step={sequences * cfg.block_size}")
