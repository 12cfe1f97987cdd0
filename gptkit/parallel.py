"""How the model is wrapped for the processes of a torchrun job: DDP or FSDP2, and --parallel=auto's choice.

    choice, line = parallel.decide(raw_model, cfg, d, rt, use_compile)  # single, ddp or fsdp; why
    model = parallel.wrap(raw_model, choice, rt, use_compile)           # the module that runs the steps
    with parallel.no_sync(model): ...              # forward + backward of a micro-batch not a step's last
    grad_norm = parallel.clip_grad_norm_(params, max_norm)    # a plain tensor, from sharded gradients too
    with parallel.gathered(model): ...             # the whole weights, for an evaluation (no collective per forward)
    parallel.is_sharded(model)                     # FSDP: save and restore through torch.distributed.checkpoint

ddp: every process holds the whole model, its gradients and the optimizer's states; the gradients are
    all-reduced in the backward of a step's last micro-batch. Communication per step: one all-reduce of the
    gradients (2x their bytes on the wire, ring).
fsdp: FSDP2 (torch.distributed.fsdp.fully_shard) on each transformer block, then on the whole model (the root
    unit: embeddings, final norm, head). Every process holds 1/world_size of each parameter, gradient and
    optimizer state; a unit's whole weights exist only while it runs (gathered before its forward, again
    before its backward), and its gradients are reduce-scattered after its backward. Communication per
    micro-batch: two all-gathers of the weights and one reduce-scatter of the gradients, about 1.5x DDP's
    volume per step (with gradient accumulation, that again for every micro-batch: see no_sync). On CUDA
    with bf16 the mixed-precision policy gathers bf16 weights for the compute and reduces the gradients in
    fp32; elsewhere everything stays in the parameters' dtype (fp32), autocast casting as without FSDP.
auto: DDP when a whole replica fits each device, FSDP when not (gptkit/plan.py's choose_parallel).

On one process nothing is wrapped (torch.compile aside). This module is the only place that knows which wrapper
a run chose: train.py asks for the wrapped model and uses the helpers above, whatever it is.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from gptkit import plan
from gptkit.cli import UserError
from gptkit.runtime import Dist, Runtime

CHOICES = ("auto", "ddp", "fsdp")
# torch.distributed.fsdp and .tensor take about a second to import: only a run under FSDP imports them. Until one
# has, no module is an FSDP unit and no tensor a DTensor (the checks below look them up in sys.modules).
FSDP, DTENSOR = "torch.distributed.fsdp", "torch.distributed.tensor"


class ParallelError(UserError):
    """A --parallel setting this run cannot use; the message says what to use instead."""


def choose(requested: str, model: torch.nn.Module, setup: plan.Setup, capacity: float,
           batch_size: int | None) -> tuple[str, str]:
    """("ddp" or "fsdp", why) for a job of setup.world_size > 1 processes: the one asked for, or with "auto"
    the plan's choice for a device of `capacity` bytes (plan.choose_parallel: DDP when a whole replica fits)."""
    if requested not in CHOICES:
        raise ParallelError(f"parallel {requested!r} unknown; use {', '.join(CHOICES)}")
    if requested != "auto":
        return requested, f"--parallel={requested}"
    return plan.choose_parallel(model, setup, capacity, batch_size)


