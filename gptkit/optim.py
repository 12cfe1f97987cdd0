"""The optimizer and its learning-rate schedule.

    optimizer = make_optimizer(model, cfg, device_type)
    lr = set_lr(optimizer, step, cfg)        # every step, before the update

optimizer="adamw" (GPT-2's recipe) is one AdamW over every weight. optimizer="muon" is Muon for the 2-D weight
matrices inside the blocks and AdamW for the rest (embeddings, head, gains, biases), stepped together by one
object, MuonAdamW, that train.py, torch.amp.GradScaler and the checkpoint use like any optimizer.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # annotations only: nothing of gptkit.config is needed at run time
    from gptkit.config import TrainConfig


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, device_type: str,
                   graphable: bool = False) -> torch.optim.AdamW | MuonAdamW:
    """AdamW (weight decay on the matrices only), or with cfg.optimizer="muon" Muon + AdamW as one optimizer.
    graphable: an AdamW whose step a CUDA graph can record (gptkit/cudagraph.py; make_adamw)."""
    if cfg.optimizer == "muon":
        return make_muon_adamw(model, cfg, device_type)
    params = [p for p in model.parameters() if p.requires_grad]  # the tied wte/lm_head weight appears once
    return make_adamw(params, cfg, device_type, graphable)


def make_adamw(params: list[torch.nn.Parameter], cfg: TrainConfig, device_type: str,
               graphable: bool = False) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices (linear weights, embeddings) only, not on biases and gains.
    graphable: fused, with the learning rate a tensor on the device (set_lr fills it) and, on CUDA,
    capturable=True (its step counts on the device), as a CUDA graph of the step needs."""
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]  # the modern block may have no gains or biases at all
    # The fused CUDA kernel updates all parameters in a few launches instead of several per tensor, and can
    # skip its update on the device (step_unless).
    extra = {"fused": True} if device_type in FUSED_DEVICE_TYPES or graphable else {}
    lr = cfg.learning_rate
    if graphable:
        lr = torch.tensor(lr, device=params[0].device)
        extra["capturable"] = device_type == "cuda"  # (torch allows capturable on accelerators only)
    return torch.optim.AdamW(groups, lr=lr, betas=(cfg.beta1, cfg.beta2), **extra)


# Where AdamW runs fused. (The CPU has a fused AdamW too, but its arithmetic differs from the loop's by
# rounding, and the CPU gains nothing from skipping a step on the device: the for-loop implementation stays.)
FUSED_DEVICE_TYPES = ("cuda",)


# How an optimizer runs, not what it has learned: a checkpoint's values are those of the machine that saved it.
IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable")


def load_optimizer_state(optimizer, state: dict) -> None:
    """optimizer.load_state_dict(state), keeping this machine's implementation choices (keeping_implementation)."""
    with keeping_implementation(optimizer):
        optimizer.load_state_dict(state)


@contextlib.contextmanager
def keeping_implementation(optimizer) -> Iterator[None]:
    """Around a load of optimizer state (ours, or torch.distributed.checkpoint's): every group keeps this
    machine's implementation settings. torch restores every group setting from the checkpoint, so a run
    started on a CPU (fused None) would resume on a GPU without the fused kernel, and one started on a GPU
    would resume on a CPU asking for it.

    The saved groups are given this machine's settings before torch reads them (a load pre-hook), because torch
    places AdamW's `step` by them: on the parameter's device in float32 when fused or capturable, else where it
    was loaded (the CPU). Placed by the saved ones, a CPU checkpoint resumed by fused AdamW on a GPU would keep
    `step` on the CPU, and a GPU one resumed by the loop implementation elsewhere would move it to the device."""
    chosen = [{k: g[k] for k in IMPLEMENTATION_KEYS if k in g} for g in optimizer.param_groups]
    lrs = [g["lr"] for g in optimizer.param_groups]

    def ours(part, state: dict) -> dict:  # (a new dict: the checkpoint itself is left as it was)
        groups = [{**saved, **{k: g[k] for k in IMPLEMENTATION_KEYS if k in g}}
                  for saved, g in zip(state["param_groups"], part.param_groups)]
        return {**state, "param_groups": groups}

    hooks = [part.register_load_state_dict_pre_hook(ours) for part in _parts(optimizer)]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
    for group, keep, lr in zip(optimizer.param_groups, chosen, lrs, strict=True):
        group.update(keep)
        # The learning rate keeps this optimizer's form: a float, or the very tensor a CUDA graph reads.
        loaded = float(group["lr"])
        group["lr"] = lr.fill_(loaded) if isinstance(lr, torch.Tensor) else loaded


