"""The whole training step as one CUDA graph: captured once, replayed every step, so that the host launches one
graph instead of every kernel of the forward, the backward, the clipping and the optimizer step.

    graphed = GraphedStep(model, optimizer, rt, accum=4, batch_size=16, block_size=256, grad_clip=1.0)
    loss, grad_norm, flags = graphed(loader, stop_requested)   # device tensors; read them a step later

A small model's step is bound by the host (Python, guards, kernel launches), not by the GPU: replaying a graph
removes that. What a graph needs, this module provides:
- static inputs: each micro-batch is copied into a fixed buffer (`x`, `y`) before the replay;
- a learning rate that lives on the device (a tensor the graph reads; optim.set_lr fills it) and fused AdamW
  with capturable=True (optim.make_adamw(..., graphable=True));
- the flags on the device: [a NaN/inf this step or any earlier one, a stop signal], the stop signal passed in
  through a device tensor. The optimizer step is masked on the device by the first (optim.step_unless), so a
  non-finite step is never applied, nor any step after it, until train.py reads the flags and stops.

The first `warmup` steps run the same step eagerly on a side stream (they are real training steps, and
torch.compile compiles in them), then it is captured, and replayed from there on. On a device other than CUDA
the step always runs eagerly: the same arithmetic, which is how the tests check it on a CPU.
"""

from __future__ import annotations

import torch

from gptkit import parallel
from gptkit.optim import step_unless


class GraphedStep:
    def __init__(self, model: torch.nn.Module, optimizer, device: torch.device, *, accum: int, batch_size: int,
                 block_size: int, grad_clip: float, autocast, warmup: int = 3):
        self.model, self.optimizer, self.device = model, optimizer, device
        self.accum, self.grad_clip, self.autocast, self.warmup = accum, grad_clip, autocast, warmup
        shape = (accum, batch_size, block_size)
        self.x = torch.zeros(shape, dtype=torch.long, device=device)  # the step's micro-batches, copied in
        self.y = torch.zeros(shape, dtype=torch.long, device=device)
        self.stop_in = torch.zeros((), device=device)  # 1.0: a stop signal was asked for before this step
        self.halted = torch.zeros((), device=device)  # 1.0 once any step was non-finite: every later one is masked
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.capture = device.type == "cuda"
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.steps = 0

    def __call__(self, loader, stop_requested: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One training step on the loader's next accum micro-batches: (mean loss, gradient norm, flags), as
        device tensors that a replay overwrites (copy or read them before the next call)."""
        for micro in range(self.accum):
            x, y = loader.next_batch()
            self.x[micro].copy_(x, non_blocking=True)
            self.y[micro].copy_(y, non_blocking=True)
        self.stop_in.fill_(float(stop_requested))  # a scalar fill: no host-to-device copy
        if not self.capture:
            outputs = self.body()
            self.optimizer.zero_grad(set_to_none=True)
        elif self.steps < self.warmup:
            outputs = self._warm_up_step()
        else:
            if self.graph is None:
                self._capture()
            self.graph.replay()
            outputs = self.outputs
        loader.prefetch()  # the next step's first batch, read while the device runs this one
        self.steps += 1
        return outputs

    def body(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step itself, on the static tensors only (what the graph records): forward and backward over the
        micro-batches, the clip, the flags, the masked optimizer step. Gradients are None before it runs."""
        loss_sum = torch.zeros((), device=self.device)
        for micro in range(self.accum):
            with self.autocast():
                loss = self.model(self.x[micro], self.y[micro])[1] / self.accum
            loss.backward()
            loss_sum += loss.detach()
        grad_norm = parallel.clip_grad_norm_(self.params, self.grad_clip if self.grad_clip > 0 else float("inf"))
        bad = (~torch.isfinite(loss_sum) | ~torch.isfinite(grad_norm)).float()
        self.halted.copy_(torch.maximum(self.halted, bad))
        flags = torch.stack([self.halted, self.stop_in])
        step_unless(self.optimizer, self.halted)
        return loss_sum, grad_norm, flags

    def _warm_up_step(self):
        """An eager step on a side stream (as CUDA graphs want their warm-up: the caching allocator and cuBLAS
        settle there, away from the capture)."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            outputs = self.body()
            self.optimizer.zero_grad(set_to_none=True)
        torch.cuda.current_stream(self.device).wait_stream(side)
        return outputs

    def _capture(self) -> None:
        """Record body() once (nothing runs during the capture: the replay that follows is this step). Its
        gradients are allocated inside the graph's memory pool, and stay there for every replay."""
        self.optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize(self.device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = self.body()
