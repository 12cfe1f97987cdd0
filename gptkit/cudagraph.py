"""The whole training step as one CUDA graph: captured once, replayed every step, so that the host launches one
graph instead of every kernel of the forward, the backward, the clipping and the optimizer step.

    graphed = GraphedStep(model, optimizer, rt.device, accum=4, grad_clip=1.0,
                          autocast=lambda: rt.autocast(cache=False), before_capture=saver.wait)
    train_step = TrainStep(model, optimizer, scaler, rt, d, cfg, accum=4, graphed=graphed)   # gptkit/step.py
    loss, grad_norm, flags = graphed(loader, request)   # what TrainStep calls: device tensors, read a step later

(gptkit/step_factory.py's make_step builds the two, as a run does.)

A small model's step is bound by the host (Python, guards, kernel launches), not by the GPU: replaying a graph
removes that. The step is gptkit/step.py's step_body, the very function the plain step runs; what a graph needs
besides, this module provides:
- static inputs: each micro-batch is copied into fixed buffers before the replay (`batch`: one per tensor of
  the micro-batch, shaped by the first step's: x and y for the default objective; a preference batch's x, y and
  its reference log-probabilities, read with the batch, gptkit/data/pairs.py's PairBatch.tensors), and the
  objective is called with micro-batches made of those buffers;
- a learning rate that lives on the device (a tensor the graph reads; optim.set_lr fills it) and fused AdamW
  with capturable=True (optim.make_adamw(..., graphable=True));
- the flags on the device: [a NaN/inf this step or any earlier one, the step boundary's request], the request
  passed in through a device tensor. The optimizer step is masked on the device by the first
  (optim.step_unless), so a non-finite step is never applied, nor any step after it, until train.py reads the
  flags and stops.

The first `warmup` steps run the same step eagerly on a side stream, one stream made once (they are real
training steps, and torch.compile compiles in them), then it is captured, and replayed from there on. Before the
capture `before_capture` runs (train.py: the wait for a checkpoint still being written in the background,
whose writer thread would otherwise synchronise with the device while the capture records: a global capture
refuses that). The capture runs under torch._dynamo's error_on_recompile: a compiled model that would compile
again inside the capture fails naming the guard that changed, not with an error from inside the capture. (The
capture itself hands the warm-up's cached blocks back first, torch.cuda.graph's empty_cache.) From then on the
graph's private pool keeps a whole step's gradients and working memory for good, beside the regular pool, where
the evaluations then run: batch_size=auto keeps a margin for that (batch_size.graph_batch_reserve). On a device other than
CUDA the step always runs eagerly, and before_capture runs at the step where the capture would happen: the same
arithmetic and the same order, which is how the tests check it on a CPU.

Settings that cannot be captured are refused before the first step (settings.refuse_uncapturable), not at the
capture.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gptkit import step
from gptkit.step import Objective, OnDevice, Skip, next_token_loss, non_finite, trained_parameters


def batch_tensors(batch) -> tuple[torch.Tensor, ...]:
    """The tensors of a micro-batch as the loader gives it: a tuple (x, y) itself, or an object's tensors()."""
    return batch.tensors() if hasattr(batch, "tensors") else tuple(batch)


def batch_like(template, tensors: tuple[torch.Tensor, ...]):
    """A micro-batch of the template's kind made of `tensors` (as batch_tensors gives them back)."""
    return template.with_tensors(tensors) if hasattr(template, "with_tensors") else tensors