def _parts(optimizer) -> list[torch.optim.Optimizer]:
    return [optimizer.muon, optimizer.adamw] if isinstance(optimizer, MuonAdamW) else [optimizer]


def can_mask(optimizer) -> bool:
    """Whether step_unless can skip this optimizer's update on the device: fused AdamW, and Muon (ours)."""
    return all(isinstance(o, Muon) or (isinstance(o, torch.optim.AdamW) and o.defaults.get("fused"))
               for o in _parts(optimizer))


def step_unless(optimizer, found_inf: torch.Tensor) -> None:
    """optimizer.step(), which leaves every parameter and every state (moments, step counts, momentum) as it
    was where found_inf, a float32 () tensor on the device, is nonzero: the decision stays on the device, so
    the host never waits for it. The mechanism is torch.amp.GradScaler's (an optimizer attribute `found_inf`
    that fused AdamW honours); our Muon honours it the same way. Only for can_mask(optimizer)."""
    parts = _parts(optimizer)
    for o in parts:
        o.found_inf = found_inf
    try:
        optimizer.step()
    finally:
        for o in parts:
            del o.found_inf


# ----------------------------------------------------------------------------- Muon


def block_matrices(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """What Muon optimises: the 2-D weights inside the transformer blocks (attention's c_attn and c_proj, the
    MLP's c_fc and c_proj). Embeddings and the head are lookups and a classifier, not hidden layers: AdamW."""
    return [p for name, p in model.named_parameters()
            if p.requires_grad and p.dim() == 2 and name.startswith("transformer.h.")]


def newton_schulz_dtype(device_type: str) -> torch.dtype:
    """bfloat16 on CUDA (tensor cores, as torch.optim.Muon); float32 elsewhere (see Muon)."""
    return torch.bfloat16 if device_type == "cuda" else torch.float32


def make_muon_adamw(model: torch.nn.Module, cfg: TrainConfig, device_type: str) -> MuonAdamW:
    matrices = block_matrices(model)
    ids = {id(p) for p in matrices}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in ids]
    # "muon": True marks the group for set_lr, which gives it muon_lr's share of the schedule.
    muon = Muon([{"params": matrices, "muon": True}], lr=cfg.muon_lr, momentum=cfg.muon_momentum,
                weight_decay=cfg.muon_weight_decay, nesterov=True, ns_dtype=newton_schulz_dtype(device_type))
    return MuonAdamW(muon, make_adamw(rest, cfg, device_type))


class MuonAdamW:
    """Muon and AdamW stepped as one optimizer.

    param_groups are both optimizers' groups (the very dicts, so set_lr and GradScaler.unscale_ reach every
    parameter); step, zero_grad, state_dict and load_state_dict act on both. torch.amp.GradScaler needs no
    more: it unscales through param_groups, calls step() only when no gradient overflowed, and keys its
    per-optimizer state by id(this object).
    """

    def __init__(self, muon: torch.optim.Muon, adamw: torch.optim.AdamW):
        self.muon, self.adamw = muon, adamw

    @property
    def param_groups(self) -> list[dict]:
        return self.muon.param_groups + self.adamw.param_groups

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MuonAdamW.step takes no closure")
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adamw.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])

    def __repr__(self) -> str:
        n_muon = sum(len(g["params"]) for g in self.muon.param_groups)
        n_adamw = sum(len(g["params"]) for g in self.adamw.param_groups)
        return (f"{type(self.muon).__name__} on {n_muon} block matrices + AdamW on {n_adamw} other tensors")


class Muon(torch.optim.Muon):
    """torch.optim.Muon's update (momentum, Nesterov, learning-rate adjustment, decoupled weight decay, the
    quintic Newton-Schulz iteration) and state dict, with two things torch's lacks:

    - the iteration's precision, ns_dtype: torch's runs it in bfloat16, hard-coded (`grad.bfloat16()` in
      torch/optim/_muon.py). That is right on a GPU, but a CPU without native bf16 arithmetic emulates it: on
      the 2-core development machine one training step of the 4-layer, 128-wide char model took 813 ms that
      way and 88 ms in float32. make_muon_adamw picks bfloat16 on CUDA, float32 elsewhere.
    - a step skipped on the device (optim.step_unless): where the attribute `found_inf` (a () tensor) is
      nonzero, parameters and momentum keep their values, without the host reading the flag.
    """

    def __init__(self, params, *, ns_dtype: torch.dtype = torch.float32, **kwargs):
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)
        skip = None if found_inf is None else found_inf != 0  # () bool: this step is skipped
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                moved = buf.lerp(p.grad, 1 - momentum)  # the momentum after this step
                update = p.grad.lerp(moved, momentum) if group["nesterov"] else moved
                # (torch.where, not a multiply by 0, for a skipped step: its values may be NaN)
                buf.copy_(moved if skip is None else torch.where(skip, buf, moved))
                del moved  # (freed before the iteration's temporaries, with Nesterov)
                update = orthogonalize_whole(update, group["ns_coefficients"], group["ns_steps"], group["eps"],
                                             self.ns_dtype)
                scale = -lr * lr_ratio(p.shape, group["adjust_lr_fn"])
                if skip is None:
                    p.mul_(1 - lr * group["weight_decay"]).add_(update, alpha=scale)
                else:
                    new = p.mul(1 - lr * group["weight_decay"]).add_(update, alpha=scale)
                    p.copy_(torch.where(skip, p, new))
        return loss


