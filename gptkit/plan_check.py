"""Before a run allocates anything: does its step fit this machine at all? The plan's peak for one training
step (gptkit/plan.py's `memory`: weights, gradients, optimizer state, activations) against the device's whole
memory, and a one-line refusal naming the largest batch_size, block_size or n_layer that fits, instead of a
numpy or allocator traceback (or minutes of building a model that cannot train).

    check_run_fits(cfg, ckpt, meta, rt.device, rt.dtype, world_size)   # raises RunTooBig

The model is sized from its shape alone, on the meta device, and from one- and two-block copies of it (a step's
memory grows by the same amount with each block), so that a 100,000-block model is refused in milliseconds.
The bound is the device's whole memory (a CPU's available RAM, a GPU's total), not the plan's conservative
capacity: only what surely cannot run is refused; a run near the limit is batch_size=auto's and the
out-of-memory message's to size.
"""

from __future__ import annotations

import dataclasses

import torch

from gptkit import lora, plan
from gptkit.cli import UserError
from gptkit.config import TrainConfig, lora_settings
from gptkit.lora import LoRASettings
from gptkit.objectives import make_objective
from gptkit.options import command_line_values
from gptkit.plan_report import base_config
from gptkit.runtime import ram
from model import GPT, GPTConfig


class RunTooBig(UserError):
    """A run whose training step needs more memory than the device has; the message names what fits."""


def run_shape(cfg: TrainConfig, ckpt: dict | None, vocab_size: int, char: bool) -> GPTConfig:
    """The GPTConfig the run trains (checkpoint/run_model.py's build_model), without building it."""
    if ckpt is not None:
        return GPTConfig.from_dict(ckpt["model_config"])
    if cfg.init_from == "scratch":
        return cfg.model_config(vocab_size, vocab_multiple=1 if char else 64)
    base = base_config(cfg.init_from, cfg.dropout)
    if cfg.block_size < base.block_size and not cfg.lora_rank and not make_objective(cfg).keeps_base_context:
        base = dataclasses.replace(base, block_size=cfg.block_size)  # (a full fine-tune crops its positions)
    return dataclasses.replace(base, vocab_size=max(base.vocab_size, vocab_size))


def fit_base_context(cfg: TrainConfig, argv: list[str], say: bool = True) -> TrainConfig:
    """A new fine-tune whose block_size comes from a config file (configs/finetune_chat.py's GPT-2 context) and
    exceeds its base's context (the quick start's 64): the base's, said in one line (`say`), before the data
    fits it further. One asked for on the command line is left as asked (checkpoint/run_model.py refuses it)."""
    if cfg.init_from in ("scratch", "resume") or "block_size" in command_line_values(TrainConfig, argv):
        return cfg
    context = base_config(cfg.init_from, cfg.dropout).block_size
    if cfg.block_size <= context:
        return cfg
    if say:
        print(f"note: block_size {cfg.block_size} (the config file's) exceeds {cfg.init_from}'s context of {context}: "
              f"this fine-tune uses block_size={context}, its base's context", flush=True)
    return dataclasses.replace(cfg, block_size=context)


def step_peak(shape: GPTConfig, cfg: TrainConfig, ckpt: dict | None, setup: plan.Setup, batch: int) -> float:
    """The plan's peak (bytes) of one training step at `batch` sequences per micro-batch: computed for one and
    two blocks, and extended block by block to the model's n_layer."""
    settings = LoRASettings(**ckpt["lora"]["settings"]) if ckpt and ckpt.get("lora") else lora_settings(cfg)
    peaks = []
    for n_layer in (1, 2):
        with torch.device("meta"):
            model = GPT(dataclasses.replace(shape, n_layer=n_layer))
            if settings is not None:
                lora.apply(model, settings)
        peaks.append(plan.memory(model, setup, batch).peak)
    return peaks[0] + (shape.n_layer - 1) * (peaks[1] - peaks[0])


def available_memory(device: torch.device) -> float:
    """The device's whole memory for the run: a GPU's total, or the RAM available now."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return ram()[1]


def check_run_fits(cfg: TrainConfig, ckpt: dict | None, meta: dict, device: torch.device, dtype: torch.dtype,
                   world_size: int = 1, compile: bool = False) -> None:
    """Refuse (RunTooBig) a run whose training step cannot fit `device`'s memory, naming the largest
    batch_size that fits, else (not even one sequence fits) the largest block_size, else (the model is too big
    for even one position) the largest n_layer. Under torchrun the step is sized per process: the least of DDP
    and FSDP unless --parallel chose one; `compile`: whether the step is compiled (it keeps less)."""
    shape = run_shape(cfg, ckpt, int(meta["vocab_size"]), meta["tokenizer"]["kind"] == "char")
    objective = make_objective(cfg)
    per_batch = objective.sequences_per_item  # (DPO: 2 a pair)
    batch = cfg.batch_size or 1  # (batch_size=auto: its least)
    setup = plan.Setup.of_run(cfg, device.type, dtype, world_size, accum=min(cfg.gradient_accumulation_steps, 2),
                              compile=compile, objective=objective)
    shares = ["ddp", "fsdp"] if world_size > 1 and cfg.parallel == "auto" else [
        "fsdp" if world_size > 1 and cfg.parallel == "fsdp" else "ddp"]
    limit = available_memory(device) / (world_size if device.type != "cuda" else 1)

    def peak(shape: GPTConfig, seq_len: int, sequences: int) -> float:
        return min(step_peak(shape, cfg, ckpt, dataclasses.replace(setup, seq_len=seq_len, parallel=share),
                             sequences) for share in shares)

    T = cfg.block_size
    need = peak(shape, T, batch * per_batch)
    if need <= limit:
        return
    memory = f"{plan.format_bytes(limit)} of {'GPU memory' if device.type == 'cuda' else 'RAM available'}"
    what = f"batch_size={cfg.batch_size}, " if cfg.batch_size else ""
    said = (f"this run's training step needs ~{plan.format_bytes(need)} ({what}block_size={T}, "
            f"{shape.n_layer} layers of {shape.n_embd}; python train.py ... --plan shows the parts), more than the "
            f"{memory} here")
    if peak(shape, T, per_batch) <= limit:
        fits = largest(lambda b: peak(shape, T, b * per_batch) <= limit, batch)
        raise RunTooBig(f"{said}: at most --batch_size={fits} fits (raise --gradient_accumulation_steps to keep "
                        f"the tokens per step)")

    def block_fits(t: int) -> bool:
        # a model from scratch has block_size positions; a fine-tune's are its base's
        seq_shape = dataclasses.replace(shape, block_size=t) if cfg.init_from == "scratch" and not ckpt else shape
        return peak(seq_shape, t, per_batch) <= limit

    if block_fits(1):
        fits = largest(block_fits, T)
        raise RunTooBig(f"{said}: not even --batch_size=1 fits; at most --block_size={fits} does, at batch_size=1")
    layers = largest(lambda n: peak(dataclasses.replace(shape, n_layer=n), T, batch * per_batch) <= limit,
                     shape.n_layer)
    advice = (f"at most --n_layer={layers} fits at this batch_size and block_size" if layers else
              "not even one layer fits: use a smaller --n_embd")
    raise RunTooBig(f"{said}: the model is too big; {advice}")


def largest(fits, above: int) -> int:
    """The largest n in [1, above) with fits(n) (fits(1) holds, fits(above) does not; fits grows monotonic),
    0 when fits(1) does not hold."""
    if not fits(1):
        return 0
    lo, hi = 1, above
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