def decide(model: torch.nn.Module, cfg, d: Dist, rt: Runtime, use_compile: bool,
           objective=None) -> tuple[str, str | None]:
    """How this run's processes share the model: ("single", None) on one process, else ("ddp" or "fsdp", the
    one line that says which and why). cfg: the run's TrainConfig (batch_size None: auto, planned at 1);
    objective: the run's (what its step holds: plan.Setup.of_run), None: the next-token loss."""
    if not d.enabled:
        return "single", None
    setup = plan.Setup.of_run(cfg, rt.device_type, rt.dtype, d.world_size, compile=use_compile,
                              accum=max(1, cfg.gradient_accumulation_steps // d.world_size), objective=objective)
    choice, why = choose(cfg.parallel, model, setup, plan.process_capacity(rt.device, d.world_size), cfg.batch_size)
    return choice, f"parallel: {choice.upper()} over {d.world_size} processes ({why})"


def wrap(model: torch.nn.Module, choice: str, rt: Runtime, use_compile: bool,
         compile_scope: str = "model") -> torch.nn.Module:
    """The module that runs the training steps, for decide's `choice`. `model` is the plain GPT on its device;
    under FSDP it is sharded in place (its parameters become DTensors holding this process' shard): build the
    optimizer after this call. compile_scope "blocks" compiles each block on its own, in place (FSDP always
    does): identical blocks share one compiled graph, so compile time does not grow with the depth."""
    if choice == "fsdp":
        return shard(model, rt, use_compile)
    if use_compile and compile_scope == "blocks":
        for block in model.transformer.h:
            block.compile()  # in place: the parameter names stay those of the plain model
        use_compile = False
    if choice == "ddp":
        # The model has no buffers, so DDP's forward syncs nothing: evaluation, where ranks may run different
        # numbers of batches, involves no collective until evaluate's own all_reduce. Gradients as views into
        # the all-reduce buckets save a copy of every gradient.
        model = DDP(model, device_ids=[rt.device.index] if rt.device_type == "cuda" else None,
                    gradient_as_bucket_view=True)
    # Compiling the DDP-wrapped model lets DDP's graph splitting overlap the all-reduce with the backward.
    return torch.compile(model) if use_compile else model


def mixed_precision(rt: Runtime):
    """FSDP2's MixedPrecisionPolicy: bf16 weights gathered for the compute and fp32 gradient reduction on CUDA
    with bf16; else nothing cast."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if rt.device_type == "cuda" and rt.dtype == torch.bfloat16:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard(model: torch.nn.Module, rt: Runtime, use_compile: bool) -> torch.nn.Module:
    """FSDP2 on `model` in place: fully_shard on each block (compiled first, each on its own, with use_compile),
    then on the root, which takes the parameters left (embeddings, final norm, head). Returns the model."""
    if rt.needs_grad_scaler:
        raise ParallelError("--parallel=fsdp does not combine with float16 (the loss scaler would see only this "
                            "process' shard of the gradients); use --dtype=bfloat16, or --parallel=ddp")
    from torch.distributed.fsdp import fully_shard

    policy = mixed_precision(rt)
    for block in model.transformer.h:
        if use_compile:
            block.compile()  # in place: the parameter names stay those of the plain model
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    # FSDP2 takes the first unit to run a forward as the root. Settle it now: a block called on its own first (by
    # HellaSwag's scoring, which calls model.hidden_states, before any training step) would take that role.
    model._get_fsdp_state()._lazy_init()
    return model


def _fsdp_units(model: torch.nn.Module) -> list:
    """The FSDP units (FSDPModule) of a model sharded by `shard`, root first; none for any other model."""
    fsdp = sys.modules.get(FSDP)
    return [] if fsdp is None else [m for m in model.modules() if isinstance(m, fsdp.FSDPModule)]


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether the model's parameters are FSDP shards (its checkpoints are then written by every process)."""
    return bool(_fsdp_units(model))


@contextlib.contextmanager
def no_sync(model: torch.nn.Module) -> Iterator[None]:
    """Around the forward and backward of a micro-batch that is not a step's last. Under DDP its gradients
    accumulate on each process without being all-reduced (DDP's no_sync). Under FSDP they are reduce-scattered
    all the same: holding them whole until the step's last micro-batch (FSDP2's
    set_requires_gradient_sync(False)) would cost every process the whole model's fp32 gradients, DDP's
    memory, which is what FSDP is chosen to avoid (GPT-2 xl on 8 GPUs: 11.0 instead of 5.9 GiB per device);
    the reduce-scatters overlap the backward. Nothing for a plain model."""
    inner = getattr(model, "_orig_mod", model)  # a compiled model's
    if isinstance(inner, DDP):
        with inner.no_sync():
            yield
    else:
        yield


def clip_grad_norm_(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over every gradient, sharded or not; the total norm as a plain tensor.
    With FSDP's DTensor gradients torch computes the norm over all shards (a reduction across the processes)
    and scales each shard: the same clip as one process holding every gradient."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm.full_tensor() if _is_dtensor(norm) else norm


def _is_dtensor(t: torch.Tensor) -> bool:
    dtensor = sys.modules.get(DTENSOR)
    return dtensor is not None and isinstance(t, dtensor.DTensor)


@contextlib.contextmanager
def gathered(model: torch.nn.Module) -> Iterator[None]:
    """Inside the block a sharded model holds its whole weights, and its forwards (and direct calls such as
    model.hidden_states and model.head, which HellaSwag's scoring makes) gather nothing: the processes may run
    different numbers of them, as DDP's can. Every process enters and leaves together (one all-gather per
    unit on the way in). It costs the whole weights' memory for the block; the gradients and optimizer states
    stay sharded. Nothing for a model that is not sharded."""
    units = _fsdp_units(getattr(model, "_orig_mod", model))
    if not units:
        yield
        return
    blocks = units[1:]  # (the root, units[0], never reshards after its forward: FSDP2's default for the root)
    for unit in blocks:
        unit.set_reshard_after_forward(False, recurse=False)
    for unit in units:
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
        for unit in blocks:
            unit.set_reshard_after_forward(True, recurse=False)


def local_bytes(model: torch.nn.Module, optimizer) -> dict[str, int]:
    """The bytes this process holds of the parameters, gradients and optimizer states (of a sharded model,
    its shards: DTensors' local tensors), each tensor once."""
    def nbytes(t: torch.Tensor) -> int:
        t = t.to_local() if _is_dtensor(t) else t
        return t.numel() * t.element_size()

    def tensors(value) -> Iterator[torch.Tensor]:  # in an optimizer's state_dict: the very state tensors
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, dict):
            for v in value.values():
                yield from tensors(v)

    params = {id(p): p for p in model.parameters()}.values()
    return {"params": sum(nbytes(p) for p in params),
            "grads": sum(nbytes(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(nbytes(t) for t in tensors(optimizer.state_dict()))}