def orthogonalize_whole(g: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """orthogonalize, of the whole matrix also when g is this process' shard of it (a DTensor: a run under
    FSDP): Newton-Schulz needs whole matrices, so the shards are gathered (DTensor.full_tensor), every process
    orthogonalizes the matrix, and keeps its own shard of the result (cut locally: no communication back)."""
    dtensor = sys.modules.get("torch.distributed.tensor")  # not imported: g cannot be a DTensor
    if dtensor is None or not isinstance(g, dtensor.DTensor):
        return orthogonalize(g, coefficients, steps, eps, dtype)
    whole = orthogonalize(g.full_tensor(), coefficients, steps, eps, dtype)
    return dtensor.distribute_tensor(whole, g.device_mesh, g.placements, src_data_rank=None)


def orthogonalize(g: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """G (m, n) -> about U V^T of its SVD, computed in `dtype`: torch's Muon's quintic Newton-Schulz iteration
    (the same coefficients, steps and normalisation), which moves every singular value to about 1 (0.5 to
    1.5)."""
    a, b, c = coefficients
    x = g.to(dtype)
    wide = x.size(0) <= x.size(1)
    x = x if wide else x.T  # iterate on the wide orientation: the Gram matrix is the smaller one
    x = x / x.norm().clamp(min=eps)  # spectral norm <= 1 (not in place: x may be the momentum buffer)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)  # a x + (b A + c A^2) x
    return (x if wide else x.T).to(g.dtype)


def lr_ratio(shape: torch.Size, adjust_lr_fn: str | None) -> float:
    """torch's Muon's learning-rate adjustment for a (rows, cols) matrix: "original" (the default) keeps the
    update's RMS per element steady across shapes; "match_rms_adamw" matches AdamW's update RMS."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return 1.0


def describe(optimizer) -> str:
    """One line for the run's log: which optimizers, on what, and for Muon which Newton-Schulz precision."""
    if isinstance(optimizer, MuonAdamW):
        return f"optimizer: {optimizer!r}; Newton-Schulz in {str(optimizer.muon.ns_dtype).removeprefix('torch.')}"
    return f"optimizer: {type(optimizer).__name__}"


# ----------------------------------------------------------------------------- the learning-rate schedule


def get_lr(step: int, cfg: TrainConfig) -> float:
    """AdamW's learning rate at `step`: a linear warmup (never 0, even at step 0), then
    cosine: a cosine decay from learning_rate to min_lr at lr_decay_iters;
    wsd: learning_rate until the last cooldown_frac of lr_decay_iters, then a straight line down to min_lr."""
    if not cfg.decay_lr:
        return cfg.learning_rate
    if step < cfg.warmup_iters:
        return cfg.learning_rate * (step + 1) / (cfg.warmup_iters + 1)
    if step >= cfg.lr_decay_iters:
        return cfg.min_lr
    if cfg.lr_schedule == "wsd":
        left, cooldown = cfg.lr_decay_iters - step, cfg.cooldown_frac * cfg.lr_decay_iters
        if left >= cooldown:
            return cfg.learning_rate
        return cfg.min_lr + (cfg.learning_rate - cfg.min_lr) * left / cooldown
    progress = (step - cfg.warmup_iters) / max(1, cfg.lr_decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.learning_rate - cfg.min_lr)


def set_lr(optimizer, step: int, cfg: TrainConfig) -> float:
    """Set every group's learning rate for `step`: AdamW's groups get get_lr, Muon's the same schedule relative
    to their own peak, muon_lr. Returns AdamW's (the logged lr)."""
    lr = get_lr(step, cfg)
    relative = lr / cfg.learning_rate if cfg.learning_rate else 0.0  # (0: batch_size=auto's trial step)
    for group in optimizer.param_groups:
        value = cfg.muon_lr * relative if group.get("muon") else lr
        if isinstance(group["lr"], torch.Tensor):  # a graphable AdamW's: filled in place, on the device
            group["lr"].fill_(value)
        else:
            group["lr"] = value
    return lr