class GraphedStep:
    """gptkit/step.py's training step as one CUDA graph (this module's docstring). `objective` as TrainStep's:
    it is called with micro-batches of the loader's kind whose tensors are the graph's static buffers."""

    def __init__(self, model: torch.nn.Module, optimizer, device: torch.device, *, accum: int, grad_clip: float,
                 autocast, warmup: int = 3, objective: Objective = next_token_loss,
                 before_capture: Callable[[], None] | None = None):
        self.model, self.optimizer, self.device = model, optimizer, device
        self.accum, self.grad_clip, self.autocast, self.warmup = accum, grad_clip, autocast, warmup
        self.objective, self.before_capture = objective, before_capture
        # the step's micro-batches, copied in: one (accum, ...) buffer per tensor of a micro-batch, made at the
        # first step with its shapes and dtypes; `template`, that first micro-batch, gives the objective's
        # micro-batches their kind (batch_like)
        self.batch: tuple[torch.Tensor, ...] = ()
        self.template = None
        self.stop_in = torch.zeros((), device=device)  # the step boundary's request: 1.0 a stop (step.StepRequests)
        self.halted = torch.zeros((), device=device)  # 1.0 once any step was non-finite: every later one is masked
        self.params = trained_parameters(optimizer)
        self.on_device = OnDevice(device, autocast)
        self.capture = device.type == "cuda"
        self.side = torch.cuda.Stream(device) if self.capture else None  # the warm-up steps' stream, made once
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], torch.Tensor] | None = None
        self.metrics: dict[str, torch.Tensor] = {}  # the objective's, of the last step (static once captured)
        self.steps = 0

    @property
    def x(self) -> torch.Tensor:
        """The static buffer of the batch's first tensor (the default objective's inputs x)."""
        return self.batch[0]

    def __call__(self, loader, stop_requested: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One training step on the loader's next accum micro-batches: (mean loss, gradient norm, flags), as
        device tensors that a replay overwrites (copy or read them before the next call); the objective's
        metrics are in `metrics`. `stop_requested`: the request for the step boundary (a bool: a stop)."""
        for micro in range(self.accum):
            batch = loader.next_batch()
            tensors = batch_tensors(batch)
            if self.template is None:
                self.template = batch
                self.batch = tuple(torch.zeros((self.accum, *t.shape), dtype=t.dtype, device=self.device)
                                   for t in tensors)
            for static, t in zip(self.batch, tensors, strict=True):
                static[micro].copy_(t, non_blocking=True)
        self.stop_in.fill_(float(stop_requested))  # a scalar fill: no host-to-device copy
        if self.steps == self.warmup:
            self.capture_begins()
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
        loss, grad_norm, self.metrics, flags = outputs
        return loss, grad_norm, flags

    def body(self) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        """The step itself, on the static tensors only (what the graph records): gptkit/step.py's step_body, the
        plain step's own function (forward and backward over the micro-batches, clip), with the flags decided
        on the device (a NaN/inf now or at any earlier step, and the request) and the optimizer step masked by
        them. No loss scaler (float16 is refused with graphs) and no read-ahead inside. Gradients are None before
        it runs."""
        micro_batches = (batch_like(self.template, tensors) for tensors in zip(*self.batch, strict=True))
        flags = []

        def decide(loss: torch.Tensor, grad_norm: torch.Tensor) -> Skip:
            self.halted.copy_(torch.maximum(self.halted, non_finite(loss, grad_norm).float()))
            flags.append(torch.stack([self.halted, self.stop_in]))
            return self.halted  # every step from a bad one on masked, on the device

        loss, grad_norm, metrics = step.step_body(self.model, self.optimizer, None, lambda: next(micro_batches),
                                                  self.accum, self.on_device, self.grad_clip, decide=decide,
                                                  objective=self.objective)
        return loss, grad_norm, metrics, flags[0]

    def capture_begins(self) -> None:
        """At the step where the capture begins (on CUDA; elsewhere where it would): before_capture, e.g. a
        wait for the checkpoint being written in the background, so that no other thread touches the device
        while the capture records."""
        if self.before_capture is not None:
            self.before_capture()

    def _warm_up_step(self):
        """An eager step on a side stream (as CUDA graphs want their warm-up: the caching allocator and cuBLAS
        settle there, away from the capture)."""
        side = self.side
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            outputs = self.body()
            self.optimizer.zero_grad(set_to_none=True)
        torch.cuda.current_stream(self.device).wait_stream(side)
        return outputs

    def _capture(self) -> None:
        """Record body() once (nothing runs during the capture: the replay that follows is this step). Its
        gradients are allocated inside the graph's memory pool, and stay there for every replay. A recompile of
        a compiled model inside the capture is an error that names its guard (error_on_recompile)."""
        self.optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize(self.device)
        self.graph = torch.cuda.CUDAGraph()
        with torch._dynamo.config.patch(error_on_recompile=True), torch.cuda.graph(self.graph):
            self.outputs = self.body()
