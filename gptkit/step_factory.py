"""A run's training step, built in one place: its optimizer, its loss scaler, with cuda_graphs its graphed
variant, and the TrainStep over them (gptkit/step.py). train.py's run, bench.py's training rows, batch_size=auto's
trial step and the memory benchmarks all build their step here, so that each runs the step a run takes.

    train_step = make_step(wrapped, cfg, rt, d, accum=4, raw_model=model, objective=loss, graphs=True,
                           before_capture=saver.wait)
    out = train_step(step, loader, requests.next)       # train_step.optimizer, .scaler, .graphed: its parts
    train_step.cut_by(stop, list(model.transformer.h))  # later, once the run's StopFlag exists (one process)

Built before the step: the optimizer over the raw model's trainable parameters (optim.make_optimizer; graphable,
with a learning rate on the device, when graphed), a GradScaler that does anything only with float16 on CUDA,
and the GraphedStep recording the wrapped model's step with autocast's cache off (a graph would read the cast
weights after the cache frees them).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gptkit.config import TrainConfig
from gptkit.cudagraph import GraphedStep
from gptkit.optim import make_optimizer
from gptkit.runtime import Dist, Runtime
from gptkit.step import Objective, StopFlag, TrainStep, next_token_loss


def make_step(model: torch.nn.Module, cfg: TrainConfig, rt: Runtime, d: Dist, *, accum: int,
              raw_model: torch.nn.Module | None = None, objective: Objective = next_token_loss, graphs: bool = False,
              before_capture: Callable[[], None] | None = None,
              adapt_optimizer: Callable[[torch.optim.Optimizer], None] | None = None,
              stop: StopFlag | None = None, blocks: list[torch.nn.Module] | None = None) -> TrainStep:
    """The TrainStep of a run over `model` (what runs the step: maybe DDP-, FSDP- or compile-wrapped), taking
    `accum` micro-batches per step of `objective`. `raw_model`: the module whose parameters the optimizer
    updates (the unwrapped model; None: `model`). `graphs`: the step replayed as one CUDA graph (resolved before:
    runtime.resolve_cuda_graphs), `before_capture` run before its capture. `adapt_optimizer`: called with the
    new optimizer before anything else holds it (bench.py's --compile_optimizer). `stop`, `blocks`: TrainStep's
    (or later, cut_by)."""
    optimizer = make_optimizer(model if raw_model is None else raw_model, cfg, rt.device_type, graphable=graphs)
    if adapt_optimizer is not None:
        adapt_optimizer(optimizer)
    scaler = torch.amp.GradScaler(rt.device_type, enabled=rt.needs_grad_scaler)
    graphed = None
    if graphs:
        graphed = GraphedStep(model, optimizer, rt.device, accum=accum, grad_clip=cfg.grad_clip,
                              autocast=lambda: rt.autocast(cache=False), objective=objective,
                              before_capture=before_capture)
    return TrainStep(model, optimizer, scaler, rt, d, cfg, accum=accum, objective=objective, graphed=graphed,
                     stop=stop, blocks=blocks)


class OneBatch:
    """A loader as the step reads it (next_batch, prefetch) that serves one micro-batch every time: the made-up
    tokens of batch_size=auto's trial step and of the memory benchmarks."""

    def __init__(self, batch):
        self.batch = batch

    def next_batch(self):
        return self.batch

    def prefetch(self) -> None:
        pass
